"""Ways to spend a policy's k candidates on k different kernels, besides departures
(``departures.py``): the k most likely formats, each written greedily (``format_diverse``), or
one greedy kernel per retrieval hint (``hint_diverse``). After supervised training the policy
puts nearly all its mass on one kernel, so k temperature samples are mostly copies of it.
``SAMPLE_MODES`` names every way, ``check_samples`` checks one against a policy.
"""

from __future__ import annotations

import torch

from sparserl_compile.policy.decode import generate
from sparserl_compile.policy.encoder import PreparedStructure, StructureBatch
from sparserl_compile.policy.masks import make_matcher
from sparserl_compile.policy.sampling import DecodeConfig, Rollout, format_of, header_prefix
from sparserl_compile.policy.speculative import generate_speculative
from sparserl_compile.policy.tokenizer import prompt_text

#: how a policy's k candidates are drawn (``PolicyProvider(samples=)``, ``sparserl eval --samples``):
#: k temperature samples, the k most likely formats each written greedily (``format_diverse``),
#: one greedy sample per retrieval hint (``hint_diverse``), or the greedy kernel and its k - 1 most
#: likely departures (``branch_diverse``)
SAMPLE_MODES = ("temperature", "formats", "hints", "branches")

def check_samples(samples: str, model) -> None:
    """A ``ValueError`` for an unknown ``samples`` mode, or for ``"hints"`` on a policy trained
    without retrieval hints (``model.config.retrieval``)."""
    if samples not in SAMPLE_MODES:
        raise ValueError(f"samples={samples!r}: choose one of {', '.join(map(repr, SAMPLE_MODES))}")
    if samples == "hints" and not getattr(model.config, "retrieval", False):
        raise ValueError("samples='hints' conditions each candidate on a retrieval hint: it needs a policy "
                         "trained with hints (sparserl train sft --retrieval); this checkpoint was trained "
                         "without hints (config.retrieval is False)")

@torch.no_grad()
def rank_formats(model, tokenizer, structure: PreparedStructure, op: str, dtype: str, n: int,
                 formats, hint: str | None = None) -> list[tuple[str, float]]:
    """The model's log-probability of choosing each format (teacher-forced, one batched
    forward over ``prompt + header_prefix(op, fmt)``), most likely first. The prefix ends at a
    pre-tokenizer boundary (the next header text starts with a space), so its tokens are the
    ones the model would write."""
    device = next(model.parameters()).device
    prompt = tokenizer.encode(prompt_text(op, dtype, n, hint))
    seqs = [tokenizer.encode(header_prefix(op, f)) for f in formats]
    L = len(prompt) + max(len(x) for x in seqs)
    ids = torch.full((len(seqs), L), tokenizer.pad_token_id, dtype=torch.long)
    att = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(prompt) + len(x)] = torch.tensor(prompt + x)
        att[i, : len(prompt) + len(x)] = 1
    sb = StructureBatch.collate([structure]).repeat(len(seqs)).to(device)
    logits = model(ids.to(device), sb, attention_mask=att.to(device)).logits.float()
    logp = torch.log_softmax(logits, -1)
    out = []
    for i, (f, x) in enumerate(zip(formats, seqs)):
        pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(x), device=device)
        out.append((f, float(logp[i, pos, torch.tensor(x, device=device)].sum())))
    return sorted(out, key=lambda t: -t[1])

def format_diverse(model, tokenizer, structure: PreparedStructure, op: str, dtype: str, n: int,
                   k: int, formats, config: DecodeConfig = DecodeConfig(greedy=True),
                   grammar_text: str | None = None, hint: str | None = None,
                   references: list[str] | None = None) -> list[Rollout]:
    """k samples that differ in their format: the model's k most likely formats
    (``rank_formats``), each forced as the sample's header prefix, the rest written by the
    model (greedy by default). After supervised training the policy puts nearly all its mass
    on one format, so k temperature samples are often k copies of one kernel; this spends the
    k candidates on the k formats the model ranks highest instead. Each rollout's ``extra``
    holds its format and the format's log-probability. ``references``: drafts for speculative
    decoding, as in ``generate`` (speed only)."""
    if config.constrained:  # only formats the grammar has for this op and dtype
        vocab = model.config.vocab_size

        def allowed(f):
            ids = tokenizer.encode(header_prefix(op, f))
            return make_matcher(tokenizer, vocab, grammar_text, op, dtype).validate_tokens(ids) == len(ids)

        formats = [f for f in formats if allowed(f)]
    if not formats:
        raise ValueError(f"no format of {op}/{dtype} is allowed by the grammar")
    ranked = rank_formats(model, tokenizer, structure, op, dtype, n, formats, hint)[:k]
    forced = [tokenizer.encode(header_prefix(op, f)) for f, _ in ranked]
    # speculative decoding pays only where a draft is of the forced format: it decodes its samples
    # one by one (unless config.batch_drafts), plain decoding as one batch. So the formats some
    # reference has are drafted, the rest decoded together (the same tokens either way, greedy)
    drafted = {f for f in map(format_of, references or []) if f}
    rolls: list = [None] * len(ranked)
    for use_refs in (True, False):
        idx = [i for i, (f, _) in enumerate(ranked) if (f in drafted) == use_refs]
        if idx:
            part = generate(model, tokenizer, structure, op, dtype, n, k=len(idx), config=config,
                            grammar_text=grammar_text, forced=[forced[i] for i in idx], hint=hint,
                            references=references if use_refs else None)
            for i, r in zip(idx, part):
                rolls[i] = r
    for r, (f, lp) in zip(rolls, ranked):
        r.extra.update(format=f, format_logprob=lp)
    return rolls

def hint_diverse(model, tokenizer, structure: PreparedStructure, op: str, dtype: str, n: int,
                 hints: list[str], config: DecodeConfig = DecodeConfig(greedy=True),
                 grammar_text: str | None = None, references: list[str] | None = None) -> list[Rollout]:
    """One sample per retrieval hint (``retrieval.nearest_hints``: the nearest measured
    matrices' winners, best match first), each written by the model with that hint in its
    prompt (greedy by default). A hinted policy's temperature samples are mostly copies of its
    greedy kernel; conditioning each candidate on a different retrieved winner spends the k
    candidates on k different pieces of evidence instead, and the model still writes, and may
    change, every kernel. Each rollout's ``extra["hint"]`` is its hint. With
    ``config.batch_drafts`` and ``references`` the hints' kernels are decoded speculatively in
    one batch (``generate_speculative(hints=)``), else one after another."""
    if not hints:
        raise ValueError("hint_diverse needs at least one hint (the policy's retrieval table had no entry "
                         "for this op and dtype)")
    if config.batch_drafts and references and len(hints) > 1:  # one batch, a prompt per hint
        rolls = generate_speculative(model, tokenizer, structure, op, dtype, n, references, k=len(hints),
                                     config=config, grammar_text=grammar_text, hints=list(hints))
        for r, h in zip(rolls, hints):
            r.extra["hint"] = h
        return rolls
    rolls = []
    for h in hints:
        (r,) = generate(model, tokenizer, structure, op, dtype, n, k=1, config=config,
                        grammar_text=grammar_text, hint=h, references=references)
        r.extra["hint"] = h
        rolls.append(r)
    return rolls
