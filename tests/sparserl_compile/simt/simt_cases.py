"""Shared pieces of the simt tests: hand-written kernels, edge-case matrices, a runner.

``run_candidate`` converts a matrix to the candidate's format, launches the kernel on the CPU
executor and returns the output next to a float64 scipy reference and an error bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from sparserl_compile import contract, formats, simt
from sparserl_compile.matrices import canonical

HDR_SCALAR = "// sparserl op=spmv format=csr dtype=f32 index=i32\n// launch block=128 work=rows per_block=128\n"
SIG_F32 = contract.signature_c("spmv", "csr", "f32")

SCALAR_CSR = HDR_SCALAR + SIG_F32 + """ {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= n_rows) return;
    float acc = 0.0f;
    for (int k = row_ptr[row]; k < row_ptr[row + 1]; ++k) {
        acc = fmaf(vals[k], __ldg(&x[col_idx[k]]), acc);
    }
    y[row] = acc;
}
"""

# a warp per row, lanes stride the row, shuffle reduction
VECTOR_CSR = """// sparserl op=spmv format=csr dtype=f32 index=i32
// launch block=128 work=rows per_block=4
""" + SIG_F32 + """ {
    int row = blockIdx.x * 4 + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    float acc = 0.0f;
    if (row < n_rows) {
        for (int k = row_ptr[row] + lane; k < row_ptr[row + 1]; k += 32) acc += vals[k] * x[col_idx[k]];
    }
    for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffff, acc, off);
    if (row < n_rows && lane == 0) y[row] = acc;
}
"""

# a block per row, tree reduction in shared memory with barriers
SHARED_REDUCE = """// sparserl op=spmv format=csr dtype=f32 index=i32
// launch block=128 work=rows per_block=1
""" + SIG_F32 + """ {
    __shared__ float part[128];
    int row = blockIdx.x;
    float acc = 0.0f;
    for (int k = row_ptr[row] + threadIdx.x; k < row_ptr[row + 1]; k += blockDim.x) acc += vals[k] * x[col_idx[k]];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) y[row] = part[0];
}
"""

# the same with dynamic shared memory (smem bytes given at launch)
DYNAMIC_REDUCE = SHARED_REDUCE.replace("smem=0", "").replace(
    "// launch block=128 work=rows per_block=1", "// launch block=128 work=rows per_block=1 smem=512"
).replace("__shared__ float part[128];", "extern __shared__ float part[];")

OWN_KERNELS = {"scalar": SCALAR_CSR, "vector": VECTOR_CSR, "shared": SHARED_REDUCE, "dynamic": DYNAMIC_REDUCE}


def edge_matrices() -> dict[str, sp.csr_matrix]:
    """Generated edge cases: empty rows, one long row, nnz = 0, one row, rectangular."""
    rng = np.random.default_rng(7)

    def rand(r, c, density):
        m = sp.random(r, c, density=density, random_state=rng, format="csr", dtype=np.float32)
        m.data = rng.integers(-4, 5, m.nnz).astype(np.float32)
        return canonical(m)

    empty_rows = rand(300, 300, 0.02).tolil()
    empty_rows[::3, :] = 0
    long_row = rand(200, 500, 0.01).tolil()
    long_row[17, :] = rng.integers(1, 5, 500)
    return {
        "empty_rows": canonical(empty_rows.tocsr()),
        "long_row": canonical(long_row.tocsr()),
        "nnz0": canonical(sp.csr_matrix((64, 48), dtype=np.float32)),
        "one_row": rand(1, 700, 0.3),
        "rect_tall": rand(513, 37, 0.1),
        "rect_wide": rand(29, 1000, 0.05),
    }


_NP = {"f32": np.float32, "f16": np.float16}


def to_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """float array -> the dtype's numpy storage (bf16 as ml_dtypes.bfloat16)."""
    if dtype == "bf16":
        import ml_dtypes

        return np.ascontiguousarray(a.astype(ml_dtypes.bfloat16))
    return np.ascontiguousarray(a.astype(_NP[dtype]))


#: relative error bound per dtype (float accumulation, one rounding of the output)
TOL = {"f32": 2e-5, "f16": 2e-3, "bf16": 1.6e-2}


@dataclass
class Outcome:
    y: np.ndarray         # kernel output as float64
    ref: np.ndarray       # float64 reference from the dtype-rounded inputs
    bound: np.ndarray     # per-entry error bound
    stats: simt.LaunchStats

    @property
    def ok(self) -> bool:
        return bool(np.all(np.abs(self.y - self.ref) <= self.bound))

    def worst(self) -> float:
        return float(np.max(np.abs(self.y - self.ref) - self.bound, initial=0.0))


def run_candidate(cand: contract.Candidate, m: sp.csr_matrix, *, n: int = 8, seed: int = 0,
                  guarded: bool = True, integer: bool = False, max_fill: float = float("inf"),
                  **launch_kw) -> Outcome:
    """Launch ``cand`` on ``m`` through the CPU executor; raises FormatNotSuitable if the
    format does not fit the matrix."""
    h = cand.header
    fd = formats.convert(m.indptr, m.indices, m.shape, h.format, h.params, max_fill=max_fill)
    rng = np.random.default_rng(seed)
    if integer:
        vals = rng.integers(-3, 4, m.nnz).astype(np.float32)
    else:
        vals = m.data.astype(np.float32)
    xs = (m.shape[1],) if h.op == "spmv" else (m.shape[1], n)
    x = (rng.integers(-3, 4, xs) if integer else rng.standard_normal(xs)).astype(np.float32)
    vals_s, x_s = to_storage(vals, h.dtype), to_storage(x, h.dtype)
    ys = (m.shape[0],) if h.op == "spmv" else (m.shape[0], n)
    y = to_storage(np.full(ys, np.nan, np.float32), h.dtype)
    if h.launch.zero_output:
        y[...] = 0
    args = fd.kernel_args(h.op, n, fd.arrays, fd.gather_values(vals_s), x_s.reshape(-1), y.reshape(-1))
    k = simt.compile_kernel(cand.source, guarded=guarded)
    st = k.launch(h.launch.grid(fd.scalars, n), h.launch.block, h.launch.smem, args, **launch_kw)
    a64 = sp.csr_matrix((vals_s.astype(np.float64), m.indices, m.indptr), shape=m.shape)
    x64 = x_s.astype(np.float64)
    ref = a64 @ x64
    mag = abs(a64) @ np.abs(x64)
    bound = TOL[h.dtype] * mag + 1e-30
    return Outcome(y.astype(np.float64), np.asarray(ref), np.asarray(bound), st)
