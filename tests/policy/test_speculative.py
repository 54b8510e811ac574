"""policy/speculative.py: speculative decoding writes the samples plain decoding would, in fewer model calls."""

import pytest
import torch

from policy_fixtures import banded_structure as _s
from sparserl_compile import contract
from sparserl_compile.matrices import banded
from sparserl_compile.policy.decode import generate
from sparserl_compile.policy.encoder import prepare_structure
from sparserl_compile.policy.masks import unpack_masks
from sparserl_compile.policy.model import CountingPolicy
from sparserl_compile.policy.provider import DEFAULT_CHECKPOINT
from sparserl_compile.policy.sampling import DecodeConfig


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
                  config=DecodeConfig(max_new_tokens=200, seed=3, trace=False))
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
