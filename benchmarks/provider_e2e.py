"""End to end through the runtime's provider, on the policy's held-out split (GPU).

For each provider and each held-out supervision record (matrix, op, width; ``training/data.py``
split, never trained on), the runtime's plan table is cleared and the disk cache is off, so one
``SparseRLTensor @ x`` asks the provider for ``k`` candidates, compiles, verifies (sandbox,
against cuSPARSE and a float64 reference) and times them against cuSPARSE in the same
process, and keeps the fastest verified one or cuSPARSE. Per product:

* ``speedup``: cuSPARSE's L2-flushed time over the kept kernel's, both measured by that
  selection (1.0 where cuSPARSE was kept): what the runtime delivers through this provider;
* ``space_speedup``: the record's kernel-space best over torch.sparse int32, from the H200
  supervision measurements: what the whole hand-written space reaches on that product;
* ``delivered_speedup``: after the selection, the runtime's ``A @ x`` and torch.sparse's
  product timed again side by side in this process (L2 flushed, CUDA events, a GPU sleep
  before each call so that neither call's host path enters the time, each timed twice in
  turn, the faster median of each): the GPU time of what a user's call runs, zeroing of the
  output and the fallback path included, free of the selection's own timing noise;
* ``reference_leak``: torch.sparse's product timed with the L2 flush alone and with its host
  path hidden, in turn: how much of its host path the flush alone lets into a timing (the
  selection hides it, ``bench.HIDE_HOST_US``);
* ``rel_err``: the product against torch.sparse on the same tensors (max abs difference over
  max abs value), ``first_call_s`` and ``plan`` (the format kept, or the reference);
* ``first_use``: that first call's split from the runtime's ``first_uses()`` log (proposal,
  selection, every candidate's outcome and phases), as ``cold_start.py`` rows have it.

The summary gives the geometric means (of both speedups), the ratio of the provider's to the
space's, how often cuSPARSE was kept, and how many results were wrong (``rel_err`` above
``--wrong-tol``). The policy issue's target: the provider's geometric-mean speedup within 5 %
of the kernel space's, and never a wrong result.

``search:0`` runs the whole pruned kernel space through the same runtime path (every point
compiled, verified and timed against cuSPARSE in one selection). When it is among the
providers, every other provider's summary also has ``ratio_to_search``: its geometric-mean
speedup over the search's on the products both ran, each measured the same way in the same
process, so the cuSPARSE timings of other calls do not enter the comparison.

    python benchmarks/provider_e2e.py [--providers nearest:4,policy:4,search:0] [--json out.json]

Shared matrices are read from ``../shared/matrices`` or ``SPARSERL_SHARED_MATRICES``; records
whose matrix is not there are skipped and counted.
"""

from __future__ import annotations

import argparse
import sys

import torch

import sparserl_compile as sr
from cold_start import _breakdown, _make_provider, first_product, native_csr
from sparserl_compile import bench, matrices, miss, plans
from sparserl_compile.fileio import write_json
from sparserl_compile.training.stats import geomean


def _host_leak(native, x) -> dict:
    """torch.sparse's product timed as the selection times it (L2 flush only) and with its
    host path hidden, in turn, in this process: medians in us."""
    fn = (lambda: torch.mv(native, x)) if x.dim() == 1 else (lambda: torch.mm(native, x))
    return {"flush_only_us": bench.time_fn(fn).median_us,
            "host_hidden_us": bench.time_fn(fn, hide_host_us=bench.HIDE_HOST_US).median_us}


def _kept_us(record: dict) -> float | None:
    """The kept kernel's time in the selection record (None where cuSPARSE was kept)."""
    if not record.get("chosen"):
        return None
    if record.get("chosen_us") is not None:
        return record["chosen_us"]
    ok = [c["kernel_us"] for c in record.get("candidates", []) if c.get("kind") == "ok" and c.get("kernel_us")]
    return min(ok) if ok else None


def run(provider_specs: list[str], records, device: str = "cuda", wrong_tol: float = 1e-3,
        on_row=None, loaded: dict | None = None) -> tuple[list[dict], dict]:
    """The rows and the per-provider summary; ``loaded`` (MatrixRef -> CSR) is used and filled."""
    dev = torch.device(device)
    rows: list[dict] = []
    loaded = {} if loaded is None else loaded
    for spec in provider_specs:
        pspec, k, spare = parse_spec(spec)
        prov = _make_provider(pspec)
        sr.configure(provider=prov, k=k, cache=False, on_miss="search", sandbox_spare=spare)
        label = pspec if spare is None else f"{pspec}/{spare}"
        sr.prewarm().join()
        warm = sr.sparsify(matrices.stencil2d(40, seed=3)).to(dev)  # contexts, NVRTC, the GPU's clocks: not
        warm @ torch.randn(warm.shape[1], device=dev)  # charged to the first record (as cold_start.py)
        for r in records:
            if r.matrix not in loaded:
                loaded[r.matrix] = r.matrix.load()
            m = loaded[r.matrix]
            a = sr.sparsify(m).to(dev)
            x = torch.randn(m.shape[1], device=dev) if r.op == "spmv" else torch.randn(m.shape[1], r.n, device=dev)
            native = native_csr(m, dev)
            first, err = first_product(a, native, x, dev)
            logged = miss.first_uses()
            rec = (logged[-1].get("verification") or {}) if logged else {}
            leak = _host_leak(native, x) if dev.type == "cuda" else None
            ref_us, kept_us = rec.get("reference_us"), _kept_us(rec)
            ours_us, ref2_us = (bench.time_side_by_side(lambda: a @ x, lambda: native @ x) if dev.type == "cuda"
                                else (None, None))
            best = r.best()
            plan = next(iter(plans.plans().values()), None)
            row = {"provider": label, "k": k, "sandbox_spare": spare, "matrix": r.matrix.label, "nnz": int(m.nnz), "op": r.op,
                   "n": r.n, "first_call_s": round(first, 4), "reference_us": ref_us, "kept_us": kept_us,
                   "speedup": (ref_us / kept_us) if (ref_us and kept_us) else 1.0,
                   "reference_runs_us": rec.get("reference_runs_us"), "reference_leak": leak,
                   "delivered_us": ours_us, "delivered_reference_us": ref2_us,
                   "delivered_speedup": (ref2_us / ours_us) if (ours_us and ref2_us) else None,
                   "space_speedup": (r.reference_us / best.us) if (best and r.reference_us) else None,
                   "chosen": rec.get("chosen"), "rule": rec.get("rule"),
                   "plan": getattr(getattr(plan, "header", None), "format", None) or type(plan).__name__,
                   "rel_err": err, "wrong": err > wrong_tol,
                   "first_use": _breakdown(logged[-1] if logged else None)}
            rows.append(row)
            print(f"  {label:10s} {r.matrix.label[:44]:44s} {r.op} n={r.n:<3d} first {first:5.2f}s  "
                  f"x{row['speedup']:5.2f} (space x{row['space_speedup'] or 0:5.2f}, delivered "
                  f"x{row['delivered_speedup'] or 0:5.2f})  {row['plan']}"
                  f"{'  WRONG' if row['wrong'] else ''}", flush=True)
            if on_row is not None:
                on_row(rows)
    sr.configure(sandbox_spare=None)
    return rows, summarize(rows)


def parse_spec(spec: str) -> tuple[str, int, int | None]:
    """``NAME[+SAMPLES][@CHECKPOINT]:K[/SPARE]`` -> (provider spec, k, idle sandbox workers or
    None for the provider's own wish; ``miss.sandbox_spare``)."""
    pspec, _, tail = spec.rpartition(":")
    k, slash, spare = tail.partition("/")
    try:
        return pspec, int(k), (int(spare) if slash else None)
    except ValueError:
        raise SystemExit(f"provider spec {spec!r}: expected NAME[+SAMPLES][@CHECKPOINT]:K[/SPARE], "
                         "K and SPARE whole numbers (e.g. default:4 or default:4/2)") from None


COLD_NNZ = 10**6


def _median(values) -> float | None:
    v = sorted(x for x in values if x is not None)
    return v[len(v) // 2] if v else None


def summarize(rows: list[dict]) -> dict:
    out = {}
    product = lambda r: (r["matrix"], r["op"], r["n"])  # noqa: E731
    search = {product(r): r for r in rows if r["provider"] == "search"}
    for p in dict.fromkeys(r["provider"] for r in rows):
        rs = [r for r in rows if r["provider"] == p]
        sp = geomean([r["speedup"] for r in rs if r["speedup"]])
        space = geomean([r["space_speedup"] for r in rs if r["space_speedup"]])
        firsts = sorted(r["first_call_s"] for r in rs)
        out[p] = {"products": len(rs), "speedup_geomean": sp, "space_speedup_geomean": space,
                  "delivered_speedup_geomean": geomean([r["delivered_speedup"] for r in rs
                                                        if r.get("delivered_speedup")]),
                  "ratio_to_space": (sp / space) if (sp and space) else None,
                  "reference_kept": sum(r["chosen"] is None for r in rs),
                  "wrong": sum(r["wrong"] for r in rs), "max_rel_err": max(r["rel_err"] for r in rs),
                  "first_call_median_s": _median(firsts), "first_call_max_s": firsts[-1],
                  # the cold-start target: a new structure of <= 10^6 nonzeros served in under 1 s
                  "first_calls_upto_1e6_nnz": sum(r.get("nnz", 0) <= COLD_NNZ for r in rs),
                  "first_calls_over_1s_upto_1e6_nnz": sum(r.get("nnz", 0) <= COLD_NNZ and r["first_call_s"] > 1.0
                                                          for r in rs),
                  "propose_median_s": _median([(r.get("first_use") or {}).get("propose_s") for r in rs]),
                  "select_median_s": _median([(r.get("first_use") or {}).get("select_s") for r in rs])}
        both = [r for r in rs if product(r) in search]
        if search and p != "search" and both:
            mine = geomean([r["speedup"] for r in both])
            theirs = geomean([search[product(r)]["speedup"] for r in both])
            out[p].update(search_products=len(both), search_speedup_geomean=theirs, ratio_to_search=mine / theirs)
            paired = [r for r in both if r.get("delivered_speedup") and search[product(r)].get("delivered_speedup")]
            if paired:
                mine = geomean([r["delivered_speedup"] for r in paired])
                theirs = geomean([search[product(r)]["delivered_speedup"] for r in paired])
                out[p].update(search_delivered_speedup_geomean=theirs, delivered_ratio_to_search=mine / theirs)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--providers", default="nearest:4,policy:4",
                   help="comma list of NAME[+SAMPLES][@CHECKPOINT]:K[/SPARE], as benchmarks/cold_start.py; "
                        "/SPARE sets configure(sandbox_spare=SPARE) for that provider (idle sandbox "
                        "workers; default the provider's own wish) and labels its rows NAME/SPARE")
    p.add_argument("--data", default=None, help="supervision file(s); default: training/data.py's")
    p.add_argument("--max-records", type=int, default=0, help="first N held-out records (0 = all)")
    p.add_argument("--wrong-tol", type=float, default=1e-3,
                   help="relative error against torch.sparse above which a result counts as wrong")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("provider_e2e.py measures on a CUDA GPU (--device cpu runs the script on the reference)",
              file=sys.stderr)
        return 2
    from sparserl_compile.training import data

    records = data.split(data.load_supervision(args.data or data.DEFAULT_SUPERVISION)).held_out
    if args.max_records:
        records = records[:args.max_records]
    have, missing, loaded = [], 0, {}
    for r in records:
        try:
            if r.matrix not in loaded:
                loaded[r.matrix] = r.matrix.load()
        except FileNotFoundError:
            missing += 1
        else:
            have.append(r)
    print(f"[e2e] {len(have)} held-out records ({missing} skipped: shared matrix not found)", flush=True)

    def dump(rows, summary=None):
        if args.json:
            write_json(args.json, {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                                   "torch": torch.__version__, "skipped_records": missing, "summary": summary,
                                   "rows": rows})

    rows, summary = run(args.providers.split(","), have, args.device, args.wrong_tol, on_row=dump, loaded=loaded)
    dump(rows, summary)
    for prov, s in summary.items():
        print(f"[e2e] {prov}: geomean x{s['speedup_geomean']:.2f} over cuSPARSE, kernel space x"
              f"{s['space_speedup_geomean']:.2f} (ratio {s['ratio_to_space']:.3f}); cuSPARSE kept "
              f"{s['reference_kept']}/{s['products']}; wrong {s['wrong']}; first call median "
              f"{s['first_call_median_s']:.2f} s, max {s['first_call_max_s']:.2f} s; over 1 s: "
              f"{s['first_calls_over_1s_upto_1e6_nnz']} of {s['first_calls_upto_1e6_nnz']} products of <= 1e6 "
              f"nonzeros; proposal median {s['propose_median_s'] or 0:.2f} s, selection "
              f"{s['select_median_s'] or 0:.2f} s", flush=True)
        if s.get("delivered_speedup_geomean"):
            print(f"[e2e] {prov}: delivered x{s['delivered_speedup_geomean']:.2f} (re-timed side by side after "
                  f"the selection)", flush=True)
        if "delivered_ratio_to_search" in s:
            print(f"[e2e] {prov}: delivered, the whole space x{s['search_delivered_speedup_geomean']:.2f} "
                  f"(ratio {s['delivered_ratio_to_search']:.3f})", flush=True)
        if "ratio_to_search" in s:
            print(f"[e2e] {prov}: the whole space through the runtime x{s['search_speedup_geomean']:.2f} on the same "
                  f"{s['search_products']} products (ratio {s['ratio_to_search']:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
