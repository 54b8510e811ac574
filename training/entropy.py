"""Per-token entropy of a policy checkpoint on held-out prompts: how much room it leaves to explore.

For every held-out supervision record (``data.split``) the prompt is the one SFT trains on (the
structure prefix, ``op= dtype= n=``, and the nearest other matrix's winner for a policy trained
with retrieval hints) and the continuation is the record's fastest verified kernel rendered for
the matrix (the SFT target, teacher-forced). At every continuation position the policy's
next-token distribution over its whole vocabulary (no grammar mask) gives an entropy in nats.
Positions are split into **header** tokens (those that start inside the two contract header
lines: format, launch geometry) and **body** tokens (the rest, ``<|eos|>`` included).

A policy that only learned the best template has almost all its entropy in a few header tokens
and near zero in the body: sampling it can pick another format or block size but never writes a
different kernel.

    python -m sparserl_compile.training.entropy policy/checkpoints/default --out entropy.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

import torch

from sparserl_compile.training.data import DEFAULT_SUPERVISION


@dataclass
class EntropyReport:
    checkpoint: str
    records: int = 0
    skipped: int = 0  # held-out records whose fastest variant the current families do not render
    tokens: int = 0
    header_tokens: int = 0
    body_tokens: int = 0
    mean: float | None = None  # nats per token over every continuation token
    header_mean: float | None = None
    body_mean: float | None = None
    #: the share of body tokens whose entropy is under 0.05 nats (the policy is all but sure)
    body_sure_share: float | None = None
    per_record: list[dict] = field(default_factory=list)


def header_token_count(tokenizer, source: str) -> int:
    """How many of ``source``'s tokens (``tokenizer.encode(source.rstrip())``) start inside its
    two header lines."""
    text = source.rstrip()
    cut = len(text.split("\n", 2)[0]) + len(text.split("\n", 2)[1]) + 2 if text.count("\n") >= 2 else len(text)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    return sum(1 for start, _end in enc["offset_mapping"] if start < cut)


@torch.no_grad()
def token_entropies(model, example) -> torch.Tensor:
    """The entropy (nats) of the next-token distribution at each target token of ``example``
    (an ``lm.LMExample``), in order."""
    from sparserl_compile.training.lm import collate

    P, T = len(example.prompt_ids), len(example.target_ids)
    batch = collate([example], 0, P + T)
    dev = next(model.parameters()).device
    structure = batch.structure.to(dev) if batch.structure is not None else None
    out = model(batch.input_ids.to(dev), structure, attention_mask=batch.attention_mask.to(dev))
    logits = out.logits[0, P - 1:P + T - 1].float()  # position t predicts token t + 1
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1).cpu()


def checkpoint_entropy(checkpoint: str, data: str = DEFAULT_SUPERVISION, max_records: int = 0,
                       device: str = "cpu", log=None) -> EntropyReport:
    """The ``EntropyReport`` of ``checkpoint`` on the held-out records of ``data`` (the first
    ``max_records``, 0 = all) whose matrices are present."""
    from sparserl_compile.policy.model import load_policy
    from sparserl_compile.training.data import load_supervision, split
    from sparserl_compile.training.sft import build_examples
    from sparserl_compile.training.space import ranked_variants

    model, tok = load_policy(checkpoint, device)
    model.eval()
    parts = split(load_supervision(data))
    records = [r for r in parts.held_out if r.best() is not None and r.matrix.present()]
    records = records[:max_records] if max_records else records
    if not records:
        raise ValueError(f"{data}: no held-out record with a verified variant and its matrix present")
    entries = None
    if getattr(model.config, "retrieval", False):
        from sparserl_compile.training.neighbours import entries_from_records

        entries = entries_from_records(parts.train)
    rep = EntropyReport(checkpoint)
    head_sum = body_sum = 0.0
    sure = 0
    for r in records:
        examples, _ = build_examples([r], tok, model.config.max_points, hint_entries=entries, log=lambda *_: None)
        if not examples:
            rep.skipped += 1
            continue
        ex = examples[0]
        src = tok.decode(ex.target_ids[:-1])
        h = header_token_count(tok, src)
        ent = token_entropies(model, ex)
        head, body = ent[:h], ent[h:]
        head_sum += float(head.sum())
        body_sum += float(body.sum())
        sure += int((body < 0.05).sum())
        rep.records += 1
        rep.header_tokens += len(head)
        rep.body_tokens += len(body)
        best = ranked_variants(r, 1)[0]
        rep.per_record.append({"label": r.matrix.label, "op": r.op, "n": r.n, "target": best.family,
                               "tokens": len(ent), "header_mean": _mean(float(head.sum()), len(head)),
                               "body_mean": _mean(float(body.sum()), len(body)),
                               "header_max": float(head.max()) if len(head) else None})
        if log is not None:
            log(f"[entropy] {r.matrix.label} {r.op} n={r.n}: {len(ent)} tokens, header "
                f"{rep.per_record[-1]['header_mean']}, body {rep.per_record[-1]['body_mean']}")
    rep.tokens = rep.header_tokens + rep.body_tokens
    rep.mean = _mean(head_sum + body_sum, rep.tokens)
    rep.header_mean = _mean(head_sum, rep.header_tokens)
    rep.body_mean = _mean(body_sum, rep.body_tokens)
    rep.body_sure_share = _mean(float(sure), rep.body_tokens)
    return rep


def _mean(total: float, count: int) -> float | None:
    return total / count if count else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a policy checkpoint folder (e.g. policy/checkpoints/default)")
    p.add_argument("--data", default=DEFAULT_SUPERVISION, help="supervision file(s); the held-out split is used")
    p.add_argument("--max-records", type=int, default=0, help="only the first this many held-out records (0 = all)")
    p.add_argument("--device", default="cpu", help="'cpu' or 'cuda'")
    p.add_argument("--out", default="", help="also write the report (with per-record rows) as JSON here")
    a = p.parse_args(argv)
    if a.max_records < 0:
        p.error(f"--max-records {a.max_records}: 0 (all) or more")
    try:
        rep = checkpoint_entropy(a.checkpoint, a.data, a.max_records, a.device, log=print)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in asdict(rep).items() if k != "per_record"}
    print(json.dumps(summary, indent=1))
    if a.out:
        from sparserl_compile.fileio import write_json

        write_json(a.out, asdict(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
