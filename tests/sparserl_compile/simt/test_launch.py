"""SimtKernel.launch: own kernels against scipy, the argument checks, conversions, atomics."""

from __future__ import annotations

import numpy as np
import pytest

from sparserl_compile import simt
from sparserl_compile.matrices import load_npz, shared_manifest, stencil2d
from simt_cases import HDR_SCALAR, OWN_KERNELS, SIG_F32, edge_matrices


def _spmv(src, m, *, guarded=True, workers=1):
    k = simt.compile_kernel(src, guarded=guarded)
    x = np.random.default_rng(1).standard_normal(m.shape[1]).astype(np.float32)
    y = np.full(m.shape[0], np.nan, np.float32)
    h = k.header.launch
    st = k.launch(h.grid({"n_rows": m.shape[0]}), h.block, h.smem,
                  [np.int32(m.shape[0]), np.int32(m.shape[1]), m.indptr, m.indices, m.data, x, y],
                  workers=workers)
    ref = m.astype(np.float64) @ x.astype(np.float64)
    bound = 2e-5 * (abs(m.astype(np.float64)) @ np.abs(x.astype(np.float64))) + 1e-30
    assert np.all(np.abs(y - ref) <= bound), f"max error {np.max(np.abs(y - ref))}"
    return st


@pytest.mark.parametrize("name", sorted(OWN_KERNELS))
@pytest.mark.parametrize("case", sorted(edge_matrices()))
def test_own_kernels_on_edge_cases(name, case):
    m = edge_matrices()[case]
    if name in ("shared", "dynamic") and m.shape[0] == 0:
        pytest.skip("a block per row")
    st = _spmv(OWN_KERNELS[name], m)
    assert st.mode == ("loops" if name == "scalar" else "fibers")


@pytest.mark.parametrize("name", sorted(OWN_KERNELS))
def test_own_kernels_on_real_matrices(name, shared_matrices):
    for info in [i for i in shared_manifest(shared_matrices) if i.nnz < 60_000][:3]:
        _spmv(OWN_KERNELS[name], load_npz(info.path))


def test_unguarded_and_multithreaded_runs_agree():
    m = stencil2d(40)
    for name in ("vector", "shared"):
        _spmv(OWN_KERNELS[name], m, guarded=False)
        st = _spmv(OWN_KERNELS[name], m, workers=2)
        assert st.workers == 2


def test_atomics_are_atomic_across_workers():
    src = HDR_SCALAR + SIG_F32 + " {\n    atomicAdd(&y[threadIdx.x % 4], 1.0f);\n}\n"
    k = simt.compile_kernel(src)
    y = np.zeros(4, np.float32)
    e = np.zeros(0, np.int32)
    k.launch(64, 128, 0, [np.int32(4), np.int32(0), np.zeros(5, np.int32), e, np.zeros(0, np.float32),
                          np.zeros(0, np.float32), y], workers=2)
    assert y.tolist() == [2048.0] * 4


def _convert_kernel(expr: str):
    return simt.compile_kernel(HDR_SCALAR + SIG_F32 + " {\n    int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                               f"    if (i < n_rows) y[i] = {expr};\n}}\n")


def _all_kinds_of_floats() -> np.ndarray:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    near = np.array([65504, 65519.99, 65520, 2**-24, 2**-25, 2**-25 * 1.0001, 3 * 2**-26, 6e-8,
                     1 + 2**-11, 1 + 3 * 2**-11, np.inf, -np.inf, 0.0, -0.0, 3.0e38], np.float32)
    return np.concatenate([bits.view(np.float32), near, -near, (rng.standard_normal(50_000) * 1e3).astype(np.float32)])


def test_half_conversion_rounds_like_ieee():
    x = _all_kinds_of_floats()
    k = _convert_kernel("__half2float(__float2half_rn(x[i]))")
    y = np.empty_like(x)
    k.launch((x.size + 127) // 128, 128, 0, [np.int32(x.size), np.int32(0), np.zeros(1, np.int32),
                                             np.zeros(0, np.int32), np.zeros(0, np.float32), x, y])
    with np.errstate(all="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(y), nan)
    assert np.array_equal(y[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_bfloat16_conversion_rounds_like_ieee():
    import ml_dtypes

    x = _all_kinds_of_floats()
    k = _convert_kernel("__bfloat162float(__float2bfloat16_rn(x[i]))")
    y = np.empty_like(x)
    k.launch((x.size + 127) // 128, 128, 0, [np.int32(x.size), np.int32(0), np.zeros(1, np.int32),
                                             np.zeros(0, np.int32), np.zeros(0, np.float32), x, y])
    with np.errstate(all="ignore"):
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(y), nan)
    assert np.array_equal(y[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_argument_checks_name_the_argument():
    k = simt.compile_kernel(OWN_KERNELS["scalar"])
    m = stencil2d(4)
    good = [np.int32(16), np.int32(16), m.indptr, m.indices, m.data, np.ones(16, np.float32), np.zeros(16, np.float32)]
    with pytest.raises(TypeError, match="takes 7"):
        k.launch(1, 128, 0, good[:-1])
    with pytest.raises(TypeError, match=r"argument 5 \(x\) must have dtype float32"):
        k.launch(1, 128, 0, good[:5] + [np.ones(16), good[6]])
    with pytest.raises(ValueError, match="C-contiguous"):
        k.launch(1, 128, 0, good[:5] + [np.ones(32, np.float32)[::2], good[6]])
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(16, np.float32)
        ro.flags.writeable = False
        k.launch(1, 128, 0, good[:6] + [ro])
    with pytest.raises(ValueError, match="1024"):
        k.launch(1, (64, 32), 0, good)


def test_misaligned_output_is_written_back_in_place():
    k = simt.compile_kernel(OWN_KERNELS["scalar"])
    m = stencil2d(5)
    buf = np.full(m.shape[0] + 1, -7, np.float32)
    y = buf[1:]  # 4-byte offset: launched through an aligned copy
    x = np.ones(m.shape[1], np.float32)
    k.launch(1, 128, 0, [np.int32(25), np.int32(25), m.indptr, m.indices, m.data, x, y])
    assert buf[0] == -7
    np.testing.assert_allclose(y, m @ x, rtol=1e-6)


def test_speed_on_1e5_nonzeros():
    """A kernel family on a 10^5-nonzero matrix runs well under a second on one core."""
    m = stencil2d(142)  # 100,096 nonzeros
    assert 95_000 < m.nnz < 110_000
    for name in ("scalar", "vector"):
        st = _spmv(OWN_KERNELS[name], m)
        assert st.wall_s < 1.0, (name, st)
