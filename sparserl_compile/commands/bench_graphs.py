"""``sparserl bench --suite graphs``: SpMM on graphs through the public API, beside torch.sparse.

The graphs: the citation, social (power-law), mesh and planar graphs of ``../shared/matrices``
and generated R-MAT, random geometric and community power-law graphs (``graphs.py``) up to
about 10^8 nonzeros. Every graph is multiplied as a GCN layer does, by its normalized
adjacency D^-1/2 (A + I) D^-1/2 (``graphs.gcn_normalize``). For each dtype (float32, bfloat16)
and dense width N (32, 64, 128, 256), in one process:

1. ``S = sr.sparsify(A_hat).to(device, dtype)``: the conversion, timed;
2. ``S @ X`` once: the first call plans the product (the provider's candidates compiled,
   verified in the sandbox and timed against cuSPARSE, the winner's format built), timed, with
   ``sr.first_uses()``'s split of it and which kernel family won (or why the reference did);
3. ``S @ X`` and ``torch.sparse.mm(A_csr, X)`` (the same CSR, int32 indices, in ``dtype``) timed
   side by side: *cold* (L2 flushed before each call, the host path hidden behind a GPU spin:
   the GPU time of one call, ``bench.time_side_by_side``) and *back to back* (calls queued one
   after another with one synchronize at the end: host time included, L2 warm,
   ``bench.stream_us``), each timed twice in turn and the faster kept.

The byte floor of one product (``floor_bytes``): the CSR arrays once, every X row that some
nonzero reads once, Y written once:

    4 (n_rows + 1) + nnz (4 + v) + v N (columns with a nonzero) + v N n_rows,  v = value bytes

over the device's measured copy bandwidth (``bench.copy_bandwidth``); ``frac_floor`` is that
time over the cold time. A product whose estimated device memory (``memory_need``) exceeds
what is free is skipped and recorded with the reason, as is every product left when
``--time-budget`` runs out. Written under ``--out`` as ``graphs_<date>.json`` after every graph
(a run cut short keeps what it measured), and printed as a table.

On a CPU (``--device cpu``) every sparserl product runs the reference and the times are wall
clock (no L2 to flush): that checks the plumbing, not speed.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from sparserl_compile.commands.suite_spec import MatrixSpec
from sparserl_compile.fileio import write_json

WIDTHS = (32, 64, 128, 256)
QUICK_WIDTHS = (64, 128)
DTYPES = ("f32", "bf16")
#: graph kinds of the shared set that the suite takes (adjacency matrices)
SHARED_KINDS = ("gnn_citation", "social_powerlaw", "mesh", "road_planar")
#: device memory a product may plan to use, as a fraction of what is free
MEMORY_FRACTION = 0.85


def _g(name, kind, gen, nnz, quick=False, **kw) -> MatrixSpec:
    kw.setdefault("seed", 0)
    return MatrixSpec(name, kind, "generated", gen, kw, None, nnz, quick, generators="graphs")


#: generated graphs (nonzeros of the symmetric adjacency estimated, for ordering and --max-nnz)
GENERATED: tuple[MatrixSpec, ...] = (
    _g("rmat_s18_e8", "powerlaw", "rmat_graph", 3_900_000, True, scale=18, edge_factor=8),
    _g("community_2^18_d16", "community", "community_graph", 4_000_000, True, n=1 << 18, avg_degree=16),
    _g("rgg_2^18_d16", "geometric", "geometric_graph", 4_100_000, n=1 << 18, avg_degree=16),
    _g("community_2^20_d16_ordered", "community", "community_graph", 16_000_000, n=1 << 20, avg_degree=16,
       shuffle=False),
    _g("community_2^20_d16", "community", "community_graph", 16_000_000, n=1 << 20, avg_degree=16),
    _g("rmat_s20_e16", "powerlaw", "rmat_graph", 30_000_000, scale=20, edge_factor=16),
    _g("rgg_2^21_d16", "geometric", "geometric_graph", 33_000_000, n=1 << 21, avg_degree=16),
    _g("rmat_s22_e12", "powerlaw", "rmat_graph", 90_000_000, scale=22, edge_factor=12),
    _g("rmat_s24_e3", "powerlaw", "rmat_graph", 95_000_000, scale=24, edge_factor=3),
    _g("community_2^22_d24", "community", "community_graph", 100_000_000, n=1 << 22, avg_degree=24),
    _g("rgg_2^23_d12", "geometric", "geometric_graph", 100_000_000, n=1 << 23, avg_degree=12),
)

#: shared graphs in the suite (all the shared graph kinds have more; ``--graphs`` names any of them)
SHARED_FULL = ("cora_adj", "citeseer_adj", "polblogs", "wiki-Vote", "astro-ph", "MIT8", "fe_body",
               "rgg_n_2_15_s0")
SHARED_QUICK = ("cora_adj", "astro-ph")


def shared_graphs() -> list[MatrixSpec]:
    """Every adjacency of ``../shared/matrices`` whose kind is a graph (feature matrices excluded)."""
    from sparserl_compile import matrices

    return [MatrixSpec(m.name, m.kind, "shared", None, {}, str(m.path), m.nnz, m.name in SHARED_QUICK)
            for m in matrices.shared_manifest()
            if m.kind in SHARED_KINDS and m.n_rows == m.n_cols and not m.name.endswith("_features")]


def suite(*, quick: bool = False, names: list[str] | None = None, max_nnz: int = 0) -> list[MatrixSpec]:
    """The suite's graphs, smallest first: ``names`` picks any shared graph or generated one by
    name; otherwise the quick subset or the full list."""
    shared = shared_graphs()
    if names:
        known = {s.name: s for s in (*GENERATED, *shared)}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"--graphs: unknown graph(s) {unknown}; choose from {sorted(known)}")
        specs = [known[n] for n in names]
    else:
        specs = [s for s in GENERATED if s.quick or not quick]
        specs += [s for s in shared if s.name in (SHARED_QUICK if quick else SHARED_FULL)]
    if max_nnz:
        specs = [s for s in specs if s.nnz_estimate <= max_nnz]
    return sorted(specs, key=lambda s: s.nnz_estimate)


# ------------------------------------------------------------------ bytes and memory


def floor_bytes(n_rows: int, nnz: int, touched_cols: int, n: int, value_bytes: int) -> int:
    """Bytes one SpMM must move at least (module doc): CSR arrays, each X row some nonzero
    reads, and Y."""
    return int(4 * (n_rows + 1) + nnz * (4 + value_bytes) + value_bytes * n * (touched_cols + n_rows))


def memory_need(n_rows: int, n_cols: int, nnz: int, n: int, value_bytes: int) -> int:
    """Estimated peak device bytes of one product's first call, all processes together:

    * this process: three copies of the CSR arrays (sparserl's, torch's, the kernel's format),
      X and two outputs (sparserl's and torch's);
    * the sandbox worker verifying candidates: the operands and, per value set (3), an X, a
      float64 reference and a float64 error bound of Y, plus one output in its own dtype, float64
      and cuSPARSE's check.

    An estimate: what does not fit is skipped before it can fail halfway."""
    csr = 4 * (n_rows + 1) + nnz * (4 + value_bytes)
    here = 3 * csr + value_bytes * n * (n_cols + 2 * n_rows)
    sandbox = (csr + 8 * nnz + 3 * (value_bytes * n * n_cols + 16 * n * n_rows)
               + 8 * n * n_cols + n * n_rows * (2 * value_bytes + 8))
    return int(here + sandbox)


# ------------------------------------------------------------------ one graph


def _dtype(torch, name: str):
    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[name]


def _timings(ours, theirs, device: str, one_us: float) -> dict:
    """Cold (L2 flushed, GPU time) and back-to-back (host included) medians, side by side."""
    from sparserl_compile import bench

    reps = int(min(30, max(5, 3e5 / max(one_us, 1.0))))  # about 0.3 s per median
    calls = int(min(100, max(5, 3e5 / max(one_us, 1.0))))
    if device == "cuda":
        ours_cold, torch_cold = bench.time_side_by_side(ours, theirs, reps=reps)
    else:
        ours_cold = min(bench.wall_median_us(ours, device, reps=reps) for _ in range(2))
        torch_cold = min(bench.wall_median_us(theirs, device, reps=reps) for _ in range(2))
    o, t = [], []
    for _ in range(2):
        o.append(bench.stream_us(ours, device, calls=calls, warmup=2))
        t.append(bench.stream_us(theirs, device, calls=calls, warmup=2))
    return {"sparserl_cold_us": ours_cold, "torch_cold_us": torch_cold, "sparserl_b2b_us": min(o),
            "torch_b2b_us": min(t), "reps": reps, "b2b_calls": calls}


def _first_use_summary(rows: list[dict]) -> dict:
    """The planning record of one product: time split, plan, winner and its family."""
    if not rows:
        return {"planned": "already planned (no miss)"}
    r = rows[-1]
    ver = r.get("verification") or {}
    chosen = ver.get("chosen")
    family = next((c.get("family") for c in ver.get("candidates", []) if c.get("name") == chosen), None)
    out = {k: r.get(k) for k in ("source", "problem_s", "cache_s", "propose_s", "select_s", "plan_s", "total_s",
                                 "plan")}
    out.update(kernel=chosen, family=family, rule=ver.get("rule"), candidates=len(ver.get("candidates", [])),
               verified=sum(1 for c in ver.get("candidates", []) if c.get("kind") == "ok"),
               selection_reference_us=ver.get("reference_us"))
    return out


def _plan_of(S, n: int, dt) -> dict:
    """The plan the runtime keeps for ``S @ X`` at width ``n``: a kernel (its format) or the
    reference (and why)."""
    from sparserl_compile import plans
    from sparserl_compile.cache import width_bucket
    from sparserl_compile.problem import device_arch

    p = plans.plans().get((S.fingerprint, "spmm", width_bucket(n), dt, device_arch(S.device)))
    if p is None:
        return {"kind": None}
    if p.kind == "kernel":
        return {"kind": "kernel", "format": p.header.format}
    return {"kind": p.kind, "reason": getattr(p, "reason", None)}


def bench_graph(spec: MatrixSpec, *, widths, dtypes, device: str, deadline: float | None,
                skipped: list[dict]) -> list[dict]:
    """Rows for one graph (a load failure is one row with ``error``); skips appended to ``skipped``."""
    import torch

    import sparserl_compile as sr
    from sparserl_compile import bench, graphs, miss
    from sparserl_compile.bench import csr_tensor

    base = {"graph": spec.name, "kind": spec.kind, "origin": spec.origin()}
    t0 = time.perf_counter()
    try:
        a_hat = graphs.gcn_normalize(spec.load())
    except Exception as e:  # noqa: BLE001 - one graph's failure never stops the suite
        return [dict(base, error=f"load failed: {type(e).__name__}: {e}")]
    n_rows, n_cols = a_hat.shape
    touched = int(np.count_nonzero(np.bincount(a_hat.indices, minlength=n_cols)))
    base.update(n_rows=n_rows, nnz=int(a_hat.nnz), touched_cols=touched,
                load_s=round(time.perf_counter() - t0, 3))
    rows: list[dict] = []
    for dname in dtypes:
        dt = _dtype(torch, dname)
        vb = torch.finfo(dt).bits // 8
        t1 = time.perf_counter()
        S = sr.sparsify(a_hat).to(device=device, dtype=dt)
        bench.sync(device)
        conversion_s = time.perf_counter() - t1
        native = csr_tensor(torch, torch.from_numpy(a_hat.indptr).to(device), torch.from_numpy(a_hat.indices)
                            .to(device), torch.from_numpy(a_hat.data).to(device=device, dtype=dt), a_hat.shape)
        for n in widths:
            row = dict(base, dtype=dname, n=n)
            if deadline is not None and time.perf_counter() > deadline:
                skipped.append(dict(row, skipped="time budget spent"))
                continue
            if device == "cuda":
                need = memory_need(n_rows, n_cols, int(a_hat.nnz), n, vb)
                # free on the device plus what torch's allocator holds unused
                free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
                if need > MEMORY_FRACTION * free:
                    skipped.append(dict(row, skipped=f"memory: needs about {need / 2**30:.1f} GiB, "
                                                     f"{free / 2**30:.1f} GiB free"))
                    continue
            try:
                rows.append(_product(row, S, native, n, dt, device, conversion_s, vb))
            except Exception as e:  # noqa: BLE001 - recorded, the suite goes on
                if device == "cuda":
                    torch.cuda.empty_cache()
                rows.append(dict(row, error=f"{type(e).__name__}: {e}"[:1000]))
            gc.collect()
        del S, native
        miss.clear_first_uses()
    return rows


def _max_rel_diff(Y, Y_ref) -> float:
    """max |Y - Y_ref| / max |Y_ref| in float32, a block of rows at a time (outputs of 10^9
    elements would not fit twice more in float32)."""
    step = max(1, (1 << 26) // max(int(Y.shape[1]), 1))
    diff = scale = 0.0
    for i in range(0, int(Y.shape[0]), step):
        a, b = Y[i:i + step].float(), Y_ref[i:i + step].float()
        diff = max(diff, float((a - b).abs().max()))
        scale = max(scale, float(b.abs().max()))
    return diff / max(scale, 1e-30)


def _product(row: dict, S, native, n: int, dt, device: str, conversion_s: float, vb: int) -> dict:
    import torch

    from sparserl_compile import bench, miss

    g = torch.Generator(device=device).manual_seed(n)
    X = torch.randn(S.shape[1], n, generator=g, device=device).to(dt)
    miss.clear_first_uses()
    bench.sync(device)
    t0 = time.perf_counter()
    Y = S @ X  # the first call: plans this product
    bench.sync(device)
    first_s = time.perf_counter() - t0
    row.update(conversion_s=round(conversion_s, 4), first_call_s=round(first_s, 4),
               first_use=_first_use_summary(miss.first_uses()), plan=_plan_of(S, n, dt))
    Y_ref = torch.sparse.mm(native, X)
    row["max_rel_diff_vs_torch"] = _max_rel_diff(Y, Y_ref)
    del Y, Y_ref
    bench.sync(device)
    t1 = time.perf_counter()
    torch.sparse.mm(native, X)
    bench.sync(device)
    one_us = (time.perf_counter() - t1) * 1e6
    row.update(_timings(lambda: S @ X, lambda: torch.sparse.mm(native, X), device, one_us))
    row["speedup_cold"] = row["torch_cold_us"] / row["sparserl_cold_us"]
    row["speedup_b2b"] = row["torch_b2b_us"] / row["sparserl_b2b_us"]
    fb = floor_bytes(row["n_rows"], row["nnz"], row["touched_cols"], n, vb)
    row["floor_bytes"] = fb
    if device == "cuda":
        row["floor_us"] = bench.floor_us(fb)
        row["frac_floor"] = row["floor_us"] / row["sparserl_cold_us"]
        row["torch_frac_floor"] = row["floor_us"] / row["torch_cold_us"]
    return row


# ------------------------------------------------------------------ the run


def run(args: argparse.Namespace) -> dict:
    """The graph suite as ``sparserl bench --suite graphs`` runs it (see the module doc)."""
    import torch

    import sparserl_compile as sr
    from sparserl_compile.version import machine_info, versions

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; use --device cpu (plumbing only, no speed)")
    widths = _ints(args.widths, "--widths") if args.widths else list(QUICK_WIDTHS if args.quick else WIDTHS)
    dtypes = [d.strip() for d in (args.dtypes or ",".join(DTYPES)).split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("f32", "bf16", "f16")]
    if bad or not dtypes:
        raise SystemExit(f"--dtypes {args.dtypes!r}: use a comma list of f32, bf16, f16")
    try:
        specs = suite(quick=args.quick, names=[s.strip() for s in args.graphs.split(",") if s.strip()]
                      if args.graphs else None, max_nnz=args.max_nnz)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d_%H%M%S")
    path = out_dir / f"graphs_{stamp}.json"
    budget = args.time_budget or (170.0 if args.quick else 520.0)
    doc = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "machine": machine_info(),
           "versions": versions(), "device": device, "suite": "graphs",
           "args": {k: v for k, v in vars(args).items() if k != "func"}, "widths": widths, "dtypes": dtypes,
           "time_budget_s": budget, "floor_formula": "4 (n_rows + 1) + nnz (4 + v) + v N touched_cols + v N n_rows",
           "rows": [], "skipped": []}
    tmp_cache = None
    old_env = os.environ.get("SPARSERL_CACHE_DIR")
    if args.cache_dir:
        os.environ["SPARSERL_CACHE_DIR"] = str(Path(args.cache_dir).expanduser())
    else:  # a fresh cache: every first call searches, so its cost is the one a new structure pays
        tmp_cache = tempfile.mkdtemp(prefix="sparserl-graphs-")
        os.environ["SPARSERL_CACHE_DIR"] = tmp_cache
    doc["cache_dir"] = os.environ["SPARSERL_CACHE_DIR"] if args.cache_dir else "fresh (temporary)"
    before, before_provider = sr.get_config(), sr.get_provider()
    sr.configure(on_miss="search", **({"provider": args.provider} if args.provider else {}),
                 **({"k": args.k} if args.k else {}))
    doc["provider"] = sr.get_provider().name
    t_start = time.perf_counter()
    deadline = t_start + budget
    try:
        for spec in specs:
            if time.perf_counter() > deadline:
                doc["skipped"].append({"graph": spec.name, "skipped": "time budget spent"})
                continue
            print(f"[graphs] {spec.name} ({spec.kind}, ~{spec.nnz_estimate} nnz)", flush=True)
            rows = bench_graph(spec, widths=widths, dtypes=dtypes, device=device, deadline=deadline,
                               skipped=doc["skipped"])
            doc["rows"].extend(rows)
            for r in rows:
                print("  " + summary_line(r), flush=True)
            doc["wall_s"] = round(time.perf_counter() - t_start, 2)
            write_json(path, doc)
            gc.collect()
    finally:
        sr.configure(on_miss=before.on_miss, k=before.k, provider=before_provider)
        if old_env is None:
            os.environ.pop("SPARSERL_CACHE_DIR", None)
        else:
            os.environ["SPARSERL_CACHE_DIR"] = old_env
        if tmp_cache:
            shutil.rmtree(tmp_cache, ignore_errors=True)
    doc["wall_s"] = round(time.perf_counter() - t_start, 2)
    write_json(path, doc)
    print(table(doc))
    print(f"[graphs] wrote {path}")
    doc["_path"] = str(path)
    return doc


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: give positive integers, e.g. 32,64,128,256") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"{flag} {text!r}: give positive integers, e.g. 32,64,128,256")
    return vals


def _f(v, spec=".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def summary_line(r: dict) -> str:
    if "error" in r:
        return f"{r['graph']} {r.get('dtype', '')} {r.get('n', '')}: ERROR {r['error'][:160]}"
    won = _winner(r)
    return (f"{r['graph']:<26} {r['dtype']:<4} N={r['n']:<4} nnz={r['nnz']:<10} torch={_f(r['torch_cold_us'])}us "
            f"ours={_f(r['sparserl_cold_us'])}us x{_f(r['speedup_cold'], '.2f')} "
            f"floor={_f(r.get('frac_floor'), '.0%')} b2b x{_f(r['speedup_b2b'], '.2f')} [{won}] "
            f"first={_f(r['first_call_s'], '.2f')}s")


def _winner(r: dict) -> str:
    """The family that won, else the plan's kind (``reference``), else ``-``."""
    fu, plan = r.get("first_use", {}), r.get("plan", {})
    if plan.get("kind") == "kernel":
        return fu.get("family") or f"kernel ({plan.get('format')})"
    return plan.get("kind") or "-"


def table(doc: dict) -> str:
    """The results as a markdown table (one line per product), then the skipped ones."""
    head = ("| graph | kind | nnz | dtype | N | torch cold us | sparserl cold us | speedup | floor % (ours / torch) "
            "| b2b speedup | winner | first call s |")
    lines = [head, "|" + "---|" * 12]
    for r in doc["rows"]:
        if "error" in r:
            lines.append(f"| {r['graph']} | {r.get('kind', '')} | | {r.get('dtype', '')} | {r.get('n', '')} | "
                         f"error: {r['error'][:80]} |||||||")
            continue
        fl = (f"{_f(100 * r['frac_floor'], '.0f')} / {_f(100 * r['torch_frac_floor'], '.0f')}"
              if r.get("frac_floor") else "-")
        lines.append(f"| {r['graph']} | {r['kind']} | {r['nnz']} | {r['dtype']} | {r['n']} | "
                     f"{_f(r['torch_cold_us'])} | {_f(r['sparserl_cold_us'])} | {_f(r['speedup_cold'], '.2f')} | "
                     f"{fl} | {_f(r['speedup_b2b'], '.2f')} | {_winner(r)} | "
                     f"{_f(r['first_call_s'], '.2f')} |")
    for s in doc["skipped"]:
        lines.append(f"skipped: {s['graph']} {s.get('dtype', '')} {s.get('n', '')}: {s['skipped']}")
    return "\n".join(lines)
