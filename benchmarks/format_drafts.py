"""How many forwards decoding takes with a draft of every format among the references (CPU or GPU).

The policy decodes speculatively (``decode.generate_speculative``): a forward checks a draft
looked up in reference kernels. Until the thirty-first session the references were the first
four proposals of the nearest measured entries (``retrieval.reference_sources(formats=())``),
and a kernel in a format none of them is written in was decoded one token a forward: an SpMM
departure from CSR to BSR, ELL or SELL (``decode.branch_diverse``), or a greedy kernel or
sample that leaves the nearest winners' formats. ``reference_sources`` now adds the nearest
proposal of every other contract format by default (``policy.provider.problem_inputs``, the
provider, ``sparserl eval`` and RAFT).

For the first ``--records`` held-out records (``training.data`` split), under each matrix's
fitted grammar, three decodings, each twice in alternating order per record (``nearest``: the
nearest proposals' drafts alone; ``every_format``: the default drafts):

- ``greedy``: the greedy kernel;
- ``departures``: its k - 1 most likely departures (``branch_diverse``, given the greedy kernel);
- ``samples``: k temperature samples at T = 0.8 in one batch (seeded per record), as
  ``sparserl eval --samples temperature --untraced-samples`` and the provider draw them.

Both as plain lists of sources, without the header index below (as before it existed).
``--compare header`` compares instead the default drafts without and with the kernels of the
sample's own header (``plain``: the drafts as a plain list; ``header``: ``decode.Drafts``, which
adds, once a sample has written its two header lines, the space's kernels with that header).

Per way: model calls (forwards) and seconds. Greedy decoding writes the same tokens whatever the
drafts, so the script exits 1 if a greedy kernel or a departure differs; the samples are
reported, not checked (the same seed, but another way through the random stream is allowed).

    python benchmarks/format_drafts.py [--checkpoint policy/checkpoints/default] [--records 42] [--k 4]
        [--device cpu|cuda] [--compare formats|header] --json benchmarks/results/cpu_format_drafts_<date>.json
"""

from __future__ import annotations

import argparse
import sys
import time

PARTS = ("greedy", "departures", "samples")
WAYS = {"formats": ("nearest", "every_format"), "header": ("plain", "header")}


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="policy/checkpoints/default")
    p.add_argument("--records", type=int, default=42, help="the first this many held-out records")
    p.add_argument("--k", type=int, default=4, help="candidates: the greedy kernel and k - 1 departures; k samples")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-new-tokens", type=int, default=1200)
    p.add_argument("--compare", choices=tuple(WAYS), default="formats",
                   help="formats: the nearest proposals' drafts alone vs a draft of every format; header: "
                        "the default drafts without vs with the kernels of each sample's own header")
    p.add_argument("--json", help="write the summary and the per-record rows here")
    a = p.parse_args(argv)
    ways = WAYS[a.compare]
    base, new = ways

    from sparserl_compile.policy.decode import DecodeConfig, branch_diverse, format_of, generate
    from sparserl_compile.policy.model import CountingPolicy, load_policy
    from sparserl_compile.policy.provider import problem_inputs
    from sparserl_compile.policy.retrieval import default_entries, reference_sources
    from sparserl_compile.bench import sync
    from sparserl_compile.fileio import write_json
    from sparserl_compile.version import run_stamp
    from sparserl_compile.training.data import DEFAULT_SUPERVISION, load_supervision, split
    from sparserl_compile.training.rl import problems_from_records

    model, tok = load_policy(a.checkpoint, a.device)
    counted = CountingPolicy(model)
    problems = problems_from_records(split(load_supervision(DEFAULT_SUPERVISION)).held_out[: a.records])
    greedy_cfg = DecodeConfig(greedy=True, max_new_tokens=a.max_new_tokens, trace=False, batch_drafts=True)
    rows, differ = [], 0
    for i, pb in enumerate(problems):
        m = pb.matrix
        t0 = time.perf_counter()
        s, _, every, gram = problem_inputs(model, m, pb.op, pb.dtype, pb.n)
        inputs_s = time.perf_counter() - t0
        if a.compare == "formats":  # both as plain lists: no header index (decode.Drafts.for_header)
            refs = {"nearest": list(reference_sources(s.features, pb.op, pb.dtype, pb.n, default_entries(), m,
                                                      count=4, formats=())), "every_format": list(every)}
        else:
            refs = {"plain": list(every), "header": every}
        sample_cfg = DecodeConfig(temperature=0.8, seed=i, max_new_tokens=a.max_new_tokens, trace=False,
                                  batch_drafts=True)

        def decode(part, way, greedy=None, model=counted):
            r = refs[way]
            if part == "greedy":
                return generate(model, tok, s, pb.op, pb.dtype, pb.n, k=1, config=greedy_cfg, grammar_text=gram,
                                references=r)
            if part == "departures":
                return branch_diverse(model, tok, s, pb.op, pb.dtype, pb.n, a.k, greedy_cfg, grammar_text=gram,
                                      references=r, greedy=greedy)[1:]
            return generate(model, tok, s, pb.op, pb.dtype, pb.n, k=a.k, config=sample_cfg, grammar_text=gram,
                            references=r)

        if i == 0:  # warm-up, untimed: the grammar compiled, the first forwards' set-up paid
            (g,) = decode("greedy", base, model=model)
            decode("departures", base, greedy=g, model=model)
        row = {"label": pb.label, "op": pb.op, "n": pb.n, "drafts": {w: len(r) for w, r in refs.items()},
               "inputs_s": inputs_s}
        texts = {}
        for part in PARTS:
            row[part] = {}
            for way in (ways if i % 2 == 0 else ways[::-1]):
                counted.calls = 0
                sync(a.device)
                t0 = time.perf_counter()
                rolls = decode(part, way, greedy=texts.get(("greedy_rollout", way)))
                sync(a.device)
                row[part][way] = {"calls": counted.calls, "s": time.perf_counter() - t0}
                texts[(part, way)] = [r.text for r in rolls]
                if part == "greedy":
                    texts[("greedy_rollout", way)] = rolls[0]
            row[part]["same"] = texts[(part, base)] == texts[(part, new)]
        row["formats"] = [format_of(t) for t in texts[("greedy", base)] + texts[("departures", base)]]
        bad = not (row["greedy"]["same"] and row["departures"]["same"])
        differ += bad
        rows.append(row)
        print(f"[drafts] {pb.label[:36]:36s} {pb.op} n={pb.n:<4d} "
              + "  ".join(f"{part} {row[part][base]['calls']:3d} -> {row[part][new]['calls']:3d}"
                          for part in PARTS)
              + ("  DIFFERENT KERNELS" if bad else ""), flush=True)
    summary = {}
    for part in PARTS:
        summary[part] = {way: {"calls": sum(r[part][way]["calls"] for r in rows),
                               "s": sum(r[part][way]["s"] for r in rows)} for way in ways}
        summary[part]["records_fewer_calls"] = sum(r[part][new]["calls"] < r[part][base]["calls"] for r in rows)
        summary[part]["records_more_calls"] = sum(r[part][new]["calls"] > r[part][base]["calls"] for r in rows)
        summary[part]["slowest_s"] = {way: max(r[part][way]["s"] for r in rows) for way in ways}
        summary[part]["same"] = sum(r[part]["same"] for r in rows)
        sm = summary[part]
        print(f"[drafts] {part:10s} {len(rows)} records, k = {a.k}: model calls {sm[base]['calls']} -> "
              f"{sm[new]['calls']}, {sm[base]['s']:.1f} s -> {sm[new]['s']:.1f} s; "
              f"fewer calls on {sm['records_fewer_calls']}, more on {sm['records_more_calls']}; "
              f"the same text on {sm['same']}")
    summary["max_inputs_s"] = max(r["inputs_s"] for r in rows)
    if a.json:
        write_json(a.json, {**run_stamp(), "checkpoint": a.checkpoint, "device": a.device, "k": a.k,
                            "compare": a.compare, "ways": list(ways),
                            "records": len(rows), "summary": summary, "rows": rows})
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
