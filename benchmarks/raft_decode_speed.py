"""RAFT's candidate decoding, by origin: how long one problem's greedy kernel, format candidates
and temperature samples take to decode (``training.rl._raft_candidates``, as an RL update draws
them), with the format candidates decoded two ways:

- ``plain``: without drafts, one batch (how RL decoded them before the eighteenth session);
- ``drafted``: speculatively, against drafts that include a rendered kernel of each plausible
  format (``reference_sources(formats=...)``) and the greedy kernel, for the formats a draft
  has; the rest in one batch (``decode.format_diverse``; what RL does now).

With ``--batched-samples`` a third mode, ``batched``, decodes as ``drafted`` but writes the
temperature samples in one batch without drafts (``sparserl train rl --no-sample-drafts``)
instead of speculatively one at a time. With ``--traced-samples`` a fourth, ``traced``, decodes
as ``drafted`` with the samples traced (a grammar mask and log-probability at every position, as
RAFT drew them until the nineteenth session; now untraced: a mask only where an unmasked draw is
rejected). With ``--batch-drafts`` a fifth, ``together``, decodes as ``drafted`` but writes a
problem's drafted samples, and its drafted format candidates, speculatively in one batch
(``sparserl train rl --batch-drafts``) instead of one at a time. Their samples are other draws of
the same distribution, so only their greedy and format candidates are checked against the other
modes. Every mode also counts its model calls (``calls``): on the H200, where a forward of this
small model costs about the same for one row as for eight, they are what batching saves.

Greedy decoding writes the same tokens either way; the script checks that every candidate is
the same text in both runs and exits 1 otherwise. The problems are RL's (``--unlabelled-mix``
problems at ``--seed``; ``SPARSERL_SHARED_MATRICES`` names the shared folder for ``shared:``
sources).

    python benchmarks/raft_decode_speed.py [--checkpoint policy/checkpoints/default] [--count 8]
        [--seed 3] [--max-nnz 300000] [--explore mixed] [--device cpu|cuda] [--batch-drafts] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from unittest import mock

from sparserl_compile.policy.model import CountingPolicy, load_policy
from sparserl_compile.policy.provider import structure_and_formats
from sparserl_compile.policy.retrieval import default_entries, reference_sources
from sparserl_compile.training.rl import RLConfig, _raft_candidates
from sparserl_compile.fileio import write_json
from sparserl_compile.training.unlabelled import parse_mix, unlabelled_problems

MIX = ("shared:social_powerlaw=2,shared:gnn_citation=1,shared:road_planar=1,shared:mesh=1,banded=1,"
       "block_diagonal=1,rmat=1,circuit=1,uniform_random=1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default="policy/checkpoints/default")
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--max-nnz", type=int, default=300_000)
    ap.add_argument("--mix", default=MIX)
    ap.add_argument("--explore", default="mixed", choices=("mixed", "formats"))
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=1200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batched-samples", action="store_true", help="also time the samples in one batch, undrafted")
    ap.add_argument("--traced-samples", action="store_true", help="also time the samples traced (as before)")
    ap.add_argument("--batch-drafts", action="store_true",
                    help="also time the drafted samples and format candidates speculatively in one batch")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import sparserl_compile.policy.decode as decode

    model, tok = load_policy(args.checkpoint, args.device)[:2]
    model.eval()
    cfg = RLConfig(init=args.checkpoint, data="", out_dir="", k=args.k, raft_explore=args.explore,
                   max_new_tokens=args.max_new_tokens, temperature=1.0)
    problems = unlabelled_problems(args.count, seed=args.seed, max_nnz=args.max_nnz, mix=parse_mix(args.mix))
    format_diverse = decode.format_diverse

    def undrafted(*a, references=None, **kw):  # format candidates as RL decoded them before
        return format_diverse(*a, **kw)

    modes = ("plain", "drafted") + (("batched",) if args.batched_samples else ()) + (
        ("traced",) if args.traced_samples else ()) + (("together",) if args.batch_drafts else ())
    plain_config = decode.DecodeConfig

    def traced_config(**kw):  # the samples' config as RAFT built it before: traced
        return plain_config(**{**kw, "trace": True}) if not kw.get("greedy") else plain_config(**kw)
    mode_cfg = {"batched": dataclasses.replace(cfg, sample_drafts=False),
                "together": dataclasses.replace(cfg, batch_drafts=True)}
    counted = CountingPolicy(model)
    rows, totals, same_all = [], {mode: {} for mode in modes}, True
    for i, pb in enumerate(problems):
        m = pb.matrix
        st, formats = structure_and_formats(m.indptr, m.indices, m.shape, model.config.max_points)  # as RL
        refs = reference_sources(st.features, pb.op, pb.dtype, pb.n, default_entries(), m, count=max(4, args.k),
                                 exclude=pb.label, formats=formats)
        texts, unsampled, row = {}, {}, {"problem": f"{pb.label} {pb.op}"}
        for mode in modes:
            seconds: dict = {}
            with mock.patch.object(decode, "format_diverse", undrafted if mode == "plain" else format_diverse), \
                    mock.patch.object(decode, "DecodeConfig", traced_config if mode == "traced" else plain_config):
                counted.calls = 0
                rs = _raft_candidates(counted, tok, st, pb, None, refs, mode_cfg.get(mode, cfg),
                                      seed=1000 + i, seconds=seconds, formats=formats)
            seconds["calls"] = counted.calls
            texts[mode] = [r.text for r in rs]
            unsampled[mode] = [r.text for r in rs if r.extra.get("origin") != "sample"]
            row[mode] = {k: round(v, 3) for k, v in seconds.items()}
            for k, v in seconds.items():
                totals[mode][k] = totals[mode].get(k, 0.0) + v
        row["same_candidates"] = texts["plain"] == texts["drafted"]
        for mode in ("batched", "traced", "together"):  # other draws of the samples: the greedy and format candidates only
            if mode in unsampled:
                row["same_candidates"] &= unsampled[mode] == unsampled["drafted"]
        row["formats"] = [decode.format_of(t) for t in texts["drafted"]]
        same_all &= row["same_candidates"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"checkpoint": args.checkpoint, "device": args.device, "explore": args.explore, "k": args.k,
           "problems": f"unlabelled_problems({args.count}, seed={args.seed}, max_nnz={args.max_nnz}, mix={args.mix})",
           "totals_s": {mode: {k: round(v, 2) for k, v in t.items()} for mode, t in totals.items()},
           "same_candidates": same_all, "rows": rows}
    print(json.dumps(out["totals_s"]), "same candidates:", same_all)
    if args.json:
        write_json(args.json, out)
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main())
