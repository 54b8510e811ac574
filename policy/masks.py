"""Grammar-constrained decoding's masks: one llguidance matcher per sample over
``grammar.kernel_grammar()``, its allowed next tokens as a packed bitmask (32 tokens per int32
word), and the logits masked with it.

Each sample gets a copy of a matcher compiled once per (tokenizer, grammar). The packed masks
are what a ``Rollout`` keeps, so PPO recomputes log-probabilities under exactly the masks the
rollout used (``unpack_masks``). This module samples nothing.
"""

from __future__ import annotations

import torch

from sparserl_compile.policy.sampling import completion_ids
from sparserl_compile.policy.tokenizer import tokenizer_key

_LLTOK_CACHE: dict[tuple, object] = {}

def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of the tokenizer (built once per tokenizer object: ~1 s)."""
    import llguidance.hf

    key = (tokenizer_key(tokenizer), vocab_size)
    if key not in _LLTOK_CACHE:
        _LLTOK_CACHE[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    return _LLTOK_CACHE[key]

def token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """llguidance's packed token bitmask on the host: ``rows`` rows of int32 words, 32 tokens a
    word, every token allowed; pinned where CUDA is (its copy to the GPU each step). What
    ``llguidance.torch.allocate_token_bitmask`` returns, without importing ``llguidance.torch``:
    that module wraps a function in ``torch.compile`` at import, which imports inductor (a second or more of
    a process's first proposal) for a kernel the decoder never calls."""
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
    key = (tokenizer_key(tokenizer), vocab_size, text)
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

def apply_masks(logits: torch.Tensor, packed: torch.Tensor, vocab: int, eos: int) -> torch.Tensor:
    """Disallowed tokens -> -inf under the packed llguidance bitmasks (one row per logits row);
    a row whose matcher allows nothing (it failed) may only end: its ``<|eos|>`` gets 0."""
    allowed = unpack_masks(packed.to(logits.device), vocab)  # moved packed (32 tokens per int)
    logits = logits.masked_fill(~allowed, float("-inf"))
    logits[:, eos] = torch.where(allowed.any(-1), logits[:, eos], torch.zeros_like(logits[:, eos]))
    return logits

def grammar_accepts(tokenizer, vocab_size: int, source: str, grammar_text: str | None = None) -> bool:
    """Whether ``source`` + <|eos|> is a complete sentence of the grammar (as tokenized)."""
    m = make_matcher(tokenizer, vocab_size, grammar_text)
    ids = completion_ids(tokenizer, source)
    return m.validate_tokens(ids) == len(ids)
