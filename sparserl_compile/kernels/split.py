"""Row-split SpMM for power-law graphs (GE-SpMM / Sputnik / RoDe style), format ``csr_split``.

The layout (``graphformats.py``) stores the rows in a locality order with the hub rows first
and the other rows cut into pieces of about ``piece`` nonzeros. The kernel ``csr_split``:

* lanes along the dense width: lane ``l`` owns the ``v`` consecutive columns
  ``blockIdx.y * 32v + l*v``, read with one vector load per gathered row of ``X`` (float2 /
  float4 for f32; ``__nv_bfloat162``/``__half2``, or a float2 / float4 load of 4 or 8 16-bit
  values) and written with vector stores;
* the (column, value) pairs of the piece are loaded 32 at a time with one coalesced access
  (lane ``l`` loads entry ``base + l``) into the warp's slice of shared memory and read back
  by every lane (a broadcast), four at a time so that four rows of ``X`` are in flight per
  lane. Staging costs two ``__syncwarp`` per 32 entries where register shuffles would cost two
  warp exchanges per entry; on the GPU both are broadcasts, on the CPU executor warp
  operations are what verification pays for;
* short rows are merged: one warp walks every row of its piece, the 32-entry chunks running
  across row ends, and stores each row's result as the row ends;
* a hub row (length >= ``hub``) gets a whole block: its ``warps`` warps take interleaved
  32-entry chunks of the row and add their partial sums in shared memory in a fixed order
  (deterministic, no atomics, so the same kernel serves f16/bf16), hub blocks first so they
  start before the many small pieces. One block per hub bounds how fast the longest row can
  go; with ``split = 16`` (f32 only) a hub row is cut into up to 16 chunks, one block each,
  whose sums are added into the zeroed output with ``atomicAdd`` (``zero_output=1``: the
  runtime clears ``y`` first, the price of spreading a hub over the GPU);
* the row order (``order``: natural, degree, RCM, BFS) decides which rows run together, and
  so how often a gathered row of ``X`` is still in the L2; results go to ``row_id[row]``.

Every control decision depends on the piece or the hub row only, never on the lane, so the
full-mask ``__syncwarp`` and the one ``__syncthreads`` (hub blocks, reached by every thread
of the block) are legal. Dense columns past ``n`` are guarded (``col_ok``): those lanes still
stage entries and reach every barrier. ``n % v == 0`` (``n_align``) keeps every vector whole.
"""

from __future__ import annotations

from sparserl_compile.contract import LaunchSpec
from sparserl_compile.kernels import template as t

UNROLL = 4

_VS = {"f32": (1, 2, 4), "f16": (2, 4, 8), "bf16": (2, 4, 8)}
_ALLOWED = {"v": (1, 2, 4, 8), "order": (1, 2, 3, 4), "piece": (32, 128), "hub": (512, 4096), "warps": (4, 8, 16),
            "split": (1, 16)}


def space(op: str, dtype: str) -> list[dict]:
    """Every width of vector, every order, two piece sizes; one block shape (8 warps, hubs from
    512 nonzeros, whole hub rows) plus, for the widest vector, a wider hub block (16 warps, hubs
    from 4096); for f32 also hub rows cut into up to 16 chunks summed with atomicAdd."""
    if op != "spmm":
        return []
    pts = [{"v": v, "order": o, "piece": p, "hub": 512, "warps": 8, "split": 1}
           for v in _VS[dtype] for o in (1, 2, 3, 4) for p in (32, 128)]
    pts += [{"v": _VS[dtype][-1], "order": o, "piece": 128, "hub": 4096, "warps": 16, "split": 1} for o in (3, 4)]
    if dtype == "f32":
        pts += [{"v": v, "order": o, "piece": 128, "hub": 512, "warps": 8, "split": 16} for v in _VS[dtype] for o in (2, 4)]
    return pts


def _pair(dtype: str) -> tuple[str, str]:
    return ("__half2", "__half22float2") if dtype == "f16" else ("__nv_bfloat162", "__bfloat1622float2")


def load_x(dtype: str, v: int, off: str, name: str) -> list[str]:
    """Lines declaring ``float {name}0 .. {name}{v-1}`` = ``x[off .. off+v)`` by one vector load."""
    names = [f"{name}{i}" for i in range(v)]
    if dtype == "f32" or v <= 2:
        return t.load_vec(dtype, v, "x", off, names)
    raw = "float2" if v == 4 else "float4"
    pair, conv = _pair(dtype)
    lines = [f"{raw} {name}_r = reinterpret_cast<const {raw}*>(x + {off})[0];",
             f"const {pair}* {name}_h = reinterpret_cast<const {pair}*>(&{name}_r);"]
    for i in range(v // 2):
        lines += [f"float2 {name}_{i} = {conv}({name}_h[{i}]);",
                  f"float {names[2 * i]} = {name}_{i}.x;", f"float {names[2 * i + 1]} = {name}_{i}.y;"]
    return lines


def store_y(dtype: str, v: int, off: str, acc: str = "a") -> list[str]:
    """Lines storing ``{acc}0 .. {acc}{v-1}`` to ``y[off ..]`` (vector stores)."""
    vals = [f"{acc}{i}" for i in range(v)]
    if dtype == "f32" or v <= 2:
        return [t.store_vec(dtype, v, "y", off, vals)]
    pair = _pair(dtype)[0]
    make = "__floats2half2_rn" if dtype == "f16" else "__floats2bfloat162_rn"
    return [f"reinterpret_cast<{pair}*>(y + {off} + {2 * i})[0] = {make}({vals[2 * i]}, {vals[2 * i + 1]});"
            for i in range(v // 2)]


def _chunk_load(dtype: str, base: str, end: str) -> list[str]:
    """Lane ``lane`` stages entry ``base + lane`` in the warp's slice ``s_col/s_val[wb ..]``;
    the first barrier lets every lane finish reading the previous chunk."""
    return [
        "__syncwarp();",
        f"if ({base} + lane < {end}) {{",
        f"    s_col[wb + lane] = __ldg(&scol[{base} + lane]);",
        f"    s_val[wb + lane] = {t.ldg(dtype, 'sval', f'{base} + lane')};",
        "}",
        "__syncwarp();",
    ]


def _steps(dtype: str, v: int, j: str, count: int) -> list[str]:
    """Broadcast entries ``j .. j+count-1`` of the chunk and add them into ``a0..``."""
    lines = []
    for u in range(count):
        lines.append(f"int c{u} = s_col[wb + {j} + {u}];")
        lines.append(f"float w{u} = s_val[wb + {j} + {u}];")
    lines.append("if (col_ok) {")
    for u in range(count):
        lines += t.indent(load_x(dtype, v, f"(long long)c{u} * n + c", f"x{u}_"), 1)
    for u in range(count):
        lines += [f"    a{i} = fmaf(w{u}, x{u}_{i}, a{i});" for i in range(v)]
    lines.append("}")
    return lines


def _hub(dtype: str, v: int, w: int, atomic: bool) -> list[str]:
    """One hub row (or, with ``atomic``, one chunk of it) per block: warps take interleaved
    32-entry chunks, shared-memory sum in a fixed order; a chunk is added into ``y``."""
    body = [
        "int h = blockIdx.x;",
        "int start = __ldg(&srow_ptr[h]);",
        "int end = __ldg(&srow_ptr[h + 1]);",
        f"for (int k0 = start + warp * 32; k0 < end; k0 += {32 * w}) {{",
    ]
    inner = _chunk_load(dtype, "k0", "end") + [
        "int cnt = min(32, end - k0);",
        "int j = 0;",
        f"for (; j + {UNROLL - 1} < cnt; j += {UNROLL}) {{",
    ]
    inner += t.indent(_steps(dtype, v, "j", UNROLL), 1) + ["}", "for (; j < cnt; ++j) {"]
    inner += t.indent(_steps(dtype, v, "j", 1), 1) + ["}"]
    body += t.indent(inner, 1) + ["}"]
    body += [f"part[(warp * 32 + lane) * {v} + {i}] = a{i};" for i in range(v)]
    body += ["__syncthreads();", "if (warp == 0 && col_ok) {", f"    for (int q = 1; q < {w}; ++q) {{"]
    body += [f"        a{i} += part[(q * 32 + lane) * {v} + {i}];" for i in range(v)]
    body += ["    }", "    long long yo = (long long)__ldg(&row_id[h]) * n + c;"]
    if atomic:
        body += [f"    atomicAdd(&y[yo + {i}], a{i});" for i in range(v)]
    else:
        body += t.indent(store_y(dtype, v, "yo"), 1)
    body += ["}", "return;"]
    return body


def _pieces(dtype: str, v: int, w: int) -> list[str]:
    """One piece (a run of stored rows) per warp, 32-entry chunks running across row ends."""
    body = [
        f"int unit = blockIdx.x * {w} + warp;",
        f"int piece = unit - n_hubs * {w};",
        f"if (piece >= n_parts - n_hubs * {w}) return;",
        "int r = __ldg(&piece_ptr[piece]);",
        "int r_end = __ldg(&piece_ptr[piece + 1]);",
        "int base = __ldg(&srow_ptr[r]);",
        "int k_end = __ldg(&srow_ptr[r_end]);",
    ]
    body += _chunk_load(dtype, "base", "k_end")
    loop = [
        "int k = __ldg(&srow_ptr[r]);",
        "int re = __ldg(&srow_ptr[r + 1]);",
        " ".join(f"a{i} = 0.0f;" for i in range(v)),
        f"for (; k + {UNROLL - 1} < re; k += {UNROLL}) {{",
        f"    if (k + {UNROLL - 1} - base >= 32) {{",
        "        base = k;",
    ]
    loop += t.indent(_chunk_load(dtype, "base", "k_end"), 2) + ["    }", "    int j = k - base;"]
    loop += t.indent(_steps(dtype, v, "j", UNROLL), 1) + ["}", "for (; k < re; ++k) {", "    if (k - base >= 32) {",
                                                          "        base = k;"]
    loop += t.indent(_chunk_load(dtype, "base", "k_end"), 2) + ["    }", "    int j = k - base;"]
    loop += t.indent(_steps(dtype, v, "j", 1), 1) + ["}", "if (col_ok) {",
                                                     "    long long yo = (long long)__ldg(&row_id[r]) * n + c;"]
    loop += t.indent(store_y(dtype, v, "yo"), 1) + ["}"]
    body += ["for (; r < r_end; ++r) {"] + t.indent(loop, 1) + ["}"]
    return body


def render(op: str, dtype: str, params: dict, structure=None):
    if op != "spmm":
        raise ValueError("csr_split renders SpMM only; for SpMV use csr_vector, csr_part or merge")
    t.check_params("csr_split", params, _ALLOWED)
    v, w, atomic = params["v"], params["warps"], params["split"] > 1
    if v not in _VS[dtype]:
        raise ValueError(f"csr_split: v={v} is not one of {list(_VS[dtype])} for dtype {dtype} "
                         "(columns per lane: one 4-, 8- or 16-byte load)")
    if atomic and dtype != "f32":
        raise ValueError(f"csr_split: split={params['split']} sums hub chunks with atomicAdd(float*), "
                         f"which the kernel language has for f32 only (got {dtype}); use split=1")
    tile = 32 * v
    body = [
        f"__shared__ float part[{w * 32 * v}];",
        "int warp = threadIdx.x / 32;",
        "int lane = threadIdx.x % 32;",
        f"int c = blockIdx.y * {tile} + lane * {v};",
        "bool col_ok = c < n;",
        t.zero_acc(v),
        f"__shared__ int s_col[{32 * w}];",
        f"__shared__ float s_val[{32 * w}];",
        "int wb = warp * 32;",
        "if (blockIdx.x < n_hubs) {",
    ]
    body += t.indent(_hub(dtype, v, w, atomic), 1) + ["}"] + _pieces(dtype, v, w)
    launch = LaunchSpec(block=32 * w, work="parts", per_block=w, tile_n=tile, n_align=v, zero_output=atomic)
    fp = {k: params[k] for k in ("order", "piece", "hub", "warps", "split")}
    return t.assemble(op, "csr_split", dtype, launch, body, family="csr_split", params=params, format_params=fp)


def applies(op: str, dtype: str, n=None, nnz=None) -> bool:
    return op == "spmm"


FAMILIES = (
    t.Family("csr_split", ("spmm",), space, render, applies,
             doc="warp per piece of merged short rows, block per hub row, lanes along N with vector "
                 "loads, (col, val) staged in shared memory 32 at a time; rows in a locality order"),
)
