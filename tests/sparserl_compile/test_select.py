"""select: the decision rule (as a pure function over sandbox results) and choose end to end."""

from __future__ import annotations

from dataclasses import replace

import pytest

from faults import FAULTS, GOOD, candidate
from sparserl_compile import matrices, structure
from sparserl_compile.contract import Candidate, parse_header
from sparserl_compile.problem import Problem
from sparserl_compile.sandbox import SandboxResult
from sparserl_compile.select import Evaluation, choose, decide
from test_verify import needs_simt


def _problem(m, op="spmv", n=1):
    return Problem(op, "f32", n, m.shape[0], m.shape[1], m.nnz, m.indptr, m.indices,
                   structure.fingerprint(m.indptr, m.indices, m.shape), "cpu")


def _timed(us):
    b = {"median_us": us, "p10_us": us, "p90_us": us, "method": "events", "l2_flushed": True, "reps": 3}
    return SandboxResult("ok", bench=b)


def _ref(us):
    return SandboxResult("ok", reference={"int32": {"median_us": us}, "int64": {"median_us": us * 1.1}})


def _hot(us):
    """A candidate timed both ways, hot at half its flushed time (both below the reference's)."""
    return replace(_timed(us), graph_bench={"median_us": us / 2, "method": "graph", "l2_flushed": False})


def _ref_hot(us):
    r = _ref(us)
    return replace(r, reference={**r.reference, "int32_graph": {"median_us": us / 2, "method": "graph"}})


CANDS = [candidate(GOOD), candidate(GOOD.replace("float acc", "float  acc"))]


def test_fastest_verified_candidate_wins_when_it_beats_the_reference():
    ev = Evaluation((_hot(9.0), _hot(7.0)), _ref_hot(10.0), 1.0)
    c = decide(CANDS, ev)
    assert c.candidate is CANDS[1] and c.kernel_us == 7.0 and c.reference_us == 10.0
    assert c.speedup == pytest.approx(10 / 7)


def test_the_faster_of_the_two_reference_timings_counts():
    """cuSPARSE is timed before and after the candidates; a slow first timing (the GPU still
    clocking up) must not let a kernel through that only beats that bad measurement."""
    ev = Evaluation((_hot(9.0), _hot(7.0)), _ref_hot(10.0), 1.0, reference_again=_ref_hot(6.0))
    c = decide(CANDS, ev)
    assert ev.reference_us() == 6.0 and c.candidate is None and c.reference_us == 6.0
    assert c.record["reference_runs_us"] == [10.0, 6.0]
    slower_again = Evaluation((_hot(9.0), _hot(7.0)), _ref_hot(10.0), 1.0, reference_again=_ref_hot(12.0))
    assert decide(CANDS, slower_again).candidate is CANDS[1] and slower_again.reference_us() == 10.0
    failed_again = Evaluation((_timed(7.0),), _ref(10.0), 1.0, reference_again=SandboxResult("timeout"))
    assert failed_again.reference_us() == 10.0 and failed_again.reference_runs_us() == [10.0, None]


def test_a_reference_whose_timing_failed_keeps_the_reference():
    """A kernel is kept only where it is shown faster than the reference: a reference job that
    crashed or timed out shows nothing, so the reference stays. A reference job that ran but
    found no cuSPARSE path for the product (no timing, nothing else the user could run) does
    not block the kernel."""
    for failed in (SandboxResult("timeout"), SandboxResult("crashed", error="worker died")):
        c = decide(CANDS, Evaluation((_hot(9.0), _hot(7.0)), failed, 1.0))
        assert c.candidate is None and c.kernel_us == 7.0 and "timing failed" in c.record["rule"]
        assert c.record["transient"]  # not written to the disk cache (miss._put)
    assert "worker died" in decide(CANDS, Evaluation((_hot(7.0),), SandboxResult("crashed", error="worker died"),
                                                     1.0)).record["rule"]
    unsupported = SandboxResult("ok", reference={})
    assert decide(CANDS, Evaluation((_hot(9.0), _hot(7.0)), unsupported, 1.0)).candidate is CANDS[1]


def _graphed(us, graph_us):
    return replace(_timed(us), graph_bench={"median_us": graph_us, "method": "graph", "l2_flushed": False})


def _ref_graphed(us, graph_us):
    r = _ref(us)
    return replace(r, reference={**r.reference, "int32_graph": {"median_us": graph_us, "method": "graph"}})


def test_a_candidate_must_beat_the_reference_hot_as_well_as_flushed():
    """Winning with the L2 flushed is not enough: a kernel slower than cuSPARSE with cached
    operands would be slower per call in an eager loop. Every product size is timed both
    ways, and the margin applies to both."""
    ev = Evaluation((_graphed(7.0, 5.0),), _ref_graphed(10.0, 4.0), 1.0)
    c = decide(CANDS[:1], ev)
    assert c.candidate is None and c.kernel_us == 7.0 and ev.reference_graph_us() == 4.0
    assert "hot L2" in c.record["rule"] and c.record["best_hot_us"] == 5.0
    assert c.record["reference_graph_us"] == c.record["reference_hot_us"] == 4.0
    # a slower-flushed candidate that still beats the reference and also wins hot is kept instead
    ev = Evaluation((_graphed(7.0, 5.0), _graphed(9.0, 3.5)), _ref_graphed(10.0, 4.0), 1.0)
    c = decide(CANDS, ev)
    assert c.candidate is CANDS[1] and c.record["chosen_hot_us"] == 3.5
    # ... but not one that does not beat the reference flushed by the margin
    ev = Evaluation((_graphed(7.0, 5.0), _graphed(9.9, 3.5)), _ref_graphed(10.0, 4.0), 1.0)
    assert decide(CANDS, ev).candidate is None
    # nor one within the margin hot (3.9 is not below 0.97 x 4.0)
    assert decide(CANDS[:1], Evaluation((_graphed(7.0, 3.9),), _ref_graphed(10.0, 4.0), 1.0)).candidate is None
    # a long product (hundreds of us) is held to the same rule
    ev = Evaluation((_graphed(700.0, 650.0),), _ref_graphed(1000.0, 600.0), 1.0)
    assert decide(CANDS[:1], ev).candidate is None
    # the faster of the reference's two hot timings counts, as for its flushed timings
    ev = Evaluation((_graphed(7.0, 3.8),), _ref_graphed(10.0, 5.0), 1.0, reference_again=_ref_graphed(10.0, 3.9))
    assert ev.reference_graph_us() == 3.9 and decide(CANDS[:1], ev).candidate is None
    # a reference cuSPARSE times with int64 indices only: its int64 hot figure counts
    int64_only = SandboxResult("ok", reference={"int64": {"median_us": 10.0},
                                                "int64_graph": {"median_us": 4.0, "method": "graph"}})
    ev = Evaluation((_graphed(7.0, 5.0),), int64_only, 1.0)
    assert ev.reference_us() == 10.0 and ev.reference_graph_us() == 4.0 and decide(CANDS[:1], ev).candidate is None
    # a missing hot figure on either side keeps the reference: nothing shows the kernel wins there
    assert decide(CANDS[:1], Evaluation((_timed(7.0),), _ref_graphed(10.0, 4.0), 1.0)).candidate is None
    assert decide(CANDS[:1], Evaluation((_graphed(7.0, 3.0),), _ref(10.0), 1.0)).candidate is None
    assert decide(CANDS[:1], Evaluation((_graphed(7.0, 3.0),), _ref_graphed(10.0, 4.0), 1.0)).candidate is CANDS[0]


class _ScriptedPool:
    """A SandboxPool stand-in: reference jobs time ``refs`` in turn, candidates ``kernel``."""

    def __init__(self, refs, kernel):
        self.refs, self.kernel, self.jobs = list(refs), kernel, []

    def run(self, job, pattern, **kw):
        self.jobs.append("reference" if job.candidate is None else "candidate")
        self.widths = getattr(self, "widths", []) + [job.widths]
        return self.refs.pop(0) if job.candidate is None else self.kernel


def test_evaluate_times_the_reference_again_only_when_a_candidate_was_timed():
    from sparserl_compile.select import evaluate

    prob = _problem(matrices.stencil2d(4))
    pool = _ScriptedPool([_ref(10.0), _ref(8.0)], _timed(9.0))
    ev = evaluate(prob, CANDS, pool=pool, executor="gpu")
    assert pool.jobs == ["reference", "candidate", "candidate", "reference"]
    assert ev.reference_us() == 8.0 and decide(CANDS, ev).candidate is None  # 9 us does not beat 8
    pool = _ScriptedPool([_ref(10.0)], SandboxResult("wrong", "error_bound: ..."))
    ev = evaluate(prob, CANDS, pool=pool, executor="gpu")
    assert pool.jobs == ["reference", "candidate", "candidate"] and ev.reference_again is None


def test_evaluate_verifies_each_candidate_at_every_width_of_its_bucket():
    """A plan is keyed by the width bucket: each candidate's job carries the widths it will
    serve there (the call's first, multiples of its n_align only), the reference's none."""
    from sparserl_compile import kernels
    from sparserl_compile.select import evaluate
    from sparserl_compile.verify import widths_to_verify

    m = matrices.stencil2d(4)
    cands = [c for c in kernels.space("spmm", "f32", structure=m) if c.family == "csr_rowgroup"]
    one = next(c for c in cands if c.header.launch.n_align == 1)
    four = next(c for c in cands if c.header.launch.n_align == 4)
    pool = _ScriptedPool([_ref(10.0)], SandboxResult("wrong", "error_bound: ..."))
    evaluate(_problem(m, "spmm", 48), [one, four], pool=pool, executor="gpu")
    assert pool.widths[0] == ()
    assert pool.widths[1] == widths_to_verify("spmm", 48) and len(pool.widths[1]) == 32
    assert pool.widths[2] == widths_to_verify("spmm", 48, 4) and pool.widths[2][0] == 48
    pool = _ScriptedPool([], SandboxResult("wrong", "align: ..."))
    evaluate(_problem(m, "spmm", 50), [four], pool=pool, executor="cpu")
    assert pool.widths == [(50,)]  # 50 does not suit n_align=4: the align check rejects it


class _ParallelPool:
    """A pool of several workers: verification jobs (untimed) come through ``map``, each
    answered from ``verified`` in turn; timed jobs through ``run``."""

    workers = 4

    def __init__(self, verified, kernel_us):
        self.verified, self.kernel_us, self.jobs = verified, kernel_us, []

    def map(self, jobs, pattern, **kw):
        assert all(not j.time and j.value_sets == 3 for j in jobs)  # every check, nothing timed
        assert all(j.widths for j in jobs)  # at every width the plan serves
        self.jobs.append(("verify", len(jobs)))
        return [SandboxResult("ok", phases={"prepare": 0.5}) if ok else SandboxResult("wrong", "error_bound: x")
                for ok in self.verified]

    def run(self, job, pattern, **kw):
        if job.candidate is None:
            self.jobs.append("reference")
            return _ref_hot(10.0)
        assert job.time and job.value_sets == 1 and job.widths == ()  # re-checked on one set at n, then timed
        self.jobs.append("time")
        r = _hot(self.kernel_us.pop(0))
        return SandboxResult(r.kind, bench=r.bench, graph_bench=r.graph_bench, phases={"prepare": 0.1, "time": 0.2})


def test_parallel_verify_checks_all_at_once_then_times_the_verified_in_turn():
    from sparserl_compile.select import evaluate

    prob = _problem(matrices.stencil2d(4))
    cands = CANDS + [candidate(GOOD.replace("float acc", "float   acc"))]
    pool = _ParallelPool([True, False, True], [9.0, 7.0])
    ev = evaluate(prob, cands, pool=pool, executor="gpu", parallel_verify=True)
    # nothing is timed while other jobs run: all verified first, then the reference, the
    # verified candidates and the reference again, one at a time
    assert pool.jobs == [("verify", 3), "reference", "time", "time", "reference"]
    assert [r.kind for r in ev.results] == ["ok", "wrong", "ok"]
    assert [r.kernel_us for r in ev.results] == [9.0, None, 7.0]
    # a timed candidate keeps its full verification's phases beside its timing and re-check
    assert ev.results[0].phases == {"prepare": 0.5, "time": 0.2, "recheck": 0.1}
    assert set(ev.parts) == {"verify", "reference", "time"} and decide(cands, ev).candidate is cands[2]
    # one candidate, or a pool of one worker: the default order
    pool = _ScriptedPool([_ref(10.0), _ref(8.0)], _timed(9.0))
    pool.workers = 1
    evaluate(prob, cands, pool=pool, executor="gpu", parallel_verify=True)
    assert pool.jobs == ["reference", "candidate", "candidate", "candidate", "reference"]


def test_generated_kernels_are_told_apart_in_the_record():
    """Policy kernels match no family point: their names carry the format and a digest of the
    source, so a record (and pregen's ranking by name) never confuses two of them."""
    gen = [Candidate(c.source, c.header) for c in CANDS]  # family None: what the policy proposes
    names = [c.name for c in gen]
    assert names[0] != names[1] and all(n.startswith("generated[csr]#") for n in names)
    assert Candidate(GOOD, parse_header(GOOD)).name == names[0]  # the same source, the same name
    c = decide(gen, Evaluation((_hot(9.0), _hot(7.0)), _ref_hot(10.0), 1.0))
    assert c.record["chosen"] == names[1] and c.record["chosen_us"] == 7.0
    assert [r["name"] for r in c.record["candidates"]] == names


def test_reference_wins_within_the_margin_and_failures_never_win():
    ev = Evaluation((_timed(9.8), SandboxResult("wrong", "error_bound: ...")), _ref(10.0), 1.0)
    c = decide(CANDS, ev)
    assert c.candidate is None and "reference wins" in c.record["rule"]
    ev = Evaluation((SandboxResult("timeout"), SandboxResult("impossible")), _ref(10.0), 1.0)
    assert decide(CANDS, ev).candidate is None


def test_untimed_rule_is_first_verified_in_provider_order():
    ev = Evaluation((SandboxResult("compile_error"), SandboxResult("ok"), SandboxResult("ok")), None, 1.0)
    three = [candidate(FAULTS["compile_error"].source), *CANDS]
    c = decide(three, ev)
    assert c.candidate is CANDS[0] and c.kernel_us is None
    assert [r["kind"] for r in c.record["candidates"]] == ["compile_error", "ok", "ok"]


def test_no_candidates_means_reference():
    assert choose(_problem(matrices.stencil2d(4)), [], executor="cpu").candidate is None


@needs_simt
def test_choose_on_cpu_picks_the_verified_candidate(shared_matrices):
    m = matrices.load_npz(shared_matrices / "add32.npz")
    cands = [candidate(FAULTS["compile_error"].source), candidate(FAULTS["wrong_answer"].source), candidate(GOOD)]
    c = choose(_problem(m), cands, executor="cpu", timeout_s=60)
    assert c.candidate is cands[2] and c.cubin
    assert [r["kind"] for r in c.record["candidates"]] == ["compile_error", "wrong", "ok"]
    # where the time went, per candidate (the cold-start benchmark reports it)
    ok = c.record["candidates"][2]["phases"]
    assert set(ok) >= {"prepare", "values", "runs"} and ok["prepare"] > 0 and ok["runs"] > 0
    assert sum(ok.values()) <= c.record["candidates"][2]["wall_s"] + 1e-3


@pytest.mark.gpu
def test_choose_on_gpu_times_against_cusparse():
    m = matrices.stencil2d(300)
    c = choose(_problem(m), [candidate(GOOD)], executor="gpu", timeout_s=120)
    rec = c.record["candidates"][0]
    assert rec["kind"] == "ok" and rec["kernel_us"] > 0 and c.reference_us > 0
    print(f"\nstencil2d_300 scalar CSR {rec['kernel_us']:.1f} us vs torch.sparse {c.reference_us:.1f} us")


@pytest.mark.gpu
def test_parallel_verify_agrees_with_the_default_order_on_gpu():
    """Verified all at once then timed in turn, or each verified and timed in turn: the same
    outcome for every candidate, and every verified one timed."""
    from sparserl_compile.sandbox import SandboxPool
    from sparserl_compile.select import evaluate

    m = matrices.stencil2d(300)
    wrong = GOOD.replace("acc +=", "acc -=", 1)
    assert wrong != GOOD
    cands = [candidate(GOOD), candidate(wrong), candidate(GOOD.replace("float acc", "float  acc"))]
    with SandboxPool(3, timeout_s=120) as pool:
        seq = evaluate(_problem(m), cands, pool=pool, executor="gpu")
        par = evaluate(_problem(m), cands, pool=pool, executor="gpu", parallel_verify=True)
    assert [r.kind for r in seq.results] == [r.kind for r in par.results] == ["ok", "wrong", "ok"]
    assert all(r.kernel_us > 0 for r in par.results if r.ok) and par.reference_us() > 0
    assert set(par.parts) == {"verify", "reference", "time"}
    print(f"\nstencil2d_300, 3 candidates: default order {seq.seconds:.2f} s, parallel verify {par.seconds:.2f} s")


def test_records_of_older_rules_are_told_apart():
    from sparserl_compile.select import outdated

    c = decide(CANDS, Evaluation((_hot(9.0), _hot(7.0)), _ref_hot(10.0), 1.0))
    assert outdated(c.record) is None
    old = {k: v for k, v in c.record.items() if k not in ("widths_verified", "reference_hot_us")}
    assert "one width" in outdated(old)
    assert "hot L2" in outdated({**old, "widths_verified": [1]})
    assert outdated({"chosen": None, "candidates": [{}], "rule": "reference wins"}) is None
    untimed = decide(CANDS, Evaluation((SandboxResult("ok"),), None, 1.0))
    assert outdated(untimed.record) is None and untimed.record["widths_verified"] == []


# ---------------------------------------------------------------- the dense product


def _ref_dense(ref_us, ref_hot, dense_us, dense_hot):
    """A reference job that also timed the dense product."""
    return replace(_ref_graphed(ref_us, ref_hot),
                   dense={"dense": {"median_us": dense_us}, "dense_graph": {"median_us": dense_hot}})


def test_dense_wins_where_it_beats_the_reference_and_no_kernel_is_kept():
    ev = Evaluation((_graphed(12.0, 6.0),), _ref_dense(10.0, 5.0, 2.0, 1.0), 1.0)
    c = decide(CANDS[:1], ev)
    assert c.dense and c.outcome == "dense" and c.candidate is None and c.cubin is None
    assert c.dense_us == 2.0 and c.reference_us == 10.0
    rec = c.record
    assert rec["outcome"] == "dense" and rec["chosen"] is None and rec["dense_us"] == 2.0 and rec["dense_hot_us"] == 1.0
    assert "dense product wins" in rec["rule"] and "reference wins" in rec["rule_without_dense"]
    assert rec["selection_version"] == 2
    # no candidate verified at all: the dense product against the reference alone
    c = decide(CANDS[:1], Evaluation((SandboxResult("wrong", "error_bound"),), _ref_dense(10.0, 5.0, 2.0, 1.0), 1.0))
    assert c.dense and c.record["kept_kernel"] is None


def test_dense_must_beat_the_kept_kernel_too_by_the_margin_both_ways():
    kernel = _graphed(4.0, 2.0)  # beats the reference (10 / 5) both ways: kept without dense
    assert decide(CANDS[:1], Evaluation((kernel,), _ref_graphed(10.0, 5.0), 1.0)).candidate is CANDS[0]
    faster = decide(CANDS[:1], Evaluation((kernel,), _ref_dense(10.0, 5.0, 3.0, 1.5), 1.0))
    assert faster.dense and faster.record["kept_kernel"] == CANDS[0].name and faster.kernel_us == 4.0
    for dense_us, dense_hot, why in [(3.95, 1.5, "flushed"), (3.0, 1.99, "hot")]:  # within the 3 % margin
        c = decide(CANDS[:1], Evaluation((kernel,), _ref_dense(10.0, 5.0, dense_us, dense_hot), 1.0))
        assert not c.dense and c.candidate is CANDS[0] and c.outcome == "kernel" and c.dense_us == dense_us
        assert c.record["outcome"] == "kernel" and why in c.record["dense_rule"] and "kernel" in c.record["dense_rule"]


def test_dense_loses_to_the_reference_within_the_margin_or_without_a_hot_figure():
    c = decide(CANDS[:1], Evaluation((_timed(20.0),), _ref_dense(10.0, 5.0, 9.8, 1.0), 1.0))
    assert not c.dense and c.outcome == "reference" and "the reference is kept" in c.record["dense_rule"]
    no_hot = replace(_ref_graphed(10.0, 5.0), dense={"dense": {"median_us": 1.0}})
    c = decide(CANDS[:1], Evaluation((_timed(20.0),), no_hot, 1.0))
    assert not c.dense and "both ways" in c.record["dense_rule"]
    failed = replace(_ref_graphed(10.0, 5.0), dense={"error": "OutOfMemoryError: CUDA out of memory"})
    c = decide(CANDS[:1], Evaluation((_timed(20.0),), failed, 1.0))
    assert not c.dense and c.record["dense_us"] is None and "out of memory" in c.record["dense_error"]


def test_the_faster_of_the_two_dense_timings_counts_and_untimed_records_say_nothing_of_dense():
    ev = Evaluation((_graphed(4.0, 2.0),), _ref_dense(10.0, 5.0, 5.0, 2.5), 1.0,
                    reference_again=_ref_dense(10.0, 5.0, 3.0, 1.5))
    assert ev.dense_us() == 3.0 and ev.dense_us(hot=True) == 1.5 and decide(CANDS[:1], ev).dense
    plain = decide(CANDS[:1], Evaluation((_graphed(4.0, 2.0),), _ref_graphed(10.0, 5.0), 1.0))
    assert "dense_us" not in plain.record and plain.dense_us is None and plain.record["outcome"] == "kernel"


def _weight_problem(density=0.5, rows=64, cols=32, dtype="bf16", op="spmm", n=16):
    import numpy as np
    import scipy.sparse as sp

    m = sp.random(rows, cols, density=density, format="csr", random_state=0, dtype=np.float32)
    m.sort_indices()
    return Problem(op, dtype, n, rows, cols, m.nnz, m.indptr.astype(np.int32), m.indices.astype(np.int32),
                   structure.fingerprint(m.indptr, m.indices, m.shape), "sm_90")


def test_dense_eligibility_is_decided_from_the_structure_and_the_settings():
    from sparserl_compile.config import RuntimeConfig
    from sparserl_compile.select import dense_unsuitable

    p = _weight_problem()
    assert dense_unsuitable(p) is None  # half the 64 x 32 entries, 4 KiB dense in bfloat16
    assert "below dense_min_density" in dense_unsuitable(_weight_problem(density=0.005, rows=400, cols=400))
    assert "over dense_max_bytes 4095" in dense_unsuitable(p, RuntimeConfig(dense_max_bytes=4095))
    assert dense_unsuitable(p, RuntimeConfig(dense_max_bytes=4096)) is None
    f32 = _weight_problem(dtype="f32")  # the same pattern takes twice the bytes in float32
    assert dense_unsuitable(f32, RuntimeConfig(dense_max_bytes=4096)) is not None
    assert dense_unsuitable(p, RuntimeConfig(dense_max_bytes=0)) is not None


def test_dense_settings_are_validated_and_read_from_the_environment(monkeypatch):
    from sparserl_compile.config import RuntimeConfig

    for bad in (dict(dense_min_density=1.5), dict(dense_min_density=True), dict(dense_max_bytes=-1),
                dict(dense_max_bytes=2.5)):
        with pytest.raises(ValueError, match="dense_"):
            RuntimeConfig(**bad)
    monkeypatch.setenv("SPARSERL_DENSE_MAX_BYTES", "2e6")
    monkeypatch.setenv("SPARSERL_DENSE_MIN_DENSITY", "0.25")
    cfg = RuntimeConfig()
    assert cfg.dense_max_bytes == 2_000_000 and cfg.dense_min_density == 0.25
    monkeypatch.setenv("SPARSERL_DENSE_MAX_BYTES", "one gig")
    with pytest.raises(ValueError, match="SPARSERL_DENSE_MAX_BYTES='one gig' is not an integer"):
        RuntimeConfig()


class _DensePool(_ScriptedPool):
    """Also records whether each job asked for the dense product."""

    def run(self, job, pattern, **kw):
        self.dense = getattr(self, "dense", []) + [job.dense]
        return super().run(job, pattern, **kw)


def test_choose_times_the_dense_product_only_where_it_is_a_candidate(monkeypatch):
    from sparserl_compile import config

    p = _weight_problem()
    pool = _DensePool([_ref_dense(10.0, 5.0, 2.0, 1.0), _ref_dense(10.0, 5.0, 2.0, 1.0)], _graphed(12.0, 6.0))
    c = choose(p, CANDS[:1], executor="gpu", pool=pool)
    assert pool.jobs == ["reference", "candidate", "reference"] and pool.dense == [True, False, True]
    assert c.dense and c.record["executor"] == "gpu" and "dense_not_timed" not in c.record
    # no candidate at all: the dense product is still timed against the reference
    pool = _DensePool([_ref_dense(10.0, 5.0, 2.0, 1.0)], None)
    c = choose(p, [], executor="gpu", pool=pool)
    assert pool.jobs == ["reference"] and c.dense
    # not a candidate by the settings: not asked for, and the record says why
    monkeypatch.setattr(config, "current", config.RuntimeConfig(dense_max_bytes=0))
    pool = _DensePool([_ref_graphed(10.0, 5.0), _ref_graphed(10.0, 5.0)], _graphed(12.0, 6.0))
    c = choose(p, CANDS[:1], executor="gpu", pool=pool)
    assert pool.dense == [False, False, False] and not c.dense and "dense_max_bytes" in c.record["dense_not_timed"]
    assert choose(p, [], executor="gpu", pool=_DensePool([], None)).record["rule"] == "no candidates proposed"


def test_untimed_selection_never_keeps_the_dense_product():
    c = choose(_weight_problem(), [], executor="cpu")
    assert not c.dense and c.candidate is None and c.record["outcome"] == "reference"


@pytest.mark.gpu
def test_choose_on_gpu_times_the_dense_product_in_the_reference_jobs():
    p = _weight_problem(density=0.5, rows=1024, cols=1024, dtype="f32", op="spmv", n=1)
    c = choose(p, [candidate(GOOD)], executor="gpu", timeout_s=120)
    rec = c.record
    assert rec["dense_us"] > 0 and rec["dense_hot_us"] > 0 and "dense_error" not in rec
    assert rec["outcome"] == c.outcome and (c.outcome == "dense") == c.dense
    print(f"\n1024 x 1024 half full, SpMV f32: {rec['outcome']} ({rec['rule']}); reference {c.reference_us:.1f} us, "
          f"dense {rec['dense_us']:.1f} us")
