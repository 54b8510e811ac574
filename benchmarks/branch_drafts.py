"""How fast departures from the greedy kernel decode with a draft of every format (CPU or GPU).

``decode.branch_diverse`` writes the greedy kernel and its k - 1 most likely departures: each
departure is the greedy kernel's tokens up to a header token, another token there, and the rest
written greedily by the model, speculatively against drafts (``decode.generate_speculative``).
A departure to another format (an SpMM kernel departing from CSR to ELL or BSR) writes a body
none of the nearest entries' drafts resembles, one token a forward, unless a draft of that
format is among the references: ``retrieval.draft_formats("branches")`` adds one of every
contract format (``policy.provider.problem_inputs``, what the provider, ``sparserl eval`` and
RAFT use).

For the first ``--records`` held-out records (``training.data`` split), under each matrix's
fitted grammar, the greedy kernel is decoded once and the departures twice, in alternating
order per record: with the drafts of the first four nearest proposals alone (``nearest``, how
they were decoded before the thirty-first session) and with a draft of every format added
(``every_format``). Per way: model calls (forwards) and seconds; greedy decoding writes the same
tokens either way, so the script exits 1 if any departure differs.

    python benchmarks/branch_drafts.py [--checkpoint policy/checkpoints/default] [--records 42] [--k 4]
        [--device cpu|cuda] --json benchmarks/results/cpu_branch_drafts_<date>.json
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="policy/checkpoints/default")
    p.add_argument("--records", type=int, default=42, help="the first this many held-out records")
    p.add_argument("--k", type=int, default=4, help="candidates: the greedy kernel and k - 1 departures")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-new-tokens", type=int, default=1200)
    p.add_argument("--json", help="write the summary and the per-record rows here")
    a = p.parse_args(argv)

    from policy.decode import DecodeConfig, branch_diverse, format_of, generate
    from policy.model import CountingPolicy, load_policy
    from policy.provider import problem_inputs
    from policy.retrieval import default_entries, reference_sources
    from sparserl_compile.bench import sync
    from sparserl_compile.fileio import write_json
    from sparserl_compile.suite import run_stamp
    from training.data import DEFAULT_SUPERVISION, load_supervision, split
    from training.rl import problems_from_records

    model, tok = load_policy(a.checkpoint, a.device)
    counted = CountingPolicy(model)
    problems = problems_from_records(split(load_supervision(DEFAULT_SUPERVISION)).held_out[: a.records])
    cfg = DecodeConfig(greedy=True, max_new_tokens=a.max_new_tokens, trace=False, batch_drafts=True)
    ways = ("nearest", "every_format")
    rows, differ = [], 0
    for i, pb in enumerate(problems):
        m = pb.matrix
        t0 = time.perf_counter()
        s, _, every, gram = problem_inputs(model, m, pb.op, pb.dtype, pb.n, samples="branches")
        t_inputs = time.perf_counter() - t0
        t0 = time.perf_counter()
        nearest = reference_sources(s.features, pb.op, pb.dtype, pb.n, default_entries(), m, count=4)
        t_nearest = time.perf_counter() - t0
        (g,) = generate(model, tok, s, pb.op, pb.dtype, pb.n, k=1, config=cfg, grammar_text=gram, references=every)
        if i == 0:  # warm-up, untimed: the grammar compiled, the first forwards' set-up paid
            branch_diverse(model, tok, s, pb.op, pb.dtype, pb.n, a.k, cfg, grammar_text=gram, references=nearest,
                           greedy=g)
        row = {"label": pb.label, "op": pb.op, "n": pb.n, "drafts": {"nearest": len(nearest), "every_format": len(every)},
               "inputs_s": t_inputs, "nearest_drafts_s": t_nearest}
        texts = {}
        for way in (ways if i % 2 == 0 else ways[::-1]):
            refs = nearest if way == "nearest" else every
            counted.calls = 0
            sync(a.device)
            t0 = time.perf_counter()
            rolls = branch_diverse(counted, tok, s, pb.op, pb.dtype, pb.n, a.k, cfg, grammar_text=gram,
                                   references=refs, greedy=g)
            sync(a.device)
            row[way] = {"calls": counted.calls, "s": time.perf_counter() - t0}
            texts[way] = [r.text for r in rolls]
        row["formats"] = [format_of(t) for t in texts["nearest"]]
        row["same"] = texts["nearest"] == texts["every_format"]
        differ += not row["same"]
        rows.append(row)
        print(f"[drafts] {pb.label[:40]:40s} {pb.op} n={pb.n:<4d} {'/'.join(map(str, row['formats'])):28s} "
              f"calls {row['nearest']['calls']:4d} -> {row['every_format']['calls']:4d}  "
              f"{row['nearest']['s']:5.2f} s -> {row['every_format']['s']:5.2f} s"
              + ("" if row["same"] else "  DIFFERENT KERNELS"), flush=True)
    summary = {way: {"calls": sum(r[way]["calls"] for r in rows), "s": sum(r[way]["s"] for r in rows)} for way in ways}
    summary["records_fewer_calls"] = sum(r["every_format"]["calls"] < r["nearest"]["calls"] for r in rows)
    summary["records_more_calls"] = sum(r["every_format"]["calls"] > r["nearest"]["calls"] for r in rows)
    summary["max_inputs_s"] = max(r["inputs_s"] for r in rows)
    print(f"[drafts] departures of {len(rows)} records, k = {a.k}: model calls {summary['nearest']['calls']} -> "
          f"{summary['every_format']['calls']}, {summary['nearest']['s']:.1f} s -> {summary['every_format']['s']:.1f} s; "
          f"fewer calls on {summary['records_fewer_calls']}, more on {summary['records_more_calls']}; "
          f"{differ} records with other kernels")
    if a.json:
        write_json(a.json, {**run_stamp(), "checkpoint": a.checkpoint, "device": a.device, "k": a.k,
                            "records": len(rows), "summary": summary, "rows": rows})
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
