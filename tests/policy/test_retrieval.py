"""Retrieval hints: the prompt, the nearest other matrix's winner, and who passes them."""

import copy

import numpy as np
import pytest

from sparserl_compile.policy import retrieval
from sparserl_compile.policy.tokenizer import KERNEL, STRUCTURE, prompt_text
from sparserl_compile.nearest import Entry


def entry(label, feats, family, params, op="spmv", n=1):
    return Entry(label, op, "f32", n, np.asarray(feats, np.float64), ((family, tuple(sorted(params.items())), 1.0),))


def test_prompt_names_the_hint_only_when_given():
    assert prompt_text("spmv", "f32", 1) == f"{STRUCTURE}op=spmv dtype=f32 n=1{KERNEL}"
    assert prompt_text("spmm", "f32", 32, "csr_vector[block=128][tpr=8]") == \
        f"{STRUCTURE}op=spmm dtype=f32 n=32 near=csr_vector[block=128][tpr=8]{KERNEL}"


def test_nearest_hint_skips_the_matrix_itself_and_other_ops():
    table = [entry("self", [1.0, 1.0], "csr_scalar", {"block": 64}),
             entry("other", [1.5, 1.0], "csr_vector", {"block": 128, "tpr": 8}),
             entry("far", [9.0, 9.0], "ell", {}),
             entry("spmm", [1.0, 1.0], "csr_rowgroup", {"g": 8}, op="spmm", n=32)]
    assert retrieval.nearest_hint([1.0, 1.0], "spmv", "f32", 1, table) == "csr_scalar[block=64]"
    assert retrieval.nearest_hint([1.0, 1.0], "spmv", "f32", 1, table, exclude="self") == \
        "csr_vector[block=128][tpr=8]"
    assert retrieval.nearest_hint([1.0, 1.0], "spmm", "f32", 32, table) == "csr_rowgroup[g=8]"
    assert retrieval.nearest_hint([1.0, 1.0], "spmv", "f16", 1, table) is None


def test_sft_examples_carry_hints_from_other_matrices(tiny_tok):
    from sparserl_compile.training import data
    from sparserl_compile.training.neighbours import entries_from_records
    from sparserl_compile.training.sft import build_examples

    def rec(n, family):
        return data.SupervisionRecord(data.MatrixRef("generated", "banded", (("half_bandwidth", 1), ("n", n))),
                                      "spmv", "f32", 1, (data.Variant(family, (("block", 128),), 1.0),))

    recs = [rec(40, "csr_scalar"), rec(48, "ell")]  # points of both matrices' kernel spaces
    entries = entries_from_records(recs)
    rendered = []

    def render(family, op, dtype, params, m):
        rendered.append(family)
        return "// kernel\n"

    ex, skipped = build_examples(recs, tiny_tok, 64, render=render, log=lambda *_: None, hint_entries=entries)
    assert skipped == 0 and len(ex) == 2
    prompts = [tiny_tok.decode(e.prompt_ids) for e in ex]
    # each record's hint is the *other* matrix's winner, never its own answer
    assert "near=ell[block=128]" in prompts[0] and "near=csr_scalar[block=128]" in prompts[1]
    plain, _ = build_examples(recs, tiny_tok, 64, render=render, log=lambda *_: None)
    assert all("near=" not in tiny_tok.decode(e.prompt_ids) for e in plain)


def test_family_hint_examples_target_the_records_best_of_the_hinted_family(tiny_tok):
    """SFT --hints N: one example per nearest other matrix's winner, target the record's fastest
    variant of that family; a family the record never measured gives no example."""
    from sparserl_compile.training import data
    from sparserl_compile.training.neighbours import entries_from_records
    from sparserl_compile.training.sft import build_examples

    def rec(n, *variants):  # points of the matrices' kernel spaces (hints are filtered to those)
        return data.SupervisionRecord(data.MatrixRef("generated", "banded", (("half_bandwidth", 1), ("n", n))),
                                      "spmv", "f32", 1, tuple(data.Variant(f, (("block", b), *extra), us)
                                                              for f, b, us, *extra in variants))

    tpr8 = ("tpr", 8)
    recs = [rec(40, ("csr_scalar", 64, 1.0), ("csr_vector", 128, 2.0, tpr8), ("csr_vector", 256, 3.0, tpr8)),
            rec(48, ("csr_vector", 256, 1.0, tpr8), ("csr_scalar", 256, 2.0)),
            rec(56, ("ell", 128, 1.0), ("csr_scalar", 64, 5.0))]
    entries = entries_from_records(recs)

    def render(family, op, dtype, params, m):
        return f"// {family} block={params['block']} rows={m.shape[0]}\n"

    ex, skipped = build_examples(recs, tiny_tok, 64, render=render, log=lambda *_: None, hint_entries=entries,
                                 hints=4)
    pairs = [(tiny_tok.decode(e.prompt_ids).split("near=")[1].split("<")[0], tiny_tok.decode(e.target_ids))
             for e in ex]
    by_rows = {}
    for hint, target in pairs:
        by_rows.setdefault(target.split("rows=")[1].split("<")[0].strip(), []).append((hint, target.split(" rows")[0]))
    # the 40-row matrix: hints are the others' points; each target is its own best of the hint's family
    assert ("csr_vector[block=256][tpr=8]", "// csr_vector block=128") in by_rows["40"]
    assert ("ell[block=128]", "// csr_scalar block=64") not in by_rows["40"]  # it measured no ell
    assert all(not h.startswith("ell") for h, _ in by_rows["40"] + by_rows["48"])
    # the 56-row matrix: csr_scalar hints give its (slow) csr_scalar, never its ell winner
    assert all(t == "// csr_scalar block=64" for h, t in by_rows["56"] if h.startswith("csr_scalar"))
    assert skipped == 0 and len(ex) == sum(len(v) for v in by_rows.values())

    # with a tolerance the hinted point itself is the target where it is close enough to the
    # family's best: the 40-row matrix measured csr_vector[256] at 3.0 vs the family's 2.0
    def targets(tol):
        ex, _ = build_examples(recs, tiny_tok, 64, render=render, log=lambda *_: None, hint_entries=entries,
                               hints=4, hint_tolerance=tol)
        return {tiny_tok.decode(e.prompt_ids).split("near=")[1].split("<")[0]: tiny_tok.decode(e.target_ids)
                for e in ex if "rows=40" in tiny_tok.decode(e.target_ids)}

    assert targets(0.4)["csr_vector[block=256][tpr=8]"].startswith("// csr_vector block=128")  # 3.0 > 1.4 x 2.0
    assert targets(0.6)["csr_vector[block=256][tpr=8]"].startswith("// csr_vector block=256")  # 3.0 <= 1.6 x 2.0


def test_provider_gives_a_retrieval_policy_its_hint(tiny_model, tiny_tok, monkeypatch):
    from sparserl_compile.policy import provider as prov_mod
    from sparserl_compile.policy.sampling import DecodeConfig
    from sparserl_compile.matrices import banded

    seen = []
    real = prov_mod.generate

    def spy(*a, hint=None, **kw):
        seen.append(hint)
        return real(*a, hint=hint, **kw)

    monkeypatch.setattr(prov_mod, "generate", spy)
    m = banded(32, 1)
    feats = prov_mod.prepare_structure(m.indptr, m.indices, m.shape).features
    monkeypatch.setattr(retrieval, "default_entries", lambda: [entry("t", feats, "csr_scalar", {"block": 256})])

    class P:
        op, dtype, n = "spmv", "f32", 1
        n_rows, n_cols, nnz = m.shape[0], m.shape[1], m.nnz
        indptr, indices, fingerprint, arch = m.indptr, m.indices, "x", "cpu"

    cfg = DecodeConfig(max_new_tokens=4)
    plain = prov_mod.PolicyProvider(model=tiny_model, tokenizer=tiny_tok, decode=cfg, samples="temperature")
    plain.candidates(P(), 1)
    rag_model = copy.deepcopy(tiny_model)
    rag_model.config.retrieval = True
    prov_mod.PolicyProvider(model=rag_model, tokenizer=tiny_tok, decode=cfg, samples="temperature").candidates(P(), 1)
    assert seen == [None, "csr_scalar[block=256]"]
    # the branches mode hands the hint on too
    calls = []
    monkeypatch.setattr(prov_mod, "branch_diverse", lambda *a, hint=None, **kw: calls.append(hint) or [])
    prov_mod.PolicyProvider(model=rag_model, tokenizer=tiny_tok, decode=cfg, samples="branches").candidates(P(), 1)
    assert calls == ["csr_scalar[block=256]"]


def test_retrieval_flag_round_trips_through_a_checkpoint(tiny_model, tiny_tok, tmp_path):
    from sparserl_compile.policy.model import load_policy, save_policy

    m = copy.deepcopy(tiny_model)
    m.config.retrieval = True
    save_policy(m, tiny_tok, tmp_path)
    back, _ = load_policy(tmp_path, "cpu")
    assert back.config.retrieval is True
    save_policy(tiny_model, tiny_tok, tmp_path / "plain")
    assert load_policy(tmp_path / "plain", "cpu")[0].config.retrieval is False


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_reference_sources_render_the_nearest_winners_hint_first():
    from sparserl_compile import contract
    from sparserl_compile.matrices import banded

    m = banded(64, 2)
    table = [entry("a", [1.0, 1.0], "csr_scalar", {"block": 64}),
             entry("b", [1.5, 1.0], "csr_vector", {"block": 128, "tpr": 8}),
             entry("c", [2.0, 1.0], "no_such_family", {})]
    srcs = retrieval.reference_sources([1.0, 1.0], "spmv", "f32", 1, table, m, count=4)
    assert len(srcs) == 2  # the unrenderable point is skipped
    heads = [contract.parse_header(s) for s in srcs]
    assert [h.format for h in heads] == ["csr", "csr"] and "64" in srcs[0].splitlines()[1]
    assert retrieval.reference_sources([1.0, 1.0], "spmv", "f32", 1, table, m, count=1, exclude="a")[0] == srcs[1]


def test_reference_sources_add_a_draft_of_each_asked_format():
    """``formats``: after the first ``count``, the nearest proposal of each asked format the first
    ones lack (format_diverse's forced formats then have drafts of their own format)."""
    from sparserl_compile.policy.sampling import format_of
    from sparserl_compile.matrices import banded

    m = banded(64, 2)
    table = [entry("a", [1.0, 1.0], "csr_scalar", {"block": 64}),
             entry("b", [1.2, 1.0], "csr_vector", {"block": 128, "tpr": 8}),
             entry("c", [1.4, 1.0], "ell", {"block": 128}),
             entry("d", [1.6, 1.0], "merge", {"block": 128, "items_per_part": 16}),
             entry("e", [1.8, 1.0], "ell", {"block": 256})]
    first = retrieval.reference_sources([1.0, 1.0], "spmv", "f32", 1, table, m, count=1, formats=())
    srcs = retrieval.reference_sources([1.0, 1.0], "spmv", "f32", 1, table, m, count=1,
                                       formats=("ell", "merge", "dia"))
    assert srcs[0] == first[0] and [format_of(s) for s in srcs] == ["csr", "ell", "merge"]  # no dia point
    assert "128" in srcs[1].splitlines()[1]  # the nearest ell point, not the farther one
    assert [format_of(s) for s in retrieval.reference_sources([1.0, 1.0], "spmv", "f32", 1, table, m, count=1,
                                                              formats=("ell",), scan=2)] == ["csr"]


def test_reference_sources_draft_every_format_by_default():
    """Without ``formats`` the drafts include the nearest proposal of every format the entries
    have (a departure or a sample may leave the nearest winners' format); ``formats=()``: the
    first ``count`` proposals alone."""
    from sparserl_compile.policy.sampling import format_of
    from sparserl_compile.matrices import banded

    m = banded(64, 2)
    table = [entry("a", [1.0, 1.0], "csr_scalar", {"block": 64}),
             entry("b", [1.2, 1.0], "csr_vector", {"block": 128, "tpr": 8}),
             entry("c", [1.4, 1.0], "ell", {"block": 128}),
             entry("d", [1.6, 1.0], "merge", {"block": 128, "items_per_part": 16})]
    assert [format_of(s) for s in retrieval.reference_sources([1.0, 1.0], "spmv", "f32", 1, table, m,
                                                              count=1)] == ["csr", "ell", "merge"]
    assert [format_of(s) for s in retrieval.reference_sources([1.0, 1.0], "spmv", "f32", 1, table, m,
                                                              count=1, formats=())] == ["csr"]


def test_nearest_hints_are_the_nearest_entries_winners_in_order():
    table = [entry("a", [1.0, 1.0], "csr_scalar", {"block": 64}),
             entry("b", [1.5, 1.0], "csr_vector", {"block": 128, "tpr": 8}),
             entry("dup", [1.6, 1.0], "csr_scalar", {"block": 64}),  # a repeat: proposed once
             entry("c", [3.0, 1.0], "ell", {})]
    assert retrieval.nearest_hints([1.0, 1.0], "spmv", "f32", 1, table, 8) == \
        ["csr_scalar[block=64]", "csr_vector[block=128][tpr=8]", "ell"]
    assert retrieval.nearest_hints([1.0, 1.0], "spmv", "f32", 1, table, 2, exclude="a") == \
        ["csr_vector[block=128][tpr=8]", "csr_scalar[block=64]"]
    assert retrieval.nearest_hints([1.0, 1.0], "spmv", "f16", 1, table, 4) == []
    assert retrieval.nearest_hint([1.0, 1.0], "spmv", "f32", 1, table) == \
        retrieval.nearest_hints([1.0, 1.0], "spmv", "f32", 1, table, 1)[0]


def test_hints_given_a_problem_are_points_its_pattern_can_run():
    """A neighbour's SELL or BSR winner is no hint for a power-law matrix that SELL would pad
    beyond the limit and that has no dense blocks: with the problem given, such points are
    passed over and the next neighbours' winners take their places."""
    from sparserl_compile.matrices import rmat

    m = rmat(12, 4, seed=1)
    table = [entry("a", [1.0, 1.0], "sell", {"C": 32, "sigma": 256}),
             entry("b", [1.2, 1.0], "bsr", {"R": 2, "C": 4}),
             entry("c", [1.5, 1.0], "csr_vector", {"block": 128, "tpr": 8}),
             entry("d", [2.0, 1.0], "merge", {"block": 128, "items_per_part": 16})]
    every = retrieval.nearest_hints([1.0, 1.0], "spmv", "f32", 1, table, 4)
    assert every[:2] == ["sell[C=32][sigma=256]", "bsr[C=4][R=2]"]
    pb = retrieval.problem_for("spmv", "f32", 1, m)
    assert retrieval.nearest_hints([1.0, 1.0], "spmv", "f32", 1, table, 4, problem=pb) == \
        ["csr_vector[block=128][tpr=8]", "merge[block=128][items_per_part=16]"]
    assert retrieval.nearest_hint([1.0, 1.0], "spmv", "f32", 1, table, problem=pb) == \
        "csr_vector[block=128][tpr=8]"


def test_provider_hint_samples_condition_each_candidate_on_another_winner(tiny_model, tiny_tok, monkeypatch):
    """samples="hints": one greedy candidate per nearest winner, each with that winner as its hint."""
    from sparserl_compile.policy import candidates
    from sparserl_compile.policy import provider as prov_mod
    from sparserl_compile.policy.sampling import DecodeConfig
    from sparserl_compile.matrices import banded

    seen = []
    real = candidates.generate

    def spy(*a, hint=None, config=None, **kw):
        seen.append((hint, config.greedy))
        return real(*a, hint=hint, config=config, **kw)

    monkeypatch.setattr(candidates, "generate", spy)  # what hint_diverse decodes with
    m = banded(32, 1)
    feats = prov_mod.prepare_structure(m.indptr, m.indices, m.shape).features
    table = [entry("t", feats, "csr_scalar", {"block": 256}),
             entry("u", feats + 0.5, "csr_vector", {"block": 128, "tpr": 4}),
             entry("v", feats + 1.0, "ell", {})]
    monkeypatch.setattr(retrieval, "default_entries", lambda: table)

    class P:
        op, dtype, n = "spmv", "f32", 1
        n_rows, n_cols, nnz = m.shape[0], m.shape[1], m.nnz
        indptr, indices, fingerprint, arch = m.indptr, m.indices, "x", "cpu"

    with pytest.raises(ValueError, match="trained without hints"):
        prov_mod.PolicyProvider(model=tiny_model, tokenizer=tiny_tok, samples="hints")
    with pytest.raises(ValueError, match="samples='nope'"):
        prov_mod.PolicyProvider(model=tiny_model, tokenizer=tiny_tok, samples="nope")
    rag_model = copy.deepcopy(tiny_model)
    rag_model.config.retrieval = True
    p = prov_mod.PolicyProvider(model=rag_model, tokenizer=tiny_tok, decode=DecodeConfig(max_new_tokens=4),
                                samples="hints", speculative=False)
    p.candidates(P(), 2)
    # nearest first; with max_new_tokens=4 every sample is cut off and dropped, so the provider
    # asks for further hints (up to 2k) and spends the table's: "ell" without parameters is not
    # a point of the kernel space, so two runnable hints are all it has
    assert seen == [("csr_scalar[block=256]", True), ("csr_vector[block=128][tpr=4]", True)]
    assert p.stats.sampled == 2 and p.stats.unfinished == 2 and p.stats.returned == 0
    # the default: the greedy kernel's departures, unless the checkpoint was trained on several hints per record
    assert prov_mod.PolicyProvider(model=rag_model, tokenizer=tiny_tok).samples == "branches"
    rag_model.config.retrieval_hints = 8
    assert prov_mod.PolicyProvider(model=rag_model, tokenizer=tiny_tok).samples == "hints"
