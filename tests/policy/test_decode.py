"""policy/decode.py: plain decoding, with and without the grammar."""

import pytest

from policy_fixtures import banded_structure as _s
from sparserl_compile import contract
from sparserl_compile.policy.decode import generate
from sparserl_compile.policy.masks import unpack_masks
from sparserl_compile.policy.sampling import DecodeConfig


def test_constrained_samples_parse_and_carry_masks(tiny_model, tiny_tok):
    rs = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=3,
                  config=DecodeConfig(max_new_tokens=150, seed=1))
    assert len(rs) == 3
    for r in rs:
        h = contract.parse_header(r.text)  # an untrained model still writes a valid header
        assert (h.op, h.dtype) == ("spmv", "f32")
        assert r.masks.shape == (len(r.tokens), (len(tiny_tok) + 31) // 32)
        allowed = unpack_masks(r.masks, len(tiny_tok))
        assert all(allowed[t, tok] for t, tok in enumerate(r.tokens))  # every token was allowed
        assert len(r.logprobs) == len(r.tokens) and max(r.logprobs) <= 0


def test_seeded_sampling_is_reproducible_and_greedy_is_deterministic(tiny_model, tiny_tok):
    cfg = DecodeConfig(max_new_tokens=30, seed=7)
    a = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=2, config=cfg)
    b = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=2, config=cfg)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    g = DecodeConfig(greedy=True, max_new_tokens=30)
    assert generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, config=g)[0].tokens == \
        generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, config=g)[0].tokens


def test_unconstrained_ablation_has_no_masks(tiny_model, tiny_tok):
    r = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=1,
                 config=DecodeConfig(max_new_tokens=20, constrained=False, seed=0))[0]
    assert r.masks is None and len(r.tokens) <= 20


def test_forced_prefixes_must_match_k(tiny_model, tiny_tok):
    with pytest.raises(ValueError, match="prefixes"):
        generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=2, forced=[[1]])
