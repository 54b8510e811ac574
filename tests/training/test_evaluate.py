"""``training.evaluate.evaluate_policy``: rates and the measured-time kernel-space fraction."""

import pytest

from sparserl_compile.policy.decode import generate
from sparserl_compile.policy.sampling import DecodeConfig
from sparserl_compile.policy.encoder import prepare_structure
from sparserl_compile.training.evaluate import evaluate_policy
from sparserl_compile.training.space import normalized as _norm
from sparserl_compile.training.rewards import KernelOutcome, RLProblem
from sparserl_compile.matrices import banded


def _all_correct(pb, sources):
    # compiles and is correct whenever the sample is non-empty; timed by a cost model at 50 us
    return [KernelOutcome(bool(s), bool(s), bool(s), 50.0 if s else None, pb.reference_us, pb.best_space_us)
            for s in sources]


def test_measured_fraction_uses_the_measured_time_of_the_point_written(tiny_model, tiny_tok):
    m = banded(32, 1)
    pb = RLProblem(m, "spmv", "f32", 1, "banded", reference_us=40.0, best_space_us=10.0)
    s = prepare_structure(m.indptr, m.indices, m.shape, max_points=tiny_model.config.max_points)
    greedy = generate(tiny_model, tiny_tok, s, "spmv", "f32", 1, k=1,
                      config=DecodeConfig(greedy=True, max_new_tokens=12, constrained=False))[0].text
    space = [{_norm(greedy): 20.0, "someotherpoint": 10.0}]  # the greedy sample "is" a point measured at 20 us
    st = evaluate_policy(tiny_model, tiny_tok, [("banded", pb)], _all_correct, k=2, temperature=1.0,
                         max_new_tokens=12, constrained=False, space_sources=space)["banded"]
    summ = st.summary()
    assert summ["samples"] == 3 and summ["records"] == 1
    assert summ["measured_space_fraction_greedy_geomean"] == pytest.approx(10.0 / 20.0)
    assert summ["measured_space_fraction_greedy_fallback_geomean"] == pytest.approx(10.0 / 20.0)  # it was correct
    assert st.rows[0]["greedy_fraction"] == st.rows[0]["greedy_fallback_fraction"] == pytest.approx(0.5)
    assert summ["speedup_greedy_geomean"] == pytest.approx(40.0 / 50.0)  # evaluator (cost model) time
    # the greedy sample is a measured point, so at most the k sampled ones are novel
    assert st.correct == 3 and st.unmeasured <= 2
    assert summ["greedy_novel"] == 0 and "greedy_novel" not in st.rows[0]
    assert len(st.measured_frac_best_of_k) == (1 if st.unmeasured < 2 else 0)


def test_a_wrong_greedy_kernel_counts_as_the_cusparse_fallback_in_the_fallback_fraction(tiny_model, tiny_tok):
    """The plain greedy fraction leaves a record with a wrong greedy kernel out (it has no
    measured time); the fallback fraction counts it as the runtime would run it: cuSPARSE
    (torch.sparse's time), here 4x slower than the space best."""
    m = banded(32, 1)
    pb = RLProblem(m, "spmv", "f32", 1, "banded", reference_us=40.0, best_space_us=10.0)

    def first_wrong(pb, sources):
        return [KernelOutcome(True, True, i > 0, 50.0, pb.reference_us, pb.best_space_us)
                for i in range(len(sources))]

    st = evaluate_policy(tiny_model, tiny_tok, [("banded", pb)], first_wrong, k=1, temperature=1.0,
                         max_new_tokens=12, constrained=False, space_sources=[{}])["banded"]
    summ = st.summary()
    assert summ["greedy_correct_rate"] == 0.0
    assert summ["measured_space_fraction_greedy_n"] == 0 and summ["measured_space_fraction_greedy_geomean"] is None
    assert summ["measured_space_fraction_greedy_fallback_n"] == 1
    assert summ["measured_space_fraction_greedy_fallback_geomean"] == pytest.approx(10.0 / 40.0)
    # the record's own row, for paired comparisons (training/compare.py)
    (row,) = st.rows
    assert row["label"] == "banded" and (row["op"], row["n"], row["samples"], row["correct"]) == ("spmv", 1, 2, 1)
    assert row["greedy_correct"] is False and row["greedy_fraction"] is None
    assert row["greedy_fallback_fraction"] == pytest.approx(10.0 / 40.0)


def test_each_failed_sample_says_where_and_why_it_failed(tiny_model, tiny_tok):
    """A record's row lists its failed samples: the stage (parse, compile, verify) and the
    evaluator's first error on one line, cut to 200 characters; correct samples are not listed."""
    m = banded(32, 1)
    pb = RLProblem(m, "spmv", "f32", 1, "banded", reference_us=40.0, best_space_us=10.0)
    outcomes = [KernelOutcome(True, False, False, detail="error: identifier \"w2\" is undefined\n  a2 = w2;"),
                KernelOutcome(False, False, False, detail="no format header " + "x" * 300),
                KernelOutcome(True, True, False, detail="mismatch at row 3"),
                KernelOutcome(True, True, True, 50.0, 40.0, 10.0)]

    st = evaluate_policy(tiny_model, tiny_tok, [("banded", pb)], lambda pb, sources: outcomes[:len(sources)], k=3,
                         temperature=1.0, max_new_tokens=12, constrained=False, space_sources=[{}])["banded"]
    (row,) = st.rows
    assert [(f["sample"], f["stage"]) for f in row["failures"]] == [(0, "compile"), (1, "parse"), (2, "verify")]
    assert row["failures"][0]["detail"] == 'error: identifier "w2" is undefined a2 = w2;'
    assert len(row["failures"][1]["detail"]) == 200
    assert all("\n" not in f["header"] and len(f["header"]) <= 160 for f in row["failures"])
    causes = st.summary()["failure_causes"]
    assert causes == {'compile: error: identifier "w2" is undefined a2 =': 1,
                      "parse: no format header " + "x" * 23: 1, "verify: mismatch at row 3": 1}
    ok = evaluate_policy(tiny_model, tiny_tok, [("banded", pb)], _all_correct, k=1, temperature=1.0,
                         max_new_tokens=12, constrained=False)["banded"]
    assert "failures" not in ok.rows[0]


def _sources_seen(tiny_model, tiny_tok, **kw):
    """One banded record evaluated with k=3; returns (stats, every source the evaluator saw)."""
    m = banded(32, 1)
    pb = RLProblem(m, "spmv", "f32", 1, "banded", reference_us=40.0, best_space_us=10.0)
    seen = []

    def record(pb, sources):
        seen.extend(sources)
        return _all_correct(pb, sources)

    st = evaluate_policy(tiny_model, tiny_tok, [("banded", pb)], record, k=3, temperature=1.0,
                         max_new_tokens=12, constrained=True, **kw)["banded"]
    return st, seen


def test_diverse_samples_are_distinct_formats(tiny_model, tiny_tok):
    st, seen = _sources_seen(tiny_model, tiny_tok, samples="formats")
    fmts = [s.split("format=")[1].split()[0] for s in seen[1:]]  # after the greedy sample
    assert st.samples == 4 and len(set(fmts)) == 3


def test_branch_samples_are_the_greedy_kernel_and_its_departures(tiny_model, tiny_tok):
    """samples="branches": the k candidates after the greedy sample are the greedy kernel and its
    k - 1 most likely departures (``departures.branch_diverse``), distinct kernels."""
    st, seen = _sources_seen(tiny_model, tiny_tok, samples="branches", branch_scope="all")
    assert st.samples == 4 and seen[1] == seen[0] and len(set(seen[1:])) == 3
    # the departures alone: the greedy kernel, counted twice in the rates, is not among the others
    summ = st.summary()
    assert st.others == 2 and summ["others"] == 2
    assert summ["others_compile_rate"] == summ["others_correct_rate"] == 1.0


def test_the_others_rates_leave_out_the_greedy_kernel_wherever_it_comes(tiny_model, tiny_tok):
    """others_*: the samples whose text differs from the greedy kernel's, whichever mode drew
    them; a sample that copies the greedy kernel is not among them."""
    m = banded(32, 1)
    pb = RLProblem(m, "spmv", "f32", 1, "banded", reference_us=40.0, best_space_us=10.0)

    def first_ok_rest_wrong(pb, sources):
        return [KernelOutcome(True, True, s == sources[0], 50.0, pb.reference_us, pb.best_space_us) for s in sources]

    st = evaluate_policy(tiny_model, tiny_tok, [("banded", pb)], first_ok_rest_wrong, k=4, temperature=1.0,
                         max_new_tokens=12, constrained=False)["banded"]
    summ = st.summary()
    copies = st.samples - 1 - st.others  # temperature samples equal to the greedy kernel
    assert st.others + copies == 4 and summ["correct_rate"] == (1 + copies) / 5
    assert summ["others_correct_rate"] in (None, 0.0) and summ["others_compile_rate"] in (None, 1.0)


def test_hint_samples_follow_the_nearest_winners_and_are_counted(tiny_model, tiny_tok, monkeypatch):
    """samples="hints": after the greedy sample (the first hint's), one greedy sample per further
    hint; a sample that is exactly its hinted point, rendered for the matrix, counts as followed."""
    import copy

    import numpy as np

    from sparserl_compile.nearest import Entry
    from sparserl_compile.training.space import default_render

    m = banded(32, 1)
    pb = RLProblem(m, "spmv", "f32", 1, "banded", reference_us=40.0, best_space_us=10.0)
    feats = prepare_structure(m.indptr, m.indices, m.shape).features
    pts = [("csr_scalar", (("block", 256),)), ("csr_vector", (("block", 128), ("tpr", 4))), ("ell", (("block", 128),))]
    table = [Entry(str(i), "spmv", "f32", 1, np.asarray(feats, np.float64) + i, ((f, p, 1.0),))
             for i, (f, p) in enumerate(pts)]
    rag = copy.deepcopy(tiny_model)
    rag.config.retrieval = True
    with pytest.raises(ValueError, match="needs a policy trained with hints"):
        evaluate_policy(tiny_model, tiny_tok, [("banded", pb)], _all_correct, k=3, temperature=1.0,
                        max_new_tokens=12, constrained=True, samples="hints", hint_entries=table)
    with pytest.raises(ValueError, match="samples='beams'"):
        evaluate_policy(rag, tiny_tok, [("banded", pb)], _all_correct, k=3, temperature=1.0,
                        max_new_tokens=12, constrained=True, samples="beams", hint_entries=table)
    seen = []

    def record(pb, sources):
        seen.extend(sources)
        return _all_correct(pb, sources)

    # an untrained tiny model writes none of the points; "followed" is exact, so 0 of 3
    st = evaluate_policy(rag, tiny_tok, [("banded", pb)], record, k=3, temperature=1.0, max_new_tokens=12,
                         constrained=True, samples="hints", hint_entries=table)["banded"]
    assert st.samples == 4 and seen[0] == seen[1]  # the first hint's sample is the greedy one
    assert st.hint_samples == 3 and st.hint_followed == 0
    assert st.summary()["hint_follow_rate"] == 0.0

    # a model that writes exactly its hint's point: every sample followed
    import sparserl_compile.policy.candidates as candidates
    import sparserl_compile.policy.decode as decode
    from sparserl_compile.policy.sampling import Rollout

    def writes_the_hint(model, tok, s, op, dtype, n, k=1, config=None, hint=None, **kw):
        fam, _, rest = hint.partition("[")
        params = dict(kv.split("=") for kv in rest.rstrip("]").split("][") if kv)
        params = {k_: int(v) for k_, v in params.items()}
        return [Rollout([], [], default_render(fam, op, dtype, params, m), [], True) for _ in range(k)]

    monkeypatch.setattr(decode, "generate", writes_the_hint)  # the greedy sample's
    monkeypatch.setattr(candidates, "generate", writes_the_hint)  # what hint_diverse decodes with
    st = evaluate_policy(rag, tiny_tok, [("banded", pb)], _all_correct, k=3, temperature=1.0,
                         max_new_tokens=12, constrained=True, samples="hints", hint_entries=table)["banded"]
    assert st.hint_samples == 3 and st.hint_followed == 3


def test_nearest_baseline_is_scored_like_the_policy():
    """The nearest provider's first proposal is its "greedy"; best-of-k covers its first k."""
    import numpy as np

    from sparserl_compile.nearest import Entry
    from sparserl_compile.search import SearchProvider
    from sparserl_compile.problem import make_problem
    from sparserl_compile.structure import features, fingerprint
    from sparserl_compile.training.evaluate import evaluate_nearest

    m = banded(64, 2)
    pb = RLProblem(m, "spmv", "f32", 1, "banded", reference_us=40.0, best_space_us=10.0)
    space_pts = SearchProvider().candidates(
        make_problem("spmv", "f32", 1, m.indptr, m.indices, m.shape, fingerprint(m.indptr, m.indices, m.shape), "sm_90"), 0)
    first, second = space_pts[3], space_pts[1]
    f = np.asarray(features(m.indptr, m.indices, m.shape).as_vector(), np.float64)
    table = [Entry("twin", "spmv", "f32", 1, f, ((first.family, first.params, 1.0), (second.family, second.params, 2.0)))]
    measured = [{_norm(first.source): 20.0, _norm(second.source): 10.0}]
    st = evaluate_nearest(table, [("banded", pb)], _all_correct, k=2, space_sources=measured)["banded"]
    summ = st.summary()
    assert summ["samples"] == 2 and summ["records"] == 1 and summ["greedy_correct_rate"] == 1.0
    assert summ["measured_space_fraction_greedy_geomean"] == pytest.approx(0.5)  # first pick: 20 us
    assert summ["measured_space_fraction_best_of_k_geomean"] == pytest.approx(1.0)  # second: 10 us
    assert st.novel == st.unmeasured == 0  # both picks are points of the space


def test_overall_pools_every_kind():
    from sparserl_compile.training.evaluate import KindStats, _summaries, overall

    a = KindStats(samples=4, compiled=4, correct=3, records=1, greedy_correct=1, measured_frac_greedy=[0.5])
    b = KindStats(samples=2, compiled=1, correct=1, records=1, measured_frac_greedy=[0.125])
    tot = overall({"x": a, "y": b})
    assert (tot.samples, tot.compiled, tot.correct, tot.records, tot.greedy_correct) == (6, 5, 4, 2, 1)
    s = _summaries({"x": a, "y": b})
    assert list(s) == ["all", "x", "y"]
    assert s["all"]["measured_space_fraction_greedy_geomean"] == pytest.approx(0.25)
    assert a.measured_frac_greedy == [0.5]  # the kinds' own lists are not touched


def test_run_eval_writes_a_report_with_an_all_row(tmp_path, tiny_tok, n_features):
    """``sparserl eval`` end to end on the CPU (header evaluator): every held-out record is
    scored per kind and pooled, the nearest baseline beside it, and the JSON is on disk."""
    import json

    from sparserl_compile.policy.model import PolicyHParams, build_policy, save_policy
    from policy_fixtures import structure_dependent_supervision
    from sparserl_compile.training.data import load_supervision, split
    from sparserl_compile.training.evaluate import EvalConfig, run_eval

    ckpt = tmp_path / "ckpt"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features)), tiny_tok, ckpt)
    data = tmp_path / "sup.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in structure_dependent_supervision()))
    held = split(load_supervision(data)).held_out
    assert held  # the fixture's seeds put some matrices in the held-out split
    out = tmp_path / "eval.json"
    rep = run_eval(EvalConfig(checkpoints=f"tiny={ckpt}", data=str(data), evaluator="header", k=2,
                              max_new_tokens=24, ablate_unconstrained=False, out=str(out), device="cpu",
                              baselines="nearest"), log=lambda *a: None)
    assert json.loads(out.read_text()) == rep and rep["in_progress"] is None
    # which machine measured it and when, written compactly (results travel to the device)
    assert rep["machine"]["host"] and rep["started"].endswith("Z")
    assert "\n " not in out.read_text()
    assert set(rep["variants"]) == {"tiny", "baseline/nearest"}
    for v in rep["variants"].values():
        assert v["all"]["records"] == len(held) == sum(s["records"] for kind, s in v.items() if kind != "all")
    assert rep["variants"]["tiny"]["all"]["samples"] == 3 * len(held)  # greedy + k=2
    assert set(rep["per_record"]) == set(rep["variants"])
    rows = rep["per_record"]["tiny"]
    assert sorted((r["label"], r["op"], r["n"]) for r in rows) == sorted((h.matrix.label, h.op, h.n) for h in held)
    assert all(r["kind"] in rep["variants"]["tiny"] and r["samples"] == 3 for r in rows)
    import hashlib  # which weights were scored: the folder and their SHA-256 (a soup also names its inputs)
    assert rep["checkpoints"] == {"tiny": {"path": str(ckpt), "model_sha256": hashlib.sha256(
        (ckpt / "model.safetensors").read_bytes()).hexdigest()}}
    from sparserl_compile.training.compare import load_rows  # the report still reads as an eval report, not a validation result
    assert load_rows(f"{out}:tiny") == rows


def test_a_correct_greedy_kernel_that_is_no_measured_point_is_counted_and_flagged(tiny_model, tiny_tok):
    """It has no measured time, so it is left out of the greedy fractions (as before); the
    summary counts it and its row says so, with the evaluator's time for it."""
    m = banded(32, 1)
    pb = RLProblem(m, "spmv", "f32", 1, "banded", reference_us=40.0, best_space_us=10.0)
    st = evaluate_policy(tiny_model, tiny_tok, [("banded", pb)], _all_correct, k=1, temperature=1.0,
                         max_new_tokens=12, constrained=False, space_sources=[{"someotherpoint": 10.0}])["banded"]
    summ = st.summary()
    assert summ["greedy_novel"] == 1 and summ["measured_space_fraction_greedy_n"] == 0
    assert summ["measured_space_fraction_greedy_fallback_n"] == 0  # correct: no fallback either
    (row,) = st.rows
    assert row["greedy_novel"] is True and row["greedy_novel_us"] == 50.0 and row["greedy_fraction"] is None


@pytest.mark.parametrize("untraced", [False, True])
def test_untraced_samples_decodes_the_temperature_samples_untraced_in_one_batch(tiny_model, tiny_tok, monkeypatch,
                                                                               untraced):
    """By default the k temperature samples are traced and one at a time (the earlier reports'
    draws); untraced_samples decodes them untraced and speculatively in one batch (the same
    distribution). The greedy kernel is untraced either way."""
    from sparserl_compile.policy import decode

    seen = []
    real = decode.generate

    def spy(*a, config=None, **kw):
        seen.append((config.greedy, config.trace, config.batch_drafts, kw.get("k")))
        return real(*a, config=config, **kw)

    monkeypatch.setattr(decode, "generate", spy)
    pb = RLProblem(banded(32, 1), "spmv", "f32", 1, "banded", reference_us=40.0, best_space_us=10.0)
    st = evaluate_policy(tiny_model, tiny_tok, [("banded", pb)], _all_correct, k=3, temperature=1.0,
                         max_new_tokens=12, constrained=True, untraced_samples=untraced)["banded"]
    assert seen == [(True, False, False, 1), (False, not untraced, untraced, 3)]
    assert st.summary()["samples"] == 4
