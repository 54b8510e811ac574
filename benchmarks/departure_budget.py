"""The policy provider's proposal with its departures cut at a forward budget and two rounds, vs before.

``PolicyProvider(samples="branches")`` proposes the greedy kernel and its k - 1 most likely
departures (``decode.branch_diverse``), decoded speculatively in one batch. Before the
thirty-seventh session a departure that no draft predicted was decoded to its end however many
forwards it took, and its batch with it (136 forwards for one SpMV proposal where the others
took 10-54), and repeats, stale and failed departures were replaced in up to four rounds, each a
batch of sequential forwards. Now a departure unfinished after ``decode.DEPARTURE_STEPS`` forwards
is cut off and replaced by the next most likely one (``PolicyProvider(departure_steps=)``), in at
most ``decode.DEPARTURE_ROUNDS`` rounds (``departure_rounds=``).

For every held-out record (``training.data`` split; the shared matrices named by
``SPARSERL_SHARED_MATRICES`` or ``../shared/matrices``), the provider's ``candidates(problem, k)``
both ways (``before``: ``departure_steps=None, departure_rounds=None``; ``now``: the defaults),
alternating which goes first: model calls (forwards, counted on the model) and seconds, and
whether the candidates are the same. Where a departure was cut (the next one replaces it) or a
third round is no longer drawn they are not: those records list the headers only one way
proposed. (Session 37 also tried drawing the replacements ahead in the
first batch, ``--ahead`` at commit 125bb18: fewer forwards, slower proposals on the CPU and the
H100, since every extra row costs host work each forward; not kept. Results:
``*_departures_ahead_2026-12-06.json``.)

    python benchmarks/departure_budget.py [--checkpoint policy/checkpoints/default] [--k 4]
        [--device cpu|cuda] [--steps 24] [--rounds 2] [--json benchmarks/results/cpu_departure_budget_<date>.json]
"""

from __future__ import annotations

import argparse
import sys
import time

WAYS = {"before": {"departure_steps": None, "departure_rounds": None}, "now": {}}


def main(argv=None) -> int:
    import torch

    from sparserl_compile.policy.model import CountingPolicy
    from sparserl_compile.policy.provider import PolicyProvider
    from sparserl_compile.policy.retrieval import problem_for
    from sparserl_compile import matrices
    from sparserl_compile.bench import sync
    from sparserl_compile.fileio import write_json
    from sparserl_compile.training import data
    from sparserl_compile.training.evaluate import geomean

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="policy/checkpoints/default")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--records", type=int, default=0, help="the first this many held-out records (0: all)")
    p.add_argument("--steps", type=int, default=None,
                   help="the `now` way's departure_steps (default: the provider's, decode.DEPARTURE_STEPS)")
    p.add_argument("--rounds", type=int, default=None,
                   help="the `now` way's departure_rounds (default: the provider's, decode.DEPARTURE_ROUNDS)")
    p.add_argument("--json", help="write the summary and the per-record rows here")
    a = p.parse_args(argv)
    now = {**({} if a.steps is None else {"departure_steps": a.steps}),
           **({} if a.rounds is None else {"departure_rounds": a.rounds})}
    ways = {**WAYS, "now": {**WAYS["now"], **now}}

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
    print(f"[budget] {len(rows)} records ({missing} skipped): forwards {summary['before']['forwards']} -> "
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
