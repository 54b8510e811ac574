"""Pruned-LLM linear layers through the public API, against dense cuBLAS and cuSPARSE (GPU).

For each weight shape (out x in features: 4096 x 4096, 11008 x 4096), sparsity (50 / 70 / 90 %,
``matrices.pruned_weight``: random normal values, global magnitude pruning) and batch (1, 4, 8,
16, 32), in bfloat16, side by side in one process:

* ``sparserl``: ``F.linear(x, sr.sparsify(W))`` after its first call chose a kernel. The first
  call runs the ``search`` provider with the disk cache off and ``k`` = every bitmap point the
  search proposes for the product (they come first on weight-like patterns) plus ``--others``:
  each compiled, verified in the sandbox and timed against cuSPARSE; the fastest verified one
  is kept if it beats cuSPARSE, else cuSPARSE is;
* ``dense``: ``F.linear(x, W)`` with the pruned weight stored dense (cuBLAS);
* ``cusparse``: ``reference.reference_product`` on ``x^T`` (torch.sparse CSR, int32 indices),
  the product the runtime runs where cuSPARSE is kept, transposes included as ``F.linear``'s.

Each is timed with the L2 flushed (``bench.time_fn``: CUDA events, the GPU kept busy before
each start so that no host path enters the time) and back to back (``bench.stream_us``: calls
queued without waiting, warm L2, host path included). Per row: the three times, the speedups
over dense, what the first call kept and took, the error against the dense product, and the
bytes the kept layout reads against the dense bfloat16 weight (``formats.stored_bytes`` of the
kept kernel's format; CSR for cuSPARSE; the ``SparseRLTensor`` itself also holds its CSR arrays).

Every bitmap point the first call verified is then timed directly (launched without the
runtime, L2 flushed, ``bench.time_fn``) next to the selection's own sandbox timing of it, so the
table shows which point wins where (``--no-direct`` skips this).

    python benchmarks/llm_layers.py [--quick] [--json PATH] [--time-budget S] [--others 2]
        [--shapes 4096x4096,11008x4096] [--sparsities 0.5,0.7,0.9] [--batches 1,4,8,16,32]

Writes ``--json`` (default ``$OUT/llm_layers.json``, else ``benchmarks/results/llm_layers.json``)
after every row, so a run cut by its time limit keeps what finished. ``--quick``: 4096 x 4096 at 70 %,
batches 1 and 16. ``--time-budget``: start no new (shape, sparsity) after that many seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from report import text_table  # this folder: the scripts run as `python benchmarks/NAME.py`


DEFAULT_SHAPES = ((4096, 4096), (11008, 4096))
DEFAULT_SPARSITIES = (0.5, 0.7, 0.9)
DEFAULT_BATCHES = (1, 4, 8, 16, 32)
QUICK = {"shapes": ((4096, 4096),), "sparsities": (0.7,), "batches": (1, 16)}
VALUE_BYTES = 2  # bfloat16


@dataclass(frozen=True)
class Case:
    """One weight: its shape (out, in features) and sparsity; every batch runs on it."""

    n_rows: int
    n_cols: int
    sparsity: float

    @property
    def label(self) -> str:
        return f"{self.n_rows}x{self.n_cols}@{self.sparsity:.0%}"


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"4096x4096,11008x4096"`` -> ((4096, 4096), (11008, 4096))."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            r, c = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"shape {part!r}: write rows x cols, e.g. 4096x4096") from None
        if r < 1 or c < 1:
            raise ValueError(f"shape {part!r}: both sides must be >= 1")
        out.append((r, c))
    if not out:
        raise ValueError(f"no shapes in {text!r}")
    return tuple(out)


def _numbers(text: str, kind, what: str) -> tuple:
    try:
        vals = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--{what} {text!r}: a comma-separated list of numbers") from None
    if not vals:
        raise ValueError(f"--{what} is empty")
    return vals


def cases(args) -> tuple[list[Case], tuple[int, ...]]:
    """The weights and batches the arguments ask for (``--quick`` overrides the lists)."""
    shapes = QUICK["shapes"] if args.quick else parse_shapes(args.shapes)
    sparsities = QUICK["sparsities"] if args.quick else _numbers(args.sparsities, float, "sparsities")
    batches = QUICK["batches"] if args.quick else _numbers(args.batches, int, "batches")
    if any(not 0.0 <= s < 1.0 for s in sparsities):
        raise ValueError(f"sparsities {sparsities}: fractions in [0, 1)")
    if any(b < 1 for b in batches):
        raise ValueError(f"batches {batches}: each >= 1")
    return [Case(r, c, s) for r, c in shapes for s in sparsities], tuple(batches)


def problem_for(pattern, batch: int, fingerprint: str = "bench"):
    """The runtime's problem for ``F.linear`` at ``batch``: SpMM of the weight by x^T, n = batch."""
    from sparserl_compile.problem import Problem

    return Problem("spmm", "bf16", int(batch), pattern.shape[0], pattern.shape[1], int(pattern.nnz),
                   pattern.indptr, pattern.indices, fingerprint, "sm_90")


def bitmap_points(problem, features=None) -> list:
    """The bitmap candidates the search proposes for ``problem``, in its order (its rules for
    the bitmap families, without converting the pattern to the space's other formats).
    ``features``: the pattern's ``structure.features``, when the caller has them."""
    from sparserl_compile import kernels, structure
    from sparserl_compile.search import SearchProvider

    f = features if features is not None else structure.features(
        problem.indptr, problem.indices, (problem.n_rows, problem.n_cols))
    n = 1 if problem.op == "spmv" else int(problem.n)
    return [c for c in kernels.space(problem.op, problem.dtype, n=n)
            if c.header.format == "bitmap" and SearchProvider._rule(c, f, n) is None]


def layout_bytes(chosen, pattern, value_bytes: int = VALUE_BYTES, converted=None) -> int:
    """Bytes the kept plan's layout holds: the chosen candidate's format as converted
    (``converted``: its ``FormatData`` if already built), or CSR (int32 indices) where cuSPARSE
    was kept (``chosen=None``)."""
    from sparserl_compile import formats

    if chosen is None:
        return int(pattern.nnz * (value_bytes + 4) + 4 * (pattern.shape[0] + 1))
    fd = converted
    if fd is None:
        h = chosen.header
        fd = formats.convert(pattern.indptr, pattern.indices, pattern.shape, h.format, h.params)
    return formats.stored_bytes(fd, value_bytes)


def speedup(base_us: float | None, us: float | None) -> float | None:
    """``base_us / us`` (None when either is missing or not positive)."""
    if not base_us or not us or base_us <= 0 or us <= 0:
        return None
    return base_us / us


def _f(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table (one line per weight and batch)."""
    def num(key, spec):
        return lambda r: _f(r[key], spec)

    return text_table([
        ("weight", 18, lambda r: r["weight"]), ("b", 3, lambda r: str(r["batch"])),
        ("kept", 38, lambda r: str(r["kept"])[:38]), ("sparse", 8, num("sparse_us", "8.1f")),
        ("dense", 8, num("dense_us", "8.1f")), ("cusp", 8, num("cusparse_us", "8.1f")),
        ("x dense", 7, num("speedup_vs_dense", "7.2f")), ("b2b x", 6, num("b2b_speedup_vs_dense", "6.2f")),
        ("bytes", 6, num("bytes_vs_dense", "6.3f")), ("err", 8, num("rel_err", "8.1e")),
        ("first s", 7, num("first_call_s", "7.2f")),
    ], rows)


def direct_table(rows: list[dict]) -> str:
    """Per weight and batch, every bitmap point's direct and sandbox times, fastest first."""
    lines = []
    for r in rows:
        pts = sorted(r.get("direct") or [], key=lambda p: p["direct_us"] if p["direct_us"] is not None else 1e30)
        if not pts:
            continue
        lines.append(f"{r['weight']} batch {r['batch']} (dense {_f(r['dense_us'], '.1f')} us):")
        lines += [f"    {p['name']:<52} {_f(p['direct_us'], '8.1f')} us  sandbox {_f(p['sandbox_us'], '8.1f')} us  "
                  f"err {_f(p['rel_err'], '.1e')}" for p in pts]
    return "\n".join(lines)


def selection_summary(first_use: dict | None) -> dict:
    """What the first call's selection kept and timed, from its ``miss.first_uses()`` row."""
    row = first_use or {}
    rec = row.get("verification") or {}
    cands = rec.get("candidates") if isinstance(rec.get("candidates"), list) else []
    return {
        "plan": row.get("plan"), "chosen": rec.get("chosen"), "rule": rec.get("rule"),
        "reference_us": rec.get("reference_us"), "dense_sandbox_us": rec.get("dense_us"),
        "select_s": row.get("select_s"),
        "candidates": [{"name": c.get("name"), "family": c.get("family"), "kind": c.get("kind"),
                        "kernel_us": c.get("kernel_us"), "hot_us": c.get("hot_us"),
                        "error": (c.get("error") or "")[:200]}
                       for c in cands],
    }


def json_path(arg: str | None) -> Path:
    """``--json``, else ``$OUT/llm_layers.json``, else ``benchmarks/results/llm_layers.json``."""
    if arg:
        return Path(arg)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "llm_layers.json"
    return Path(__file__).resolve().parent / "results" / "llm_layers.json"


# ----------------------------------------------------------------------------- GPU side


class _Weight:
    """One pruned weight on the GPU: dense, as a SparseRLTensor, as CSR, and its bitmap layouts."""

    def __init__(self, case: Case, seed: int, dev):
        import torch

        import sparserl_compile as sr
        from sparserl_compile import matrices, structure, verify

        m = matrices.pruned_weight(case.n_rows, case.n_cols, case.sparsity, "magnitude", seed=seed)
        self.pattern = verify.Pattern.of(m)
        self.features = structure.features(self.pattern.indptr, self.pattern.indices, self.pattern.shape)
        self.dense = torch.from_numpy(m.toarray()).to(dev, torch.bfloat16)
        self.sparse = sr.sparsify(self.dense)
        self.crow = torch.from_numpy(self.pattern.indptr).to(dev)
        self.col = torch.from_numpy(self.pattern.indices).to(dev)
        self.val = torch.from_numpy(m.data).to(dev, torch.bfloat16)
        self._layouts: dict = {}

    def layout(self, header):
        """(FormatData, device arrays, device values) of ``header``'s format, built once."""
        from sparserl_compile import formats

        key = (header.format, header.format_params)
        if key not in self._layouts:
            p = self.pattern
            fd = formats.convert(p.indptr, p.indices, p.shape, header.format, header.params)
            self._layouts[key] = (fd, formats.to_device(fd, self.val.device), fd.gather_values(self.val).contiguous())
        return self._layouts[key]


def _rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def _direct(w: _Weight, cand, x, ref, dev) -> dict:
    """One bitmap point launched straight on ``x^T`` (no runtime), timed with the L2 flushed."""
    import torch

    from sparserl_compile import bench, compiler, launcher

    h = cand.header
    fd, arrays, vals = w.layout(h)
    xt = x.t().contiguous()
    y = torch.empty(w.pattern.shape[0], x.shape[0], dtype=torch.bfloat16, device=dev)
    major, minor = torch.cuda.get_device_capability(dev)
    kern = launcher.load(compiler.compile_cubin(cand.source, arch=f"sm_{major}{minor}").cubin, h)
    args = fd.kernel_args("spmm", x.shape[0], arrays, vals, xt, y)
    bound = kern.bind(args[:-2], grid=h.launch.grid(fd.scalars, x.shape[0]))
    bound(xt, y)
    torch.cuda.synchronize(dev)
    err = _rel_err(y.t(), ref)
    us = bench.time_fn(lambda: bound(xt, y), hide_host_us=bench.HIDE_HOST_US).median_us
    return {"name": cand.name, "direct_us": us, "rel_err": err}


def run_batch(w: _Weight, case: Case, batch: int, args, dev) -> dict:
    """One row: first call (selection), then sparserl, dense and cuSPARSE timed side by side."""
    import torch
    import torch.nn.functional as F

    import sparserl_compile as sr
    from sparserl_compile import bench, kernels, miss, plans, reference

    x = torch.randn(batch, case.n_cols, device=dev, dtype=torch.bfloat16)
    points = bitmap_points(problem_for(w.pattern, batch), w.features)
    sr.configure(provider="search", k=len(points) + args.others, cache=False)
    plans.clear()
    plans.reset_stats()
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    y = F.linear(x, w.sparse)
    torch.cuda.synchronize(dev)
    first_s = time.perf_counter() - t0
    uses = miss.first_uses()
    sel = selection_summary(uses[-1] if uses else None)
    ref = F.linear(x, w.dense)
    chosen = next((c for c in kernels.space("spmm", "bf16", n=batch) if c.name == sel["chosen"]), None)
    converted = w.layout(chosen.header)[0] if chosen is not None and chosen.header.format == "bitmap" else None

    dense_bytes = case.n_rows * case.n_cols * VALUE_BYTES
    fns = {"sparse": lambda: F.linear(x, w.sparse), "dense": lambda: F.linear(x, w.dense),
           "cusparse": lambda: reference.reference_product(w.crow, w.col, w.val, x.t().contiguous(),
                                                           case.n_rows, case.n_cols).t()}
    flushed = {k: bench.time_fn(f, hide_host_us=bench.HIDE_HOST_US).median_us for k, f in fns.items()}
    b2b = {k: bench.stream_us(f, dev) for k, f in fns.items()}
    row = {
        "weight": case.label, "n_rows": case.n_rows, "n_cols": case.n_cols, "sparsity": case.sparsity,
        "batch": batch, "kept": sel["chosen"] or ("dense" if sel["plan"] == "dense" else "cusparse"),
        "first_call_s": first_s,
        "rel_err": _rel_err(y, ref),
        "sparse_us": flushed["sparse"], "dense_us": flushed["dense"], "cusparse_us": flushed["cusparse"],
        "b2b_sparse_us": b2b["sparse"], "b2b_dense_us": b2b["dense"], "b2b_cusparse_us": b2b["cusparse"],
        "speedup_vs_dense": speedup(flushed["dense"], flushed["sparse"]),
        "speedup_vs_cusparse": speedup(flushed["cusparse"], flushed["sparse"]),
        "b2b_speedup_vs_dense": speedup(b2b["dense"], b2b["sparse"]),
        "bytes_vs_dense": (1.0 if sel["plan"] == "dense"  # the dense product kept: the weight stored dense
                           else layout_bytes(chosen, w.pattern, converted=converted) / dense_bytes),
        "selection": sel, "direct": [],
    }
    if not args.no_direct:
        verified = {c["name"]: c["kernel_us"] for c in sel["candidates"] if c["kind"] == "ok"}
        for c in points:
            if c.name in verified:
                d = _direct(w, c, x, ref, dev)
                d["sandbox_us"] = verified[c.name]
                row["direct"].append(d)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4096x4096 at 70 %%, batches 1 and 16")
    ap.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in DEFAULT_SHAPES))
    ap.add_argument("--sparsities", default=",".join(str(s) for s in DEFAULT_SPARSITIES))
    ap.add_argument("--batches", default=",".join(str(b) for b in DEFAULT_BATCHES))
    ap.add_argument("--others", type=int, default=2, help="points of other families tried after the bitmap ones")
    ap.add_argument("--no-direct", action="store_true", help="skip timing every bitmap point directly")
    ap.add_argument("--time-budget", type=float, default=0.0, help="start no new weight after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="where to write the results (default $OUT/llm_layers.json, "
                    "else benchmarks/results/llm_layers.json)")
    args = ap.parse_args(argv)
    todo, batches = cases(args)

    import torch

    from sparserl_compile.fileio import write_json

    if not torch.cuda.is_available():
        print("llm_layers: needs a CUDA GPU (it times cuBLAS, cuSPARSE and sparserl kernels)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    path = json_path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "args": vars(args), "rows": [],
           "skipped": []}
    t_start = time.perf_counter()
    for i, case in enumerate(todo):
        if args.time_budget and time.perf_counter() - t_start > args.time_budget:
            doc["skipped"] = [c.label for c in todo[i:]]
            print(f"time budget reached: skipping {doc['skipped']}")
            break
        w = _Weight(case, args.seed, dev)
        for b in batches:
            row = run_batch(w, case, b, args, dev)
            doc["rows"].append(row)
            write_json(path, doc)
            print(table([row]).splitlines()[-1], flush=True)
        del w
        torch.cuda.empty_cache()
    print("\n" + table(doc["rows"]))
    if not args.no_direct:
        print("\nbitmap points timed directly (L2 flushed):\n" + direct_table(doc["rows"]))
    print(f"\nwrote {path} ({time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
