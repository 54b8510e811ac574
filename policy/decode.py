"""Sampling kernels from the policy: greedy, temperature sampling, k samples at once, with or
without the grammar.

``generate(model, tokenizer, structure, op, dtype, n, k=..., config=...)`` runs k samples of
one matrix in one batch (identical prompts, so no padding; a KV cache makes each step one
token). With ``constrained=True`` (the default) every sample has its own llguidance matcher
over ``grammar.kernel_grammar()``: before each step the matcher's bitmask of allowed tokens is
applied to the logits (disallowed -> -inf), so only kernels that parse can come out, and
``<|eos|>`` is allowed only where the kernel is complete. The packed bitmasks are kept in the
``Rollout`` so that PPO recomputes log-probabilities under exactly the masks the rollout used
(``unpack_masks``); ``logprobs`` are the log-probabilities of the chosen tokens under the
masked, temperature-scaled distribution the sample was drawn from.

Generated text is the completion after ``<|kernel|>``: the two contract header lines and the
kernel, without ``<|eos|>``. This module does not parse headers or compile anything.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from sparserl_compile.policy.encoder import PreparedStructure, StructureBatch
from sparserl_compile.policy.tokenizer import prompt_text


@dataclass(frozen=True)
class DecodeConfig:
    """How to sample."""

    greedy: bool = False  # argmax at each step (k identical samples; use k=1)
    temperature: float = 1.0  # softmax temperature when sampling
    top_k: int = 0  # keep only the k most likely allowed tokens (0 = all)
    max_new_tokens: int = 1024  # a sample not finished by then is returned with finished=False
    constrained: bool = True  # llguidance grammar masks; False is the unconstrained ablation
    seed: int | None = None  # torch generator seed for reproducible samples
    #: record each token's grammar mask and log-probability (PPO needs them). False, with
    #: speculative decoding: greedy, where the model's top token is grammatical it is the masked
    #: argmax too, so the mask is not computed there (same tokens); sampling without top-k, each
    #: forward's positions are drawn unmasked at once and a draw the grammar rejects is drawn
    #: again under its mask (the masked distribution; other draws than traced). ``logprobs`` NaN
    #: there, ``masks`` None
    trace: bool = True
    #: speculative decoding (``references`` given): the longest draft one forward checks. Longer
    #: drafts cost little more per forward (the model is small; a step is mostly host work) and
    #: save forwards where the model writes what a reference says: untraced greedy on the H200
    #: took 0.18-0.36 s per kernel with 16, 0.09-0.15 s with 64, 0.08-0.10 s with 128 (same
    #: tokens; benchmarks/results/h200_decode_speed_2026-12-03b.json). Never changes a sample.
    draft_len: int = 128
    #: speculative decoding of k > 1 samples: all in one batch, each with its own drafts, instead
    #: of one after another (``generate_speculative``). The same distribution; about as many
    #: forwards as the slowest sample takes instead of their sum
    batch_drafts: bool = False


@dataclass
class Rollout:
    """One sample: what was written and everything PPO needs to score it again."""

    prompt_ids: list[int]
    tokens: list[int]  # completion tokens, including the final <|eos|> if finished
    text: str  # completion text without <|eos|>
    logprobs: list[float]  # per token, under the (masked) sampling distribution
    finished: bool  # ended with <|eos|> (not cut by max_new_tokens)
    masks: torch.Tensor | None = None  # (len(tokens), ceil(V/32)) int32 packed allowed-token bitmask
    grammar_error: str | None = None  # llguidance's message if the matcher failed
    extra: dict = field(default_factory=dict)


_LLTOK_CACHE: dict[tuple, object] = {}


def _tok_key(tokenizer) -> str:
    """A content hash of the tokenizer, memoized on the object (ids can be reused after GC)."""
    key = getattr(tokenizer, "_sparserl_key", None)
    if key is None:
        import hashlib

        key = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
        tokenizer._sparserl_key = key
    return key


_ENCODED: dict[tuple, list[int]] = {}


def encode_cached(tokenizer, text: str) -> list[int]:
    """``tokenizer.encode(text)``, remembered per tokenizer: the drafts (rendered kernel-space
    kernels) and prompts repeat across a proposal's decoding calls and across proposals, and
    encoding each anew cost about 34 encodes, 16 ms, of an H100 proposal (``propose_profile.py``).
    A fresh list each call; at most 4096 texts are kept (then the memo starts over)."""
    try:
        key = (_tok_key(tokenizer), text)
    except AttributeError:  # not a fast (Rust-backed) tokenizer: nothing to key it by
        return tokenizer.encode(text)
    ids = _ENCODED.get(key)
    if ids is None:
        if len(_ENCODED) >= 4096:
            _ENCODED.clear()
        ids = _ENCODED[key] = tokenizer.encode(text)
    return list(ids)


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of the tokenizer (built once per tokenizer object: ~1 s)."""
    import llguidance.hf

    key = (_tok_key(tokenizer), vocab_size)
    if key not in _LLTOK_CACHE:
        _LLTOK_CACHE[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    return _LLTOK_CACHE[key]


def token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """llguidance's packed token bitmask on the host: ``rows`` rows of int32 words, 32 tokens a
    word, every token allowed; pinned where CUDA is (its copy to the GPU each step). What
    ``llguidance.torch.allocate_token_bitmask`` returns, without importing ``llguidance.torch``:
    that module wraps a function in ``torch.compile`` at import, which imports inductor (1.3 s of a
    process's first proposal on the CPU) for a kernel the decoder never calls."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32,
                      pin_memory=torch.cuda.is_available())


def fill_token_bitmask(matcher, bitmask: torch.Tensor, row: int) -> None:
    """Write ``matcher``'s allowed next tokens into row ``row`` of ``bitmask`` (``token_bitmask``),
    as ``llguidance.torch.fill_next_token_bitmask`` does."""
    v = bitmask[row]
    matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())


_MATCHER_CACHE: dict[tuple, object] = {}


def make_matcher(tokenizer, vocab_size: int, grammar_text: str | None = None,
                 op: str | None = None, dtype: str | None = None):
    """A fresh llguidance matcher for one sample; raises with llguidance's message if the
    grammar does not compile. The grammar is compiled once per (tokenizer, grammar) and each
    sample gets a ``deep_copy`` of that matcher in its initial state."""
    import llguidance

    from sparserl_compile.policy.grammar import kernel_grammar

    text = grammar_text or kernel_grammar(op, dtype)
    key = (_tok_key(tokenizer), vocab_size, text)
    if key not in _MATCHER_CACHE:
        g = llguidance.LLMatcher.grammar_from_lark(text)
        m = llguidance.LLMatcher(ll_tokenizer(tokenizer, vocab_size), g, log_level=0)
        if m.is_error():
            raise ValueError(f"the kernel grammar does not compile under llguidance: {m.get_error()}")
        if len(_MATCHER_CACHE) > 32:
            _MATCHER_CACHE.clear()
        _MATCHER_CACHE[key] = m
    return _MATCHER_CACHE[key].deep_copy()


def unpack_masks(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(..., W) int32 llguidance bitmasks -> (..., vocab_size) bool (True = allowed)."""
    bits = torch.arange(32, dtype=torch.int32, device=packed.device)
    allowed = (packed.unsqueeze(-1) >> bits) & 1
    return allowed.reshape(*packed.shape[:-1], -1)[..., :vocab_size].bool()


def _apply_masks(logits: torch.Tensor, packed: torch.Tensor, vocab: int, eos: int) -> torch.Tensor:
    """Disallowed tokens -> -inf under the packed llguidance bitmasks (one row per logits row);
    a row whose matcher allows nothing (it failed) may only end: its ``<|eos|>`` gets 0."""
    allowed = unpack_masks(packed.to(logits.device), vocab)  # moved packed (32 tokens per int)
    logits = logits.masked_fill(~allowed, float("-inf"))
    logits[:, eos] = torch.where(allowed.any(-1), logits[:, eos], torch.zeros_like(logits[:, eos]))
    return logits


def _generator(cfg: "DecodeConfig", device) -> torch.Generator | None:
    """The seeded sampling generator of ``cfg`` (None: torch's global one)."""
    if cfg.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(cfg.seed)
    return gen


def _pick(logits: torch.Tensor, cfg: DecodeConfig, gen: torch.Generator | None):
    """Choose one token per row; returns (tokens, logprobs of the chosen tokens)."""
    if cfg.greedy:
        logp = torch.log_softmax(logits, -1)
        tok = logits.argmax(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    scaled = logits / max(cfg.temperature, 1e-5)
    if cfg.top_k:
        kth = scaled.topk(min(cfg.top_k, scaled.shape[-1]), -1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    logp = torch.log_softmax(scaled, -1)
    tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


@torch.no_grad()
def generate(model, tokenizer, structure: PreparedStructure, op: str, dtype: str, n: int,
             k: int = 1, config: DecodeConfig = DecodeConfig(),
             grammar_text: str | None = None, forced: list[list[int]] | None = None,
             hint: str | None = None, references: list[str] | None = None,
             step_budget: int | None = None) -> list[Rollout]:
    """k completions for one matrix (see the module docstring).

    ``forced``: per sample, completion tokens to write first whatever the model prefers
    (``format_diverse`` forces each sample's format this way); their log-probabilities are
    still those of the (masked) distribution, and the grammar matcher consumes them.
    ``hint``: the retrieval hint of the prompt (``policy/retrieval.py``; policies trained with
    hints only).
    ``references``: kernel sources the samples are likely to resemble (the hinted kernel and
    its neighbours, ``retrieval.reference_sources``): decoding is then speculative
    (``generate_speculative``), same distribution, far fewer model calls when the policy
    writes what a reference says; ``forced`` prefixes too. ``step_budget``: see
    ``generate_speculative``; it counts model calls, so it applies to speculative decoding only
    (without references every sample is decoded to its end).
    """
    if forced is not None and len(forced) != k:
        raise ValueError(f"forced has {len(forced)} prefixes for k={k} samples")
    if references:
        return generate_speculative(model, tokenizer, structure, op, dtype, n, references, k=k,
                                    config=config, grammar_text=grammar_text, hint=hint, forced=forced,
                                    step_budget=step_budget)
    if k < 1:
        raise ValueError(f"k={k}: ask for at least one sample")
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    eos = tokenizer.eos_token_id
    prompt = tokenizer.encode(prompt_text(op, dtype, n, hint))
    gen = _generator(config, device)
    matchers = [make_matcher(tokenizer, vocab, grammar_text, op, dtype) for _ in range(k)] if config.constrained else None
    bitmask = token_bitmask(k, vocab) if config.constrained else None
    sb = StructureBatch.collate([structure]).repeat(k).to(device)
    ids = torch.tensor([prompt] * k, device=device)
    out = model(ids, sb, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    tokens = [[] for _ in range(k)]
    logps = [[] for _ in range(k)]
    masks = [[] for _ in range(k)]
    done = [False] * k
    errors: list[str | None] = [None] * k
    for step_i in range(config.max_new_tokens):
        logits = logits.float().clone()
        if matchers is not None:
            for i, m in enumerate(matchers):
                if done[i]:
                    bitmask[i].fill_(-1)
                    continue
                fill_token_bitmask(m, bitmask, i)
            logits = _apply_masks(logits, bitmask, vocab, eos)
        tok, lp = _pick(logits, config, gen)
        if forced is not None:
            for i, f in enumerate(forced):
                if step_i < len(f) and not done[i]:
                    tok[i] = f[step_i]
                    lp[i] = torch.log_softmax(logits[i] / (1.0 if config.greedy else max(config.temperature, 1e-5)),
                                              -1)[f[step_i]]
        tok_list, lp_list = tok.tolist(), lp.tolist()  # one transfer per step, not two per sample
        for i in range(k):
            if done[i]:
                continue
            t = tok_list[i]
            tokens[i].append(t)
            logps[i].append(lp_list[i])
            if matchers is not None:
                masks[i].append(bitmask[i].clone())
                if not matchers[i].consume_token(t) and matchers[i].is_error():
                    errors[i] = matchers[i].get_error()
            if t == eos:
                done[i] = True
        if all(done):
            break
        step = torch.where(torch.tensor(done, device=device), torch.full_like(tok, eos), tok)
        out = model(step[:, None], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    rollouts = []
    for i in range(k):
        finished = bool(tokens[i]) and tokens[i][-1] == eos
        body = tokens[i][:-1] if finished else tokens[i]
        rollouts.append(Rollout(
            prompt_ids=list(prompt), tokens=tokens[i], text=tokenizer.decode(body),
            logprobs=logps[i], finished=finished,
            masks=torch.stack(masks[i]) if matchers is not None and masks[i] else None,
            grammar_error=errors[i]))
    return rollouts


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


def header_of(text: str) -> str | None:
    """The two header lines of a generated kernel once both are written, else None."""
    lines = text.split("\n", 2)
    return "\n".join(lines[:2]) if len(lines) == 3 else None


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
    samples' tokens so far, then from the references (on a banded SpMM, 8 samples took 163
    forwards over five seeds with the other samples' tokens, 204 from the references alone;
    level on the other cases, 2-core CPU, default checkpoint). A sample's rejected draft
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
    gen = _generator(config, device)
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
    ``generate_speculative``."""
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
                        logits = _apply_masks(logits, bitmask, vocab, eos)
                        masks[i].append(bitmask[0].clone())
                    if p0 + j < len(prefix):  # forced: the prefix's token, at the model's log-probability
                        t = prefix[p0 + j]
                        lpv = float(torch.log_softmax(logits[0] / temp, -1)[t])
                    else:
                        tok, lp = _pick(logits, config, gen)
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


def header_prefix(op: str, fmt: str) -> str:
    """The start of a kernel up to and including its format choice (header line 1) and the next
    key, ``dtype``, which closes the format's name: forced or scored without it, ``format=csr``
    would go on as ``csr_split`` (a format whose name extends another's)."""
    return f"// sparserl op={op} format={fmt} dtype"


def format_of(source: str) -> str | None:
    """The format named in a kernel's first line (``header_prefix``), None without one. Unlike
    ``contract.parse_header`` it checks nothing, so it reads unfinished samples too."""
    first = source.lstrip().split("\n", 1)[0]
    return first.split("format=", 1)[1].split()[0] if "format=" in first else None


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


#: where ``branch_points`` looks for alternatives: the two contract header lines (the format, its
#: parameters and the launch configuration) or every position of the kernel
BRANCH_SCOPES = ("header", "all")


def _header_end(tokenizer, tokens: list[int]) -> int:
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
    end = _header_end(tokenizer, body) if scope == "header" else len(body)
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
        logits = _apply_masks(logits, packed, vocab, eos)
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
    output column (version 5's SELL departure on a uniform random SpMM, thirty-fourth session)."""
    from sparserl_compile import contract
    from sparserl_compile.graphformats import LAYOUT_ONLY_PARAMS

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
#: of 150 departures of version 5 on the held-out records (k = 4, CPU, decoded alone), the four
#: that took more than 24 all failed the CPU executor's verification (two did not compile, two
#: computed wrong results), and one of the two that took 17-24 passed; the passing ones took 4-17
DEPARTURE_STEPS = 24
#: the policy provider's rounds of departures (``branch_diverse(rounds=)``): replacements drawn in
#: a third or fourth round passed the CPU executor's verification 0 times in 9 on the same
#: records (8 of 15 in the second round, 102 of 126 in the first), and each round is a batch of
#: sequential forwards (8-14) before the selection can start
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


def completion_ids(tokenizer, source: str) -> list[int]:
    """Token ids of a training target: the kernel (trailing whitespace stripped) and <|eos|>.

    The grammar ends at the kernel's closing brace, so targets must not end in whitespace.
    """
    return tokenizer.encode(source.rstrip()) + [tokenizer.eos_token_id]


def grammar_accepts(tokenizer, vocab_size: int, source: str, grammar_text: str | None = None) -> bool:
    """Whether ``source`` + <|eos|> is a complete sentence of the grammar (as tokenized)."""
    m = make_matcher(tokenizer, vocab_size, grammar_text)
    ids = completion_ids(tokenizer, source)
    return m.validate_tokens(ids) == len(ids)


_ = np  # numpy is used by callers building structures; kept for type hints in docs
