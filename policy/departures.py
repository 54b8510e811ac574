"""Departures: the greedy kernel's most likely single-token alternatives, each completed by
the model (``branch_diverse``).

The choices that matter for speed are a few tokens of the contract header (the format, its
parameters, the launch configuration), where the model's second choice keeps some probability.
``branch_points`` ranks the departures in one teacher-forced forward; ``stale_departure``
leaves out, on the text alone, a departure whose body still computes with the header value it
changed; ``branch_diverse`` draws departures in rounds until k distinct kernels pass.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from sparserl_compile import contract
from sparserl_compile.graphformats import LAYOUT_ONLY_PARAMS
from sparserl_compile.policy.decode import generate
from sparserl_compile.policy.encoder import PreparedStructure, StructureBatch
from sparserl_compile.policy.masks import apply_masks, fill_token_bitmask, make_matcher, token_bitmask
from sparserl_compile.policy.sampling import DecodeConfig, Rollout
from sparserl_compile.policy.tokenizer import prompt_text

#: where ``branch_points`` looks for alternatives: the two contract header lines (the format, its
#: parameters and the launch configuration) or every position of the kernel
BRANCH_SCOPES = ("header", "all")

def header_end(tokenizer, tokens: list[int]) -> int:
    """How many of ``tokens`` it takes to finish the two contract header lines (all of them
    when they never do): the positions whose choice is still part of the header."""
    text = ""
    for p, t in enumerate(tokens):
        if text.count("\n") >= 2:
            return p
        text += tokenizer.decode([t])
    return len(tokens)

@torch.no_grad()
def branch_points(model, tokenizer, structure: PreparedStructure, op: str, dtype: str, n: int,
                  tokens: list[int], count: int, grammar_text: str | None = None, hint: str | None = None,
                  constrained: bool = True, scope: str = "header", skip: set | None = None) -> list[tuple[int, int, float]]:
    """The ``count`` most likely single departures from a (greedy) sample's ``tokens``: pairs of a
    position p and a token a != tokens[p] the grammar allows there, ranked by the sequence
    log-probability of ``tokens[:p] + [a]`` (one teacher-forced forward; the masks are the
    grammar's along ``tokens``). Returned as (p, a, log-probability), most likely first.

    A departure that only spells the same text with other tokens (``a``'s text starts what
    ``tokens[p:]`` says) is left out, and so are the ``skip`` pairs. ``scope``: ``"header"``
    (the positions of the two contract header lines, where the format, its parameters and the
    launch configuration are chosen) or ``"all"``."""
    if scope not in BRANCH_SCOPES:
        raise ValueError(f"scope={scope!r}: choose one of {', '.join(map(repr, BRANCH_SCOPES))}")
    eos = tokenizer.eos_token_id
    body = tokens[:-1] if tokens and tokens[-1] == eos else list(tokens)
    end = header_end(tokenizer, body) if scope == "header" else len(body)
    if end == 0 or count < 1:
        return []
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    prompt = tokenizer.encode(prompt_text(op, dtype, n, hint))
    ids = torch.tensor([prompt + body[:end]], device=device)
    sb = StructureBatch.collate([structure]).to(device)
    logits = model(ids, sb).logits[0, len(prompt) - 1:len(prompt) - 1 + end].float()
    if constrained:  # the grammar's mask at each position along the sample
        matcher = make_matcher(tokenizer, vocab, grammar_text, op, dtype)
        packed = token_bitmask(end, vocab)
        for p in range(end):
            fill_token_bitmask(matcher, packed, p)
            matcher.consume_token(body[p])
        logits = apply_masks(logits, packed, vocab, eos)
    logp = torch.log_softmax(logits, -1)
    chosen = logp.gather(-1, torch.tensor(body[:end], device=device)[:, None]).squeeze(-1)
    before = torch.cat([chosen.new_zeros(1), chosen.cumsum(0)[:-1]])  # log p(tokens[:p])
    score = (logp + before[:, None]).index_put_((torch.arange(end, device=device), ids[0, len(prompt):]),
                                                torch.tensor(float("-inf"), device=device))
    out, skip = [], skip or set()
    flat = score.flatten()
    top = flat.topk(min(flat.numel(), 16 * count + len(skip) + 64))  # room for the re-spellings left out
    for s, idx in zip(top.values.tolist(), top.indices.tolist()):
        if s == float("-inf") or len(out) == count:
            break
        p, a = divmod(idx, logits.shape[-1])
        if (p, a) in skip or a == eos:
            continue
        if tokenizer.decode(body[p:]).startswith(tokenizer.decode([a])):
            continue  # the same text in other tokens
        out.append((p, a, s))
    return out

_INT_TOKEN = re.compile(r"(?<![\w.])\d+(?![\w.])")

def stale_departure(greedy_text: str, text: str) -> str | None:
    """Why a departure's body still computes with a header value of the greedy kernel, or None.

    A departure changes one header token and lets the model write the rest; often the body
    does not follow: a merge kernel departed to ``items_per_part=8`` keeps the greedy body's
    ``min(p * 16, total)``, and its pieces then overrun ``part_row`` (a fault on the GPU, which
    costs the sandbox worker). Checked on the text alone, in microseconds. The header numbers
    the departure changed (a launch field, or a format parameter when the format is the greedy
    one's; old -> new, both at least 2) are looked up in the greedy body: a field none of whose
    lines writes ``old`` as a number tells nothing. The departure is stale when at least one
    field tells, the body names none of them, and every greedy line that wrote an ``old`` is in
    the body verbatim: one such line rewritten (the model followed the header there) and it is
    not. Unparseable headers are left to the contract's own check (None). A verdict only ever
    leaves a candidate out, never admits one; the GPU's verification stays the judge.

    Also stale: an SpMM departure whose body never reads ``n`` (the dense width; every SpMM
    point of the kernel space reads it). That is an SpMV body under an SpMM header, as when a
    departure to another format makes the model write that format's SpMV kernel: it fills one
    output column (a SELL departure on a uniform random SpMM did exactly this)."""
    try:
        g, d = contract.parse_header(greedy_text), contract.parse_header(text)
    except contract.ContractError:
        return None

    def body(src: str) -> list[str]:
        lines = src.lstrip().splitlines()[2:]
        return [ln.strip() for ln in lines if ln.strip() and contract.KERNEL_NAME not in ln]

    d_body = body(text)
    words = set(re.findall(r"\w+", "\n".join(d_body)))
    if d.op == "spmm" and "n" not in words:
        return "stale: an SpMM header over a body that never reads n (an SpMV body: one output column)"
    fields = [(k, getattr(g.launch, k), getattr(d.launch, k)) for k in ("block", "per_block", "tile_n", "smem")]
    if g.format == d.format:
        # a layout-only parameter (the row order) leaves the body as it is: nothing to go by
        fields += [(k, gv, d.params[k]) for k, gv in g.format_params if k not in LAYOUT_ONLY_PARAMS]
    changed = [(k, old, new) for k, old, new in fields if old != new and min(old, new) >= 2]
    if not changed:
        return None
    g_lines, d_lines = body(greedy_text), set(d_body)
    g_numbers = [set(_INT_TOKEN.findall(ln)) for ln in g_lines]
    kept = []
    for k, old, new in changed:
        carried = [ln for ln, nums in zip(g_lines, g_numbers) if str(old) in nums]
        if not carried:
            continue  # the greedy body does not write this number: nothing to go by
        if k in words or not all(ln in d_lines for ln in carried):
            return None  # the body names the field, or rewrote a line that used it
        kept.append(f"{k}={new} (the greedy kernel's {old}) in {carried[0]!r}")
    if kept:
        return "stale: the body keeps the greedy kernel's header values: " + "; ".join(kept)
    return None

#: the policy provider's limit on the forwards one departure takes (``branch_diverse(step_budget=)``):
#: a departure that passes verification is mostly predicted by the drafts and takes 4-17 forwards;
#: one that takes more than 24 is one no draft predicts, which nearly always fails to compile or
#: computes wrong results, and holds up its whole batch meanwhile
DEPARTURE_STEPS = 24
#: the policy provider's rounds of departures (``branch_diverse(rounds=)``): a replacement drawn
#: in a third or later round is a departure the model ranks low and rarely passes verification,
#: while each round costs a batch of sequential forwards before the selection can start
DEPARTURE_ROUNDS = 2

def branch_diverse(model, tokenizer, structure: PreparedStructure, op: str, dtype: str, n: int, k: int,
                   config: DecodeConfig = DecodeConfig(greedy=True), grammar_text: str | None = None,
                   hint: str | None = None, references: list[str] | None = None,
                   greedy: Rollout | None = None, scope: str = "header", screen=None,
                   rounds: int | None = None, stale_check: bool = True,
                   step_budget: int | None = None) -> list[Rollout]:
    """k distinct kernels: the greedy one and the k - 1 most likely single departures from it
    (``branch_points``), each the greedy kernel's tokens up to a position, another token there,
    and the rest written by the model (greedy by default).

    After supervised training the policy is nearly deterministic (about 0.001 nats per token),
    so k temperature samples are mostly copies of the greedy kernel, and a higher temperature
    buys variety with broken kernels. The choices that matter for speed are a few tokens of the
    header (the format, its parameters, the launch configuration) where the model's second
    choice still has some mass; this spends the k - 1 other candidates on the most likely of
    those second choices, ranked by the model, each completed as the model would. A departure
    that ends in a kernel already among the candidates is replaced by the next one (two rounds).
    ``greedy``: the greedy rollout when the caller has it (its ``tokens`` are used); each other
    rollout's ``extra`` holds its ``branch`` (position, token) and log-probability.

    ``screen``: a callable taking a round's new departures' texts and returning, per text, None
    to keep it or why it is left out (``policy.screen.Screen.check`` for the matrix: a departure
    that would fail the GPU's verification is replaced by the next most likely one, as a repeat
    is). The left-out departures are listed in the greedy rollout's ``extra["screened_out"]`` as
    (position, token, reason). ``stale_check`` (default): a departure whose body still computes
    with the greedy kernel's value of a header number it changed (``stale_departure``) is left
    out and replaced the same way, before any screen and without one. ``rounds``: how many times
    departures are drawn to fill the k (default 4 with a screen or the stale check, else 2).

    ``step_budget`` (speculative decoding): a departure unfinished after this many forwards is
    cut off, listed in ``screened_out`` and replaced like a repeat (the policy provider passes
    ``DEPARTURE_STEPS``); None (default: evaluation and RL see every departure the policy
    writes, the failing ones included): no limit."""
    if k < 1:
        raise ValueError(f"k={k}: ask for at least one candidate")
    greedy_cfg = replace(config, greedy=True)
    if greedy is None:
        (greedy,) = generate(model, tokenizer, structure, op, dtype, n, k=1, config=greedy_cfg,
                             grammar_text=grammar_text, hint=hint, references=references)
    out, seen, tried, dropped = [greedy], {greedy.text}, set(), []
    for _round in range(rounds if rounds is not None else (4 if screen is not None or stale_check else 2)):
        want = k - len(out)
        if want <= 0:
            break
        points = branch_points(model, tokenizer, structure, op, dtype, n, greedy.tokens, want,
                               grammar_text=grammar_text, hint=hint, constrained=config.constrained,
                               scope=scope, skip=tried)
        if not points:
            break
        tried.update((p, a) for p, a, _ in points)
        rolls = generate(model, tokenizer, structure, op, dtype, n, k=len(points), config=greedy_cfg,
                         grammar_text=grammar_text, hint=hint, references=references,
                         forced=[greedy.tokens[:p] + [a] for p, a, _ in points], step_budget=step_budget)
        new = []
        for r, (p, a, s) in zip(rolls, points):
            if r.extra.get("cut") == "budget":
                dropped.append((p, a, f"cut: unfinished after {step_budget} forwards"))
                continue
            if r.text not in seen:
                seen.add(r.text)
                r.extra.update(branch=(p, a), branch_logprob=s)
                new.append(r)
        stale = [stale_departure(greedy.text, r.text) if stale_check else None for r in new]
        fresh = [r for r, why in zip(new, stale) if why is None]
        screened = iter(screen([r.text for r in fresh]) if screen is not None and fresh else [None] * len(fresh))
        for r, why in zip(new, stale):
            why = why if why is not None else next(screened)
            if why is None:
                out.append(r)
            else:
                dropped.append((*r.extra["branch"], why))
    if screen is not None or dropped:
        greedy.extra["screened_out"] = dropped
    return out[:k]
