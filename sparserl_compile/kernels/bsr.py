"""Block CSR families: CUDA-core BSR (R x C in {2,4,8}) and tensor-core BSR (16 x 16, wmma).

Block ``k`` of block row ``b`` sits at block column ``bsr_col[k]`` with values
``bsr_val[(k*R + r)*C + c]`` (zero-filled). One column index serves R*C values, which is
where BSR saves traffic on blocked matrices (FEM, multi-dof stencils, pruned weights).

* ``bsr``: SpMV: ``R`` threads per block row, thread ``r`` computing row ``b*R + r``. SpMM:
  one warp per block row, each lane holding ``R x v`` accumulators for its ``v`` dense
  columns and reading each ``x`` vector once per block column.
* ``bsr_wmma`` (SpMM, f16/bf16 only, R = C = 16): one warp per (block row, 16 dense columns)
  multiplies each 16x16 block with ``nvcuda::wmma`` (16x16x16, float accumulation). The
  ``x`` tile is staged through shared memory with guards, so any ``n`` works (``n_align=1``)
  and rows/columns of ``x`` past the matrix edge read as 0. f32 is excluded: wmma has no
  fp32 x fp32 shape (only tf32, which rounds inputs to 10 mantissa bits and would fail the
  f32 error bound against cuSPARSE).

Blocks at the right/bottom edge may extend past ``n_cols``/``n_rows``; those columns are
guarded on read and those rows are not stored.
"""

from __future__ import annotations

from sparserl_compile.contract import LaunchSpec
from sparserl_compile.kernels import template as t

_RC = (2, 4, 8)


def bsr_space(op: str, dtype: str) -> list[dict]:
    if op == "spmv":
        return [{"R": r, "C": c} for r in _RC for c in _RC]
    return [{"R": r, "C": c, "v": v} for r in _RC for c in _RC for v in (1, t.max_vec(dtype))]


def bsr_render(op: str, dtype: str, params: dict, structure=None):
    b = 128
    if op == "spmv":
        t.check_params("bsr", params, {"R": _RC, "C": _RC})
        R, C = params["R"], params["C"]
        per = b // R
        body = [
            f"int br = blockIdx.x * {per} + threadIdx.x / {R};",
            f"int r = threadIdx.x % {R};",
            "if (br >= n_brows) return;",
            f"int row = br * {R} + r;",
            "float acc = 0.0f;",
            "int end = __ldg(&bsr_ptr[br + 1]);",
            "for (int k = __ldg(&bsr_ptr[br]); k < end; ++k) {",
            f"    int c0 = __ldg(&bsr_col[k]) * {C};",
            f"    long long vb = ((long long)k * {R} + r) * {C};",
            f"    for (int cc = 0; cc < {C}; ++cc) {{",
            "        if (c0 + cc < n_cols) {",
            f"            acc = fmaf({t.ldg(dtype, 'bsr_val', 'vb + cc')}, {t.ldg(dtype, 'x', 'c0 + cc')}, acc);",
            "        }",
            "    }",
            "}",
            "if (row < n_rows) {",
            f"    y[row] = {t.from_float(dtype, 'acc')};",
            "}",
        ]
        launch = LaunchSpec(block=b, work="brows", per_block=per)
    else:
        t.check_params("bsr", params, {"R": _RC, "C": _RC, "v": (1, t.max_vec(dtype))})
        R, C, v = params["R"], params["C"], params["v"]
        per = b // 32
        body = [f"int br = blockIdx.x * {per} + threadIdx.x / 32;", "if (br >= n_brows) return;"]
        body += t.spmm_columns(dtype, 32, v) + ["if (!col_ok) return;"]
        body += [t.zero_acc(v, f"a{r}_") for r in range(R)]
        body += [
            "int end = __ldg(&bsr_ptr[br + 1]);",
            "for (int k = __ldg(&bsr_ptr[br]); k < end; ++k) {",
            f"    int c0 = __ldg(&bsr_col[k]) * {C};",
            f"    long long vb = (long long)k * {R * C};",
            f"    for (int cc = 0; cc < {C}; ++cc) {{",
            "        if (c0 + cc < n_cols) {",
            "            long long xo = (long long)(c0 + cc) * n + c;",
        ]
        xs = [f"xv{i}" for i in range(v)]
        inner = t.load_vec(dtype, v, "x", "xo", xs)
        for r in range(R):
            inner.append(f"float w{r} = {t.ldg(dtype, 'bsr_val', f'vb + {r * C} + cc')};")
            inner += t.fma_lines(v, f"a{r}_", f"w{r}", "xv")
        body += t.indent(inner, 3) + ["        }", "    }", "}"]
        for r in range(R):
            body += [
                f"if (br * {R} + {r} < n_rows) {{",
                f"    long long yo = (long long)(br * {R} + {r}) * n + c;",
                "    " + t.store_vec(dtype, v, "y", "yo", [f"a{r}_{i}" for i in range(v)]),
                "}",
            ]
        launch = LaunchSpec(block=b, work="brows", per_block=per, tile_n=32 * v, n_align=v)
    return t.assemble(op, "bsr", dtype, launch, body, family="bsr", params=params,
                      format_params={"R": params["R"], "C": params["C"]})


def _always(op, dtype, n=None, nnz=None) -> bool:
    return True


# ----------------------------------------------------------------------------- wmma

_WARPS = (4, 8)


def wmma_space(op: str, dtype: str) -> list[dict]:
    if op != "spmm" or dtype == "f32":
        return []
    return [{"warps": w} for w in _WARPS]


def wmma_render(op: str, dtype: str, params: dict, structure=None):
    if op != "spmm" or dtype == "f32":
        raise ValueError(
            f"bsr_wmma renders f16/bf16 SpMM only (got op={op}, dtype={dtype}): wmma has no fp32 "
            "shape, and tf32 would miss the f32 error bound"
        )
    t.check_params("bsr_wmma", params, {"warps": _WARPS})
    w = params["warps"]
    T = "__half" if dtype == "f16" else "__nv_bfloat16"
    ns = "nvcuda::wmma"
    frag = f"{ns}::fragment<{ns}::{{}}, 16, 16, 16, {{}}>"
    body = [
        f"__shared__ float stage[{w * 384}];",
        "int warp = threadIdx.x / 32;",
        "int lane = threadIdx.x % 32;",
        f"int br = blockIdx.x * {w} + warp;",
        "if (br >= n_brows) return;",
        "int c0 = blockIdx.y * 16;",
        "float* ys = stage + warp * 384;",
        f"{T}* xs = reinterpret_cast<{T}*>(ys + 256);",
        f"{frag.format('matrix_a', T + ', ' + ns + '::row_major')} fa;",
        f"{frag.format('matrix_b', T + ', ' + ns + '::row_major')} fb;",
        f"{frag.format('accumulator', 'float')} fc;",
        f"{ns}::fill_fragment(fc, 0.0f);",
        "int end = __ldg(&bsr_ptr[br + 1]);",
        "for (int k = __ldg(&bsr_ptr[br]); k < end; ++k) {",
        "    int r0 = __ldg(&bsr_col[k]) * 16;",
        "    for (int e = lane; e < 256; e += 32) {",
        "        int xr = r0 + e / 16;",
        "        int xc = c0 + e % 16;",
        f"        {T} xv = {t.from_float(dtype, '0.0f')};",
        "        if (xr < n_cols && xc < n) {",
        "            xv = x[(long long)xr * n + xc];",
        "        }",
        "        xs[e] = xv;",
        "    }",
        "    __syncwarp();",
        f"    {ns}::load_matrix_sync(fa, bsr_val + (long long)k * 256, 16);",
        f"    {ns}::load_matrix_sync(fb, xs, 16);",
        f"    {ns}::mma_sync(fc, fa, fb, fc);",
        "    __syncwarp();",
        "}",
        f"{ns}::store_matrix_sync(ys, fc, 16, {ns}::mem_row_major);",
        "__syncwarp();",
        "for (int e = lane; e < 256; e += 32) {",
        "    int yr = br * 16 + e / 16;",
        "    int yc = c0 + e % 16;",
        "    if (yr < n_rows && yc < n) {",
        f"        y[(long long)yr * n + yc] = {t.from_float(dtype, 'ys[e]')};",
        "    }",
        "}",
    ]
    launch = LaunchSpec(block=32 * w, work="brows", per_block=w, tile_n=16)
    return t.assemble(op, "bsr", dtype, launch, body, family="bsr_wmma", params=params,
                      format_params={"R": 16, "C": 16})


def _wmma_applies(op, dtype, n=None, nnz=None) -> bool:
    return op == "spmm" and dtype in ("f16", "bf16")


FAMILIES = (
    t.Family("bsr", ("spmv", "spmm"), bsr_space, bsr_render, _always,
             doc="block CSR, R x C in {2,4,8}; CUDA cores"),
    t.Family("bsr_wmma", ("spmm",), wmma_space, wmma_render, _wmma_applies,
             doc="16x16 block CSR on tensor cores (nvcuda::wmma), f16/bf16 SpMM"),
)
