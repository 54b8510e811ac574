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


def test_error_bound_grows_with_row_length_and_output_precision():
    lengths = np.array([0, 1, 10, 1000])
    absref = np.array([0.0, 1.0, 10.0, 1000.0])
    ref = absref.copy()
    b32 = verify.error_bound(lengths, absref, ref, "f32")
    assert b32[0] < 1e-20 and np.all(np.diff(b32) > 0)
    assert b32[3] / absref[3] < 1e-3  # 1000 terms: still far below a 0.1 % error
    b16 = verify.error_bound(lengths, absref, ref, "f16")
    assert np.all(b16[1:] > b32[1:] + 0.4 * 2.0**-11 * ref[1:])


def test_bf16_storage_round_trips_like_torch():
    torch = pytest.importorskip("torch")
    a = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    store, exact = verify.to_dtype(a, "bf16")
    want = torch.from_numpy(a).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(exact.astype(np.float32), want)
    assert store.dtype == np.uint16


@needs_simt
@pytest.mark.parametrize("name", [k for k in FAULTS if k != "infinite_loop"])
def test_every_fault_kernel_is_rejected_for_its_reason_on_cpu(name):
    f = FAULTS[name]
    r = verify.verify(candidate(f.source), matrices.stencil2d(12), executor="cpu", static=f.static)
    assert not r.ok, name
    assert r.failed in f.checks, (name, r.reason)


@needs_simt
def test_random_operands_are_float32_of_magnitude_half_to_one_and_a_half_with_either_sign():
    a = verify._random_operand(np.random.default_rng([3, 1]), (400, 50))
    b = verify._random_operand(np.random.default_rng([3, 1]), (400, 50))
    assert a.dtype == np.float32 and a.shape == (400, 50) and np.array_equal(a, b)
    assert 0.5 <= np.abs(a).min() and np.abs(a).max() < 1.5
    assert 0.45 < (a < 0).mean() < 0.55 and 0.95 < np.abs(a).mean() < 1.05
    assert not np.array_equal(a, verify._random_operand(np.random.default_rng([3, 2]), (400, 50)))


def test_value_sets_are_shared_by_candidates_of_one_pattern_only():
    pat = verify.Pattern.of(matrices.stencil2d(12))
    wrong = FAULTS["wrong_answer"]
    assert verify.verify(candidate(GOOD), pat, executor="cpu").ok
    first = dict(verify._VALUE_SETS["sets"])
    assert sorted(first) == [0, 1, 2]
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


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("n", [1, 4])
def test_torch_float64_reference_matches_scipy(dtype, n):
    """The GPU executor's reference (torch.sparse in float64, where the outputs are) agrees
    with scipy's to float64 rounding; shown here with CPU tensors."""
    torch = pytest.importorskip("torch")
    m = matrices.generate("uniform_random", n_rows=300, n_cols=200, per_row=6, seed=2)
    pat = verify.Pattern.of(m)
    x_shape = (pat.shape[1],) if n == 1 else (pat.shape[1], n)
    vs = verify._ValueSet(pat, np.diff(pat.indptr), x_shape, dtype, 0, 1)
    ref, absref, _ = vs.host()
    t_ref, t_abs = verify._device_reference(torch, pat, vs.vals, vs.x, dtype, device="cpu")
    np.testing.assert_allclose(t_ref.numpy(), ref, rtol=0, atol=1e-12 * float(np.abs(absref).max()))
    np.testing.assert_allclose(t_abs.numpy(), absref, rtol=1e-13)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_gpu_value_sets_draw_their_operands_where_they_run_and_again_the_same(dtype):
    """The GPU executor's operands are drawn by torch where the kernel runs (shown on CPU
    tensors): the distribution of ``_random_operand``, the same values when drawn again after a
    kernel wrote into them, and a float64 reference computed from exactly those values."""
    torch = pytest.importorskip("torch")
    m = matrices.generate("uniform_random", n_rows=300, n_cols=200, per_row=6, seed=2)
    pat = verify.Pattern.of(m)
    vs = verify._ValueSet(pat, np.diff(pat.indptr), (pat.shape[1], 4), dtype, 0, 1)
    vals, x = vs.device_operands("cpu")
    store = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    assert vals.dtype == x.dtype == store and vals.shape == (pat.nnz,) and x.shape == (pat.shape[1] * 4,)
    mag = x.float().abs()
    assert float(mag.min()) >= 0.5 and float(mag.max()) <= 1.5 and 0.4 < float((x > 0).float().mean()) < 0.6
    ref, absref, bound = vs.device("cpu")
    a = sp.csr_matrix((vals.double().numpy(), pat.indices, pat.indptr), shape=pat.shape)
    x64 = x.double().numpy().reshape(pat.shape[1], 4)
    np.testing.assert_allclose(ref.numpy(), a @ x64, rtol=1e-12, atol=1e-12)
    assert ref.dtype == bound.dtype == torch.float64 and bool((bound > 0).all())
    x.fill_(7.0)  # a kernel writing its input: the next runs draw clean operands, the same ones
    vs.drop_device_operands()
    vals2, x2 = vs.device_operands("cpu")
    assert torch.equal(vals2, vals) and torch.equal(x2.double(), torch.from_numpy(x64.reshape(-1)))
    other = verify._ValueSet(pat, np.diff(pat.indptr), (pat.shape[1], 4), dtype, 0, 2)
    assert not torch.equal(other.device_operands("cpu")[1], x2)


def test_an_empty_pattern_gets_its_device_reference_from_the_host():
    torch = pytest.importorskip("torch")
    pat = verify.Pattern.of(sp.csr_matrix((5, 3), dtype=np.float32))
    vs = verify._ValueSet(pat, np.diff(pat.indptr), (3,), "f32", 0, 0)
    ref, absref, bound = vs.device("cpu")
    assert ref.shape == (5,) and ref.dtype == torch.float64 and not bool(ref.any()) and bool((bound > 0).all())


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
                verify._check_run(run, conv(ref), conv(bound), 0, "")
                got = None
            except verify._Fail as f:
                got = f.check
                assert "output 1" in f.reason, f.reason
            assert got == failed, (name, conv)
    assert verify._same_bits(torch.tensor([1, 2]), torch.tensor([1, 2]))
    assert not verify._same_bits(torch.tensor([1, 2]), torch.tensor([1, 3]))
    assert verify._max_rel_err(torch.tensor([1.5]), torch.tensor([1.0]), torch.tensor([2.0])) == 0.25


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


def test_error_bound_is_the_same_on_tensors():
    """The GPU executor's bound (tensors) is the CPU executor's (numpy), to the bit."""
    torch = pytest.importorskip("torch")
    lengths = np.array([0, 3, 1000], np.int32)
    absref, ref = np.array([0.0, 2.5, 40.0]), np.array([0.0, -1.5, 12.0])
    for dtype in ("f32", "f16", "bf16"):
        a = verify.error_bound(lengths, absref, ref, dtype)
        t = verify.error_bound(torch.from_numpy(lengths), torch.from_numpy(absref), torch.from_numpy(ref), dtype)
        assert t.dtype == torch.float64 and np.array_equal(t.numpy(), a)
    a2 = verify.error_bound(lengths, np.ones((3, 2)), np.ones((3, 2)), "f32")
    t2 = verify.error_bound(torch.from_numpy(lengths), torch.ones(3, 2, dtype=torch.float64),
                            torch.ones(3, 2, dtype=torch.float64), "f32")
    assert np.array_equal(t2.numpy(), a2)
