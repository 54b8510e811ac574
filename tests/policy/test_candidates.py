"""policy/candidates.py: k candidates spent on the model's most likely formats, or one per retrieval hint."""

import pytest

from policy_fixtures import banded_structure as _s
from sparserl_compile.policy.decode import generate
from sparserl_compile.policy.masks import unpack_masks
from sparserl_compile.policy.model import CountingPolicy
from sparserl_compile.policy.sampling import DecodeConfig


def test_format_diverse_forces_the_models_top_formats(tiny_model, tiny_tok):
    from sparserl_compile.policy.candidates import format_diverse, rank_formats
    from sparserl_compile.policy.sampling import header_prefix

    fmts = ("csr", "merge", "dia", "ell")
    ranked = rank_formats(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, fmts)
    assert sorted(f for f, _ in ranked) == sorted(fmts)
    lps = [lp for _, lp in ranked]
    assert lps == sorted(lps, reverse=True) and max(lps) < 0
    rs = format_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 3, fmts + ("no_such_format",),
                        config=DecodeConfig(greedy=True, max_new_tokens=40))
    assert [r.extra["format"] for r in rs] == [f for f, _ in ranked[:3]]  # grammar dropped the unknown one
    for r in rs:
        assert r.text.startswith(header_prefix("spmv", r.extra["format"]))
        allowed = unpack_masks(r.masks, len(tiny_tok))
        assert all(allowed[t, tok] for t, tok in enumerate(r.tokens))  # forced tokens obey the grammar too
        assert len(r.logprobs) == len(r.tokens) and max(r.logprobs) <= 0


def test_batched_hint_candidates_are_the_hints_kernels_one_at_a_time(tiny_model, tiny_tok):
    """hint_diverse with batch_drafts: prompts of different lengths (one hint each) padded into
    one batch write each hint's greedy kernel token for token, in fewer model calls; a wrong
    count of hints is refused."""
    from sparserl_compile.policy.candidates import hint_diverse
    from sparserl_compile.policy.speculative import generate_speculative

    hints = ["csr_scalar[block=128]", "ell[block=256][tpr=2][rows_per_warp=4][vec=2]", "x"]
    g = DecodeConfig(greedy=True, max_new_tokens=60, trace=False)
    plain = [generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, config=g, hint=h)[0] for h in hints]
    refs = [plain[0].text, plain[2].text[:30]]
    seq, bat = CountingPolicy(tiny_model), CountingPolicy(tiny_model)
    one = hint_diverse(seq, tiny_tok, _s(), "spmv", "f32", 1, hints, config=g, references=refs)
    together = hint_diverse(bat, tiny_tok, _s(), "spmv", "f32", 1, hints, references=refs,
                            config=DecodeConfig(greedy=True, max_new_tokens=60, trace=False, batch_drafts=True))
    assert len({len(r.prompt_ids) for r in together}) == 3  # three prompt lengths
    for a, b, c, h in zip(together, one, plain, hints):
        assert a.tokens == b.tokens == c.tokens and a.extra["hint"] == b.extra["hint"] == h
        assert a.prompt_ids == b.prompt_ids == c.prompt_ids
    assert bat.calls < seq.calls
    with pytest.raises(ValueError, match="2 hints for k=3"):
        generate_speculative(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, refs, k=3, hints=hints[:2])
    with pytest.raises(ValueError, match="not both"):
        generate_speculative(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, refs, k=3, hints=hints, hint="x")
