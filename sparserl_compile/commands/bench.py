"""``sparserl bench``: the benchmark suite, and the supervision data set for the policy.

For every matrix (the real set in ``../shared/matrices`` and/or a generated scale-up suite of
2D/3D stencils, banded, block-diagonal, uniform random and R-MAT matrices from 10^4 to
5 x 10^7 nonzeros, seeds recorded) and every op (SpMV; SpMM with N = 8, 32, 128) it runs the
search provider's candidates through the sandbox (``select.evaluate``: compile, verify, time
L2-flushed) beside torch.sparse with int32 and int64 indices, and records per row: reference
times, every variant's outcome and time, the best kernel and its family, the byte floor,
the fraction of the floor reached and the speedup over torch.sparse (int32).

Written under ``--out`` (default ``benchmarks/results/``):

* ``bench_<date>.json``: machine (GPU, clocks, driver), versions, arguments, rows. Rewritten
  after every matrix, so a budget stop or a crash keeps what was measured.
* ``supervision_<date>.jsonl.gz``: one JSON line per (matrix, op, n, variant) -- the matrix's
  origin (generator, arguments and seed, or the shared name), fingerprint, the variant's
  family/params/format, its outcome kind and times -- the policy's SFT data.

One failing matrix or variant is recorded and skipped; ``--time-budget`` stops adding
matrices once spent. ``--executor cpu`` (no GPU) verifies without timing: times are null.

``--suite graphs`` is another benchmark: SpMM on graphs through the public API beside
torch.sparse, with the first call's cost (``bench_graphs.py``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import gzip
import json
import math
import time
import traceback
from pathlib import Path

import numpy as np

from sparserl_compile.commands.suite_spec import MatrixSpec
from sparserl_compile.fileio import write_json
from sparserl_compile.problem import Problem
from sparserl_compile.version import machine_info, versions

OPS_WIDTHS = {"spmv": (1,), "spmm": (8, 32, 128)}


def _g(name, kind, gen, nnz, quick=False, **kw) -> MatrixSpec:
    kw.setdefault("seed", 0)
    return MatrixSpec(name, kind, "generated", gen, kw, None, nnz, quick)


#: the generated scale-up suite (nnz estimates for ordering and --max-nnz)
GENERATED: tuple[MatrixSpec, ...] = (
    _g("stencil2d_100", "stencil", "stencil2d", 49_600, True, n=100),
    _g("stencil3d_20", "stencil", "stencil3d", 53_600, n=20),
    _g("banded_20k_b2", "banded", "banded", 99_994, n=20_000, half_bandwidth=2),
    _g("blockdiag_500x16", "block", "block_diagonal", 128_000, True, n_blocks=500, block=16),
    _g("uniform_10k_d8", "random", "uniform_random", 80_000, False, n_rows=10_000, n_cols=10_000, per_row=8),
    _g("rmat_s14_e8", "powerlaw", "rmat", 120_000, True, scale=14, edge_factor=8),
    _g("stencil2d_300", "stencil", "stencil2d", 448_800, n=300),
    _g("stencil3d_50", "stencil", "stencil3d", 867_500, n=50),
    _g("banded_1m_b8", "banded", "banded", 16_999_928, n=1_000_000, half_bandwidth=8),
    _g("blockrandom_4x4", "block", "block_random", 4_000_000, n_brows=50_000, n_bcols=50_000, R=4, C=4,
       blocks_per_row=5),
    _g("uniform_1m_d16", "random", "uniform_random", 16_000_000, n_rows=1_000_000, n_cols=1_000_000, per_row=16),
    _g("rmat_s18_e16", "powerlaw", "rmat", 4_000_000, scale=18, edge_factor=16),
    _g("stencil2d_1000", "stencil", "stencil2d", 4_996_000, n=1000),
    _g("stencil3d_100", "stencil", "stencil3d", 6_940_000, n=100),
    _g("blockdiag_20kx32", "block", "block_diagonal", 20_480_000, n_blocks=20_000, block=32),
    _g("rmat_s20_e16", "powerlaw", "rmat", 16_000_000, scale=20, edge_factor=16),
    _g("stencil3d_200", "stencil", "stencil3d", 55_760_000, n=200),
)


#: a wider, smaller grid of generated matrices (1e4 to ~3e6 nonzeros, every generator, shapes and
#: densities the scale-up suite lacks: rectangular, very short and long rows, skewed R-MAT, random
#: geometric), measured for the policy's supervision data; about one in five is held out
#: (``training/data.py:is_held_out``)
GRID: tuple[MatrixSpec, ...] = (
    _g("g_stencil2d_50", "stencil", "stencil2d", 12_300, n=50, seed=1),
    _g("g_stencil2d_150", "stencil", "stencil2d", 111_400, n=150, seed=1),
    _g("g_stencil2d_400", "stencil", "stencil2d", 798_400, n=400, seed=1),
    _g("g_stencil3d_12", "stencil", "stencil3d", 11_200, n=12, seed=1),
    _g("g_stencil3d_30", "stencil", "stencil3d", 183_600, n=30, seed=1),
    _g("g_stencil3d_70", "stencil", "stencil3d", 2_381_000, n=70, seed=1),
    _g("g_banded_50k_b1", "banded", "banded", 150_000, n=50_000, half_bandwidth=1, seed=1),
    _g("g_banded_50k_b4_half", "banded", "banded", 225_000, n=50_000, half_bandwidth=4, fill=0.5, seed=1),
    _g("g_banded_20k_b16", "banded", "banded", 660_000, n=20_000, half_bandwidth=16, seed=1),
    _g("g_banded_300k_b3", "banded", "banded", 2_100_000, n=300_000, half_bandwidth=3, seed=1),
    _g("g_blockdiag_5000x4", "block", "block_diagonal", 80_000, n_blocks=5000, block=4, seed=1),
    _g("g_blockdiag_2000x8_half", "block", "block_diagonal", 64_000, n_blocks=2000, block=8, density=0.5, seed=1),
    _g("g_blockdiag_400x64", "block", "block_diagonal", 1_638_400, n_blocks=400, block=64, seed=1),
    _g("g_blockrandom_2x2", "block", "block_random", 320_000, n_brows=20_000, n_bcols=20_000, R=2, C=2,
       blocks_per_row=4, seed=1),
    _g("g_blockrandom_8x8", "block", "block_random", 768_000, n_brows=4_000, n_bcols=4_000, R=8, C=8,
       blocks_per_row=3, seed=1),
    _g("g_blockrandom_4x4_wide", "block", "block_random", 800_000, n_brows=10_000, n_bcols=100_000, R=4, C=4,
       blocks_per_row=5, seed=1),
    _g("g_uniform_50k_d2", "random", "uniform_random", 100_000, n_rows=50_000, n_cols=50_000, per_row=2, seed=1),
    _g("g_uniform_20k_d32", "random", "uniform_random", 640_000, n_rows=20_000, n_cols=20_000, per_row=32, seed=1),
    _g("g_uniform_tall", "random", "uniform_random", 800_000, n_rows=200_000, n_cols=5_000, per_row=4, seed=1),
    _g("g_uniform_wide", "random", "uniform_random", 640_000, n_rows=5_000, n_cols=500_000, per_row=128, seed=1),
    _g("g_uniform_100k_d24", "random", "uniform_random", 2_400_000, n_rows=100_000, n_cols=100_000, per_row=24,
       seed=1),
    _g("g_rmat_s12_e16", "powerlaw", "rmat", 53_000, scale=12, edge_factor=16, seed=1),
    _g("g_rmat_s16_e4", "powerlaw", "rmat", 260_000, scale=16, edge_factor=4, seed=1),
    _g("g_rmat_s15_e32_skew", "powerlaw", "rmat", 590_000, scale=15, edge_factor=32, a=0.7, b=0.1, c=0.1,
       seed=1),
    _g("g_rmat_s17_e8", "powerlaw", "rmat", 1_000_000, scale=17, edge_factor=8, seed=1),
    _g("g_rmat_s19_e4", "powerlaw", "rmat", 2_000_000, scale=19, edge_factor=4, seed=1),
    _g("g_rgg_20k_d8", "geometric", "random_geometric", 160_000, n=20_000, avg_degree=8, seed=1),
    _g("g_rgg_100k_d40", "geometric", "random_geometric", 4_000_000, n=100_000, avg_degree=40, seed=1),
    _g("g_rgg_200k_d12", "geometric", "random_geometric", 2_400_000, n=200_000, avg_degree=12, seed=1),
)


#: a second grid: more of the kinds where the nearest lookup
#: and the policy missed most on the held-out split (uniform random of every shape and density,
#: R-MAT, circuit-like), plus one more of each other generator; 1e4 to ~1e6 nonzeros so that one
#: device call measures all of it. Held out as GRID is (one in five by hash).
GRID2: tuple[MatrixSpec, ...] = (
    _g("g2_uniform_3k_d8", "random", "uniform_random", 24_000, n_rows=3_000, n_cols=3_000, per_row=8, seed=2),
    _g("g2_uniform_30k_d1", "random", "uniform_random", 30_000, n_rows=30_000, n_cols=30_000, per_row=1, seed=2),
    _g("g2_uniform_10k_d16", "random", "uniform_random", 160_000, n_rows=10_000, n_cols=10_000, per_row=16,
       seed=2),
    _g("g2_uniform_40k_d8", "random", "uniform_random", 320_000, n_rows=40_000, n_cols=40_000, per_row=8, seed=2),
    _g("g2_uniform_100k_d4", "random", "uniform_random", 400_000, n_rows=100_000, n_cols=100_000, per_row=4,
       seed=2),
    _g("g2_uniform_8k_d64", "random", "uniform_random", 512_000, n_rows=8_000, n_cols=8_000, per_row=64, seed=2),
    _g("g2_uniform_2k_d256", "random", "uniform_random", 512_000, n_rows=2_000, n_cols=20_000, per_row=256,
       seed=2),
    _g("g2_uniform_tall_d2", "random", "uniform_random", 800_000, n_rows=400_000, n_cols=2_000, per_row=2, seed=2),
    _g("g2_uniform_wide_d16", "random", "uniform_random", 320_000, n_rows=20_000, n_cols=1_000_000, per_row=16,
       seed=2),
    _g("g2_uniform_60k_d12", "random", "uniform_random", 720_000, n_rows=60_000, n_cols=60_000, per_row=12,
       seed=2),
    _g("g2_uniform_150k_d6", "random", "uniform_random", 900_000, n_rows=150_000, n_cols=150_000, per_row=6,
       seed=2),
    _g("g2_uniform_1k_d300", "random", "uniform_random", 300_000, n_rows=1_000, n_cols=100_000, per_row=300,
       seed=2),
    _g("g2_rmat_s13_e8", "powerlaw", "rmat", 60_000, scale=13, edge_factor=8, seed=2),
    _g("g2_rmat_s14_e16", "powerlaw", "rmat", 230_000, scale=14, edge_factor=16, seed=2),
    _g("g2_rmat_s16_e8", "powerlaw", "rmat", 500_000, scale=16, edge_factor=8, seed=2),
    _g("g2_rmat_s14_e32_skew", "powerlaw", "rmat", 400_000, scale=14, edge_factor=32, a=0.6, b=0.2, c=0.15,
       seed=2),
    _g("g2_rmat_s18_e2", "powerlaw", "rmat", 500_000, scale=18, edge_factor=2, seed=2),
    _g("g2_rmat_s12_e64", "powerlaw", "rmat", 171_000, scale=12, edge_factor=64, seed=2),
    _g("g2_circuit_5k", "circuit", "circuit", 35_500, n=5_000, per_row=5, dense_lines=2, dense_fill=0.3, seed=2),
    _g("g2_circuit_20k", "circuit", "circuit", 100_000, n=20_000, per_row=3, dense_lines=8, dense_fill=0.05,
       seed=2),
    _g("g2_circuit_50k_far", "circuit", "circuit", 250_000, n=50_000, per_row=4, dense_lines=4, dense_fill=0.02,
       local=0.1, seed=2),
    _g("g2_circuit_100k", "circuit", "circuit", 440_000, n=100_000, per_row=3, dense_lines=20, dense_fill=0.01,
       seed=2),
    _g("g2_circuit_200k_local", "circuit", "circuit", 800_000, n=200_000, per_row=3, dense_lines=0, local=0.9,
       seed=2),
    _g("g2_rgg_50k_d4", "geometric", "random_geometric", 200_000, n=50_000, avg_degree=4, seed=2),
    _g("g2_rgg_10k_d32", "geometric", "random_geometric", 320_000, n=10_000, avg_degree=32, seed=2),
    _g("g2_rgg_80k_d10", "geometric", "random_geometric", 800_000, n=80_000, avg_degree=10, seed=2),
    _g("g2_stencil2d_80", "stencil", "stencil2d", 32_000, n=80, seed=2),
    _g("g2_stencil2d_250", "stencil", "stencil2d", 312_000, n=250, seed=2),
    _g("g2_stencil3d_20", "stencil", "stencil3d", 54_000, n=20, seed=2),
    _g("g2_stencil3d_45", "stencil", "stencil3d", 620_000, n=45, seed=2),
    _g("g2_banded_100k_b2", "banded", "banded", 500_000, n=100_000, half_bandwidth=2, seed=2),
    _g("g2_banded_10k_b32_half", "banded", "banded", 330_000, n=10_000, half_bandwidth=32, fill=0.5, seed=2),
    _g("g2_banded_200k_diag", "banded", "banded", 200_000, n=200_000, half_bandwidth=0, seed=2),
    _g("g2_blockdiag_1000x16", "block", "block_diagonal", 256_000, n_blocks=1_000, block=16, seed=2),
    _g("g2_blockdiag_20000x2", "block", "block_diagonal", 80_000, n_blocks=20_000, block=2, seed=2),
    _g("g2_blockrandom_4x4", "block", "block_random", 480_000, n_brows=5_000, n_bcols=5_000, R=4, C=4,
       blocks_per_row=6, seed=2),
    _g("g2_blockrandom_2x2_sparse", "block", "block_random", 160_000, n_brows=40_000, n_bcols=40_000, R=2, C=2,
       blocks_per_row=1, seed=2),
)


def shared_specs() -> list[MatrixSpec]:
    from sparserl_compile import matrices

    out = []
    for m in matrices.shared_manifest():
        out.append(MatrixSpec(m.name, m.kind, "shared", None, {}, str(m.path), m.nnz,
                              quick=m.name in ("add32", "bcsstk13")))
    return out


def suite_specs(which: str, *, quick: bool = False, max_nnz: int | None = None,
                names: list[str] | None = None) -> list[MatrixSpec]:
    """Matrices of ``which`` ("generated" | "grid" | "grid2" | "shared" | "all"), smallest first."""
    if which not in ("generated", "grid", "grid2", "shared", "all"):
        raise ValueError(f"--suite {which!r}: use generated, grid, grid2, shared or all")
    specs = []
    if which in ("generated", "all"):
        specs += list(GENERATED)
    if which in ("grid", "all"):
        specs += list(GRID)
    if which in ("grid2", "all"):
        specs += list(GRID2)
    if which in ("shared", "all"):
        specs += shared_specs()
    if quick:
        specs = [s for s in specs if s.quick]
    if max_nnz:
        specs = [s for s in specs if s.nnz_estimate <= max_nnz]
    if names:
        specs = [s for s in specs if s.name in names]
    return sorted(specs, key=lambda s: s.nnz_estimate)


def _problem(m, op: str, n: int, dtype: str, arch: str):
    from sparserl_compile import structure

    ip = np.ascontiguousarray(m.indptr, np.int32)
    ix = np.ascontiguousarray(m.indices, np.int32)
    fp = structure.fingerprint(ip, ix, m.shape)
    return Problem(op, dtype, 1 if op == "spmv" else n, int(m.shape[0]), int(m.shape[1]),
                             int(ix.size), ip, ix, fp, arch)


def bench_matrix(spec: MatrixSpec, *, ops: list[tuple[str, int]], dtype: str, pool, executor: str,
                 max_candidates: int = 0, timeout_s: float = 60.0, reps: int = 30,
                 value_sets: int = 3) -> tuple[list[dict], list[dict]]:
    """Rows (one per op/n) and supervision lines for one matrix; errors are recorded, not raised."""
    from sparserl_compile import formats, select
    from sparserl_compile.search import SearchProvider

    rows, sup = [], []
    base = {"matrix": spec.name, "kind": spec.kind, "origin": spec.origin()}
    try:
        m = spec.load()
    except Exception as e:  # noqa: BLE001
        return [dict(base, error=f"load failed: {type(e).__name__}: {e}")], []
    arch = "cpu" if executor == "cpu" else _arch()
    base.update(n_rows=int(m.shape[0]), n_cols=int(m.shape[1]), nnz=int(m.nnz))
    provider = SearchProvider()
    for op, n in ops:
        t0 = time.perf_counter()
        row = dict(base, op=op, n=n, dtype=dtype)
        try:
            prob = _problem(m, op, n, dtype, arch)
            cands = provider.candidates(prob, max_candidates)
            row["search"] = provider.last_report.to_dict() if provider.last_report else None
            ev = select.evaluate(prob, cands, pool=pool, executor=executor, time=executor == "gpu",
                                 value_sets=value_sets, timeout_s=timeout_s, reps=reps, precompile=True)
            ref = ev.reference.reference if ev.reference is not None and ev.reference.ok else {}
            row["torch_int32_us"] = (ref.get("int32") or {}).get("median_us")
            row["torch_int64_us"] = (ref.get("int64") or {}).get("median_us")
            row["torch_int32_graph_us"] = (ref.get("int32_graph") or {}).get("median_us")
            if ev.reference is not None and not ev.reference.ok:
                row["reference_error"] = ev.reference.error[:500]
            vb = 4 if dtype == "f32" else 2
            floor_b = formats.floor_bytes(op, prob.n_rows, prob.n_cols, prob.nnz, prob.n, vb)
            row["floor_bytes"] = floor_b
            row["floor_us"] = next((r.floor_us for r in (ev.reference, *ev.results) if r is not None and r.floor_us),
                                   None)
            variants = [select.outcome_record(c, r) for c, r in zip(cands, ev.results)]
            row["variants"] = variants
            row["verified"] = sum(1 for v in variants if v["kind"] == "ok")
            row["kinds"] = dict(sorted(_count(v["kind"] for v in variants).items()))
            timed = [v for v in variants if v["kind"] == "ok" and v["kernel_us"] is not None]
            if timed:
                best = min(timed, key=lambda v: v["kernel_us"])
                row.update(best_us=best["kernel_us"], best_name=best["name"], best_family=best["family"])
                if row["floor_us"]:
                    row["frac_floor"] = row["floor_us"] / best["kernel_us"]
                ref_us = row["torch_int32_us"] or row["torch_int64_us"]
                if ref_us:
                    row["speedup"] = ref_us / best["kernel_us"]
                    row["torch_frac_floor"] = (row["floor_us"] / ref_us) if row["floor_us"] else None
            elif variants and row["verified"]:
                first = next(v for v in variants if v["kind"] == "ok")
                row.update(best_us=None, best_name=first["name"], best_family=first["family"])
            for v in variants:
                sup.append({"matrix": spec.origin(), "name": spec.name, "fingerprint": prob.fingerprint,
                            "op": op, "n": prob.n, "dtype": dtype, "arch": arch, "variant": v["name"],
                            "family": v["family"], "params": v["params"], "format": v["format"],
                            "kind": v["kind"], "kernel_us": v["kernel_us"], "graph_us": v["graph_us"],
                            "torch_int32_us": row["torch_int32_us"], "floor_us": row["floor_us"]})
        except Exception as e:  # noqa: BLE001 - one failure never kills the run
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-2000:]
        row["wall_s"] = round(time.perf_counter() - t0, 3)
        rows.append(row)
    del m
    gc.collect()
    return rows, sup


def _count(it) -> dict:
    out: dict = {}
    for k in it:
        out[k] = out.get(k, 0) + 1
    return out


def _arch() -> str:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


# ------------------------------------------------------------------ the run

def run(args: argparse.Namespace) -> dict:
    if args.suite == "graphs":  # SpMM through the public API beside torch.sparse (bench_graphs.py)
        from sparserl_compile.commands import bench_graphs

        return bench_graphs.run(args)
    from sparserl_compile import select
    from sparserl_compile.sandbox import SandboxPool

    executor = args.executor or select.default_executor()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d_%H%M%S")
    results_path = out_dir / f"bench_{stamp}.json"
    sup_path = out_dir / f"supervision_{stamp}.jsonl.gz"
    ops: list[tuple[str, int]] = []
    widths = [int(w) for w in args.widths.split(",")] if args.widths else list(OPS_WIDTHS["spmm"])
    if args.quick and not args.widths:
        widths = [32]  # --quick: one SpMM width
    for op in args.ops.split(","):
        op = op.strip()
        if op not in OPS_WIDTHS:
            raise SystemExit(f"--ops: unknown op {op!r}; use spmv and/or spmm")
        ops += [(op, 1)] if op == "spmv" else [(op, w) for w in widths]
    specs = suite_specs(args.suite, quick=args.quick, max_nnz=args.max_nnz,
                        names=args.matrices.split(",") if args.matrices else None)
    doc = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "machine": machine_info(),
           "versions": versions(), "executor": executor,
           "args": {k: v for k, v in vars(args).items() if k != "func"},
           "supervision": sup_path.name, "rows": [], "skipped_for_budget": []}
    t_start = time.perf_counter()
    with SandboxPool(1, timeout_s=args.timeout) as pool:
        sup_f = gzip.open(sup_path, "at", encoding="utf-8")
        try:
            for spec in specs:
                if args.time_budget and time.perf_counter() - t_start > args.time_budget:
                    doc["skipped_for_budget"].append(spec.name)
                    continue
                print(f"[bench] {spec.name} ({spec.kind}, ~{spec.nnz_estimate} nnz)", flush=True)
                rows, sup = bench_matrix(spec, ops=ops, dtype=args.dtype, pool=pool, executor=executor,
                                         max_candidates=args.max_candidates, timeout_s=args.timeout,
                                         reps=args.reps, value_sets=args.value_sets)
                doc["rows"].extend(rows)
                for line in sup:
                    sup_f.write(json.dumps(line, default=_json_default) + "\n")
                sup_f.flush()
                for r in rows:
                    print("  " + _summary_line(r), flush=True)
                doc["wall_s"] = round(time.perf_counter() - t_start, 2)
                write_json(results_path, doc, default=_json_default)
        finally:
            sup_f.close()
    doc["wall_s"] = round(time.perf_counter() - t_start, 2)
    write_json(results_path, doc, default=_json_default)
    print(f"[bench] wrote {results_path} and {sup_path}")
    doc["_paths"] = {"results": str(results_path), "supervision": str(sup_path)}
    return doc


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)


def _fmt(v, spec=".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _summary_line(r: dict) -> str:
    if "error" in r and "variants" not in r:
        return f"{r['matrix']} {r.get('op', '')}: ERROR {r['error'][:100]}"
    return (f"{r['matrix']:<22} {r['op']}{'' if r['op'] == 'spmv' else r['n']:<4} nnz={r['nnz']:<9} "
            f"torch={_fmt(r.get('torch_int32_us'))}us best={_fmt(r.get('best_us'))}us "
            f"[{r.get('best_family')}] x{_fmt(r.get('speedup'), '.2f')} floor={_fmt(r.get('frac_floor'), '.0%')} "
            f"verified={r.get('verified', 0)}/{len(r.get('variants', []))}")


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark the kernel space against torch.sparse; "
                                            "writes results JSON and the policy's supervision data")
    p.add_argument("--suite", default="all", choices=("generated", "grid", "grid2", "shared", "all", "graphs"),
                   help="generated: the scale-up suite; grid, grid2: the wider small grids (supervision data); "
                        "graphs: SpMM on graphs through the public API beside torch.sparse (not part of all)")
    p.add_argument("--quick", action="store_true", help="a small subset (a few minutes on an H200)")
    p.add_argument("--ops", default="spmv,spmm", help="comma list of spmv, spmm")
    p.add_argument("--widths", default="", help="SpMM dense widths N (default 8,32,128; graphs: 32,64,128,256)")
    p.add_argument("--dtype", default="f32", choices=("f32", "f16", "bf16"))
    p.add_argument("--time-budget", type=float, default=0.0, dest="time_budget",
                   help="seconds; stop adding matrices once spent (0 = no limit; graphs: 170 with --quick, "
                        "else 520)")
    p.add_argument("--out", default=str(Path("benchmarks") / "results"))
    p.add_argument("--executor", default=None, choices=("gpu", "cpu"),
                   help="default: gpu if available; cpu verifies without timing")
    p.add_argument("--max-nnz", type=int, default=0, dest="max_nnz", help="skip matrices above this nnz")
    p.add_argument("--matrices", default="", help="comma list of matrix names to run (default all)")
    p.add_argument("--max-candidates", type=int, default=0, dest="max_candidates",
                   help="first K points of the pruned space per problem (0 = all)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per candidate in the sandbox")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per kernel")
    p.add_argument("--value-sets", type=int, default=3, dest="value_sets")
    g = p.add_argument_group("--suite graphs")
    g.add_argument("--graphs", default="", help="comma list of graph names (generated or shared; default the suite)")
    g.add_argument("--dtypes", default="", help="comma list of f32, bf16, f16 (default f32,bf16)")
    g.add_argument("--device", default=None, choices=("cuda", "cpu"),
                   help="default cuda if available; cpu runs the reference (checks the plumbing, no speed)")
    g.add_argument("--provider", default=None, help="where candidates come from (default: the runtime's)")
    g.add_argument("--k", type=int, default=0, help="candidates per product (0: the provider's default)")
    g.add_argument("--cache-dir", default="", dest="cache_dir",
                   help="kernel cache to use (default: a fresh temporary one, so every first call searches)")
    p.set_defaults(func=lambda a: (run(a), 0)[1])
