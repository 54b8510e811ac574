"""Tensor-core SpMM over condensed row windows (TC-GNN / DTC-SpMM style), format ``tcw``.

The layout (``graphformats.py``) cuts the rows, in a locality order, into windows of ``H``
rows and condenses each window's distinct columns into tiles of 16. A tile is an ``H x 16``
block of A (mostly zeros on a graph) against the 16 rows of ``X`` its columns name; the
kernel ``tcw_wmma``, one warp per window and ``16*nt`` (``H = 16``) or ``32*nt`` (``H = 8``)
dense columns:

* zero-fills the tile in shared memory and scatters the tile's nonzeros into it
  (``tcw_pos``/``tcw_val``, coalesced, 32 at a time);
* gathers the 16 rows of ``X`` for the tile's columns, 16 bytes (8 values) per lane and load,
  into shared memory (padding columns read as 0);
* multiplies with ``nvcuda::wmma`` (``m16n16k16`` for ``H = 16``, ``m8n32k16`` for ``H = 8``),
  accumulating in float, ``nt`` accumulator fragments per warp so one A tile serves
  ``nt`` column blocks;
* stores the accumulators through shared memory and writes each window row to the user's
  row (``row_id``), two values per store.

A column shared by several rows of a window is gathered once per window instead of once per
row: the reuse a locality order creates (``order``) is what the tensor cores turn into
saved traffic. f16/bf16 only: wmma has no f32 x f32 shape, and tf32 would round the inputs
beyond the f32 error bound. Dense widths are multiples of 8 (``n_align = 8``: 16-byte loads).

Zero-filled tile entries multiply real rows of ``X``: where ``X`` holds an inf or NaN in a
column the window reads, the other rows of that window get NaN too (0 * inf), unlike a CSR
product (the same holds for ``bsr_wmma``). Finite inputs are unaffected. The CPU executor
runs these kernels through its wmma emulation (``simt``), so every point verifies on the CPU
too.
"""

from __future__ import annotations

from sparserl_compile.contract import DTYPES, LaunchSpec
from sparserl_compile.kernels import template as t

_WARPS = 4
_ALLOWED = {"H": (8, 16), "nt": (1, 2, 4), "order": (1, 2, 3, 4), "warps": (_WARPS,)}
NS = "nvcuda::wmma"


def space(op: str, dtype: str) -> list[dict]:
    """Both window heights, two column widths per warp, every order."""
    if op != "spmm" or dtype == "f32":
        return []
    return [{"H": h, "nt": nt, "order": o, "warps": _WARPS} for h in (16, 8) for nt in (2, 4) for o in (1, 2, 3, 4)]


def _shape(H: int) -> tuple[int, int]:
    """(m, n) of the wmma shape for window height H (k is 16)."""
    return (16, 16) if H == 16 else (8, 32)


def render(op: str, dtype: str, params: dict, structure=None):
    if op != "spmm" or dtype == "f32":
        raise ValueError(
            f"tcw_wmma renders f16/bf16 SpMM only (got op={op}, dtype={dtype}): wmma has no fp32 "
            "shape, and tf32 would miss the f32 error bound"
        )
    t.check_params("tcw_wmma", params, _ALLOWED)
    H, nt, w = params["H"], params["nt"], params["warps"]
    m, fn = _shape(H)
    tn = fn * nt                       # dense columns per warp
    region = max(H * tn, (16 * tn + H * 16) // 2)  # floats of shared memory per warp
    T = DTYPES[dtype]
    pair = "__half2" if dtype == "f16" else "__nv_bfloat162"
    make2 = "__floats2half2_rn" if dtype == "f16" else "__floats2bfloat162_rn"
    frag = f"{NS}::fragment<{NS}::{{}}, {m}, {fn}, 16, {{}}>"
    body = [
        f"__shared__ float stage[{w * region}];",
        "int warp = threadIdx.x / 32;",
        "int lane = threadIdx.x % 32;",
        f"int win = blockIdx.x * {w} + warp;",
        "if (win >= n_parts) return;",
        f"int c0 = blockIdx.y * {tn};",
        f"float* ws = stage + warp * {region};",
        f"{T}* as = reinterpret_cast<{T}*>(ws);",
        f"{T}* xs = as + {H * 16};",
        f"{frag.format('matrix_a', T + ', ' + NS + '::row_major')} fa;",
        f"{frag.format('matrix_b', T + ', ' + NS + '::row_major')} fb;",
    ]
    for i in range(nt):
        body += [f"{frag.format('accumulator', 'float')} acc{i};", f"{NS}::fill_fragment(acc{i}, 0.0f);"]
    body += [
        "float4 zero4 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);",
        "int t_end = __ldg(&win_ptr[win + 1]);",
        "for (int tl = __ldg(&win_ptr[win]); tl < t_end; ++tl) {",
        f"    for (int e = lane; e < {H * 16 // 8}; e += 32) {{",
        "        reinterpret_cast<float4*>(as)[e] = zero4;",
        "    }",
        "    __syncwarp();",
        "    int q_end = __ldg(&tile_ptr[tl + 1]);",
        "    for (int q = __ldg(&tile_ptr[tl]) + lane; q < q_end; q += 32) {",
        "        as[__ldg(&tcw_pos[q])] = tcw_val[q];",
        "    }",
        f"    for (int e = lane; e < {2 * tn}; e += 32) {{",
        f"        int r = e / {tn // 8};",
        f"        int cc = (e % {tn // 8}) * 8;",
        "        int col = __ldg(&tile_col[tl * 16 + r]);",
        "        float4 xv = zero4;",
        "        if (col >= 0 && c0 + cc < n) {",
        "            xv = reinterpret_cast<const float4*>(x + (long long)col * n + c0 + cc)[0];",
        "        }",
        f"        reinterpret_cast<float4*>(xs + r * {tn} + cc)[0] = xv;",
        "    }",
        "    __syncwarp();",
        f"    {NS}::load_matrix_sync(fa, as, 16);",
    ]
    for i in range(nt):
        body += [f"    {NS}::load_matrix_sync(fb, xs + {i * fn}, {tn});",
                 f"    {NS}::mma_sync(acc{i}, fa, fb, acc{i});"]
    body += ["    __syncwarp();", "}"]
    body += [f"{NS}::store_matrix_sync(ws + {i * fn}, acc{i}, {tn}, {NS}::mem_row_major);" for i in range(nt)]
    body += [
        "__syncwarp();",
        f"for (int e = lane; e < {H * tn // 2}; e += 32) {{",
        f"    int r = e / {tn // 2};",
        f"    int cc = (e % {tn // 2}) * 2;",
        f"    int row = __ldg(&row_id[win * {H} + r]);",
        "    if (row >= 0 && c0 + cc < n) {",
        f"        reinterpret_cast<{pair}*>(y + (long long)row * n + c0 + cc)[0] = "
        f"{make2}(ws[r * {tn} + cc], ws[r * {tn} + cc + 1]);",
        "    }",
        "}",
    ]
    launch = LaunchSpec(block=32 * w, work="parts", per_block=w, tile_n=tn, n_align=8)
    return t.assemble(op, "tcw", dtype, launch, body, family="tcw_wmma", params=params,
                      format_params={"order": params["order"], "H": H})


def applies(op: str, dtype: str, n=None, nnz=None) -> bool:
    return op == "spmm" and dtype in ("f16", "bf16")


FAMILIES = (
    t.Family("tcw_wmma", ("spmm",), space, render, applies,
             doc="condensed row windows of H rows on tensor cores (nvcuda::wmma), f16/bf16 SpMM"),
)
