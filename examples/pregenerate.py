"""Deployment: pre-generate a kernel cache for a folder of matrices, then serve from it.

Two phases, as a deployment runs them on two machines:

1. **build** (``sparserl_compile.pregen.discover`` + ``pregenerate``, the Python API of
   ``sparserl pregen``): for every matrix and product, search candidate kernels, compile them
   with NVRTC, verify them and write the verdict into the cache folder ``--out``.

   * On a GPU machine the target is that GPU; candidates are verified and timed against
     cuSPARSE there, and the entries carry the times.
   * Without a GPU, name the serving GPU (``--target-gpu``, ``--target-arch``,
     ``--target-driver``, ``--target-nvrtc``: they must equal what
     ``cache.local_target()`` prints on the serving machine, or every lookup misses).
     Candidates are compiled for its arch and verified with the CPU executor
     (``executor="cpu"``); the entries are *untimed*, and the serving runtime times each one
     against cuSPARSE once, on first use, before it trusts it.

2. **serve**: point ``SPARSERL_CACHE_DIR`` at the folder, as a serving process would.

   * On a GPU: run every product through sparserl and report ``stats()``: every plan comes
     from the cache (``cache_hits``), no search runs for timed entries, and results are
     checked against a float64 scipy product.
   * On the CPU there is no kernel launch (generated kernels are GPU-only; CPU products use
     torch's CSR kernels): it looks up, for every product, the exact cache key the GPU runtime
     would compute (the fingerprint the ``SparseRLTensor`` carries, the op, the width bucket,
     the target) and reports hits, then shows ``sparserl cache ls`` and ``sparserl cache
     verify`` of the folder.

    python examples/pregenerate.py MATRIX_DIR --out kernels/                 # on the GPU machine
    python examples/pregenerate.py MATRIX_DIR --out kernels/ --ops spmv \\
        --target-gpu "NVIDIA H200" --target-driver 13000 --target-nvrtc 13.0  # without a GPU
    python examples/pregenerate.py --out kernels/ --ops spmv                  # two generated matrices
    python examples/pregenerate.py MATRIX_DIR --out kernels/ --provider search --compare-search --time
        # GPU: build with the whole kernel space (offline, no hurry); then each product's first
        # call from the cache against the same first call without it (the serving default
        # provider, on first use), and each served product's steady time against torch.sparse's
    python examples/pregenerate.py MATRIX_DIR --out kernels/ --serve-only --time
        # another machine of the same GPU kind: serve a cache built elsewhere, build nothing
    python examples/pregenerate.py MATRIX_DIR --out kernels/ --provider policy --serve-provider policy
        # the shipped policy's entries serve every process; another checkpoint's are keyed to
        # it, and its serving process runs it too (a process running a policy also finds
        # entries built with search or nearest)

The exit status is 1 if a product failed to build or a served product missed the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

import sparserl_compile as sr
from sparserl_compile import bench, cache, config, matrices, miss, plans, pregen, providers
from sparserl_compile.problem import make_problem

#: the serving GPU assumed when none is named and this machine has none (the H200 image:
#: CUDA 13 driver, NVRTC 13.0); a wrong driver/NVRTC version makes every lookup miss
DEFAULT_TARGET = cache.Target(arch="sm_90", gpu_name="NVIDIA H200", driver_version="13000", nvrtc_version="13.0")


@dataclasses.dataclass(frozen=True)
class BuildReport:
    """What the build phase did."""

    target: cache.Target
    executor: str  # "gpu" (verified and timed here) or "cpu" (verified, untimed)
    rows: list[pregen.Row]
    seconds: float
    policy_hash: str = "none"  # the entries' key field: a policy checkpoint's hash, "none" for the families

    @property
    def failed(self) -> int:
        return sum(r.outcome == "failed" for r in self.rows)


@dataclasses.dataclass(frozen=True)
class Lookup:
    """One served product and where its plan came from."""

    name: str
    op: str
    n: int
    found: bool  # the cache holds an entry under the key the GPU runtime computes
    verdict: str  # "kernel", "reference wins", "untimed kernel", or "missing"
    max_rel_err: float  # the sparserl product vs a float64 scipy product
    first_call_s: float = 0.0  # wall time of the first product (synchronized): the plan from the cache
    search_first_call_s: float | None = None  # --compare-search: the same first product without the cache
    served_us: float | None = None  # --time (GPU): the served product's median, after its first call
    torch_us: float | None = None  # --time (GPU): torch.sparse's CSR product, timed side by side with it
    search_served_us: float | None = None  # --compare-search --time: the first-use plan's median after
    search_torch_us: float | None = None  # its first call, and torch.sparse's timed side by side with it


@dataclasses.dataclass(frozen=True)
class ServeReport:
    """What the serve phase saw."""

    cache_dir: str
    device: str
    entries: int  # valid entry files in the folder
    lookups: list[Lookup]
    stats: config.RuntimeStats | None  # GPU only: the runtime's counters over the served products

    @property
    def misses(self) -> int:
        return sum(not x.found for x in self.lookups)


def write_demo_matrices(folder: Path) -> list[Path]:
    """Two small generated matrices (a 2-D stencil and a banded matrix with an empty row)."""
    folder.mkdir(parents=True, exist_ok=True)
    band = matrices.banded(96, 2).tolil()
    band[40, :] = 0.0  # an empty row
    mats = {"stencil2d_8.npz": matrices.stencil2d(8), "banded_96_row40_empty.npz": sp.csr_matrix(band)}
    paths = []
    for name, m in mats.items():
        m = matrices.canonical(m)
        m.eliminate_zeros()
        sp.save_npz(folder / name, m)
        paths.append(folder / name)
    return paths


def pruned_mlp_onnx(path: str | os.PathLike, sizes=(1024, 1024, 1024), sparsity: float = 0.9,
                    seed: int = 0) -> None:
    """An MLP ``x -> relu(x W1^T + b1) W2^T + b2 ...`` as ONNX (``Gemm`` with ``transB=1``, as
    torch.onnx exports ``nn.Linear``), float32, each weight magnitude-pruned to ``sparsity``
    zeros: what ``sparserl pregen`` finds in a pruned model. Needs the ``onnx`` package."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes, prev = [], [], "x"
    last = len(sizes) - 2
    for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        w = (rng.standard_normal((d_out, d_in)) / np.sqrt(d_in)).astype(np.float32)
        w[np.abs(w) < np.quantile(np.abs(w), sparsity)] = 0.0
        inits += [numpy_helper.from_array(w, f"fc{i}.weight"),
                  numpy_helper.from_array(np.zeros(d_out, np.float32), f"fc{i}.bias")]
        lin = "y" if i == last else f"lin{i}"
        nodes.append(helper.make_node("Gemm", [prev, f"fc{i}.weight", f"fc{i}.bias"], [lin], transB=1))
        if i < last:
            nodes.append(helper.make_node("Relu", [lin], [f"h{i}"]))
            prev = f"h{i}"
    graph = helper.make_graph(nodes, "pruned_mlp",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", sizes[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", sizes[-1]])],
                              initializer=inits)
    model = helper.make_model(graph)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def build(paths: list[str], out: str | os.PathLike, *, ops=("spmv", "spmm"), widths=(32,),
          target: cache.Target | None = None, progress: bool = True, provider=None) -> BuildReport:
    """Fill the cache at ``out`` for every matrix under ``paths`` (``sparserl pregen``'s API).
    ``provider`` (a name or a provider object): who proposes the candidates while building
    (``"search"``: the whole pruned kernel space); the runtime's provider is restored afterwards,
    so serving uses its own."""
    on_gpu = torch.cuda.is_available()
    if target is None:
        target = cache.local_target() if on_gpu else DEFAULT_TARGET
    executor = "gpu" if on_gpu and target == cache.local_target() else "cpu"
    items = pregen.discover(paths)
    if not items:
        raise SystemExit(f"no matrices (.npz, .mtx, .onnx) under {paths}")
    before = providers.get_provider()
    builder = providers.set_provider(provider) if provider else before
    t0 = time.perf_counter()
    try:
        rows = pregen.pregenerate(items, cache_dir=out, ops=tuple(ops), widths=tuple(widths), target=target,
                                  executor=executor, progress=progress)
    finally:
        providers.set_provider(before)
    return BuildReport(target, executor, rows, time.perf_counter() - t0, providers.policy_hash(builder))


@contextlib.contextmanager
def serving_from(cache_dir: str | os.PathLike):
    """``SPARSERL_CACHE_DIR=cache_dir`` and a fresh plan table, restored afterwards."""
    old = os.environ.get("SPARSERL_CACHE_DIR")
    os.environ["SPARSERL_CACHE_DIR"] = str(cache_dir)
    plans.clear()
    plans.reset_stats()
    try:
        yield
    finally:
        plans.clear()
        if old is None:
            os.environ.pop("SPARSERL_CACHE_DIR", None)
        else:
            os.environ["SPARSERL_CACHE_DIR"] = old


def _rel_err(y: torch.Tensor, ref: np.ndarray) -> float:
    y = y.detach().double().cpu().numpy()
    return float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30)) if ref.size else 0.0


def _first_call(A, x, device: str) -> tuple[torch.Tensor, float]:
    """``A @ x`` and its wall time in seconds, synchronized (a first call: plan included)."""
    t0 = time.perf_counter()
    y = A @ x
    if device == "cuda":
        torch.cuda.synchronize()
    return y, time.perf_counter() - t0


def _products(paths: list[str], ops, widths, device: str):
    """Every (matrix, op, width) under ``paths`` in one fixed order: the matrix item, its
    ``SparseRLTensor`` on ``device``, op, width, and a dense operand (float64 draws from a fixed
    seed, and as float32 on ``device``), the same for every pass over the same arguments."""
    rng = np.random.default_rng(0)
    for it in pregen.discover(paths):
        A = sr.sparsify(it.matrix).to(device)
        for op in ops:
            for n in (1,) if op == "spmv" else widths:
                x_np = rng.standard_normal(it.matrix.shape[1] if n == 1 else (it.matrix.shape[1], n))
                yield it, A, op, n, x_np, torch.from_numpy(x_np.astype(np.float32)).to(device)


def _side_by_side_with_torch(A, x) -> tuple[float, float]:
    """(sparserl us, torch.sparse us) of ``A @ x``, timed side by side (``bench.time_side_by_side``)."""
    native = torch.sparse_csr_tensor(A.crow, A.col, A.val, size=tuple(A.shape))
    return bench.time_side_by_side(lambda: A @ x, lambda: native @ x)


def search_first_calls(paths: list[str], *, ops=("spmv", "spmm"), widths=(32,),
                       timed: bool = False) -> list[tuple[float, float | None, float | None]]:
    """What serving pays without a pre-generated cache (GPU): each product's first call with the
    disk cache off, so the runtime's provider proposes and the selection compiles, verifies and
    times on first use. Same products and order as ``serve``. One ``(first call s, us, torch us)``
    each; ``timed``: the plan's median after that first call and torch.sparse's beside it (else None)."""
    old = config.get_config().cache
    sr.configure(cache=False)
    try:
        out = []
        for _, A, _, _, _, x in _products(paths, ops, widths, "cuda"):
            first = _first_call(A, x, "cuda")[1]
            out.append((first, *(_side_by_side_with_torch(A, x) if timed else (None, None))))
        return out
    finally:
        sr.configure(cache=old)


def serve(paths: list[str], cache_dir: str | os.PathLike, *, ops=("spmv", "spmm"), widths=(32,),
          target: cache.Target | None = None, timed: bool = False) -> ServeReport:
    """Serve every product from the cache at ``cache_dir`` (see the module docstring).
    ``timed`` (GPU): also time each served product against torch.sparse's CSR product, side by
    side (``bench.time_side_by_side``: L2 flushed, host hidden)."""
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    lookups: list[Lookup] = []
    stats = None
    with serving_from(cache_dir):
        store = cache.KernelCache.default()
        if not on_gpu:
            target = target or DEFAULT_TARGET
        for it, A, op, n, x_np, x in _products(paths, ops, widths, device):
            before = config.stats()
            y, first_s = _first_call(A, x, device)  # GPU: plan from the cache; CPU: torch's CSR kernel
            err = _rel_err(y, it.matrix.astype(np.float64) @ x_np.astype(np.float32).astype(np.float64))
            if on_gpu:
                after = config.stats()
                found = after.cache_hits > before.cache_hits
                verdict = ("missing" if not found else
                           "kernel" if after.kernel_calls > before.kernel_calls else
                           "dense wins" if after.dense_calls > before.dense_calls else "reference wins")
            else:
                key = miss.key_for(
                    make_problem(op, "f32", n, A.crow, A.col, tuple(A.shape), A.fingerprint,
                                         target.arch), target)
                entry = miss.lookup(store, key)  # as the GPU runtime looks it up
                found = entry is not None
                verdict = ("missing" if entry is None else "reference wins" if entry.reference_wins else
                           "dense wins" if entry.dense_wins else
                           "kernel" if "kernel_us" in entry.times else "untimed kernel")
            served_us = torch_us = None
            if timed and on_gpu:
                served_us, torch_us = _side_by_side_with_torch(A, x)
            lookups.append(Lookup(it.name, op, n, found, verdict, err, first_s, served_us=served_us,
                                  torch_us=torch_us))
        if on_gpu:
            torch.cuda.synchronize()
            stats = config.stats()
        entries = sum(x.entry is not None for x in store.ls())
    return ServeReport(str(cache_dir), device, entries, lookups, stats)


def format_lookups(report: ServeReport) -> str:
    searched = any(x.search_first_call_s is not None for x in report.lookups)
    timed = [x for x in report.lookups if x.served_us and x.torch_us]
    head = (f"{'matrix':34s} {'op':5s} {'n':>4s} {'in cache':8s} {'verdict':15s} {'rel_err':>9s} "
            f"{'first call':>10s}" + (f" {'no cache':>9s}" if searched else "")
            + (f" {'served_us':>9s} {'torch_us':>8s} {'speedup':>7s}" if timed else ""))
    lines = [head, "-" * len(head)]
    for x in report.lookups:
        line = (f"{x.name[:34]:34s} {x.op:5s} {x.n:>4d} {'yes' if x.found else 'NO':8s} "
                f"{x.verdict:15s} {x.max_rel_err:>9.1e} {x.first_call_s * 1e3:8.1f}ms"
                + (f" {x.search_first_call_s:8.2f}s" if x.search_first_call_s is not None else ""))
        if x.served_us and x.torch_us:
            line += f" {x.served_us:9.1f} {x.torch_us:8.1f} {x.torch_us / x.served_us:6.2f}x"
        lines.append(line)
    lines.append(f"{len(report.lookups) - report.misses}/{len(report.lookups)} products found in "
                 f"{report.cache_dir} ({report.entries} entries)")
    if report.lookups:
        cached = sorted(x.first_call_s for x in report.lookups)
        line = (f"first call from the cache: median {cached[len(cached) // 2] * 1e3:.1f} ms, "
                f"max {cached[-1] * 1e3:.1f} ms")
        if searched:
            cold = sorted(x.search_first_call_s for x in report.lookups if x.search_first_call_s is not None)
            line += (f"; without it (first-use selection): median {cold[len(cold) // 2]:.2f} s, "
                     f"max {cold[-1]:.2f} s")
        lines.append(line)
    if timed:
        lines.append(f"served products against torch.sparse, side by side: geomean "
                     f"{speedup_geomean(report):.2f}x over {len(timed)} products")
        cold = [x for x in timed if x.search_served_us and x.search_torch_us]
        if cold:
            g = float(np.exp(np.mean([np.log(x.search_torch_us / x.search_served_us) for x in cold])))
            lines.append(f"the same products planned on first use without the cache, against torch.sparse: "
                         f"geomean {g:.2f}x")
    return "\n".join(lines)


def speedup_geomean(report: ServeReport) -> float | None:
    """Geomean of torch.sparse's time over the served product's (``--time``), or None."""
    r = [x.torch_us / x.served_us for x in report.lookups if x.served_us and x.torch_us]
    return float(np.exp(np.mean(np.log(r)))) if r else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", help=".npz / .mtx files or folders (default: two generated matrices)")
    p.add_argument("--out", required=True, help="the kernel cache folder to build and serve from")
    p.add_argument("--ops", default="spmv,spmm", help="comma list of spmv, spmm")
    p.add_argument("--widths", default="32", help="SpMM dense widths, comma list")
    p.add_argument("--target-gpu", default=None,
                   help=f"the serving GPU's name (default: this GPU, or {DEFAULT_TARGET.gpu_name!r} without one)")
    p.add_argument("--target-arch", default=DEFAULT_TARGET.arch)
    p.add_argument("--target-driver", default=DEFAULT_TARGET.driver_version,
                   help="the serving machine's cuDriverGetVersion, e.g. 13000")
    p.add_argument("--target-nvrtc", default=DEFAULT_TARGET.nvrtc_version, help="the serving NVRTC, e.g. 13.0")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--compare-search", action="store_true",
                   help="GPU: also time each product's first call without the cache (first-use selection)")
    p.add_argument("--json", default=None, help="write the build rows and the served products here")
    p.add_argument("--provider", default=None,
                   help="build with this provider (search | nearest | policy; default: the runtime's)")
    p.add_argument("--serve-provider", default=None,
                   help="the serving process's provider (default: the runtime's). Entries built by a "
                        "policy other than the shipped one are keyed to its checkpoint: serve them with "
                        "that policy")
    p.add_argument("--serve-only", action="store_true",
                   help="build nothing: serve from a cache built elsewhere (--out must hold it)")
    p.add_argument("--time", action="store_true",
                   help="GPU: time each served product against torch.sparse's CSR product, side by side")
    return p


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    ops = tuple(o for o in args.ops.split(",") if o)
    bad = set(ops) - {"spmv", "spmm"}
    if bad:
        p.error(f"--ops: unknown {sorted(bad)}; use spmv and/or spmm")
    widths = tuple(int(w) for w in args.widths.split(",") if w)
    target = None
    if args.target_gpu:
        target = cache.Target(args.target_arch, args.target_gpu, args.target_driver, args.target_nvrtc)
    with contextlib.ExitStack() as stack:
        paths = args.paths
        if not paths:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sparserl-matrices-")))
            write_demo_matrices(folder)
            print(f"no matrices named: using two generated ones in {folder}")
            paths = [str(folder)]

        if args.serve_only:
            if not cache.KernelCache(args.out).ls():
                p.error(f"--serve-only: no cache entries in {args.out}; build one first (without --serve-only)")
            b = None
            print(f"== serve only: the cache in {args.out} was built elsewhere; nothing is built here")
        else:
            b = build(paths, args.out, ops=ops, widths=widths, target=target, progress=not args.no_progress,
                      provider=args.provider)
            print(f"== build: {len(b.rows)} products for {b.target.gpu_name} ({b.target.arch}, driver "
                  f"{b.target.driver_version}, NVRTC {b.target.nvrtc_version}), verified on the {b.executor} "
                  f"executor, with the {args.provider or providers.get_provider().name} provider, {b.seconds:.1f} s")
            print(pregen.format_table(b.rows))
            if b.executor == "cpu":
                print("(entries built without the serving GPU carry no timings; its runtime times each one "
                      "against cuSPARSE on first use)")

        if args.serve_provider:
            providers.set_provider(args.serve_provider)
        serving = providers.policy_hash(providers.get_provider())
        if b is not None and b.policy_hash not in ("none", serving, providers.shipped_policy_hash()):
            print(f"note: these entries are keyed to the policy checkpoint {b.policy_hash[:12]}, and the serving "
                  f"provider ({providers.get_provider().name}) will not find them: serve with that checkpoint's "
                  f"policy (sparserl.configure(provider=PolicyProvider(checkpoint=...)) in a serving process)")
        s = serve(paths, args.out, ops=ops, widths=widths, target=b.target if b else target, timed=args.time)
        if args.compare_search and s.device == "cuda":
            cold = search_first_calls(paths, ops=ops, widths=widths, timed=args.time)
            s = dataclasses.replace(s, lookups=[dataclasses.replace(x, search_first_call_s=c, search_served_us=us,
                                                                    search_torch_us=t)
                                                for x, (c, us, t) in zip(s.lookups, cold)])
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": s.device, "gpu": torch.cuda.get_device_name(0) if s.device == "cuda" else None,
                           "torch": torch.__version__, "serve_only": b is None,
                           "build_provider": None if b is None else (args.provider or "runtime default"),
                           "build_policy_hash": None if b is None else b.policy_hash,
                           "serve_provider": providers.get_provider().name,
                           "build_seconds": None if b is None else b.seconds,
                           "executor": None if b is None else b.executor,
                           "build": [] if b is None else [dataclasses.asdict(r) for r in b.rows],
                           "served": [dataclasses.asdict(x) for x in s.lookups],
                           "served_speedup_geomean": speedup_geomean(s),
                           "stats": None if s.stats is None else dataclasses.asdict(s.stats)},
                          f, indent=1, default=str)
        print(f"\n== serve on {s.device} with SPARSERL_CACHE_DIR={args.out}")
        print(format_lookups(s))
        if s.stats is not None:
            st = s.stats
            print(f"runtime: calls={st.calls} cache_hits={st.cache_hits} searches={st.searches} "
                  f"kernel_calls={st.kernel_calls} reference_calls={st.reference_calls} fallbacks={st.fallbacks}")
        else:
            print("(CPU: no kernel is launched here; the keys above are the ones the GPU runtime looks up)")
            from sparserl_compile.commands.cli import main as sparserl

            print("\n$ sparserl cache ls")
            sparserl(["cache", "--dir", str(args.out), "ls"])
            print("\n$ sparserl cache verify")
            sparserl(["cache", "--dir", str(args.out), "verify"])
    return 1 if (b is not None and b.failed) or s.misses else 0


if __name__ == "__main__":  # the guard matters: the verification sandbox spawns workers
    sys.exit(main())
