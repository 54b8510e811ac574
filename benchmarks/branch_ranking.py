"""Which departures from the greedy kernel fail, and would another ranking avoid them? (CPU)

For each held-out record (``training.data`` split) the policy's greedy kernel and its ``--count``
most likely header departures (``policy.decode.branch_points``, each completed greedily under
the matrix's grammar, as ``branch_diverse`` draws them) are scored by the measured evaluator
(H200 outcomes of kernel-space points, the CPU executor for the rest), and each gets its whole
sequence's log-probability (one teacher-forced forward, unmasked). The summary compares ways of
keeping k - 1 of the departures: by the departure's own score (what ``branch_diverse`` does), by
the completed kernel's log-probability, by its least likely token, and an oracle that keeps the
correct ones first; per way, best of k (fraction of the kernel-space best, geometric mean) and
how many kept departures are correct.

    python benchmarks/branch_ranking.py [--checkpoint policy/checkpoints/default] [--count 15] --json out.json
    python benchmarks/branch_ranking.py --summarize out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import torch


@torch.no_grad()
def _seq_logps(model, prompt, seqs, s):
    from sparserl_compile.policy.encoder import StructureBatch

    res = []
    for q in seqs:
        ids = torch.tensor([prompt + q])
        lg = model(ids, StructureBatch.collate([s])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(q)].float()
        res.append(torch.log_softmax(lg, -1).gather(-1, torch.tensor(q)[:, None]).squeeze(-1).tolist())
    return res


def collect(checkpoint: str, count: int, out: str, max_new_tokens: int = 1200) -> list[dict]:
    from sparserl_compile.policy.decode import DecodeConfig, branch_points, generate
    from sparserl_compile.policy.model import load_policy
    from sparserl_compile.policy.provider import problem_inputs
    from sparserl_compile.policy.tokenizer import prompt_text
    from sparserl_compile.fileio import write_json
    from sparserl_compile.training.data import DEFAULT_SUPERVISION, load_supervision, split
    from sparserl_compile.training.rewards import measured_sources, normalized
    from sparserl_compile.training.rl import make_evaluator, problems_from_records
    from sparserl_compile.training.sft import default_render

    model, tok = load_policy(checkpoint, "cpu")
    recs = split(load_supervision(DEFAULT_SUPERVISION)).held_out
    pbs = problems_from_records(recs)
    ev = make_evaluator("measured", 1, records=recs)
    rows, t0 = [], time.time()
    cfg = DecodeConfig(greedy=True, max_new_tokens=max_new_tokens, trace=False, batch_drafts=True)
    for i, (r, pb) in enumerate(zip(recs, pbs)):
        m = pb.matrix
        space = measured_sources(r, m, default_render)
        s, _, refs, gram = problem_inputs(model, m, pb.op, pb.dtype, pb.n)
        (g,) = generate(model, tok, s, pb.op, pb.dtype, pb.n, k=1, config=cfg, grammar_text=gram, references=refs)
        pts = branch_points(model, tok, s, pb.op, pb.dtype, pb.n, g.tokens, count, grammar_text=gram)
        rolls = generate(model, tok, s, pb.op, pb.dtype, pb.n, k=len(pts), config=cfg, grammar_text=gram,
                         references=refs, forced=[g.tokens[:p] + [a] for p, a, _ in pts])
        texts = [g.text] + [x.text for x in rolls]
        outs = ev(pb, texts)
        prompt = tok.encode(prompt_text(pb.op, pb.dtype, pb.n, None))
        lps = _seq_logps(model, prompt, [g.tokens] + [x.tokens for x in rolls], s)
        best = min(v for v in space.values() if v)
        for j, (t, o, lp) in enumerate(zip(texts, outs, lps)):
            p = 0 if j == 0 else pts[j - 1][0]
            body = lp[p + 1:] if j else lp
            rows.append({"rec": i, "label": pb.label, "op": pb.op, "n": pb.n, "cand": j,
                         "departure_score": 0.0 if j == 0 else pts[j - 1][2], "pos": p,
                         "total_logp": sum(lp), "body_logp": sum(body), "body_min": min(body) if body else 0.0,
                         "header": t.split("\n", 2)[:2], "compiled": bool(o.compiled), "correct": bool(o.correct),
                         "us": space.get(normalized(t)) if o.correct else None, "best_us": best})
        print(f"[rank] {i} {pb.label} {pb.op} n={pb.n}: {sum(o.correct for o in outs)}/{len(outs)} correct, "
              f"{time.time() - t0:.0f} s", flush=True)
        write_json(out, {"checkpoint": checkpoint, "count": count, "rows": rows})
    return rows


def summarize(rows: list[dict]) -> dict:
    from sparserl_compile.training.evaluate import geomean

    by = collections.defaultdict(list)
    for r in rows:
        by[r["rec"]].append(r)
    deps = [r for r in rows if r["cand"] > 0]
    pos = {k: [r[k] for r in deps if r["correct"]] for k in ("departure_score", "total_logp", "body_logp", "body_min")}
    neg = {k: [r[k] for r in deps if not r["correct"]] for k in pos}
    out = {"records": len(by), "departures": len(deps), "correct": sum(r["correct"] for r in deps),
           "auc_correct": {k: sum((p > n) + 0.5 * (p == n) for p in pos[k] for n in neg[k]) / (len(pos[k]) * len(neg[k]))
                           for k in pos},
           "ways": {}}
    ways = {"departure score (branch_diverse)": lambda d: sorted(d, key=lambda r: -r["departure_score"]),
            "completed kernel's log-probability": lambda d: sorted(d, key=lambda r: -r["total_logp"]),
            "least likely token of the completion": lambda d: sorted(d, key=lambda r: -r["body_min"]),
            "oracle: correct ones first": lambda d: sorted(d, key=lambda r: (not r["correct"], -r["departure_score"]))}
    for k in (4, 8):
        for name, pick in ways.items():
            fr, ok, n = [], 0, 0
            for rr in by.values():
                chosen = [rr[0]] + pick(rr[1:])[:k - 1]
                us = [r["us"] for r in chosen if r["correct"] and r["us"]]
                if us:
                    fr.append(rr[0]["best_us"] / min(us))
                ok += sum(r["correct"] for r in chosen[1:])
                n += len(chosen[1:])
            out["ways"][f"{name}, k={k}"] = {"best_of_k": geomean(fr), "records": len(fr),
                                             "departures_kept": n, "kept_correct": ok}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default="policy/checkpoints/default")
    p.add_argument("--count", type=int, default=15, help="departures decoded per record")
    p.add_argument("--json", help="write the rows and the summary here")
    p.add_argument("--summarize", help="only summarize the rows of this file")
    a = p.parse_args(argv)
    if a.summarize:
        d = json.load(open(a.summarize))
        rows = d["rows"] if isinstance(d, dict) else d
    else:
        if not a.json:
            p.error("--json is required (the rows are written as they come)")
        rows = collect(a.checkpoint, a.count, a.json)
    summary = summarize(rows)
    print(json.dumps(summary, indent=1))
    if a.json and not a.summarize:
        from sparserl_compile.fileio import write_json

        write_json(a.json, {"checkpoint": a.checkpoint, "count": a.count, "rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
