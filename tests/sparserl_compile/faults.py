"""Fault-injection kernels: one correct CSR SpMV kernel and one kernel per way to be wrong.

Like torch._dynamo's ``relu_*_TESTING_ONLY`` backends, these exist to prove that every
failure path of verification and of the sandbox is taken for the right reason and leaves
the caller healthy. ``FAULTS[name]`` is a ``Fault``: the candidate and the verify checks
that may legitimately reject it (several where the executor decides, e.g. an out-of-bounds
write is a ``bounds`` failure on the GPU but may be a simt ``launch`` fault on the CPU), and
the sandbox kinds that may result.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparserl_compile import contract

HEADER = ("// sparserl op=spmv format=csr dtype=f32 index=i32\n"
          "// launch block=128 work=rows per_block=128 tile_n=0 smem=0 zero_output=0 n_align=1\n")
SIG = ('extern "C" __global__ void sparserl_kernel(int n_rows, int n_cols, '
       "const int* __restrict__ row_ptr, const int* __restrict__ col_idx, "
       "const float* __restrict__ vals, const float* __restrict__ x, float* __restrict__ y)")


def _kernel(body: str, prelude: str = "") -> str:
    return HEADER + prelude + SIG + " {\n" + body + "}\n"


_ROW = "  int row = blockIdx.x * blockDim.x + threadIdx.x;\n"
_SUM = ("    float acc = 0.0f;\n"
        "    for (int k = row_ptr[row]; k < row_ptr[row + 1]; k++) {\n"
        "      acc += vals[k] * x[col_idx[k]];\n"
        "    }\n")

GOOD = _kernel(_ROW + "  if (row < n_rows) {\n" + _SUM + "    y[row] = acc;\n  }\n")

# SpMM, one thread per (row, column), for n >= 1
SPMM_GOOD = (
    "// sparserl op=spmm format=csr dtype=f32 index=i32\n"
    "// launch block=128 work=rows per_block=128 tile_n=0 smem=0 zero_output=0 n_align=1\n"
    'extern "C" __global__ void sparserl_kernel(int n_rows, int n_cols, int n, '
    "const int* __restrict__ row_ptr, const int* __restrict__ col_idx, "
    "const float* __restrict__ vals, const float* __restrict__ x, float* __restrict__ y) {\n"
    "  int row = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "  if (row < n_rows) {\n"
    "    for (int c = 0; c < n; c++) {\n"
    "      float acc = 0.0f;\n"
    "      for (int k = row_ptr[row]; k < row_ptr[row + 1]; k++) {\n"
    "        acc += vals[k] * x[col_idx[k] * n + c];\n"
    "      }\n"
    "      y[row * n + c] = acc;\n"
    "    }\n"
    "  }\n"
    "}\n"
)


@dataclass(frozen=True)
class Fault:
    source: str
    checks: frozenset[str]  # verify checks that may reject it
    kinds: frozenset[str]  # sandbox result kinds that may result
    static: bool = True  # False: static checks would reject it first; test the dynamic layer


def _f(src: str, checks, kinds, static=True) -> Fault:
    return Fault(src, frozenset(checks), frozenset(kinds), static)


FAULTS: dict[str, Fault] = {
    # valid kernel-language syntax, but NVRTC fails: an undeclared identifier
    "compile_error": _f(_kernel(_ROW + "  if (row < n_rows) {\n" + _SUM + "    y[row] = acc * undeclared_scale;\n  }\n"),
                        {"compile", "language"}, {"compile_error", "contract"}),
    # off by 0.1 %: far above the fp32 error bound
    "wrong_answer": _f(_kernel(_ROW + "  if (row < n_rows) {\n" + _SUM + "    y[row] = acc * 1.001f + 0.001f;\n  }\n"),
                       {"error_bound"}, {"wrong"}),
    # a correct result plus one store past the end of y
    "out_of_bounds_write": _f(_kernel(_ROW + "  if (row < n_rows) {\n" + _SUM + "    y[row] = acc;\n"
                                      "    if (row == n_rows - 1) { y[n_rows + 7] = 1.0f; }\n  }\n"),
                              {"bounds", "launch"}, {"wrong", "fault", "cuda_error"}),
    # never terminates (reads memory each iteration, so it cannot be optimised away)
    "infinite_loop": _f(_kernel(_ROW + "  float v = 0.0f;\n  while (v < 1.0e30f) { v += fabsf(x[0]) * 0.0f; }\n"
                                "  if (row < n_rows) { y[row] = v; }\n"),
                        set(), {"timeout"}),
    # odd rows never written
    "unwritten_output": _f(_kernel(_ROW + "  if (row < n_rows) {\n" + _SUM + "    if (row % 2 == 0) { y[row] = acc; }\n  }\n"),
                           {"written"}, {"wrong"}),
    # memoises results in __device__ globals: the second value set gets stale answers
    "state_across_launches": _f(_kernel(
        _ROW + "  if (row < n_rows) {\n"
        "    if (row < 4096 && sparserl_have[row] != 0) { y[row] = sparserl_memo[row]; return; }\n"
        + _SUM + "    if (row < 4096) { sparserl_memo[row] = acc; sparserl_have[row] = 1; }\n"
        "    y[row] = acc;\n  }\n",
        prelude="__device__ float sparserl_memo[4096];\n__device__ int sparserl_have[4096];\n"),
        {"error_bound", "deterministic", "written", "compile"}, {"wrong", "compile_error"}, static=False),
    # overwrites an input array (the matrix values)
    "writes_input": _f(_kernel(_ROW + "  if (row < n_rows) {\n" + _SUM + "    y[row] = acc;\n"
                               "    if (row == 0) { ((float*)vals)[0] = 123.0f; }\n  }\n"),
                       {"inputs", "language"}, {"wrong", "contract"}),
}


def candidate(source: str) -> contract.Candidate:
    """A ``Candidate`` for a test kernel source (header parsed from it)."""
    return contract.Candidate(source, contract.parse_header(source), family="test")
