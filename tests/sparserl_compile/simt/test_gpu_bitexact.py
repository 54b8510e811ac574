"""CPU executor vs the GPU, bit for bit, on integer-valued data (run on the device).

With small integer values every product and partial sum is exact in float, half and
bfloat16, so summation order and FMA contraction cannot change a bit: the same kernel on the
same inputs must give identical output bits on the CPU executor and on the GPU. Any
difference is a semantic gap in ``simt`` (or a GPU-side bug).
"""

from __future__ import annotations

import numpy as np
import pytest

from sparserl_compile import formats, kernels, simt
from sparserl_compile.matrices import uniform_random
from simt_cases import to_storage

M = uniform_random(257, 190, 5, seed=21)
OPS = [(op, dt) for op in ("spmv", "spmm") for dt in ("f32", "f16", "bf16")]


def _inputs(m, op, n, seed=0):
    rng = np.random.default_rng(seed)
    vals = rng.integers(-2, 3, m.nnz).astype(np.float32)
    xs = (m.shape[1],) if op == "spmv" else (m.shape[1], n)
    return vals, rng.integers(-2, 3, xs).astype(np.float32)


def cpu_bits(cand, m, n: int = 8) -> np.ndarray:
    """Output bits (uint32 for f32, uint16 otherwise) of ``cand`` on the CPU executor."""
    h = cand.header
    fd = formats.convert(m.indptr, m.indices, m.shape, h.format, h.params, max_fill=float("inf"))
    vals, x = _inputs(m, h.op, n)
    ys = (m.shape[0],) if h.op == "spmv" else (m.shape[0], n)
    y = to_storage(np.full(ys, 0.0 if h.launch.zero_output else np.nan, np.float32), h.dtype)
    args = fd.kernel_args(h.op, n, fd.arrays, fd.gather_values(to_storage(vals, h.dtype)),
                          to_storage(x, h.dtype).reshape(-1), y.reshape(-1))
    simt.compile_kernel(cand.source).launch(h.launch.grid(fd.scalars, n), h.launch.block, h.launch.smem, args)
    return y.reshape(-1).view(np.uint32 if h.dtype == "f32" else np.uint16).copy()


def gpu_bits(cand, m, n: int = 8) -> np.ndarray:
    """The same on the GPU through ``compiler.compile_cubin`` and ``launcher.load``."""
    import torch

    from sparserl_compile import compiler, launcher

    h = cand.header
    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[h.dtype]
    fd = formats.convert(m.indptr, m.indices, m.shape, h.format, h.params, max_fill=float("inf"))
    vals, x = _inputs(m, h.op, n)
    dev = torch.device("cuda")
    tv = fd.gather_values(torch.from_numpy(vals).to(dev).to(tdt))
    tx = torch.from_numpy(x).to(dev).to(tdt).reshape(-1)
    ys = (m.shape[0],) if h.op == "spmv" else (m.shape[0], n)
    ty = torch.full(ys, 0.0 if h.launch.zero_output else float("nan"), device=dev, dtype=tdt).reshape(-1)
    k = launcher.load(compiler.compile_cubin(cand.source).cubin, h)
    k.launch(fd.kernel_args(h.op, n, formats.to_device(fd, dev), tv, tx, ty), h.launch.grid(fd.scalars, n))
    torch.cuda.synchronize()
    bits = ty.cpu().view(torch.int32 if h.dtype == "f32" else torch.int16).numpy()
    return bits.view(np.uint32 if h.dtype == "f32" else np.uint16).copy()


@pytest.mark.gpu
@pytest.mark.parametrize("op, dtype", OPS)
def test_cpu_and_gpu_agree_bit_for_bit(op, dtype):
    diffs = []
    cands = [c for c in kernels.space(op, dtype, structure=M) if c.family != "baked"]
    simt.compile_many([c.source for c in cands])  # g++ in parallel; launches hit the table
    for c in cands:
        a, b = cpu_bits(c, M), gpu_bits(c, M)
        if not np.array_equal(a, b):
            diffs.append(f"{c.name}: {int((a != b).sum())} of {a.size} outputs differ")
    assert not diffs, "\n".join(diffs)


def test_cpu_side_of_the_bitexact_check_is_exact():
    """The CPU twin: integer-valued inputs give exactly the integer float64 reference."""
    import scipy.sparse as sp

    for op in ("spmv", "spmm"):
        c = next(c for c in kernels.space(op, "bf16") if c.family == "csr_scalar")
        vals, x = _inputs(M, op, 8)
        ref = sp.csr_matrix((vals.astype(np.float64), M.indices, M.indptr), shape=M.shape) @ x.astype(np.float64)
        got = cpu_bits(c, M).view(np.uint16)
        import ml_dtypes

        assert np.array_equal(got.view(ml_dtypes.bfloat16).astype(np.float64), np.asarray(ref).reshape(-1))
