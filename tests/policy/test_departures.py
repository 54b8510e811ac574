"""policy/departures.py: the greedy kernel's most likely departures, and the text check that leaves out stale ones."""

import pytest
import torch

from policy_fixtures import banded_structure as _s
from sparserl_compile import contract
from sparserl_compile.matrices import banded
from sparserl_compile.policy.decode import generate
from sparserl_compile.policy.encoder import prepare_structure
from sparserl_compile.policy.model import CountingPolicy
from sparserl_compile.policy.provider import DEFAULT_CHECKPOINT
from sparserl_compile.policy.sampling import DecodeConfig


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
    from sparserl_compile import kernels

    # drafts of every format the shipped table's winners are in
    measured = {f for e in default_entries() for f, _, _ in e.ranked}  # families the shipped table has
    table_formats = {c.header.format for c in kernels.space("spmm", "f32", n=32, structure=m) if c.family in measured}
    assert every[:len(nearest)] == nearest and {format_of(t) for t in every} == table_formats
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
