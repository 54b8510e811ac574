"""The hot path as a user meets it, side by side with torch in one process (GPU).

    python benchmarks/hot_path.py --json OUT.json [--quick] [--provider nearest]

Four measurements, each against what the user would otherwise run:

1. ``host``: host time per cached eager product, back to back (one synchronize at the end):
   ``A @ x`` through a ``SparseRLTensor`` whose plan is a kernel, against ``torch.mv`` /
   ``torch.mm`` on the torch CSR tensor, on a small matrix (host-bound: the kernels take a few
   microseconds) and the GPU time of each (CUDA events), SpMV and SpMM.
2. ``reference_kept``: a product the runtime leaves to cuSPARSE (``configure(kernels=False)``)
   through sparserl against torch directly, back to back, on shared matrices where the
   reference was kept; and, to say where a difference goes, the tensor's route (its own CSR
   tensor, int32 indices) called with ``torch.mv`` and through ``reference.native_mm``.
3. ``l2``: for held-out shared matrices (``training.data.SHARED_HELD_OUT``) and a few others,
   SpMV and SpMM at N = 32, 128: the plan the runtime selects, timed through the public API
   with a cold L2 (flushed before each call) and back to back (hot), against torch.sparse the
   same two ways; which products are slower than the reference in either regime.
4. ``stalls``: a user's hot loop (``torch.mv`` on CSR and a cached sparserl SpMV) timed idle,
   then while the runtime searches a new structure in the background
   (``on_miss="background"``) and while the default provider loads the policy
   (``load_in_background``): per-call microseconds and the ratio to idle.
5. ``compiled``: one product, eight chained ones and a 2-layer GCN on Cora / CiteSeer, eager
   torch.sparse, sparserl eager, ``torch.compile(backend="sparserl")`` in the default mode and
   with ``mode="reduce-overhead"``, and a compiled graph of one dense op (its own host cost),
   per call back to back; each variant recorded on its own (a failure loses no other row).

Results as JSON (``--json``) and a table per section on stdout. Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

import sparserl_compile as sr
from sparserl_compile import bench, matrices, plans, providers, reference
from sparserl_compile.version import run_stamp


def _loop_us(fn, calls: int, warmup: int = 50) -> float:
    """Per-call microseconds of ``calls`` back-to-back calls, one synchronize at the end."""
    return bench.stream_us(fn, "cuda", calls=calls, warmup=warmup)


def _best_loop_us(fn, calls: int, rounds: int = 5) -> float:
    return min(_loop_us(fn, calls) for _ in range(rounds))


def _csr(m: sp.csr_matrix, dtype=torch.float32):
    return torch.sparse_csr_tensor(torch.from_numpy(m.indptr.astype(np.int64)), torch.from_numpy(m.indices.astype(np.int64)),
                                   torch.from_numpy(m.data.astype(np.float32)), size=m.shape).to("cuda", dtype)


def _plan_kind(a) -> str:
    for key, plan in plans.plans().items():
        if key[0] == a.fingerprint:
            return plan.kind
    return "?"


def host_section(quick: bool) -> list[dict]:
    rows = []
    m = matrices.stencil2d(64 if quick else 100)
    a = sr.sparsify(m).cuda()
    t = _csr(m)
    for op, n in (("spmv", 1), ("spmm", 32)):
        x = torch.randn(m.shape[1], device="cuda") if op == "spmv" else torch.randn(m.shape[1], n, device="cuda")
        ours = (lambda: a @ x)
        theirs = (lambda: torch.mv(t, x)) if op == "spmv" else (lambda: torch.mm(t, x))
        ours()  # the first call selects the plan
        calls = 2000 if quick else 10000
        row = {"matrix": f"stencil2d nnz={m.nnz}", "op": op, "n": n, "plan": _plan_kind(a),
               "sparserl_host_us": _best_loop_us(ours, calls), "torch_host_us": _best_loop_us(theirs, calls),
               "sparserl_gpu_us": bench.time_fn(ours, flush_l2=False).median_us,
               "torch_gpu_us": bench.time_fn(theirs, flush_l2=False).median_us}
        rows.append(row)
    return rows


def _shared(name: str) -> sp.csr_matrix | None:
    d = matrices.shared_matrices_dir()
    p = None if d is None else d / f"{name}.npz"
    return matrices.load_npz(p).astype(np.float32) if p is not None and p.is_file() else None


def reference_kept_section(quick: bool) -> list[dict]:
    rows = []
    sr.configure(kernels=False)
    try:
        for name in ("bundle1", "rajat01", "cora_adj")[: 2 if quick else 3]:
            m = _shared(name)
            if m is None:
                continue
            a, t = sr.sparsify(m).cuda(), _csr(m)
            x = torch.randn(m.shape[1], device="cuda")
            a @ x
            a @ x  # a hit: the tensor's route to cuSPARSE is stored
            calls = 2000 if quick else 10000
            ours, theirs = _best_loop_us(lambda: a @ x, calls), _best_loop_us(lambda: torch.mv(t, x), calls)
            row = {"matrix": name, "op": "spmv", "sparserl_us": ours, "torch_us": theirs, "ratio": ours / theirs}
            # where the difference goes: the route's own CSR tensor (int32 indices, as the runtime
            # keeps them) called directly, and through reference.native_mm, against torch's int64 one
            route = a._routes.get(plans.Routes.SPMV)
            if isinstance(route, torch.Tensor):
                row["route_index_dtype"] = str(route.crow_indices().dtype)
                row["torch_mv_route_us"] = _best_loop_us(lambda: torch.mv(route, x), calls)
                row["native_mm_route_us"] = _best_loop_us(lambda: reference.native_mm(route, x), calls)
            rows.append(row)
    finally:
        sr.configure(kernels=True)
    return rows


L2_MATRICES = ("bcsstk25", "cora_features", "fe_body", "hep-th", "rajat01", "shuttle_eddy", "uk",
               "bundle1", "cora_adj", "wiki-Vote", "crack")


def l2_section(quick: bool) -> list[dict]:
    rows = []
    names = L2_MATRICES[:5] if quick else L2_MATRICES
    for name in names:
        m = _shared(name)
        if m is None:
            continue
        a, t = sr.sparsify(m).cuda(), _csr(m)
        for op, n in (("spmv", 1), ("spmm", 32), ("spmm", 128)):
            x = torch.randn(m.shape[1], device="cuda") if op == "spmv" else torch.randn(m.shape[1], n, device="cuda")
            ours = lambda: a @ x  # noqa: E731
            theirs = (lambda: torch.mv(t, x)) if op == "spmv" else (lambda: torch.mm(t, x))
            t0 = time.perf_counter()
            ours()
            first_s = time.perf_counter() - t0
            cold_o, cold_t = bench.time_side_by_side(ours, theirs)
            hot_o = _best_loop_us(ours, 300, rounds=3)
            hot_t = _best_loop_us(theirs, 300, rounds=3)
            rows.append({"matrix": name, "op": op, "n": n, "nnz": int(m.nnz), "plan": _plan_kind(a),
                         "first_call_s": first_s, "cold_sparserl_us": cold_o, "cold_torch_us": cold_t,
                         "hot_sparserl_us": hot_o, "hot_torch_us": hot_t,
                         "cold_speedup": cold_t / cold_o, "hot_speedup": hot_t / hot_o})
    return rows


def _chunks_us(fn, seconds: float, chunk: int = 100) -> list[float]:
    """Per-call microseconds of consecutive chunks of ``chunk`` calls for ``seconds``."""
    out, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        for _ in range(chunk):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / chunk * 1e6)
    return out


def stalls_section(quick: bool) -> dict:
    m = matrices.stencil2d(200)
    a, t = sr.sparsify(m).cuda(), _csr(m)
    x = torch.randn(m.shape[1], device="cuda")
    a @ x
    loops = {"torch.mv": lambda: torch.mv(t, x), "sparserl spmv": lambda: a @ x}
    secs = 1.5 if quick else 3.0
    out: dict = {"idle": {k: statistics.median(_chunks_us(f, secs)) for k, f in loops.items()}}

    # a background search of new structures while the loop runs
    sr.configure(on_miss="background")
    try:
        news = [sr.sparsify(matrices.generate("rmat", scale=15, edge_factor=8, seed=s)).cuda() for s in range(3)]
        xs = [torch.randn(b.shape[1], 64, device="cuda") for b in news]
        during = {k: [] for k in loops}
        for b, xb in zip(news, xs):
            b @ xb  # queues the search, runs the reference now
            for k, f in loops.items():
                during[k] += _chunks_us(f, secs / 3)
        done = sr.wait_for_searches(timeout=120)
        out["background_search"] = {k: statistics.median(v) for k, v in during.items()}
        out["background_search_max"] = {k: max(v) for k, v in during.items()}
        out["background_searches_done"] = bool(done)
    finally:
        sr.configure(on_miss="search")

    # the default provider's policy load (in its worker process)
    d = providers.DefaultProvider()
    if d.fallback_reason is None:
        t0 = time.perf_counter()
        d.load_in_background()
        during = {k: [] for k in loops}
        while d.loading and time.perf_counter() - t0 < 60:
            for k, f in loops.items():
                during[k] += _chunks_us(f, 0.5)
        out["policy_load_s"] = time.perf_counter() - t0
        out["policy_load"] = {k: statistics.median(v) if v else None for k, v in during.items()}
        out["policy_load_max"] = {k: max(v) if v else None for k, v in during.items()}
        close = getattr(d.load(), "close", None)
        if callable(close):
            close()
    else:
        out["policy_load"] = f"skipped: {d.fallback_reason}"
    return out


def _gcn(adj_mm, feats, w1, w2):
    h = torch.relu(adj_mm(feats @ w1))
    return adj_mm(h @ w2)


def compiled_section(quick: bool) -> list[dict]:
    rows = []
    for name in ("cora", "citeseer")[: 1 if quick else 2]:
        adj, feats_m = _shared(f"{name}_adj"), _shared(f"{name}_features")
        if adj is None or feats_m is None:
            continue
        n = adj.shape[0]
        adj = adj + sp.identity(n, dtype=np.float32, format="csr")
        deg = np.asarray(adj.sum(1)).ravel()
        dinv = sp.diags(1 / np.sqrt(deg)).astype(np.float32)
        adj = (dinv @ adj @ dinv).tocsr().astype(np.float32)
        feats = torch.from_numpy(feats_m.toarray()).cuda()
        g = torch.Generator().manual_seed(0)
        w1 = (torch.randn(feats.shape[1], 128, generator=g) * 0.05).cuda()
        w2 = (torch.randn(128, 16, generator=g) * 0.05).cuda()
        t, a = _csr(adj), sr.sparsify(adj).cuda()
        variants = {
            "torch.sparse eager": lambda: _gcn(lambda v: torch.mm(t, v), feats, w1, w2),
            "sparserl eager": lambda: _gcn(lambda v: a @ v, feats, w1, w2),
        }
        f_default = torch.compile(lambda a_, f_: _gcn(lambda v: a_ @ v, f_, w1, w2), backend="sparserl")
        f_graphs = torch.compile(lambda a_, f_: _gcn(lambda v: a_ @ v, f_, w1, w2), backend="sparserl",
                                 mode="reduce-overhead")
        variants["sparserl compiled"] = lambda: f_default(a, feats)
        variants["sparserl reduce-overhead"] = lambda: f_graphs(a, feats)
        x1 = torch.randn(n, device="cuda")
        p_eager = lambda: a @ x1  # noqa: E731
        p_comp = torch.compile(lambda a_, v: a_ @ v, backend="sparserl")
        variants["one spmv, sparserl eager"] = p_eager
        variants["one spmv, sparserl compiled"] = lambda: p_comp(a, x1)
        variants["one spmv, torch eager"] = lambda: torch.mv(t, x1)
        # eight chained SpMVs against one: (8 - 1) / 7 is the host time one more product adds to a graph
        def chain8(a_, v):
            for _ in range(8):
                v = a_ @ v
            return v

        c8 = torch.compile(chain8, backend="sparserl")
        variants["eight spmv, sparserl eager"] = lambda: chain8(a, x1)
        variants["eight spmv, sparserl compiled"] = lambda: c8(a, x1)
        floor = torch.compile(lambda v: v * 2, backend="sparserl")  # a compiled graph's own host cost
        variants["one dense op, compiled (the floor)"] = lambda: floor(x1)
        for label, f in variants.items():
            try:  # one variant's failure (e.g. CUDA graphs) must not lose the others
                for _ in range(5):
                    f()
                rows.append({"graph": name, "variant": label,
                             "us_per_call": _best_loop_us(f, 200 if quick else 1000, rounds=3)})
            except Exception as e:  # noqa: BLE001 - recorded in the results
                rows.append({"graph": name, "variant": label, "error": f"{type(e).__name__}: {e}"[:500]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="fewer matrices and calls")
    ap.add_argument("--provider", default=None, help="the runtime's provider (default: its own default)")
    ap.add_argument("--sections", default="host,reference_kept,l2,stalls,compiled")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("hot_path.py needs a CUDA GPU")
        return 2
    if args.provider:
        sr.configure(provider=args.provider)
    out: dict = {"stamp": run_stamp(), "provider": sr.get_provider().name, "quick": args.quick}
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            out[name] = globals()[f"{name}_section"](args.quick)
        except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"== {name} ({time.perf_counter() - t0:.1f} s)")
        print(json.dumps(out[name], indent=1, default=str)[:4000], flush=True)
    out["stats"] = sr.stats().__dict__
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
