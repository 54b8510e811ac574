"""The policy provider's proposal with departures drawn ahead and cut at a forward budget, vs before.

``PolicyProvider(samples="branches")`` proposes the greedy kernel and its k - 1 most likely
departures (``decode.branch_diverse``). Before the thirty-seventh session a departure that came
out a repeat or stale was replaced by the next most likely one in another round (up to four,
each a batch of sequential forwards), and a departure that no draft predicted was decoded to its
end however many forwards it took. Now each round decodes as many departures again in the same
batch, takes them in rank order, and stops once those it needs are written
(``departures_ahead``); and a departure unfinished after ``decode.DEPARTURE_STEPS`` forwards is
cut off and replaced (``departure_steps``).

For every held-out record (``training.data`` split; the shared matrices named by
``SPARSERL_SHARED_MATRICES`` or ``../shared/matrices``), the provider's ``candidates(problem, k)``
both ways (``before``: ``departures_ahead=0, departure_steps=None``; ``now``: the defaults),
alternating which goes first: model calls (forwards, counted on the model) and seconds, and
whether the candidates are the same. Drawing ahead never changes them; a cut can (the departure
cut is replaced by the next one): those records are listed with the cut departure's header.

    python benchmarks/departures_ahead.py [--checkpoint policy/checkpoints/default] [--k 4]
        [--device cpu|cuda] [--json benchmarks/results/cpu_departures_ahead_<date>.json]
"""

from __future__ import annotations

import argparse
import sys
import time

WAYS = {"before": {"departures_ahead": 0, "departure_steps": None}, "now": {}}


def main(argv=None) -> int:
    import torch

    from policy.model import CountingPolicy
    from policy.provider import PolicyProvider
    from policy.retrieval import problem_for
    from sparserl_compile import matrices
    from sparserl_compile.bench import sync
    from sparserl_compile.fileio import write_json
    from training import data
    from training.evaluate import geomean

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="policy/checkpoints/default")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--records", type=int, default=0, help="the first this many held-out records (0: all)")
    p.add_argument("--ahead", type=int, default=None,
                   help="the `now` way's departures_ahead (default: the provider's default)")
    p.add_argument("--json", help="write the summary and the per-record rows here")
    a = p.parse_args(argv)
    ways = {**WAYS, "now": {**WAYS["now"], **({} if a.ahead is None else {"departures_ahead": a.ahead})}}

    provs = {}
    for way, kw in ways.items():
        provs[way] = PolicyProvider(checkpoint=a.checkpoint, device=a.device, samples="branches", **kw)
    shared = provs["before"].model  # one model, counted: both ways decode with the same weights
    counted = CountingPolicy(shared)
    for prov in provs.values():
        prov.model, prov.tokenizer = counted, provs["before"].tokenizer
    warm = problem_for("spmv", "f32", 1, matrices.generate("banded", n=500, half_bandwidth=1, seed=1))
    for prov in provs.values():
        prov.candidates(warm, k=a.k)
    records = data.split(data.load_supervision(data.DEFAULT_SUPERVISION)).held_out
    rows, missing = [], 0
    for i, r in enumerate(records[:a.records or None]):
        try:
            m = r.matrix.load()
        except FileNotFoundError:
            missing += 1
            continue
        problem = problem_for(r.op, "f32", r.n, m)
        row = {"matrix": r.matrix.label, "op": r.op, "n": r.n}
        sources = {}
        for way in (("before", "now") if i % 2 == 0 else ("now", "before")):
            counted.calls = 0
            sync(a.device)
            t0 = time.perf_counter()
            cands = provs[way].candidates(problem, k=a.k)
            sync(a.device)
            row[way] = {"seconds": time.perf_counter() - t0, "forwards": counted.calls, "candidates": len(cands)}
            sources[way] = [c.source for c in cands]
        row["same_candidates"] = sources["before"] == sources["now"]
        if not row["same_candidates"]:
            row["only_before"] = [s.split("\n", 2)[:2] for s in sources["before"] if s not in sources["now"]]
            row["only_now"] = [s.split("\n", 2)[:2] for s in sources["now"] if s not in sources["before"]]
        rows.append(row)
        print(f"{r.matrix.label[:44]:44s} {r.op} n={r.n:<3d} forwards {row['before']['forwards']:4d} -> "
              f"{row['now']['forwards']:4d}  {row['before']['seconds']:.3f} -> {row['now']['seconds']:.3f} s  "
              f"{'same' if row['same_candidates'] else 'DIFFERENT'}", flush=True)
    summary = {}
    for way in ways:
        secs = sorted(row[way]["seconds"] for row in rows)
        summary[way] = {"forwards": sum(row[way]["forwards"] for row in rows),
                        "max_forwards": max(row[way]["forwards"] for row in rows),
                        "seconds": sum(secs), "median_s": secs[len(secs) // 2], "max_s": secs[-1],
                        "candidates": sum(row[way]["candidates"] for row in rows)}
    summary["speedup_geomean"] = geomean([row["before"]["seconds"] / row["now"]["seconds"] for row in rows])
    summary["same_candidates"] = sum(row["same_candidates"] for row in rows)
    summary["records"], summary["skipped_records"] = len(rows), missing
    print(f"[ahead] {len(rows)} records ({missing} skipped): forwards {summary['before']['forwards']} -> "
          f"{summary['now']['forwards']} (max {summary['before']['max_forwards']} -> {summary['now']['max_forwards']}), "
          f"median {summary['before']['median_s']:.3f} -> {summary['now']['median_s']:.3f} s, max "
          f"{summary['before']['max_s']:.3f} -> {summary['now']['max_s']:.3f} s; same candidates "
          f"{summary['same_candidates']}/{len(rows)}", flush=True)
    if a.json:
        write_json(a.json, {"device": a.device, "torch": torch.__version__, "checkpoint": a.checkpoint, "k": a.k,
                            "ways": ways,
                            "summary": summary, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
