"""verify: static checks, the error bound, dtype helpers, and every fault kernel on both executors."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from faults import FAULTS, GOOD, SPMM_GOOD, candidate
from sparserl_compile import matrices, verify
from sparserl_compile.contract import ContractError


def _has_simt() -> bool:
    from sparserl_compile import simt

    return hasattr(simt, "compile_kernel")


needs_simt = pytest.mark.skipif(not _has_simt(), reason="sparserl_compile.simt (CPU executor) not built yet")


def _edge_cases():
    rng = np.random.default_rng(1)
    empty_rows = sp.csr_matrix(([1.0, 2.0], ([0, 5], [3, 1])), shape=(9, 7))
    one_row = sp.csr_matrix(rng.standard_normal((1, 50)))
    long_row = sp.lil_matrix((40, 3000))
    long_row[3, :] = 1.0
    long_row[7, 5] = 1.0
    return {"empty_rows": matrices.canonical(empty_rows), "nnz0": matrices.canonical(sp.csr_matrix((5, 4))),
            "one_row": matrices.canonical(one_row), "long_row": matrices.canonical(long_row),
            "rect": matrices.uniform_random(30, 200, 6, seed=3)}


def test_signature_check_accepts_the_contract_and_rejects_a_changed_type():
    verify.check_signature(GOOD, "spmv", "csr", "f32")
    with pytest.raises(ContractError, match="parameter types"):
        verify.check_signature(GOOD.replace("const float* __restrict__ x", "const double* __restrict__ x"),
                               "spmv", "csr", "f32")
    with pytest.raises(ContractError, match="parameter types"):
        verify.check_signature(GOOD, "spmm", "csr", "f32")


def test_header_mismatch_with_the_problem_is_a_contract_failure():
    r = verify.verify(candidate(GOOD), matrices.stencil2d(4), op="spmm", executor="cpu")
    assert not r.ok and r.failed == "header" and "op=spmv" in r.reason


def test_compile_error_is_reported_with_the_nvrtc_log():
    f = FAULTS["compile_error"]
    r = verify.verify(candidate(f.source), matrices.stencil2d(5), executor="cpu")
    assert not r.ok and r.failed in f.checks
    assert "undeclared_scale" in r.reason
    assert "header" in r.checks_passed


def test_align_rejects_widths_the_kernel_cannot_take():
    src = SPMM_GOOD.replace("n_align=1", "n_align=4")
    r = verify.verify(candidate(src), matrices.stencil2d(4), executor="cpu", n=6)
    assert not r.ok and r.failed == "align"


@needs_simt
@pytest.mark.parametrize("name", [k for k in FAULTS if k != "infinite_loop"])
def test_every_fault_kernel_is_rejected_for_its_reason_on_cpu(name):
    f = FAULTS[name]
    r = verify.verify(candidate(f.source), matrices.stencil2d(12), executor="cpu", static=f.static)
    assert not r.ok, name
    assert r.failed in f.checks, (name, r.reason)


def test_value_sets_are_shared_by_candidates_of_one_pattern_only():
    pat = verify.Pattern.of(matrices.stencil2d(12))
    wrong = FAULTS["wrong_answer"]
    assert verify.verify(candidate(GOOD), pat, executor="cpu").ok
    first = dict(verify._VALUE_SETS["sets"])
    assert list(first) == [0, 1, 2, "ranges", "nonfinite"]
    # a wrong kernel after a good one on the same pattern still fails, on the shared sets
    r = verify.verify(candidate(wrong.source), pat, executor="cpu", static=wrong.static)
    assert not r.ok and r.failed in wrong.checks
    assert all(verify._VALUE_SETS["sets"][s] is first[s] for s in first)
    other = verify.Pattern.of(matrices.stencil2d(13))
    assert verify.verify(candidate(GOOD), other, executor="cpu").ok
    assert verify._VALUE_SETS["pattern"] is other
    assert verify._VALUE_SETS["sets"][0].host()[0].shape == (169,)
    verify.clear_value_sets()
    assert verify._VALUE_SETS["pattern"] is None and not verify._VALUE_SETS["sets"]


def test_output_checks_read_tensors_as_they_read_arrays():
    """``_check_run`` gives the same verdicts on tensors (the GPU path) as on numpy arrays."""
    torch = pytest.importorskip("torch")
    ref = np.array([1.0, -2.0, 3.0])
    bound = np.full(3, 1e-6)
    cases = {"ok": (ref + 1e-7, None), "written": (np.array([1.0, np.nan, 3.0]), "written"),
             "error_bound": (ref + np.array([0, 1e-3, 0]), "error_bound")}
    for name, (y, failed) in cases.items():
        for conv in (np.asarray, torch.from_numpy):
            run = verify._Run(conv(y), None, True, True)
            try:
                verify._check_run(run, verify._Expect(conv(ref), conv(bound), conv(abs(ref)), False), "set 0")
                got = None
            except verify._Fail as f:
                got = f.check
                assert "output 1" in f.reason, f.reason
            assert got == failed, (name, conv)
    assert verify._same_bits(torch.tensor([1, 2]), torch.tensor([1, 2]))
    assert not verify._same_bits(torch.tensor([1, 2]), torch.tensor([1, 3]))
    assert verify._max_rel_err(torch.tensor([1.5]), torch.tensor([1.0]), torch.tensor([2.0])) == 0.25


def test_nonfinite_outputs_must_be_where_the_reference_has_them():
    """NaN where the reference is NaN, inf of the same sign where it is inf, nothing non-finite
    elsewhere; a padded format may also give NaN where its padding meets a non-finite x."""
    torch = pytest.importorskip("torch")
    inf, nan = float("inf"), float("nan")
    ref = np.array([nan, inf, -inf, 2.0])
    bound = np.full(4, 1e-6)
    cases = {"ok": ([nan, inf, -inf, 2.0], None, None), "dropped nan": ([0.0, inf, -inf, 2.0], None, "nonfinite"),
             "wrong sign": ([nan, -inf, -inf, 2.0], None, "nonfinite"),
             "nan for finite": ([nan, inf, -inf, nan], None, "nonfinite"),
             "inf for finite": ([nan, inf, -inf, inf], None, "nonfinite"),
             "padding nan": ([nan, nan, -inf, nan], [False, True, False, True], None),
             "padding elsewhere": ([nan, inf, -inf, nan], [True, True, True, False], "nonfinite"),
             "finite but wrong": ([nan, inf, -inf, 2.5], None, "error_bound")}
    for name, (y, lenient, failed) in cases.items():
        for conv in (np.asarray, torch.from_numpy):
            len_ = None if lenient is None else conv(np.array(lenient))
            run = verify._Run(conv(np.array(y)), None, True, True)
            try:
                verify._check_run(run, verify._Expect(conv(ref), conv(bound), conv(abs(ref)), True, len_), "set x")
                got = None
            except verify._Fail as f:
                got = f.check
            assert got == failed, (name, conv, got)


def test_widths_cover_every_width_of_the_bucket_the_kernel_can_take():
    assert verify.widths_to_verify("spmv", 1) == (1,)
    assert verify.widths_to_verify("spmm", 1) == (1,)
    assert verify.widths_to_verify("spmm", 2) == (2,)
    assert verify.widths_to_verify("spmm", 3) == (3, 4)
    w = verify.widths_to_verify("spmm", 48)
    assert w[0] == 48 and sorted(w) == list(range(33, 65))
    assert verify.widths_to_verify("spmm", 48, n_align=4) == (48, 36, 40, 44, 52, 56, 60, 64)
    w = verify.widths_to_verify("spmm", 200)
    assert sorted(w) == list(range(129, 257))  # every width up to the buckets GNNs use
    big = verify.widths_to_verify("spmm", 1500, n_align=2)
    assert big[0] == 1500 and 1026 in big and 2048 in big and all(x % 2 == 0 for x in big)
    assert {x % verify.WIDTH_PERIOD for x in big} == set(range(0, verify.WIDTH_PERIOD, 2))
    assert len(big) <= verify.WIDTH_PERIOD // 2 + 3


@needs_simt
def test_every_width_passed_is_recorded_and_a_failing_width_named():
    r = verify.verify(candidate(SPMM_GOOD), matrices.stencil2d(6), executor="cpu", n=5,
                      widths=verify.widths_to_verify("spmm", 5))
    assert r.ok and r.widths == (5, 6, 7, 8) and r.to_dict()["widths"] == [5, 6, 7, 8]
    assert "mmap" in r.oob and r.sets == (0, 1, 2, "ranges", "nonfinite")
    only8 = SPMM_GOOD.replace("for (int c = 0; c < n; c++)", "for (int c = 0; c < 8; c++)")
    r = verify.verify(candidate(only8), matrices.stencil2d(6), executor="cpu", n=8,
                      widths=verify.widths_to_verify("spmm", 8))
    assert not r.ok and r.widths == (8,) and "at n=5" in r.reason, r.reason  # its rows overlap at n=5
    assert r.failed == "race"
    with pytest.raises(ValueError, match="first width"):
        verify.verify(candidate(SPMM_GOOD), matrices.stencil2d(6), executor="cpu", n=5, widths=(6, 5))


@needs_simt
def test_stale_output_check_calls_twice_into_one_unpoisoned_buffer():
    keeps = GOOD.replace("  if (row < n_rows) {\n", "  if (row < n_rows) {\n    if (y[row] == y[row]) { return; }\n", 1)
    assert keeps != GOOD
    r = verify.verify(candidate(keeps), matrices.stencil2d(8), executor="cpu")
    assert not r.ok and r.failed == "stale" and "already held" in r.reason, r.reason
    assert {"error_bound", "deterministic"} <= set(r.checks_passed) or r.checks_passed[-1] == "compile"


@needs_simt
def test_padded_formats_pass_where_their_padding_meets_inf_and_skipping_formats_need_no_leniency():
    """DIA multiplies its padding zeros (0 * inf = NaN where x is inf): accepted there only;
    ELL skips its padding and must match the reference exactly."""
    from sparserl_compile import kernels

    from sparserl_compile import formats

    m = matrices.banded(120, 2, fill=0.8, seed=1)  # a band with holes: DIA pads them with zeros
    for fam in ("dia", "ell"):
        c = next(c for c in kernels.space("spmv", "f32", structure=m) if c.family == fam)
        r = verify.verify(c, m, executor="cpu")
        assert r.ok, (fam, r.reason)
    fd = formats.convert(m.indptr, m.indices, m.shape, "dia", {})
    d, i = np.divmod(np.arange(fd.value_map.size), 120)
    col = i + fd.arrays["offsets"][d]
    expect = int(((fd.value_map < 0) & (col >= 0) & (col < 120)).sum())
    pad = verify.padding_pattern(fd)
    assert expect > 0 and pad.nnz == expect
    assert not pad.multiply(sp.csr_matrix((np.ones(m.nnz), m.indices, m.indptr), shape=m.shape)).nnz
    assert verify.padding_pattern(formats.convert(m.indptr, m.indices, m.shape, "ell", {})) is None
    bsr = formats.convert(m.indptr, m.indices, m.shape, "bsr", {"R": 4, "C": 4})
    bpad = verify.padding_pattern(bsr)
    assert bpad.nnz + m.nnz == int((bsr.value_map >= -1).sum()) - _outside(bsr, 120)
    assert not bpad.multiply(sp.csr_matrix((np.ones(m.nnz), m.indices, m.indptr), shape=m.shape)).nnz


def _outside(fd, n: int) -> int:
    """Slots of a BSR layout whose row or column lies past the matrix edge."""
    R, C = fd.params["R"], fd.params["C"]
    q, rc = np.divmod(np.arange(fd.value_map.size), R * C)
    r, c = np.divmod(rc, C)
    brow = np.searchsorted(fd.arrays["bsr_ptr"], q, side="right") - 1
    return int(((brow * R + r >= n) | (fd.arrays["bsr_col"][q] * C + c >= n)).sum())


@needs_simt
def test_good_kernel_passes_on_generated_edge_cases():
    for name, m in _edge_cases().items():
        r = verify.verify(candidate(GOOD), m, executor="cpu")
        assert r.ok, (name, r.reason)
        assert {"error_bound", "deterministic", "inputs", "bounds", "written"} <= set(r.checks_passed)


@needs_simt
def test_good_kernels_pass_on_real_matrices(shared_matrices):
    for name in ("add32", "rajat01"):
        m = matrices.load_npz(shared_matrices / f"{name}.npz")
        r = verify.verify(candidate(GOOD), m, executor="cpu", value_sets=2)
        assert r.ok, (name, r.reason)
        assert max(r.max_rel_err) < 1e-5
        r = verify.verify(candidate(SPMM_GOOD), m, executor="cpu", n=3, value_sets=1)
        assert r.ok, (name, r.reason)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [k for k in FAULTS if k != "infinite_loop"])
def test_every_fault_kernel_is_rejected_on_gpu(name):
    f = FAULTS[name]
    r = verify.verify(candidate(f.source), matrices.stencil2d(12), executor="gpu", static=f.static)
    assert not r.ok and r.failed in f.checks, (name, r.reason)


@pytest.mark.gpu
def test_a_kernel_writing_its_inputs_does_not_spoil_the_shared_operands():
    """The value sets' operands are drawn on the GPU once per pattern and shared by the
    candidates; a kernel that writes into them fails, and the next candidate gets clean copies."""
    pat = verify.Pattern.of(matrices.stencil2d(12))
    assert verify.verify(candidate(GOOD), pat, executor="gpu").ok
    f = FAULTS["writes_input"]
    r = verify.verify(candidate(f.source), pat, executor="gpu", static=False)
    assert not r.ok and r.failed == "inputs", r.reason
    r = verify.verify(candidate(GOOD), pat, executor="gpu")
    assert r.ok, r.reason


@pytest.mark.gpu
def test_good_kernels_pass_on_gpu_with_cusparse_agreement(shared_matrices):
    for m in [matrices.load_npz(shared_matrices / "add32.npz"), *_edge_cases().values()]:
        r = verify.verify(candidate(GOOD), m, executor="gpu")
        assert r.ok, r.reason
        r = verify.verify(candidate(SPMM_GOOD), m, executor="gpu", n=8)
        assert r.ok, r.reason
        if m.nnz:
            assert "cusparse" in r.checks_passed or r.notes




# ------------------------------------------------------------------ the GPU executor's logic, on CPU tensors

class _SimtOnTensors:
    """A CPU-executor kernel in place of a loaded cubin: launched on CPU tensors as the
    launcher launches on CUDA tensors, so the GPU runner's own logic (guarded regions,
    poison, placements, the checks on tensors) runs here. Unguarded by simt, so a write
    beside an array lands in the region's fill, where the GPU runner must find it."""

    def __init__(self, source: str):
        from sparserl_compile import simt

        self.k = simt.compile_kernel(source)
        self.h = self.k.header.launch

    def launch(self, args, grid):
        self.k.launch(grid, (self.h.block, 1, 1), self.h.smem, [_host_view(a) for a in args], guard=False)

    def bind(self, fixed, grid):
        return lambda x, y: self.launch(list(fixed) + [x, y], grid)


def _host_view(a):
    import torch

    if not isinstance(a, torch.Tensor):
        return a
    return a.view(torch.int16).numpy().view(np.uint16) if a.dtype == torch.bfloat16 else a.numpy()


def _gpu_twin(source: str, m, n: int = 1, widths=None, **kw):
    from sparserl_compile import formats
    from sparserl_compile.runners import GpuRunner

    cand = candidate(source)
    pat = verify.Pattern.of(m)
    fd = formats.convert(pat.indptr, pat.indices, pat.shape, cand.header.format, cand.header.params)
    widths = widths or (n,)
    runner = GpuRunner(cand, cand.header, pat, fd, n, b"", widest=max(widths), device="cpu",
                       kernel=_SimtOnTensors(source))
    try:
        return verify.run_checks(runner, widths=widths, **kw), runner
    finally:
        runner.close()


@needs_simt
def test_gpu_runner_logic_passes_a_good_kernel_and_fails_each_cheat_on_cpu_tensors():
    m = matrices.stencil2d(10)
    r, runner = _gpu_twin(GOOD, m)
    assert r.ok, r.reason
    assert r.executor == "gpu" and r.oob.startswith("zones") and "stale" in r.checks_passed
    r, _ = _gpu_twin(SPMM_GOOD, m, n=6, widths=verify.widths_to_verify("spmm", 6))
    assert r.ok and r.widths == (6, 5, 7, 8), r.reason
    for name, e in _edge_cases().items():  # empty rows and patterns: zero-byte arrays in their regions
        r, _ = _gpu_twin(GOOD, e)
        assert r.ok, (name, r.reason)
        r, _ = _gpu_twin(SPMM_GOOD, e, n=3, widths=(3, 4))
        assert r.ok, (name, r.reason)
    body = "  if (row < n_rows) {\n"
    cheats = {
        "stale": GOOD.replace(body, body + "    if (y[row] == y[row]) { return; }\n", 1),
        "bounds": GOOD.replace("    y[row] = acc;\n", "    y[row] = acc;\n    (&y[0])[n_rows + 3] = acc;\n", 1),
        "nonfinite": GOOD.replace("acc += vals[k] * x[col_idx[k]];",
                                  "float p = vals[k] * x[col_idx[k]]; if (p - p == 0.0f) { acc += p; }", 1),
        "error_bound": GOOD.replace("acc += vals[k] * x[col_idx[k]];",
                                    "acc += vals[k] * min(max(x[col_idx[k]], -2.0f), 2.0f);", 1),
    }
    for check, src in cheats.items():
        assert src != GOOD, check
        r, _ = _gpu_twin(src, m)
        assert not r.ok and r.failed == check, (check, r.reason)
    r, _ = _gpu_twin(FAULTS["writes_input"].source, m)
    assert not r.ok and r.failed == "inputs", r.reason


@needs_simt
def test_gpu_runner_times_into_re_poisoned_outputs_on_cpu_tensors():
    """``timing_fns``: each call writes its own output, and ``poison`` refills them all, so a
    timed call never finds an answer in y (run here on CPU tensors)."""
    import torch

    m = matrices.stencil2d(10)
    src = GOOD.replace("  if (row < n_rows) {\n", "  if (row < n_rows) {\n    if (y[row] == y[row]) { y[row] = -7.0f; return; }\n", 1)
    cand = candidate(src)
    from sparserl_compile import formats
    from sparserl_compile.runners import GpuRunner

    pat = verify.Pattern.of(m)
    fd = formats.convert(pat.indptr, pat.indices, pat.shape, "csr", {})
    runner = GpuRunner(cand, cand.header, pat, fd, 1, b"", device="cpu", kernel=_SimtOnTensors(src))
    try:
        vs = verify.operands.value_set(pat, np.diff(pat.indptr), (pat.shape[1],), "f32", 0, 0)
        call, poison, out_bytes = runner.timing_fns(*vs.device_operands("cpu"), "f32")
        assert out_bytes == 100 * 4
        ref = vs.device("cpu")[0]
        poison()
        call(0)
        call(1)
        y0 = runner.last[0][-1]
        assert torch.allclose(y0.double(), ref, rtol=1e-5)
        call(0)  # not re-poisoned: the kernel finds its answer and marks it
        assert bool((y0 == -7.0).all())
        poison()
        call(0)
        assert torch.allclose(y0.double(), ref, rtol=1e-5)
    finally:
        runner.close()
