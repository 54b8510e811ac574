from pathlib import Path

import pytest
import torch

from sparserl_compile.policy.decode import generate
from sparserl_compile.policy.masks import grammar_accepts, unpack_masks
from sparserl_compile.policy.sampling import DecodeConfig
from sparserl_compile.policy.encoder import prepare_structure
from sparserl_compile.policy.model import CountingPolicy
from sparserl_compile.policy.grammar import kernel_grammar
from sparserl_compile import contract
from sparserl_compile.matrices import banded


DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[2] / "policy" / "checkpoints" / "default"


def _s():
    m = banded(64, 2)
    return prepare_structure(m.indptr, m.indices, m.shape)


def test_grammar_accepts_a_contract_kernel_and_rejects_others(tiny_tok, kernel_source):
    V = len(tiny_tok)
    assert grammar_accepts(tiny_tok, V, kernel_source)
    assert not grammar_accepts(tiny_tok, V, kernel_source.replace("format=csr", "format=foo"))
    assert not grammar_accepts(tiny_tok, V, kernel_source.replace("int n_cols, ", ""))  # wrong signature
    assert not grammar_accepts(tiny_tok, V, kernel_source.rstrip()[:-1])  # unbalanced brace
    # pinned to the prompt's op: an spmv kernel is not a sentence of the spmm grammar
    assert not grammar_accepts(tiny_tok, V, kernel_source, kernel_grammar("spmm", "f32"))


def test_grammar_without_a_format_rejects_its_kernels_only(tiny_tok, kernel_source):
    """``exclude=`` (the formats a matrix does not convert to) drops those formats' kernels from
    the language and keeps the rest."""
    from sparserl_compile import kernels

    V = len(tiny_tok)
    dia = kernels.render("dia", "spmv", "f32", {"block": 128}).source
    assert grammar_accepts(tiny_tok, V, dia, kernel_grammar("spmv", "f32"))
    no_dia = kernel_grammar("spmv", "f32", exclude=("dia",))
    assert not grammar_accepts(tiny_tok, V, dia, no_dia)
    assert grammar_accepts(tiny_tok, V, kernel_source, no_dia)  # the CSR kernel still is
    with pytest.raises(ValueError, match="name formats"):
        kernel_grammar("spmv", "f32", exclude=("diag",))
    with pytest.raises(ValueError, match="leave at least one"):
        kernel_grammar("spmv", "f32", exclude=tuple(contract.FORMATS))


def test_unpack_masks_matches_bits():
    packed = torch.tensor([[0b1011, 0], [0, 1 << 3]], dtype=torch.int32)
    m = unpack_masks(packed, 40)
    assert m[0].nonzero().flatten().tolist() == [0, 1, 3]
    assert m[1].nonzero().flatten().tolist() == [35]


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


def test_the_output_grammar_is_the_kernel_languages(tiny_tok, kernel_source, monkeypatch):
    """The policy writes the kernel language of ``grammar/kernel.lark``: statements its grammar
    has no rule for are not sentences, wherever they are; a kernel grammar without the rules the
    output grammar builds on is refused, naming them."""
    from sparserl_compile import language

    V, g = len(tiny_tok), kernel_grammar("spmv", "f32")
    assert grammar_accepts(tiny_tok, V, kernel_source, g)
    assert not grammar_accepts(tiny_tok, V, kernel_source.replace("float acc = 0.0f;", "float acc acc;"), g)
    assert not grammar_accepts(tiny_tok, V, kernel_source.replace("y[row] = acc;", "y[row] = = acc;"), g)
    no_helper = language.grammar().replace("helper:", "device_fn:")
    monkeypatch.setattr(language, "grammar", lambda: no_helper)
    with pytest.raises(RuntimeError, match="defines no rule helper"):
        kernel_grammar("spmv", "f32")


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


def test_forced_prefixes_must_match_k(tiny_model, tiny_tok):
    import pytest

    with pytest.raises(ValueError, match="prefixes"):
        generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=2, forced=[[1]])


def test_draft_tokens_follow_the_longest_matching_suffix():
    from sparserl_compile.policy.speculative import draft_tokens

    refs = [[1, 2, 3, 4, 5, 6], [9, 2, 3, 7, 8]]
    assert draft_tokens([], refs, 3) == [1, 2, 3]  # nothing written yet: the first reference's start
    assert draft_tokens([0, 9, 2, 3], refs, 2) == [7, 8]  # "9 2 3" only continues in the second
    assert draft_tokens([2, 3], refs, 2) == [4, 5]  # "2 3": the first reference that has it
    assert draft_tokens([42], refs, 4) == [] and draft_tokens([1], [], 4) == []
    assert draft_tokens([5], refs, 3) == [6] and draft_tokens([6], refs, 3) == []  # a match leaves a token to draft


def test_draft_tokens_is_the_first_occurrence_of_the_longest_suffix():
    """Against the definition written out (every start in order, longest suffix first) on
    random token lists with few symbols, where partial matches abound."""
    import random

    from sparserl_compile.policy.speculative import draft_tokens

    def naive(generated, refs, length, max_ngram=4):
        if not refs or length < 1:
            return []
        if not generated:
            return refs[0][:length]
        for size in range(min(max_ngram, len(generated)), 0, -1):
            for ref in refs:
                for i in range(len(ref) - size):
                    if ref[i:i + size] == generated[-size:]:
                        return ref[i + size:i + size + length]
        return []

    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 50])
        refs = [[rng.randrange(vocab) for _ in range(rng.randrange(40))] for _ in range(rng.randrange(4))]
        generated = [rng.randrange(vocab) for _ in range(rng.randrange(10))]
        length = rng.randrange(6)
        assert draft_tokens(generated, refs, length) == naive(generated, refs, length)


def test_speculative_decoding_writes_the_same_tokens_in_fewer_calls(tiny_model, tiny_tok):
    """Greedy with drafts is greedy without: the same tokens, log-probabilities and masks;
    a reference that is the answer makes it take a fraction of the model calls, a useless one
    only costs what plain decoding does."""
    g = DecodeConfig(greedy=True, max_new_tokens=60)
    plain_model = CountingPolicy(tiny_model)
    plain = generate(plain_model, tiny_tok, _s(), "spmv", "f32", 1, config=g)[0]
    for ref, few in ((plain.text, True), ("// nothing alike " * 5, False)):
        m = CountingPolicy(tiny_model)
        spec = generate(m, tiny_tok, _s(), "spmv", "f32", 1, config=g, references=[ref])[0]
        assert spec.tokens == plain.tokens and spec.text == plain.text
        assert torch.allclose(torch.tensor(spec.logprobs), torch.tensor(plain.logprobs), atol=1e-4)
        assert torch.equal(spec.masks, plain.masks)
        assert (m.calls * 3 < plain_model.calls) if few else (m.calls <= plain_model.calls + 1)


def test_speculative_decoding_keeps_forced_prefixes(tiny_model, tiny_tok):
    """Forced prefixes (format_diverse's headers) decoded with drafts: the same tokens,
    log-probabilities and masks as plain forced decoding, in fewer calls when a reference is
    the answer; untraced greedy writes the same tokens too."""
    from sparserl_compile.policy.candidates import format_diverse
    from sparserl_compile.policy.sampling import header_prefix

    g = DecodeConfig(greedy=True, max_new_tokens=60)
    forced = [tiny_tok.encode(header_prefix("spmv", f)) for f in ("ell", "csr")]
    plain_model = CountingPolicy(tiny_model)
    plain = generate(plain_model, tiny_tok, _s(), "spmv", "f32", 1, k=2, config=g, forced=forced)
    assert [r.tokens[: len(f)] for r, f in zip(plain, forced)] == forced
    for refs, few in (([r.text for r in plain], True), (["// nothing alike " * 5], False)):
        m = CountingPolicy(tiny_model)
        spec = generate(m, tiny_tok, _s(), "spmv", "f32", 1, k=2, config=g, forced=forced, references=refs)
        for a, b in zip(spec, plain):
            assert a.tokens == b.tokens and a.text == b.text and a.finished == b.finished
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
            assert torch.equal(a.masks, b.masks)
        # plain decodes the two as one batch; with drafts each is decoded on its own
        assert (m.calls * 3 < 2 * plain_model.calls) if few else (m.calls <= 2 * plain_model.calls + 2)
        fast = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=2, forced=forced, references=refs,
                        config=DecodeConfig(greedy=True, max_new_tokens=60, trace=False))
        assert [r.tokens for r in fast] == [r.tokens for r in plain]
    fmts = ("csr", "merge", "dia", "ell")
    plain_f = format_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 3, fmts, config=g)
    spec_f = format_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 3, fmts, config=g,
                            references=[r.text for r in plain])
    assert [(r.extra["format"], r.tokens) for r in spec_f] == [(r.extra["format"], r.tokens) for r in plain_f]
    with pytest.raises(ValueError, match="prefixes"):
        generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=2, forced=[[1]], references=["x"])


@pytest.mark.parametrize("draft_len", [1, 5, 200])
def test_the_draft_length_never_changes_a_sample(tiny_model, tiny_tok, draft_len):
    g = DecodeConfig(greedy=True, max_new_tokens=60)
    plain = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, config=g)[0]
    for trace in (True, False):
        spec = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, references=[plain.text[:40], plain.text],
                        config=DecodeConfig(greedy=True, max_new_tokens=60, trace=trace, draft_len=draft_len))[0]
        assert spec.tokens == plain.tokens


def test_a_draft_length_below_one_is_refused(tiny_model, tiny_tok):
    with pytest.raises(ValueError, match="draft_len=0"):
        generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, references=["x"],
                 config=DecodeConfig(greedy=True, draft_len=0))


def test_untraced_greedy_skips_the_masks_and_writes_the_same_tokens(tiny_model, tiny_tok):
    """trace=False: where the model's top token is grammatical it is taken without computing
    the mask; the tokens are plain greedy's, constrained or not, whatever the reference."""
    for constrained in (True, False):
        g = DecodeConfig(greedy=True, max_new_tokens=60, constrained=constrained)
        plain = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, config=g)[0]
        for ref in (plain.text, plain.text[: len(plain.text) // 2], "// nothing alike " * 5):
            fast = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, references=[ref],
                            config=DecodeConfig(greedy=True, max_new_tokens=60, constrained=constrained,
                                                trace=False))[0]
            assert fast.tokens == plain.tokens and fast.text == plain.text and fast.finished == plain.finished
            assert fast.masks is None and len(fast.logprobs) == len(fast.tokens)


def test_untraced_greedy_of_the_shipped_policy_is_its_greedy_kernel():
    """The shipped retrieval policy writes grammatical top tokens, so untraced greedy decoding
    takes most positions without a mask; the kernel is plain greedy's, token for token."""
    import math
    from pathlib import Path

    from sparserl_compile.policy.model import load_policy

    model, tok = load_policy(Path(__file__).resolve().parents[2] / "policy" / "checkpoints" / "retrieval", "cpu")
    m = banded(2000, 3)
    s = prepare_structure(m.indptr, m.indices, m.shape, max_points=model.config.max_points)
    hint = "csr_vector[block=128][tpr=8]"
    plain = generate(model, tok, s, "spmv", "f32", 1, hint=hint, config=DecodeConfig(greedy=True, max_new_tokens=1200))[0]
    fast = generate(model, tok, s, "spmv", "f32", 1, hint=hint, references=[plain.text],
                    config=DecodeConfig(greedy=True, max_new_tokens=1200, trace=False))[0]
    assert plain.finished and fast.tokens == plain.tokens
    assert sum(map(math.isnan, fast.logprobs)) > len(fast.tokens) // 2  # most positions needed no mask


def test_speculative_sampling_keeps_the_masks_and_logprob_bookkeeping(tiny_model, tiny_tok):
    rs = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=3, references=["// sparserl op=spmv"],
                  config=DecodeConfig(max_new_tokens=80, seed=2))
    assert len(rs) == 3
    for r in rs:
        contract.parse_header(r.text)
        allowed = unpack_masks(r.masks, len(tiny_tok))
        assert r.masks.shape[0] == len(r.tokens) == len(r.logprobs)
        assert all(allowed[t, tok] for t, tok in enumerate(r.tokens)) and max(r.logprobs) <= 0


def test_untraced_speculative_sampling_keeps_the_grammar(tiny_model, tiny_tok):
    """Untraced sampling draws each forward's positions unmasked and draws again under the mask
    where the grammar rejects one: every token of every sample is one the grammar allows."""
    from sparserl_compile.policy.masks import make_matcher

    rs = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=4, references=["// sparserl op=spmv"],
                  config=DecodeConfig(max_new_tokens=80, seed=3, trace=False))
    assert len(rs) == 4 and all(r.masks is None for r in rs)
    for r in rs:
        contract.parse_header(r.text)
        m = make_matcher(tiny_tok, len(tiny_tok), None, "spmv", "f32")
        assert all(m.consume_token(t) for t in r.tokens)


@pytest.mark.parametrize("trace", [True, False])
def test_batched_speculative_greedy_writes_the_sequential_tokens(tiny_model, tiny_tok, trace):
    """batch_drafts: forced prefixes of different lengths and drafts each sample takes a different
    part of, decoded in one batch, write the same tokens (and, traced, log-probabilities and masks)
    as the samples decoded one after another, in fewer model calls than their sum."""
    from sparserl_compile.policy.sampling import header_prefix

    forced = [tiny_tok.encode(header_prefix("spmv", f)) for f in ("ell", "csr", "csr_vector")]
    g = DecodeConfig(greedy=True, max_new_tokens=60, trace=trace)
    plain = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=3, config=g, forced=forced)
    for refs in ([plain[0].text[:50], plain[2].text], [r.text for r in plain], ["// nothing alike " * 5]):
        seq, bat = CountingPolicy(tiny_model), CountingPolicy(tiny_model)
        one = generate(seq, tiny_tok, _s(), "spmv", "f32", 1, k=3, config=g, forced=forced, references=refs)
        together = generate(bat, tiny_tok, _s(), "spmv", "f32", 1, k=3, forced=forced, references=refs,
                            config=DecodeConfig(greedy=True, max_new_tokens=60, trace=trace, batch_drafts=True))
        for a, b in zip(together, plain):
            assert a.tokens == b.tokens and a.text == b.text and a.finished == b.finished
            assert a.prompt_ids == b.prompt_ids
            if trace:
                assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
                assert torch.equal(a.masks, b.masks)
        assert [r.tokens for r in one] == [r.tokens for r in plain]
        assert bat.calls < seq.calls


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_batched_speculative_greedy_of_the_shipped_policy_is_its_sequential_greedy(device):
    """The shipped policy's format candidates on a 20000-row banded matrix, drafted from its
    retrieval sources (kernels of several hundred tokens; the samples keep different parts of the
    drafts, so the batch's cache has holes): one batch writes every candidate token for token as
    one-at-a-time decoding does, in fewer model calls (on the GPU too, where attention with a
    mask may take another kernel than without)."""
    from sparserl_compile.policy.candidates import format_diverse
    from sparserl_compile.policy.model import load_policy
    from sparserl_compile.policy.provider import structure_and_formats
    from sparserl_compile.policy.retrieval import default_entries, reference_sources

    model, tok = load_policy(DEFAULT_CHECKPOINT, device)
    m = banded(20000, 3)
    s, formats = structure_and_formats(m.indptr, m.indices, m.shape, model.config.max_points)
    refs = reference_sources(s.features, "spmv", "f32", 1, default_entries(), m, count=8, formats=formats)
    out = {}
    for batch in (False, True):
        counted = CountingPolicy(model)
        cfg = DecodeConfig(greedy=True, max_new_tokens=1200, trace=False, batch_drafts=batch)
        rs = format_diverse(counted, tok, s, "spmv", "f32", 1, 4, formats, config=cfg, references=refs)
        out[batch] = ([(r.extra["format"], r.tokens) for r in rs], counted.calls)
    assert out[True][0] == out[False][0] and all(len(t) > 100 for _, t in out[True][0])
    assert out[True][1] < out[False][1]


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


def test_batched_speculative_sampling_keeps_the_grammar_and_the_bookkeeping(tiny_model, tiny_tok):
    """Samples decoded speculatively in one batch, traced and untraced: every token is one the
    grammar allows; traced samples carry a mask and log-probability per token."""
    from sparserl_compile.policy.masks import make_matcher

    for trace in (True, False):
        rs = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=5, references=["// sparserl op=spmv"],
                      config=DecodeConfig(max_new_tokens=80, seed=4, trace=trace, batch_drafts=True))
        assert len(rs) == 5
        for r in rs:
            assert r.text.startswith("// sparserl op=spmv format=")  # pinned by the grammar (80 tokens may cut the rest)
            m = make_matcher(tiny_tok, len(tiny_tok), None, "spmv", "f32")
            assert all(m.consume_token(t) for t in r.tokens)
            assert len(r.logprobs) == len(r.tokens)
            if trace:
                allowed = unpack_masks(r.masks, len(tiny_tok))
                assert r.masks.shape[0] == len(r.tokens) and max(r.logprobs) <= 0
                assert all(allowed[t, tok] for t, tok in enumerate(r.tokens))
            else:
                assert r.masks is None


@pytest.mark.parametrize("batch_drafts", [False, True])
def test_untraced_speculative_sampling_draws_the_masked_distribution(tiny_model, tiny_tok, batch_drafts):
    """The format token after a forced "format=" in 3000 untraced samples (unmasked draws kept
    where the grammar allows them, drawn again under the mask where not) against the masked
    softmax the traced path draws from: the same distribution, up to sampling noise."""
    import llguidance.torch as llt

    from sparserl_compile.policy.masks import apply_masks, make_matcher
    from sparserl_compile.policy.encoder import StructureBatch
    from sparserl_compile.policy.tokenizer import prompt_text

    n, vocab, temp = 3000, len(tiny_tok), 1.5
    prefix = tiny_tok.encode("// sparserl op=spmv format=")
    cfg = DecodeConfig(max_new_tokens=len(prefix) + 1, seed=5, trace=False, temperature=temp,
                       batch_drafts=batch_drafts)
    rs = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=n, references=["// sparserl op=spmv"],
                  config=cfg, forced=[prefix] * n)
    assert all(r.tokens[:-1] == prefix for r in rs)
    seen = torch.bincount(torch.tensor([r.tokens[-1] for r in rs]), minlength=vocab).double() / n
    ids = torch.tensor([tiny_tok.encode(prompt_text("spmv", "f32", 1, None)) + prefix])
    with torch.no_grad():
        logits = tiny_model(ids, StructureBatch.collate([_s()])).logits[0, -1:].float()
    matcher = make_matcher(tiny_tok, vocab, None, "spmv", "f32")
    assert all(matcher.consume_token(t) for t in prefix)
    bitmask = llt.allocate_token_bitmask(1, vocab)
    llt.fill_next_token_bitmask(matcher, bitmask, 0)
    want = torch.softmax(apply_masks(logits, bitmask, vocab, tiny_tok.eos_token_id) / temp, -1)[0].double()
    assert (want > 0.02).sum() >= 3  # several formats carry weight: a real test of the mix
    assert float((seen - want).abs().sum()) / 2 < 0.05  # total variation distance
    assert float(seen[want == 0].sum()) == 0.0  # never a token the grammar forbids


def test_branch_points_are_the_most_likely_grammatical_departures(tiny_model, tiny_tok):
    """Each departure is a position of the greedy kernel and another token the grammar allows
    there, ranked by log p(tokens[:p] + [a]) as one teacher-forced pass scores it; no departure
    only re-spells the greedy text, and ``skip`` leaves pairs out."""
    from sparserl_compile.policy.departures import branch_points
    from sparserl_compile.policy.masks import apply_masks, make_matcher
    from sparserl_compile.policy.encoder import StructureBatch
    from sparserl_compile.policy.tokenizer import prompt_text

    (g,) = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, config=DecodeConfig(greedy=True, max_new_tokens=40))
    pts = branch_points(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, g.tokens, 5, scope="all")
    assert len(pts) == 5 and [s for *_, s in pts] == sorted((s for *_, s in pts), reverse=True)
    # the reference scores: one token at a time under the grammar's masks
    prompt = tiny_tok.encode(prompt_text("spmv", "f32", 1, None))
    with torch.no_grad():
        logits = tiny_model(torch.tensor([prompt + g.tokens]), StructureBatch.collate([_s()])).logits[0].float()
    matcher = make_matcher(tiny_tok, len(tiny_tok), None, "spmv", "f32")
    import llguidance.torch as llt

    packed = llt.allocate_token_bitmask(1, len(tiny_tok))
    logp = []
    for p, t in enumerate(g.tokens):
        llt.fill_next_token_bitmask(matcher, packed, 0)
        logp.append(torch.log_softmax(apply_masks(logits[len(prompt) - 1 + p][None], packed, len(tiny_tok),
                                                   tiny_tok.eos_token_id), -1)[0])
        matcher.consume_token(t)
    for p, a, s in pts:
        assert a != g.tokens[p] and logp[p][a] > float("-inf")
        expect = sum(float(logp[q][g.tokens[q]]) for q in range(p)) + float(logp[p][a])
        assert s == pytest.approx(expect, abs=1e-3)
        assert not tiny_tok.decode(g.tokens[p:]).startswith(tiny_tok.decode([a]))
    rest = branch_points(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, g.tokens, 3, scope="all",
                         skip={(p, a) for p, a, _ in pts[:2]})
    assert [(p, a) for p, a, _ in rest] == [(p, a) for p, a, _ in pts[2:5]]
    with pytest.raises(ValueError, match="scope='body'"):
        branch_points(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, g.tokens, 3, scope="body")


def test_branch_points_stay_in_the_header_by_default(tiny_tok):
    """``scope="header"``: only the positions before the two contract header lines end."""
    from sparserl_compile.policy.departures import header_end

    src = ("// sparserl op=spmv format=csr dtype=f32 index=i32\n// launch block=128 work=rows per_block=128\n"
           'extern "C" __global__ void sparserl_kernel() {}')
    ids = tiny_tok.encode(src)
    end = header_end(tiny_tok, ids)
    assert tiny_tok.decode(ids[:end]).count("\n") == 2 and tiny_tok.decode(ids[:end - 1]).count("\n") < 2
    assert header_end(tiny_tok, ids[:5]) == 5  # an unfinished header: every position


def test_branch_diverse_is_the_greedy_kernel_and_its_distinct_departures(tiny_model, tiny_tok):
    """The first candidate is the greedy kernel; every other one starts with the greedy tokens up
    to its departure, then the departure's token; no two are the same text; drafts change nothing."""
    from sparserl_compile.policy.departures import branch_diverse

    g = DecodeConfig(greedy=True, max_new_tokens=40)
    rs = branch_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 4, config=g, scope="all")
    (greedy,) = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, config=g)
    assert rs[0].tokens == greedy.tokens and len(rs) == 4
    assert len({r.text for r in rs}) == 4
    for r in rs[1:]:
        p, a = r.extra["branch"]
        assert r.tokens[:p + 1] == greedy.tokens[:p] + [a]
    spec = branch_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 4, scope="all",
                          config=DecodeConfig(greedy=True, max_new_tokens=40, trace=False, batch_drafts=True),
                          references=[r.text for r in rs])
    assert [r.tokens for r in spec] == [r.tokens for r in rs]
    with pytest.raises(ValueError, match="k=0"):
        branch_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 0)


def test_branch_diverse_replaces_what_the_screen_leaves_out(tiny_model, tiny_tok):
    """A screen's verdicts: a departure it leaves out is replaced by the next most likely one and
    listed, with the reason, in the greedy rollout's ``screened_out``; the kept ones are the
    unscreened draw's, minus the left-out ones, in order."""
    from sparserl_compile.policy.departures import branch_diverse

    g = DecodeConfig(greedy=True, max_new_tokens=40)
    plain = branch_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 8, config=g, scope="all")
    banned = {plain[1].text, plain[3].text}
    seen = []

    def screen(texts):
        seen.extend(texts)
        return ["no" if t in banned else None for t in texts]

    rs = branch_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 4, config=g, scope="all", screen=screen)
    assert rs[0].tokens == plain[0].tokens and plain[0].text not in seen  # the greedy kernel is never screened
    assert [r.text for r in rs[1:]] == [r.text for r in plain[1:] if r.text not in banned][:3]
    out = rs[0].extra["screened_out"]
    assert sorted(why for *_, why in out) == ["no", "no"]
    assert {tuple(p[:2]) for p in out} == {plain[1].extra["branch"], plain[3].extra["branch"]}
    everything = branch_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 4, config=g, scope="all",
                                screen=lambda texts: ["no"] * len(texts), rounds=2)
    assert len(everything) == 1 and len(everything[0].extra["screened_out"]) >= 3


def test_a_sample_past_its_step_budget_is_cut_there(tiny_model, tiny_tok):
    """``step_budget``: a sample no draft predicts (one token a forward) still unfinished after
    that many forwards is cut there, ``extra["cut"] == "budget"``, having written what it would
    have written up to then; a sample the drafts carry to its end within the budget is untouched;
    in a batch, each sample counts its own."""
    from sparserl_compile.policy.sampling import header_prefix

    g = DecodeConfig(greedy=True, max_new_tokens=60, trace=False)
    (plain,) = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, config=g)
    assert len(plain.tokens) > 12
    nothing = ["// nothing alike " * 5]
    counted = CountingPolicy(tiny_model)
    (cut,) = generate(counted, tiny_tok, _s(), "spmv", "f32", 1, config=g, references=nothing, step_budget=6)
    assert not cut.finished and cut.extra["cut"] == "budget"
    assert 0 < len(cut.tokens) < len(plain.tokens) and cut.tokens == plain.tokens[:len(cut.tokens)]
    assert counted.calls == 1 + 6  # the prompt's forward and the six it took part in
    (whole,) = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, config=g, references=[plain.text],
                        step_budget=6)
    assert whole.tokens == plain.tokens and "cut" not in whole.extra
    with pytest.raises(ValueError, match="step_budget=0"):
        generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, config=g, references=nothing, step_budget=0)
    forced = [tiny_tok.encode(header_prefix("spmv", f)) for f in ("ell", "csr")]
    batch = DecodeConfig(greedy=True, max_new_tokens=60, trace=False, batch_drafts=True)
    full = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=2, config=g, forced=forced)
    rs = generate(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, k=2, config=batch, forced=forced,
                  references=nothing, step_budget=4)
    for r, f in zip(rs, full):  # in a batch each sample counts its own forwards
        assert r.extra.get("cut") == ("budget" if len(r.tokens) < len(f.tokens) else None)
        assert r.tokens == f.tokens[:len(r.tokens)]
    assert any(r.extra.get("cut") for r in rs)


def test_branch_diverse_replaces_a_departure_cut_at_the_step_budget(tiny_model, tiny_tok):
    """``step_budget``: each departure cut off unfinished is listed with why in the greedy
    rollout's ``screened_out`` and replaced by the next most likely one; none is returned cut."""
    from sparserl_compile.policy.departures import branch_diverse

    g = DecodeConfig(greedy=True, max_new_tokens=40, trace=False, batch_drafts=True)
    nothing = ["// nothing alike " * 5]  # every departure written one token a forward
    cut = branch_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 4, config=g, scope="all",
                         references=nothing, step_budget=3)
    out = cut[0].extra["screened_out"]
    assert len(out) >= 3 and all(why == "cut: unfinished after 3 forwards" for *_, why in out)
    assert not any(r.extra.get("cut") for r in cut)
    free = branch_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 4, config=g, scope="all", references=nothing)
    assert "screened_out" not in free[0].extra and len(free) == 4  # without a budget nothing is cut


def test_branch_candidates_of_the_shipped_policy_are_other_launch_choices():
    """On the shipped default policy the departures are header choices (format, its parameters,
    the launch configuration): each candidate is a complete kernel whose header parses, and its
    header differs from the greedy kernel's."""
    from sparserl_compile.policy.departures import branch_diverse
    from sparserl_compile.policy.model import load_policy

    model, tok = load_policy(DEFAULT_CHECKPOINT, "cpu")
    m = banded(2000, 3)
    s = prepare_structure(m.indptr, m.indices, m.shape, max_points=model.config.max_points)
    rs = branch_diverse(model, tok, s, "spmv", "f32", 1, 4,
                        config=DecodeConfig(greedy=True, max_new_tokens=1200, trace=False, batch_drafts=True))
    assert len(rs) == 4 and all(r.finished for r in rs)
    headers = [r.text.split("\n", 2)[:2] for r in rs]
    for r, h in zip(rs[1:], headers[1:]):
        contract.parse_header(r.text)
        assert h != headers[0]


def test_departures_of_the_shipped_policy_decode_in_fewer_forwards_with_every_formats_draft():
    """A departure into another format than the nearest entries' drafts is written one token a
    forward; with ``problem_inputs``'s drafts (one of every format) the same departures take far
    fewer forwards. Greedy decoding writes the same kernels either way."""
    from sparserl_compile.policy.departures import branch_diverse
    from sparserl_compile.policy.sampling import format_of
    from sparserl_compile.policy.model import load_policy
    from sparserl_compile.policy.provider import problem_inputs
    from sparserl_compile.policy.retrieval import default_entries, reference_sources
    from sparserl_compile.matrices import uniform_random

    model, tok = load_policy(DEFAULT_CHECKPOINT, "cpu")
    counted = CountingPolicy(model)
    m = uniform_random(3000, 3000, 8, seed=1)
    s, formats, every, grammar = problem_inputs(model, m, "spmm", "f32", 32)
    assert formats == ()  # not asked for: nothing forces a format here
    nearest = reference_sources(s.features, "spmm", "f32", 32, default_entries(), m, count=4, formats=())
    assert every[:len(nearest)] == nearest and {format_of(t) for t in every} == set(contract.FORMATS)
    cfg = DecodeConfig(greedy=True, max_new_tokens=1200, trace=False, batch_drafts=True)
    texts, calls = [], []
    for refs in (list(nearest), list(every)):  # plain lists: no drafts from the samples' own headers (below)
        counted.calls = 0
        texts.append([r.text for r in branch_diverse(counted, tok, s, "spmm", "f32", 32, 4, cfg,
                                                     grammar_text=grammar, references=refs)])
        calls.append(counted.calls)
    assert texts[0] == texts[1] and len(texts[0]) == 4
    assert {format_of(t) for t in texts[0][1:]} - {format_of(t) for t in nearest}  # a format no near draft has
    assert calls[1] * 3 < calls[0], calls


def test_a_kernel_whose_header_no_draft_has_is_drafted_from_the_space_kernel_of_its_header():
    """On a width-128 SpMM the shipped policy's greedy kernel and departures choose launch
    numbers (``tile_n=128``, ``per_block=8``) none of the nearest winners' drafts has, and the
    body spells them out, so after the header every draft is left and the kernel was written one
    token a forward. ``reference_sources`` returns a ``Drafts``: once a sample's header is
    written, the space's kernel with that header drafts its body. The same kernels, far fewer
    forwards."""
    from sparserl_compile.policy.departures import branch_diverse
    from sparserl_compile.policy.sampling import header_of
    from sparserl_compile.policy.speculative import Drafts
    from sparserl_compile.policy.model import load_policy
    from sparserl_compile.policy.provider import problem_inputs
    from sparserl_compile.matrices import uniform_random

    assert header_of("// a\n// b\n__global__") == "// a\n// b" and header_of("// a\n// b") is None
    assert Drafts(["x"]).for_header("// a\n// b") == [] and Drafts(["x"]) == ["x"]
    model, tok = load_policy(DEFAULT_CHECKPOINT, "cpu")
    counted = CountingPolicy(model)
    m = uniform_random(10000, 10000, 8, seed=0)
    s, _, drafts, grammar = problem_inputs(model, m, "spmm", "f32", 128)
    assert isinstance(drafts, Drafts)
    cfg = DecodeConfig(greedy=True, max_new_tokens=1200, trace=False, batch_drafts=True)
    texts, calls = [], []
    for refs in (list(drafts), drafts):
        counted.calls = 0
        texts.append([r.text for r in branch_diverse(counted, tok, s, "spmm", "f32", 128, 4, cfg,
                                                     grammar_text=grammar, references=refs)])
        calls.append(counted.calls)
    assert texts[0] == texts[1] and len(texts[0]) == 4
    assert all(drafts.for_header(header_of(t)) for t in texts[1])  # every one is a point of the space
    assert calls[1] * 3 < calls[0], calls


def _swap_header(source: str, header_of: str) -> str:
    """``source``'s body under ``header_of``'s two header lines: a departure whose body did not follow."""
    return "\n".join(header_of.splitlines()[:2] + source.splitlines()[2:])


def test_stale_departure_passes_every_consistent_pair_of_the_kernel_space():
    """Two renderings of one template family with different parameters are what a departure
    that follows its header looks like: the stale check passes every such pair, in both
    directions, for SpMV and SpMM, f32 and f16 (bsr_wmma: a block size that is also a buffer
    offset in the body)."""
    import itertools

    from sparserl_compile.policy.departures import stale_departure
    from sparserl_compile import kernels

    pairs = 0
    for op, n, dtype in (("spmv", None, "f32"), ("spmm", 32, "f32"), ("spmv", None, "f16"), ("spmm", 32, "f16")):
        by_family = {}
        for c in kernels.space(op, dtype, n=n):
            by_family.setdefault(c.family, []).append(c)
        for cs in by_family.values():
            for a, b in itertools.permutations(cs, 2):
                assert stale_departure(a.source, b.source) is None, (a.source[:200], b.source[:200])
                pairs += 1
    assert pairs > 1000


def test_stale_departure_names_an_spmv_body_under_an_spmm_header():
    """A wrong departure a trained policy wrote: a departure from a
    CSR SpMM kernel to SELL, whose body the model wrote as SELL's SpMV kernel (it never reads
    the width n and fills one output column). Left out on the text; the SELL SpMM kernel of the
    kernel space passes, and an SpMV departure is not asked about n."""
    from sparserl_compile.policy.departures import stale_departure
    from sparserl_compile import kernels

    greedy = next(c for c in kernels.space("spmm", "f32", n=32) if c.family == "csr_rowgroup").source
    sell_spmm = next(c for c in kernels.space("spmm", "f32", n=32) if c.family == "sell").source
    sell_spmv = next(c for c in kernels.space("spmv", "f32") if c.family == "sell").source
    spmv_body = _swap_header(sell_spmv, sell_spmm)
    why = stale_departure(greedy, spmv_body)
    assert why is not None and "never reads n" in why
    assert stale_departure(greedy, sell_spmm) is None
    spmv_greedy = next(c for c in kernels.space("spmv", "f32") if c.family == "csr_vector").source
    assert stale_departure(spmv_greedy, sell_spmv) is None


def test_stale_departure_names_the_merge_body_that_kept_the_greedy_items_per_part():
    """A departure that faulted on an R-MAT matrix: a merge departure to another items_per_part
    whose body still cuts pieces of the greedy kernel's size. Left out, with the line; the body
    rewritten for the new header, or naming the field, passes; so does a header that does not parse."""
    from sparserl_compile.policy.departures import stale_departure
    from sparserl_compile import kernels

    greedy = kernels.render("merge", "spmm", "f32", {"block": 128, "items_per_part": 64}).source
    follows = kernels.render("merge", "spmm", "f32", {"block": 128, "items_per_part": 256}).source
    stale = _swap_header(greedy, follows)
    why = stale_departure(greedy, stale)
    assert why is not None and "items_per_part=256 (the greedy kernel's 64)" in why and "p * 64" in why
    assert stale_departure(greedy, follows) is None and stale_departure(greedy, greedy) is None
    named = stale.replace("min(d0 + 64, total)", "min(d0 + items_per_part, total)")
    assert stale_departure(greedy, named) is None
    assert stale_departure(greedy, "not a kernel") is None and stale_departure("not a kernel", stale) is None
    # a block departure that kept the greedy body's thread-to-part arithmetic
    wide = kernels.render("merge", "spmv", "f32", {"block": 256, "items_per_part": 16}).source
    narrow = kernels.render("merge", "spmv", "f32", {"block": 128, "items_per_part": 16}).source
    assert stale_departure(narrow, wide) is None
    assert "block=256" in stale_departure(narrow, _swap_header(narrow, wide))


def test_branch_diverse_leaves_out_stale_departures_before_the_screen(tiny_model, tiny_tok, monkeypatch):
    """A departure the stale check flags is replaced like a screened-out one, listed with its
    reason, and never shown to the screen; ``stale_check=False`` keeps it."""
    import sparserl_compile.policy.departures as departures

    g = DecodeConfig(greedy=True, max_new_tokens=40)
    plain = departures.branch_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 8, config=g, scope="all",
                                      stale_check=False)
    flagged = plain[2].text
    monkeypatch.setattr(departures, "stale_departure", lambda greedy, text: "stale: test" if text == flagged else None)
    seen = []

    def screen(texts):
        seen.extend(texts)
        return [None] * len(texts)

    rs = departures.branch_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 4, config=g, scope="all", screen=screen)
    assert flagged not in seen and flagged not in [r.text for r in rs]
    assert [r.text for r in rs[1:]] == [r.text for r in plain[1:] if r.text != flagged][:3]
    assert [why for *_, why in rs[0].extra["screened_out"]] == ["stale: test"]
    unscreened = departures.branch_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 4, config=g, scope="all")
    assert flagged not in [r.text for r in unscreened] and unscreened[0].extra["screened_out"]
    kept = departures.branch_diverse(tiny_model, tiny_tok, _s(), "spmv", "f32", 1, 4, config=g, scope="all",
                                     stale_check=False)
    assert [r.text for r in kept] == [r.text for r in plain[:4]]


def test_the_decoders_token_bitmask_is_llguidances(tiny_tok):
    """``token_bitmask``/``fill_token_bitmask`` (the decoder's, which spare a process importing
    ``llguidance.torch`` and with it inductor) hold what llguidance's own helpers write, row by
    row, along a prefix of the grammar."""
    import llguidance.torch as llt

    from sparserl_compile.policy.masks import fill_token_bitmask, make_matcher, token_bitmask

    vocab = len(tiny_tok)
    ours, theirs = token_bitmask(3, vocab), llt.allocate_token_bitmask(3, vocab)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == torch.int32
    assert torch.equal(ours, theirs)  # all allowed before any fill
    a, b = make_matcher(tiny_tok, vocab, None, "spmv", "f32"), make_matcher(tiny_tok, vocab, None, "spmv", "f32")
    for row, tok in enumerate(tiny_tok.encode("// sparserl op=spmv")[:3]):
        fill_token_bitmask(a, ours, row)
        llt.fill_next_token_bitmask(b, theirs, row)
        assert a.consume_token(tok) and b.consume_token(tok)
    assert torch.equal(ours, theirs) and not torch.equal(ours[0], torch.full_like(ours[0], -1))


def test_encode_cached_is_the_tokenizers_encoding_in_a_fresh_list(tiny_tok):
    from sparserl_compile.policy.tokenizer import encode_cached

    text = "// sparserl op=spmv format=csr dtype=f32 index=i32"
    a = encode_cached(tiny_tok, text)
    assert a == tiny_tok.encode(text)
    a.append(-1)  # the caller's list is its own
    assert encode_cached(tiny_tok, text) == tiny_tok.encode(text)

    class Slow:  # no Rust backend to key the memo by: encoded every time
        def encode(self, t):
            return [len(t)]

    assert encode_cached(Slow(), text) == [len(text)]
