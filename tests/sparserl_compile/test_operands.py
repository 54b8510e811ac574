"""operands: the value sets (random and special), their float64 references and the error bound."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from sparserl_compile import matrices, operands, verify


def test_error_bound_grows_with_row_length_and_output_precision():
    lengths = np.array([0, 1, 10, 1000])
    absref = np.array([0.0, 1.0, 10.0, 1000.0])
    ref = absref.copy()
    b32 = operands.error_bound(lengths, absref, ref, "f32")
    assert b32[0] < 1e-20 and np.all(np.diff(b32) > 0)
    assert b32[3] / absref[3] < 1e-3  # 1000 terms: still far below a 0.1 % error
    b16 = operands.error_bound(lengths, absref, ref, "f16")
    assert np.all(b16[1:] > b32[1:] + 0.4 * 2.0**-11 * ref[1:])


def test_bf16_storage_round_trips_like_torch():
    torch = pytest.importorskip("torch")
    a = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    store, exact = operands.to_dtype(a, "bf16")
    want = torch.from_numpy(a).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(exact.astype(np.float32), want)
    assert store.dtype == np.uint16


def test_random_operands_are_float32_of_magnitude_half_to_one_and_a_half_with_either_sign():
    a = operands._random_operand(np.random.default_rng([3, 1]), (400, 50))
    b = operands._random_operand(np.random.default_rng([3, 1]), (400, 50))
    assert a.dtype == np.float32 and a.shape == (400, 50) and np.array_equal(a, b)
    assert 0.5 <= np.abs(a).min() and np.abs(a).max() < 1.5
    assert 0.45 < (a < 0).mean() < 0.55 and 0.95 < np.abs(a).mean() < 1.05
    assert not np.array_equal(a, operands._random_operand(np.random.default_rng([3, 2]), (400, 50)))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("n", [1, 4])
def test_torch_float64_reference_matches_scipy(dtype, n):
    """The GPU executor's reference (torch.sparse in float64, where the outputs are) agrees
    with scipy's to float64 rounding; shown here with CPU tensors."""
    torch = pytest.importorskip("torch")
    m = matrices.generate("uniform_random", n_rows=300, n_cols=200, per_row=6, seed=2)
    pat = verify.Pattern.of(m)
    x_shape = (pat.shape[1],) if n == 1 else (pat.shape[1], n)
    vs = operands.ValueSet(pat, np.diff(pat.indptr), x_shape, dtype, 0, 1)
    ref, absref, _ = vs.host()
    t_ref, t_abs = operands.device_reference(torch, pat, vs.vals, vs.x, dtype, device="cpu")
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
    vs = operands.ValueSet(pat, np.diff(pat.indptr), (pat.shape[1], 4), dtype, 0, 1)
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
    other = operands.ValueSet(pat, np.diff(pat.indptr), (pat.shape[1], 4), dtype, 0, 2)
    assert not torch.equal(other.device_operands("cpu")[1], x2)


def test_an_empty_pattern_gets_its_device_reference_from_the_host():
    torch = pytest.importorskip("torch")
    pat = verify.Pattern.of(sp.csr_matrix((5, 3), dtype=np.float32))
    vs = operands.ValueSet(pat, np.diff(pat.indptr), (3,), "f32", 0, 0)
    ref, absref, bound = vs.device("cpu")
    assert ref.shape == (5,) and ref.dtype == torch.float64 and not bool(ref.any()) and bool((bound > 0).all())


def test_error_bound_is_the_same_on_tensors():
    """The GPU executor's bound (tensors) is the CPU executor's (numpy), to the bit."""
    torch = pytest.importorskip("torch")
    lengths = np.array([0, 3, 1000], np.int32)
    absref, ref = np.array([0.0, 2.5, 40.0]), np.array([0.0, -1.5, 12.0])
    for dtype in ("f32", "f16", "bf16"):
        a = operands.error_bound(lengths, absref, ref, dtype)
        t = operands.error_bound(torch.from_numpy(lengths), torch.from_numpy(absref), torch.from_numpy(ref), dtype)
        assert t.dtype == torch.float64 and np.array_equal(t.numpy(), a)
    a2 = operands.error_bound(lengths, np.ones((3, 2)), np.ones((3, 2)), "f32")
    t2 = operands.error_bound(torch.from_numpy(lengths), torch.ones(3, 2, dtype=torch.float64),
                            torch.ones(3, 2, dtype=torch.float64), "f32")
    assert np.array_equal(t2.numpy(), a2)


M = matrices.generate("uniform_random", n_rows=300, n_cols=200, per_row=6, seed=2)


def _set(key, dtype="f32", n=4, m=M):
    pat = verify.Pattern.of(m)
    return operands.ValueSet(pat, np.diff(pat.indptr), (pat.shape[1], n), dtype, 0, key)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_the_ranges_set_holds_zeros_small_large_and_subnormal_values_with_finite_outputs(dtype):
    vs = _set("ranges", dtype)
    vals, x = operands.from_storage(vs.vals, dtype), operands.from_storage(vs.x, dtype)
    tiny_top = {"f32": 2.0**-126, "f16": 2.0**-14, "bf16": 2.0**-126}[dtype]
    for a in (vals, x):
        mag = np.abs(a)
        assert (a == 0).any()
        assert ((mag > 0) & (mag < 0.25) & (mag >= tiny_top)).any()  # small
        assert ((mag > 0) & (mag < tiny_top)).any()  # subnormal range
        assert (a < 0).any() and (a > 0).any()
    assert (np.abs(x) >= operands.LARGE[dtype]).any() and (np.signbit(x) & (x == 0)).any()  # -0.0 too
    ref, absref, bound = vs.host()
    assert np.isfinite(ref).all() and (absref.max(axis=1) <= operands.ROW_LIMIT[dtype] / 2).all()
    rows = np.repeat(np.arange(M.shape[0]), np.diff(M.indptr))
    row_max = np.zeros(M.shape[0])
    np.maximum.at(row_max, rows, np.abs(vals))
    assert ((row_max > 0) & (row_max < tiny_top)).any()  # whole rows of subnormal values
    assert ((row_max >= tiny_top) & (row_max < 0.25)).any()  # whole rows below 0.25
    # a kernel that drops the subnormal values, or clamps x to [-2, 2], is out of bound
    for cheat_vals, cheat_x in ((np.where(np.abs(vals) < tiny_top, 0, vals), x), (vals, np.clip(x, -2, 2))):
        a = sp.csr_matrix((cheat_vals, M.indices, M.indptr), shape=M.shape)
        assert (np.abs(a @ cheat_x - ref) > bound).any()


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_the_nonfinite_set_puts_nan_and_inf_of_both_signs_into_about_half_the_outputs(dtype):
    vs = _set("nonfinite", dtype, n=8)
    vals, x = operands.from_storage(vs.vals, dtype), operands.from_storage(vs.x, dtype)
    for a in (vals, x):
        assert np.isnan(a).any() and (a == np.inf).any() and (a == -np.inf).any() and (a == 0).any()
    ref, _, bound = vs.host()
    share = 1 - np.isfinite(ref).mean()
    assert 0.25 < share < 0.85, share
    assert np.isnan(ref).any() and (ref == np.inf).any() and (ref == -np.inf).any()
    assert (bound[np.isfinite(ref)] > 0).all()


def test_special_sets_are_the_same_drawn_again_and_differ_from_each_other():
    a, b = _set("ranges"), _set("ranges")
    assert np.array_equal(a.vals.view(np.uint8), b.vals.view(np.uint8))
    assert not np.array_equal(a.x, _set("nonfinite").x, equal_nan=True)
    with pytest.raises(ValueError, match="an int"):
        operands.ValueSet(verify.Pattern.of(M), np.diff(M.indptr), (200,), "f32", 0, "huge")


@pytest.mark.parametrize("key", ["ranges", "nonfinite"])
def test_device_special_sets_have_a_reference_of_their_own(key):
    """The GPU executor's special sets are drawn where it runs (shown on CPU tensors) and its
    float64 reference agrees with scipy's on those operands, non-finite outputs included."""
    torch = pytest.importorskip("torch")
    vs = _set(key, "f16")
    vals, x = vs.device_operands("cpu")
    ref, absref, bound = vs.device("cpu")
    want, _ = operands.host_reference(verify.Pattern.of(M), vals.double().numpy(), x.double().numpy().reshape(200, 4))
    got = ref.numpy()
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-12, atol=1e-300)


def test_the_error_bound_holds_for_subnormal_results_and_is_tight_above_them():
    """Float accumulation of subnormal products errs by up to half a subnormal step each: the
    bound's absolute term covers that, and no more than a few steps per term."""
    tiny = np.float32(2.0**-140)
    terms = np.full(10, tiny, np.float32) * np.float32(0.7)  # rounded products
    acc = np.float32(0)
    for t in terms:
        acc = np.float32(acc + t)
    ref = float(np.sum(terms.astype(np.float64)))
    b = operands.error_bound(np.array([10]), np.array([abs(ref)]), np.array([ref]), "f32")[0]
    assert abs(float(acc) - ref) <= b < 0.01 * abs(ref)
    assert operands.error_bound(np.array([0]), np.array([0.0]), np.array([0.0]), "f32")[0] < 1e-44
    assert operands.error_bound(np.array([0]), np.array([0.0]), np.array([0.0]), "f16")[0] == pytest.approx(
        2 * 2.0**-149 + 2.0**-25)
