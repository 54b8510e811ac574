import pytest

from sparserl_compile.training.rewards import (KernelOutcome, compile_reward, correctness_only_reward, correctness_reward,
                              hierarchical_reward, speed_reward)

BAD = KernelOutcome(False, False, False)
NOCOMP = KernelOutcome(True, False, False)
WRONG = KernelOutcome(True, True, False)
SLOW = KernelOutcome(True, True, True, us=100.0, reference_us=30.0, best_space_us=10.0)
FAST = KernelOutcome(True, True, True, us=10.0, reference_us=30.0, best_space_us=10.0)


def test_hierarchy_is_strict():
    r = [hierarchical_reward(o) for o in (BAD, NOCOMP, WRONG, SLOW, FAST)]
    assert r == sorted(r) and len(set(r)) == 5
    assert hierarchical_reward(SLOW) > hierarchical_reward(WRONG) + 0.99  # any correct beats wrong


def test_speed_term():
    assert speed_reward(WRONG) is None
    assert speed_reward(SLOW) == pytest.approx(0.1)  # slower than cuSPARSE: only the space term
    assert speed_reward(FAST) == pytest.approx(1.0 + 1.584962500721156)  # log2(3) + at the space best
    assert speed_reward(KernelOutcome(True, True, True)) is None  # correct but untimed


def test_parts_and_ablation():
    assert [compile_reward(o) for o in (BAD, NOCOMP, WRONG)] == [-1.0, -0.5, 0.0]
    assert [correctness_reward(o) for o in (NOCOMP, WRONG, FAST)] == [None, 0.0, 1.0]
    assert correctness_only_reward(FAST) == correctness_only_reward(SLOW) == 1.0
    assert correctness_only_reward(WRONG) == 0.0


def test_cpu_evaluator_scores_every_sample_in_order():
    """NVRTC + the CPU executor: a correct kernel after a broken one and before a wrong one
    each get their own outcome (select.evaluate alone stops at the first verified one); a
    repeated source is run once and its copies share its outcome."""
    from sparserl_compile.kernels import render
    from sparserl_compile.matrices import banded
    from sparserl_compile.training.rewards import RLProblem, SandboxEvaluator

    m = banded(40, 2)
    good = render("csr_scalar", "spmv", "f32", {"block": 64}, m)
    good = good if isinstance(good, str) else good.source
    wrong = good.replace("acc = fmaf(", "acc = 2.0f * fmaf(", 1)
    assert wrong != good
    broken = good.replace("fmaf(", "fmaf_missing(", 1)
    ev = SandboxEvaluator("cpu", workers=1)
    runs = []
    run = ev.pool.run
    ev.pool.run = lambda job, *a, **kw: runs.append(job.candidate) or run(job, *a, **kw)
    try:
        out = ev(RLProblem(m, "spmv", "f32", 1, reference_us=20.0, best_space_us=5.0),
                 [broken, good, good, wrong, "no header", good])
    finally:
        ev.close()
    assert [(o.parsed, o.compiled, o.correct) for o in out] == [
        (True, False, False), (True, True, True), (True, True, True), (True, True, False), (False, False, False),
        (True, True, True)]
    assert len(runs) == 3 and out[1] is out[2] is out[5]  # broken, good and wrong, each once
    # where the call's seconds went (the CPU executor verifies, times nothing, has no reference)
    assert set(ev.last_seconds) == {"reference", "compile", "verify", "time", "other"}
    assert ev.last_seconds["verify"] > 0
    assert ev.last_seconds["time"] == ev.last_seconds["reference"] == ev.last_seconds["compile"] == 0


def test_cpu_evaluator_verifies_on_all_workers_at_once():
    """With two workers the samples are verified at once (``parallel_verify``, untimed on the
    CPU): the same outcomes, in order, as one after another."""
    from sparserl_compile.kernels import render
    from sparserl_compile.matrices import banded
    from sparserl_compile.training.rewards import RLProblem, SandboxEvaluator

    m = banded(40, 2)
    good = render("csr_scalar", "spmv", "f32", {"block": 64}, m)
    good = good if isinstance(good, str) else good.source
    wrong = good.replace("acc = fmaf(", "acc = 2.0f * fmaf(", 1)
    broken = good.replace("fmaf(", "fmaf_missing(", 1)
    ev = SandboxEvaluator("cpu", workers=2)
    mapped = []
    pool_map = ev.pool.map
    ev.pool.map = lambda jobs, *a, **kw: mapped.append(len(jobs)) or pool_map(jobs, *a, **kw)
    try:
        out = ev(RLProblem(m, "spmv", "f32", 1, reference_us=20.0), [broken, good, "no header", wrong, good])
    finally:
        ev.close()
    assert mapped == [3]  # broken, good and wrong, at once
    assert [(o.parsed, o.compiled, o.correct) for o in out] == [
        (True, False, False), (True, True, True), (False, False, False), (True, True, False), (True, True, True)]
    assert ev.last_seconds["verify"] > 0 and ev.last_seconds["time"] == ev.last_seconds["reference"] == 0


def test_sandbox_evaluator_starts_its_workers_before_the_first_reward():
    """The workers start when the evaluator is made (in the background, while the policy loads
    and decodes); the first reward runs on them. prestart=False leaves the start to the first use."""
    from sparserl_compile.kernels import render
    from sparserl_compile.matrices import banded
    from sparserl_compile.training.rewards import RLProblem, SandboxEvaluator

    m = banded(40, 2)
    good = render("csr_scalar", "spmv", "f32", {"block": 64}, m)
    good = good if isinstance(good, str) else good.source
    ev = SandboxEvaluator("cpu", workers=2)
    try:
        assert len(ev.pool._free) + ev.pool._spawning == 2
        ev.pool.start(wait=True, count=2)
        started = {w.proc.pid for w in ev.pool._free}
        out = ev(RLProblem(m, "spmv", "f32", 1, reference_us=20.0), [good])
        assert out[0].correct and {w.proc.pid for w in ev.pool._free} == started
    finally:
        ev.close()
    lazy = SandboxEvaluator("cpu", workers=2, prestart=False)
    assert not lazy.pool._free and lazy.pool._spawning == 0
    lazy.close()


def test_measured_evaluator_replays_h200_outcomes_and_delegates_the_rest():
    """A sample that is a measured point gets the H200 outcome of that exact source (whitespace
    aside); a failed point counts as wrong; anything else goes to the inner evaluator."""
    from sparserl_compile.kernels import render
    from sparserl_compile.matrices import banded
    from sparserl_compile.training.data import MatrixRef, SupervisionRecord, Variant
    from sparserl_compile.training.rewards import HeaderEvaluator, MeasuredEvaluator, RLProblem

    m = banded(40, 2)
    ref = MatrixRef(source="generated", generator="banded", kwargs=(("n", 40), ("half_bandwidth", 2)))
    rec = SupervisionRecord(ref, "spmv", "f32", 1, (Variant("csr_scalar", (("block", 64),), 7.0),
                                                     Variant("csr_scalar", (("block", 128),), None)),
                            reference_us=20.0)

    def src(block):
        out = render("csr_scalar", "spmv", "f32", {"block": block}, m)
        return out if isinstance(out, str) else out.source

    other = render("csr_vector", "spmv", "f32", {"block": 128, "tpr": 4}, m)
    other = other if isinstance(other, str) else other.source
    ev = MeasuredEvaluator([rec], inner=HeaderEvaluator())
    pb = RLProblem(m, "spmv", "f32", 1, ref.label, reference_us=20.0, best_space_us=7.0)
    out = ev(pb, [src(64).replace("\n", "\n  "), src(128), other, "no header"])
    assert (out[0].correct, out[0].us, out[0].reference_us) == (True, 7.0, 20.0)
    assert (out[1].compiled, out[1].correct) == (True, False)
    assert out[2].correct and out[2].us is None  # delegated: the header evaluator says ok, untimed
    assert not out[3].parsed
    assert (ev.replayed, ev.delegated) == (3, 1)
    assert hierarchical_reward(out[0]) > hierarchical_reward(out[2]) > hierarchical_reward(out[1])
