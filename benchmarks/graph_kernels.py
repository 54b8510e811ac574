"""SpMM on graphs (GPU): the graph families and the rest of the kernel space against torch.sparse.

For every graph, dense width ``N`` and value dtype, in one process on one GPU:

* the search's pruned kernel space for the problem (``SearchProvider``), at most
  ``--max-points`` points per family (spread evenly through the family's points, so every
  order, vector width and window height of a family is sampled across problems);
* each point verified on the GPU executor (``verify.verify(..., executor="gpu")``: poisoned
  outputs, guard zones, input hashes, the float64 error bound, a second bit-identical run,
  cuSPARSE within twice the bound), then timed with the L2 flushed before every repetition
  (``bench.time_fn``, the host path hidden behind a GPU sleep); a point that fails
  verification is reported with its reason and never timed;
* torch.sparse CSR (cuSPARSE, int32 and int64 indices, the faster kept) timed the same way
  before and after the problem's points (the faster of the two kept: side by side);
* the byte floor (``formats.floor_bytes`` over the measured copy bandwidth), each time's
  fraction of it, the speedup over torch.sparse, and the winner.

One-time costs per graph are measured and reported: each row order (``graphformats.row_order``,
RCM and BFS) and each layout conversion (``formats.convert``, first call per graph and layout;
later calls in this process reuse it, as the runtime keeps a plan's layout).

Default graphs: R-MAT 2^20 (edge factor 16) and 2^18 (edge factor 8), then the shared graphs
largest first; widths 32, 64, 128, 256; f32 and bf16. ``--time-budget`` stops starting new
problems once spent (the results so far are written after every problem). ``--quick``: R-MAT
2^18, wiki-Vote and Cora at N = 64 and 128, one point per family (four per graph family).

    python benchmarks/graph_kernels.py [--quick] [--graphs rmat:20:16,wiki-Vote] [--widths 32,64]
        [--dtypes f32,bf16] [--max-points 2] [--max-graph-points 6] [--time-budget 210]
        [--json $OUT/graph_kernels.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from report import geomean, text_table  # this folder: the scripts run as `python benchmarks/NAME.py`

GRAPHS = ("rmat:20:16", "rmat:18:8", "astro-ph", "wiki-Vote", "PGPgiantcompo", "polblogs", "hep-th",
          "cora_adj", "citeseer_adj")
QUICK = {"graphs": ("rmat:18:8", "wiki-Vote", "cora_adj"), "widths": (64, 128), "max_points": 1, "max_graph_points": 4}
WIDTHS = (32, 64, 128, 256)
DTYPES = ("f32", "bf16")
GRAPH_FAMILIES = ("csr_split", "tcw_wmma")
#: graphs of at least this many edges count as "large" in the summary (the issue's target class)
LARGE_NNZ = 10**6


def _csv(kind, text: str) -> tuple:
    try:
        out = tuple(kind(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list") from None
    if not out:
        raise argparse.ArgumentTypeError("an empty list")
    return out


def check_graph(spec: str) -> str:
    """``rmat:SCALE:EDGE_FACTOR`` (scale 4-26, edge factor 1-64) or a shared matrix name."""
    if spec.startswith("rmat:"):
        parts = spec.split(":")
        if len(parts) != 3 or not all(p.isdigit() for p in parts[1:]):
            raise argparse.ArgumentTypeError(f"{spec!r}: write R-MAT graphs as rmat:SCALE:EDGE_FACTOR, e.g. rmat:18:8")
        s, e = int(parts[1]), int(parts[2])
        if not (4 <= s <= 26 and 1 <= e <= 64):
            raise argparse.ArgumentTypeError(f"{spec!r}: scale must be in [4, 26] and edge factor in [1, 64]")
    elif not spec.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"{spec!r}: not rmat:S:E nor a shared matrix name")
    return spec


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graphs", type=lambda s: _csv(check_graph, s), default=None,
                   help=f"comma-separated: rmat:SCALE:EDGE_FACTOR or shared matrix names (default {','.join(GRAPHS)})")
    p.add_argument("--widths", type=lambda s: _csv(int, s), default=None, help="dense widths N (default 32,64,128,256)")
    p.add_argument("--dtypes", type=lambda s: _csv(str, s), default=None, help="f32, f16, bf16 (default f32,bf16)")
    p.add_argument("--max-points", type=int, default=None, help="points per family and problem (default 2; quick 1)")
    p.add_argument("--max-graph-points", type=int, default=None,
                   help="points per graph family (csr_split, tcw_wmma) and problem (default 6; quick 4)")
    p.add_argument("--reps", type=int, default=10, help="L2-flushed timings per point (median kept)")
    p.add_argument("--time-budget", type=float, default=210.0, help="seconds; no new problem starts after it")
    p.add_argument("--quick", action="store_true",
                   help="R-MAT 2^18, wiki-Vote, Cora; N = 64, 128; 1 point per family, 4 per graph family")
    p.add_argument("--json", default=None, help="result JSON (default $OUT/graph_kernels.json, else ./graph_kernels.json)")
    a = p.parse_args(argv)
    base = QUICK if a.quick else {"graphs": GRAPHS, "widths": WIDTHS, "max_points": 2, "max_graph_points": 6}
    a.graphs = a.graphs or base["graphs"]
    a.widths = a.widths or base["widths"]
    a.dtypes = a.dtypes or DTYPES
    a.max_points = a.max_points if a.max_points is not None else base["max_points"]
    a.max_graph_points = a.max_graph_points if a.max_graph_points is not None else base["max_graph_points"]
    bad = [d for d in a.dtypes if d not in ("f32", "f16", "bf16")]
    if bad:
        p.error(f"--dtypes {','.join(bad)}: expected f32, f16 or bf16")
    if any(n < 1 for n in a.widths) or min(a.max_points, a.max_graph_points) < 1 or a.reps < 3:
        p.error("--widths must be positive, --max-points and --max-graph-points >= 1, --reps >= 3")
    if a.json is None:
        a.json = str(Path(os.environ.get("OUT", ".")) / "graph_kernels.json")
    return a


def spread(items: list, k: int) -> list:
    """At most ``k`` of ``items``, evenly spaced, first and last included (order kept)."""
    if len(items) <= k:
        return list(items)
    if k == 1:
        return [items[0]]
    idx = sorted({round(i * (len(items) - 1) / (k - 1)) for i in range(k)})
    return [items[i] for i in idx]


def choose_points(cands: list, max_points: int, offset: int = 0, max_graph_points: int | None = None) -> list:
    """Per family, ``spread`` over its points rotated by ``offset`` (so that successive
    problems sample different points of a large family), at most ``max_points`` of a family and
    ``max_graph_points`` (default the same) of a graph family; families in first-seen order."""
    by_family: dict[str, list] = {}
    for c in cands:
        by_family.setdefault(c.family or "generated", []).append(c)
    out = []
    for fam, pts in by_family.items():
        cap = max_graph_points if fam in GRAPH_FAMILIES and max_graph_points else max_points
        r = offset % len(pts)
        out += spread(pts[r:] + pts[:r], cap)
    return out


def summarize(problem: dict) -> dict:
    """One table row from a problem's record: the fastest verified point overall and per graph
    family, against torch.sparse."""
    ref = problem["torch_us"]
    timed = [p for p in problem["points"] if p.get("us")]
    row = {"graph": problem["graph"], "dtype": problem["dtype"], "n": problem["n"], "nnz": problem["nnz"],
           "torch_us": ref, "torch_floor": problem["floor_us"] / ref if ref else None,
           "best": None, "best_us": None, "speedup": None, "best_floor": None, "failed": sum(not p["ok"] for p in problem["points"])}
    if timed:
        best = min(timed, key=lambda p: p["us"])
        row.update(best=best["name"], best_family=best["family"], best_us=best["us"],
                   speedup=ref / best["us"] if ref else None, best_floor=problem["floor_us"] / best["us"])
    for fam in GRAPH_FAMILIES:
        mine = [p for p in timed if p["family"] == fam]
        row[fam] = (ref / min(p["us"] for p in mine)) if mine and ref else None
    row["winner"] = "torch.sparse" if not timed or (ref and min(p["us"] for p in timed) >= ref) else row["best_family"]
    if ref is None:
        row["winner"] += " (no torch.sparse time)"
    return row


def _fmt(v, spec: str) -> str:
    width = int(spec.split(".")[0] or 0)
    return f"{'-':>{width}}" if v is None else format(v, spec)


def _ratio(v, width: int = 6) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:{width - 1}.2f}x"


def format_table(rows: list[dict]) -> str:
    """The stdout table: one line per problem, then geometric-mean speedups by graph class."""
    def floor(key):
        return lambda r: _fmt(r[key] and 100 * r[key], "6.1f")

    table = text_table([
        ("graph", -16, lambda r: r["graph"]), ("dt", -4, lambda r: r["dtype"]), ("N", 4, lambda r: str(r["n"])),
        ("torch us", 9, lambda r: _fmt(r["torch_us"], "9.1f")), ("floor%", 6, floor("torch_floor")),
        ("best us", 9, lambda r: _fmt(r["best_us"], "9.1f")), ("floor%", 6, floor("best_floor")),
        ("speedup", 7, lambda r: _ratio(r["speedup"], 7)), ("split", 6, lambda r: _ratio(r["csr_split"])),
        ("tcw", 6, lambda r: _ratio(r["tcw_wmma"])),
        (" winner", 0, lambda r: f" {r['winner']}" + (f" ({r['failed']} failed verification)" if r["failed"] else "")),
    ], rows)
    lines = [table]
    for label, keep in (("graphs >= 1e6 edges, N >= 64", lambda r: r["nnz"] >= LARGE_NNZ and r["n"] >= 64),
                        ("all", lambda r: True)):
        sel = [r for r in rows if keep(r)]
        if sel:
            best = geomean(max(r["speedup"] or 0, 1.0) for r in sel)
            split = geomean(r["csr_split"] for r in sel)
            tc = geomean(r["tcw_wmma"] for r in sel)
            lines.append(f"geomean over {len(sel)} problems ({label}): kept plan {_ratio(best, 1).strip()}, "
                         f"csr_split {_ratio(split, 1).strip()}, tcw_wmma {_ratio(tc, 1).strip()}")
    return "\n".join(lines)


# ------------------------------------------------------------------ GPU side


def load_graph(spec: str):
    """(label, scipy CSR) for a graph spec."""
    from sparserl_compile import matrices

    if spec.startswith("rmat:"):
        _, s, e = spec.split(":")
        return f"rmat{s}_e{e}", matrices.rmat(int(s), int(e), seed=0)
    d = matrices.shared_matrices_dir()
    if d is None or not (d / f"{spec}.npz").is_file():
        raise SystemExit(f"graph {spec!r}: no {spec}.npz under the shared matrices ({d}); set SPARSERL_SHARED_MATRICES")
    return spec, matrices.load_npz(d / f"{spec}.npz")


class ConversionLog:
    """``formats.convert`` wrapped for this process: the first conversion of a (graph, layout)
    is timed and kept, later ones reuse it (verification converts per candidate)."""

    def __init__(self, formats_module):
        self.formats, self.inner = formats_module, formats_module.convert
        self.kept: dict = {}
        self.seconds: dict[str, dict[str, float]] = {}
        self.label = ""

    def __call__(self, indptr, indices, shape, fmt, params=None, **kw):
        key = (id(indptr), id(indices), tuple(shape), fmt, tuple(sorted((params or {}).items())), tuple(sorted(kw.items())))
        if key not in self.kept:
            t0 = time.perf_counter()
            self.kept[key] = (self.inner(indptr, indices, shape, fmt, params, **kw), indptr, indices)
            name = fmt + "".join(f"[{k}={v}]" for k, v in sorted((params or {}).items()))
            self.seconds.setdefault(self.label, {})[name] = round(time.perf_counter() - t0, 4)
        return self.kept[key][0]

    def forget(self) -> None:
        self.kept.clear()


def order_costs(m) -> dict[str, float]:
    """Seconds of each costly row order on ``m`` (first computation; it is then kept)."""
    from sparserl_compile import graphformats

    import numpy as np

    tiny = np.array([0, 1, 2], np.int32), np.array([1, 0], np.int32)
    for code in (3, 4):  # imports and JIT loads paid here, not in the figures
        graphformats.row_order(*tiny, (2, 2), code)
    out = {}
    ip, ix = m.indptr.astype("int32"), m.indices.astype("int32")
    for code in (3, 4):
        t0 = time.perf_counter()
        graphformats.row_order(ip, ix, m.shape, code)
        out[graphformats.ORDERS[code]] = round(time.perf_counter() - t0, 4)
    return out


def run_problem(label: str, pat, m, op_n: int, dtype: str, a, offset: int) -> dict:
    import torch

    from sparserl_compile import bench, formats, structure, verify
    from sparserl_compile.problem import Problem
    from sparserl_compile.search import SearchProvider

    fp = structure.fingerprint(pat.indptr, pat.indices, pat.shape)
    prob = Problem("spmm", dtype, op_n, pat.shape[0], pat.shape[1], pat.nnz, pat.indptr, pat.indices, fp, "sm_90")
    cands = choose_points(SearchProvider().candidates(prob), a.max_points, offset, a.max_graph_points)
    vb = 4 if dtype == "f32" else 2
    floor = bench.floor_us(formats.floor_bytes("spmm", pat.shape[0], pat.shape[1], pat.nnz, op_n, vb))

    def reference() -> float | None:  # None: torch.sparse has no kernel for this dtype here
        r = bench.time_reference(pat.indptr, pat.indices, pat.shape, op="spmm", n=op_n, dtype=dtype, reps=a.reps,
                                 hide_host_us=bench.HIDE_HOST_US)
        return min((v.median_us for k, v in r.items() if not k.endswith("_graph")), default=None)

    before = reference()
    points = []
    for c in cands:
        rec = {"name": c.name, "family": c.family, "ok": False}
        runner: list = []
        try:
            v = verify.verify(c, pat, executor="gpu", n=op_n, value_sets=1, runner_out=runner)
        except Exception as e:  # noqa: BLE001 - one point's failure is a result, not the end of the run
            rec["reason"] = f"{type(e).__name__}: {str(e)[:200]}"
            points.append(rec)
            continue
        rec.update(ok=v.ok, verify_s=round(v.seconds, 3))
        if not v.ok:
            rec["reason"] = v.reason[:300]
        else:
            t = bench.time_fn(runner[0].launch_fn(), warmup=2, reps=a.reps, hide_host_us=bench.HIDE_HOST_US)
            rec.update(us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us, impossible=bench.is_impossible(t.median_us, floor))
            if rec["impossible"]:  # faster than the bytes it must move: a kernel that skipped work
                rec.update(ok=False, reason="faster than the byte floor", us=None)
        points.append(rec)
        del runner
    after = reference()
    torch.cuda.empty_cache()
    return {"graph": label, "dtype": dtype, "n": op_n, "nnz": pat.nnz, "n_rows": pat.shape[0],
            "floor_us": floor, "torch_us": min((t for t in (before, after) if t is not None), default=None),
            "torch_runs_us": [before, after], "points": points}


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("graph_kernels.py times kernels on a GPU; no CUDA device is visible", file=sys.stderr)
        return 2
    from sparserl_compile import bench, compiler, formats, kernels, verify
    from sparserl_compile.fileio import write_json
    from sparserl_compile.version import run_stamp

    t_start = time.perf_counter()
    warm_s = formats.warm()  # numba's converters loaded (or compiled) before anything is timed
    log = ConversionLog(formats)
    formats.convert = log
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    srcs = [c.source for dt in a.dtypes for c in kernels.space("spmm", dt)]
    compiled = compiler.precompile(srcs, arch)
    doc = {**run_stamp(), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "bandwidth_Bps": bench.copy_bandwidth(), "args": {k: v for k, v in vars(a).items()},
           "precompile": compiled, "precompile_s": round(time.perf_counter() - t_start, 2), "warm_s": round(warm_s, 2),
           "graphs": {}, "problems": [], "complete": False}
    rows, k = [], 0
    for spec in a.graphs:
        if time.perf_counter() - t_start > a.time_budget:
            break
        t0 = time.perf_counter()
        label, m = load_graph(spec)
        pat = verify.Pattern.of(m)
        log.label = label
        doc["graphs"][label] = {"spec": spec, "n_rows": m.shape[0], "nnz": int(m.nnz), "load_s": round(time.perf_counter() - t0, 2),
                                "order_s": order_costs(m), "convert_s": log.seconds.setdefault(label, {})}
        for dtype in a.dtypes:
            for n in a.widths:
                if time.perf_counter() - t_start > a.time_budget:
                    break
                rec = run_problem(label, pat, m, n, dtype, a, k)
                k += 1
                doc["problems"].append(rec)
                rows.append(summarize(rec))
                print(format_table(rows[-1:]).splitlines()[2], flush=True)
                write_json(a.json, doc)
        log.forget()
        verify.clear_value_sets()
    doc["complete"] = len(doc["problems"]) == len(a.graphs) * len(a.widths) * len(a.dtypes)
    doc["seconds"] = round(time.perf_counter() - t_start, 1)
    write_json(a.json, doc)
    print()
    print(format_table(rows))
    print("one-time costs per graph (s): " + "; ".join(
        f"{g}: rcm {v['order_s']['rcm']}, bfs {v['order_s']['bfs']}, slowest layout "
        f"{max(v['convert_s'].values(), default=0)}" for g, v in doc["graphs"].items()))
    print(f"{len(doc['problems'])} problems in {doc['seconds']} s{'' if doc['complete'] else ' (time budget reached)'}; "
          f"results in {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
