"""Speculative decoding: the policy's samples, drawn from the same distribution as plain
decoding, with far fewer model calls where the policy writes what a reference kernel says.

A draft of up to ``DecodeConfig.draft_len`` tokens is looked up in the reference kernels
(``draft_tokens``: prompt-lookup drafting), the model scores the whole draft in one forward,
and positions are taken in order as plain decoding takes them: masked, tempered, drawn. The
drafts only decide how many positions one forward checks, never which sample comes out.
``Drafts`` adds the kernel space's sources by header, so a sample that has written its header
drafts its body from the space's kernels with that header.
"""

from __future__ import annotations

import copy
import math

import torch

from sparserl_compile.policy.encoder import PreparedStructure, StructureBatch
from sparserl_compile.policy.masks import apply_masks, fill_token_bitmask, make_matcher, token_bitmask
from sparserl_compile.policy.sampling import (DecodeConfig, Rollout, format_of, header_of, pick_tokens,
                                              seeded_generator)
from sparserl_compile.policy.tokenizer import encode_cached, prompt_text

#: a header is two comment lines of well under this many tokens; past it a sample's header is
#: no longer looked for (``_speculate``)
_HEADER_TOKENS = 256

class Drafts(list):
    """Reference kernels for speculative decoding (a list of sources, as ``references`` takes),
    and the kernel space's sources by their two header lines (``for_header``): once a sample
    has written its header, the space's kernels with exactly that header draft its body first.
    A greedy kernel or departure whose header no nearby winner shares (another ``tile_n``, a
    departure's block size: the body spells those numbers out) otherwise leaves every draft
    after the header and is decoded one token a forward. ``index``: builds the map (header ->
    sources) on first use, so a proposal whose samples all follow a draft never renders it.
    Drafts change how fast a sample is decoded, never which sample comes out."""

    def __init__(self, sources=(), index=None):
        super().__init__(sources)
        self._index, self._built = index, None

    def for_header(self, header: str) -> list[str]:
        """The space's kernels with exactly this header; else those of its format (a header no
        point of the space has, e.g. a departure to ``nnz_per_part=4``: their bodies still share
        most lines, and the lookup finds its place again after each number that differs)."""
        if self._index is None:
            return []
        if self._built is None:
            self._built = self._index()
        return self._built.get(header) or self._built.get(format_key(header), [])

def format_key(text: str) -> str:
    """The key under which ``Drafts`` files a kernel by its format alone."""
    return f"format={format_of(text) or ''}"

def draft_tokens(generated: list[int], refs: list[list[int]], length: int, max_ngram: int = 4) -> list[int]:
    """Prompt-lookup drafting: the tokens that follow the longest suffix of ``generated``
    (up to ``max_ngram`` tokens) where it occurs in a reference, at most ``length``; the
    first reference's start when nothing is generated yet; [] when nothing matches."""
    if not refs or length < 1:
        return []
    if not generated:
        return refs[0][:length]
    for size in range(min(max_ngram, len(generated)), 0, -1):
        tail = generated[-size:]
        for ref in refs:
            i, end = -1, len(ref) - size  # a match leaves at least one token to draft
            while True:  # the first occurrence: list.index finds each candidate start at C speed
                try:
                    i = ref.index(tail[0], i + 1, end)
                except ValueError:
                    break
                if ref[i:i + size] == tail:
                    return ref[i + size:i + size + length]
    return []

@torch.no_grad()
def generate_speculative(model, tokenizer, structure: PreparedStructure, op: str, dtype: str, n: int,
                         references: list[str], k: int = 1, config: DecodeConfig = DecodeConfig(),
                         grammar_text: str | None = None, hint: str | None = None,
                         forced: list[list[int]] | None = None, hints: list[str] | None = None,
                         step_budget: int | None = None) -> list[Rollout]:
    """``generate``'s samples, decoded speculatively against reference kernels.

    A draft of up to ``config.draft_len`` tokens is looked up in the tokenized ``references``
    (``draft_tokens``), the model scores the last chosen token and the whole draft in one
    forward, and the positions are then taken in order exactly as ``generate`` takes one: the
    grammar mask of the matcher's state, temperature, top-k, a token chosen from that
    distribution (argmax when greedy). A chosen token equal to the draft's moves on to the next
    position; the first that differs ends the step, and the cache is cut back to the tokens
    chosen. Because every token is drawn from the model's own (masked) distribution given the
    tokens before it, the samples have ``generate``'s distribution (greedy: the same tokens, up
    to floating-point ties), with ``logprobs`` and ``masks`` as ``generate`` records them; the
    drafts only decide how many positions one forward checks. A sample that writes what a
    reference says takes about ``tokens / config.draft_len`` forwards instead of ``tokens``.

    By default the samples are decoded one after another, and each finished sample becomes the
    first reference of the next (samples of one problem are often alike). With
    ``config.batch_drafts`` they are decoded together: one forward a step checks every
    unfinished sample's own draft, padded to the longest. A sample drafts from the other
    samples' tokens so far, then from the references (samples of one problem are often alike,
    so another sample's tokens are often the better draft). A sample's rejected draft
    positions stay in the batch's cache as holes its later positions do not attend to
    (``past_mask``, ``position_ids``), a finished sample leaves the batch, and the cache is cut
    back to the last position a sample keeps. The same distribution either way; the batch takes
    about as many forwards as its slowest sample instead of the sum over samples.

    ``forced`` (one prefix per sample, as in ``generate``): a sample's first tokens are its
    prefix whatever the model prefers, each with the log-probability and mask the model gave it;
    the prefix is that sample's first draft, so it costs one forward. ``hints``: one retrieval
    hint per sample (``hint_diverse``) instead of ``hint`` for all; in one batch the prompts of
    different lengths are padded, the padding left as holes.

    ``step_budget``: a sample still unfinished after taking part in this many forwards is cut
    there (``finished=False``, ``extra["cut"] = "budget"``): one that no draft predicts, written
    a token or two a forward, would hold up its whole batch. It changes no sample it does not cut.
    """
    if k < 1:
        raise ValueError(f"k={k}: ask for at least one sample")
    if forced is not None and len(forced) != k:
        raise ValueError(f"forced has {len(forced)} prefixes for k={k} samples")
    if hints is not None and (len(hints) != k or hint is not None):
        raise ValueError(f"hints has {len(hints)} hints for k={k} samples" if len(hints) != k
                         else "give hint (every sample's) or hints (one per sample), not both")
    if config.draft_len < 1:
        raise ValueError(f"DecodeConfig.draft_len={config.draft_len}: a draft holds at least one token")
    if step_budget is not None and step_budget < 1:
        raise ValueError(f"step_budget={step_budget}: a sample takes at least one forward")
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    prompts = [encode_cached(tokenizer, prompt_text(op, dtype, n, h)) for h in (hints if hints is not None else [hint] * k)]
    refs = [encode_cached(tokenizer, r) + [eos] for r in references]
    for_header = getattr(references, "for_header", None)  # Drafts: the space's kernel of a sample's header
    gen = seeded_generator(config, device)
    prefixes = forced if forced is not None else [[] for _ in range(k)]
    if config.batch_drafts and k > 1:
        past, pending, valid = _prompt_forward(model, structure, prompts, eos)
        rolls = _speculate(model, tokenizer, past, pending, valid, prefixes, refs, config, gen, grammar_text,
                           op, dtype, for_header, step_budget)
    else:
        rolls, firsts = [], {}
        for s_i in range(k):
            key = tuple(prompts[s_i])
            if key not in firsts:  # the samples of one prompt share its forward
                firsts[key] = _prompt_forward(model, structure, prompts[s_i:s_i + 1], eos)
            past, pending, valid = firsts[key]
            past = copy.deepcopy(past) if k > 1 else past  # each sample crops its own copy
            (r,) = _speculate(model, tokenizer, past, pending, valid, prefixes[s_i:s_i + 1], refs, config, gen,
                              grammar_text, op, dtype, for_header, step_budget)
            rolls.append(r)
            refs.insert(0, r.tokens)  # samples of one problem are often alike: the last one drafts first
    for r, prompt in zip(rolls, prompts):
        r.prompt_ids = list(prompt)
    return rolls

def _prompt_forward(model, structure: PreparedStructure, prompts: list[list[int]], pad: int):
    """The prompts' forward, one row each: ``(cache, pending, valid)``, the KV cache, each row's
    logits for its first completion position (rows, 1, V), and which cache positions each row
    attends to (its structure prefix and its own prompt: shorter prompts are padded, the padding
    left out)."""
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
        mask[i, :len(p)] = 1
    ids, mask = ids.to(device), mask.to(device)
    sb = StructureBatch.collate([structure]).repeat(len(prompts)).to(device)
    padded = any(len(p) < width for p in prompts)
    out = model(ids, sb, attention_mask=mask if padded else None, use_cache=True)
    ends = torch.tensor([len(p) - 1 for p in prompts], device=device)
    pending = out.logits[torch.arange(len(prompts), device=device), ends][:, None]
    n_prefix = out.past_key_values.get_seq_length() - width
    valid = torch.cat([torch.ones(len(prompts), n_prefix, dtype=torch.long, device=device), mask], dim=1)
    return out.past_key_values, pending, valid

def _speculate(model, tokenizer, past, pending: torch.Tensor, valid: torch.Tensor, prefixes: list[list[int]],
               refs: list[list[int]], config: DecodeConfig, gen, grammar_text, op: str, dtype: str,
               for_header=None, step_budget: int | None = None) -> list[Rollout]:
    """``generate_speculative``'s decoding of ``len(prefixes)`` samples in one batch, continuing the
    prompts' forward (``_prompt_forward``: ``past``, ``pending``, ``valid``). One sample is the
    sequential case: its cache has no holes, so the model is called without
    ``past_mask``/``position_ids`` and a step's rejected draft is cropped off, as before
    batching. ``for_header`` (``Drafts.for_header``): once a sample's two header lines are
    written, the space's kernels with that header become its first drafts. ``step_budget``: see
    ``generate_speculative``.

    Longer than the house's 80 lines on purpose: one decoding step's phases (drafting, the
    forward, taking positions under the masks, cutting the cache back) all read and write the
    same per-sample state (tokens, masks, cache validity, positions), and this loop is the hot
    path of every proposal; split, each phase would take and return most of that state."""
    n_rows = len(prefixes)
    device = pending.device
    vocab = model.config.vocab_size
    eos = tokenizer.eos_token_id
    holes = n_rows > 1
    valid = valid.clone()  # the prompts' forward may be shared by samples decoded one at a time
    pos = valid.sum(1).tolist()  # each sample's next position id: the positions it attends so far
    matchers = ([make_matcher(tokenizer, vocab, grammar_text, op, dtype) for _ in range(n_rows)]
                if config.constrained else [None] * n_rows)
    if config.constrained:
        bitmask = token_bitmask(1, vocab)
    fast = config.greedy and not config.trace
    # untraced sampling without top-k: each forward's positions are drawn from the unmasked
    # distribution in one batch and one transfer; a draw the grammar allows is kept, one it
    # rejects is drawn again under the mask. Rejection sampling: P(s) = p(s) + (1 - p(S)) p(s) / p(S)
    # = p(s) / p(S) for an allowed s, exactly the masked distribution (top-k would not commute
    # with the mask). Other draws than the traced path's for the same seed, the same distribution.
    fast_sample = not config.greedy and not config.trace and not config.top_k
    temp = 1.0 if config.greedy else max(config.temperature, 1e-5)  # forced positions' log-probabilities, draws
    tokens: list[list[int]] = [[] for _ in range(n_rows)]
    logps: list[list[float]] = [[] for _ in range(n_rows)]
    masks: list[list[torch.Tensor]] = [[] for _ in range(n_rows)]
    errors: list[str | None] = [None] * n_rows
    done = [False] * n_rows
    cut: list[str | None] = [None] * n_rows  # "budget": a sample ended at the step budget
    steps = [0] * n_rows  # the forwards each sample took part in
    own: list[list[list[int]]] = [[] for _ in range(n_rows)]  # each sample's drafts of its own header
    header_open = [for_header is not None] * n_rows
    live = list(range(n_rows)) if config.max_new_tokens > 0 else []  # the unfinished samples, in row order
    step = 0
    while live:
        drafts, fed = {}, {}
        for i in live:
            p0 = len(tokens[i])  # the position the sample's first row chooses
            room = config.max_new_tokens - p0 - 1
            prefix = prefixes[i]
            if p0 < len(prefix):  # the rest of the forced prefix
                drafts[i] = prefix[p0:p0 + max(0, room)]
            else:  # its header's kernel, the other samples' tokens so far (as one at a time, the finished ones)
                if header_open[i] and tokens[i]:
                    header = header_of(tokenizer.decode(tokens[i]))
                    if header is not None or len(tokens[i]) > _HEADER_TOKENS:
                        header_open[i] = False
                        own[i] = [encode_cached(tokenizer, src) + [eos] for src in (for_header(header) if header else ())]
                others = [tokens[j] for j in range(n_rows) if j != i and tokens[j]]
                drafts[i] = draft_tokens(tokens[i], own[i] + others + refs, min(config.draft_len, room))
            # fed to the model: the last chosen token (not yet in the cache; none before the first,
            # whose logits the prompt gave) and the draft, scored in one forward
            fed[i] = tokens[i][-1:] + drafts[i]
        width = max(map(len, fed.values()))
        cached = valid.shape[1]
        if width:
            ids = torch.full((len(live), width), eos, dtype=torch.long)
            new = torch.zeros((len(live), width), dtype=torch.long)
            for b, i in enumerate(live):
                ids[b, :len(fed[i])] = torch.tensor(fed[i])
                new[b, :len(fed[i])] = 1
            ids, new = ids.to(device), new.to(device)
            if holes:
                at = torch.tensor([pos[i] for i in live])[:, None] + torch.arange(width)
                out = model(ids, past_key_values=past, use_cache=True, attention_mask=new, past_mask=valid,
                            position_ids=at.to(device))
            else:  # one sample: no padding, no holes
                out = model(ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            valid = torch.cat([valid, new], dim=1)
        # each sample's rows: the distribution of its next position, then one per draft token
        if step == 0:
            rows_all = torch.cat([pending, out.logits], dim=1) if width else pending
        else:
            rows_all = out.logits
        step += 1
        # untraced greedy: each position's unmasked top token, in one transfer; the positions
        # up to the first that leaves the draft take it where the grammar accepts the run
        top_all = rows_all.float().argmax(-1).tolist() if fast else None
        drawn_all = None
        if fast_sample:
            flat = torch.softmax(rows_all.float().reshape(-1, rows_all.shape[-1]) / temp, -1)
            drawn_all = torch.multinomial(flat, 1, generator=gen)[:, 0].view(len(live), -1).tolist()
        for b, i in enumerate(live):
            draft, p0, prefix, matcher, rows = drafts[i], len(tokens[i]), prefixes[i], matchers[i], rows_all[b]
            taken = 0  # draft tokens chosen
            top, n_top = [], 0
            if fast and p0 >= len(prefix):
                top = top_all[b][:len(draft) + 1]
                run = next((top[:j + 1] for j, t in enumerate(top) if j >= len(draft) or t != draft[j]), top)
                n_top = matcher.validate_tokens(run) if matcher is not None else len(run)
            drawn = drawn_all[b] if drawn_all is not None else None
            for j in range(len(draft) + 1):
                if j < n_top:
                    t, lpv = top[j], math.nan
                elif drawn is not None and p0 + j >= len(prefix) and (
                        matcher is None or matcher.validate_tokens(drawn[j:j + 1]) == 1):
                    t, lpv = drawn[j], math.nan  # allowed: a draw of the masked distribution
                else:
                    logits = rows[j:j + 1].float().clone()
                    if matcher is not None:
                        fill_token_bitmask(matcher, bitmask, 0)
                        logits = apply_masks(logits, bitmask, vocab, eos)
                        masks[i].append(bitmask[0].clone())
                    if p0 + j < len(prefix):  # forced: the prefix's token, at the model's log-probability
                        t = prefix[p0 + j]
                        lpv = float(torch.log_softmax(logits[0] / temp, -1)[t])
                    else:
                        tok, lp = pick_tokens(logits, config, gen)
                        t, lpv = torch.cat([tok.double(), lp.double()]).tolist()  # one transfer per position
                        t = int(t)
                tokens[i].append(t)
                logps[i].append(lpv)
                if matcher is not None and not matcher.consume_token(t) and matcher.is_error():
                    errors[i] = matcher.get_error()
                if t == eos or len(tokens[i]) >= config.max_new_tokens:
                    done[i] = True
                    break
                if j < len(draft) and t == draft[j]:
                    taken += 1
                    continue
                break
            # keep in the cache what was chosen: the token fed first (when there was one) and the
            # draft tokens taken; the token chosen last is fed with the next draft
            kept = len(fed[i]) - (len(draft) - taken)
            pos[i] += kept
            valid[b, cached + kept:] = 0
            steps[i] += 1
            if not done[i] and step_budget is not None and steps[i] >= step_budget:
                done[i], cut[i] = True, "budget"
        # finished samples leave the batch; the cache is cut back to the last position one attends
        keep = [b for b, i in enumerate(live) if not done[i]]
        if keep and len(keep) < len(live):
            past.batch_select_indices(torch.tensor(keep, device=device))
            valid = valid[keep]
        live = [live[b] for b in keep]
        if width and live:
            last = int(valid.any(0).nonzero().max()) + 1
            if last < valid.shape[1]:
                past.crop(last - valid.shape[1])  # a negative count removes that many (every transformers 4.4x-5.x)
                valid = valid[:, :last]
    rollouts = []
    for i in range(n_rows):
        finished = bool(tokens[i]) and tokens[i][-1] == eos
        body = tokens[i][:-1] if finished else tokens[i]
        rollouts.append(Rollout(
            prompt_ids=[], tokens=tokens[i], text=tokenizer.decode(body), logprobs=logps[i], finished=finished,
            masks=torch.stack(masks[i]) if matchers[i] is not None and masks[i] and config.trace else None,
            grammar_error=errors[i], extra={"cut": cut[i]} if cut[i] else {}))
    return rollouts
