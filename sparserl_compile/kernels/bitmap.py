"""Bitmap-tile families for pruned weights: CUDA-core decoding (batch 1-4) and tensor cores (8-64).

Both read the ``bitmap`` format (``contract.FORMATS``, ``formats.bitmap_geometry``): a matrix
cut into bands of ``R`` rows and tiles of ``1024/R`` columns, each tile 32 int32 bitmap words
(one per lane of a warp: word ``l`` is row ``l % R``, columns ``(l / R)*32 ..`` of the tile)
and its stored values packed in word order, the tile's first value at a multiple of 8. A
stored weight costs its value's bytes plus one bit per position of the matrix: at 70 %
sparsity in bfloat16 about 0.37x the dense weight's bytes.

Every tile is decoded the same way: each lane loads its word (one coalesced 128-byte load per
warp), counts its bits with ``__popc``, and an exclusive warp scan (``__shfl_up_sync``) of the
counts gives each lane the offset of its first value inside the tile; the lane then walks its
set bits with ``__ffs``. One block owns a band (or ``G`` bands) and all its columns; its
``warps`` warps take the band's tiles in turn (warp ``w``: tiles ``w, w + warps, ...``) and
their partial sums meet in shared memory at the end, so no atomics are needed and the output
is written once, deterministically.

* ``bitmap_warp`` (SpMV, and SpMM over ``v`` dense columns per block along ``grid.y``): each
  lane multiplies its stored weights by ``x`` (the lanes of one tile read at most ``32/R``
  windows of 32 columns of ``x``, one for ``R = 32``) into ``v`` float accumulators. A warp
  loads a tile's metadata (``tile_ptr``, its bitmap word) one tile ahead of its use. With
  ``stage`` the warp loads the next tile's values with coalesced 16-byte loads into
  registers while it multiplies the current one, whose values it has put into shared memory
  (metadata then two tiles ahead); without, each lane reads its own values through
  ``__ldg``. Bands of 32 rows are fewer than bands of 8, so their blocks have more warps.
* ``bitmap_wmma`` (SpMM, f16/bf16; load as sparse, compute as dense): per tile, each lane
  zero-fills its 32-column segment of a dense ``G*R x 1024/R`` tile in shared memory and
  scatters its stored weights into it; the warp stages the matching ``1024/R x BN`` tile of
  ``x`` (16-byte loads when ``v = 8``, ``n % 8 == 0``; guarded scalar loads when ``v = 1``;
  rows past ``n_cols`` and columns past ``n`` read as 0) and multiplies them with
  ``nvcuda::wmma`` 16x16x16 (float accumulation); the metadata of the warp's next tile is
  loaded while it works on this one. Like ``bsr_wmma``, a NaN or inf in ``x``
  meets the zeros of the dense tile and reaches ``y`` as NaN, as in the dense product.

Shared memory is static and at most 48 KiB per block: both renderers refuse a point over it.
"""

from __future__ import annotations

from sparserl_compile.contract import DTYPES, LaunchSpec
from sparserl_compile.kernels import template as t

_ESIZE = {"f32": 4, "f16": 2, "bf16": 2}
_SMEM_LIMIT = 48 * 1024


def _scan(indent: str = "") -> list[str]:
    """``k`` = exclusive prefix over the warp's lanes of ``cnt`` (the bits of each lane's word)."""
    lines = [f"{indent}int k = cnt;"]
    for d in (1, 2, 4, 8, 16):
        lines += [f"{indent}int up{d} = __shfl_up_sync(0xffffffff, k, {d});",
                  f"{indent}if (lane >= {d}) k += up{d};"]
    return lines + [f"{indent}k -= cnt;"]


# ----------------------------------------------------------------------------- warp

_WARP_R = (8, 16, 32)
_WARPS = (4, 8, 16)
#: warps per block by band height: bands of 32 rows are fewer (one block each), so more warps
#: share a band's tiles
_WARPS_FOR = {8: (4, 8), 16: (4, 8), 32: (8, 16)}
_V = (1, 2, 4)


def warp_space(op: str, dtype: str) -> list[dict]:
    pts = [{"R": R, "warps": w, "stage": s} for R in _WARP_R for w in _WARPS_FOR[R] for s in (False, True)
           if not (s and w * 1024 * _ESIZE[dtype] + w * R * 4 * max(_V) > _SMEM_LIMIT)]
    if op == "spmm":
        pts = [dict(p, v=v) for p in pts for v in _V]
    return pts


def _warp_products(op: str, dtype: str, v: int) -> list[str]:
    """Inner-loop lines: ``val`` (float) times x at column ``col0 + b`` into the accumulators."""
    if op == "spmv":
        return [f"a0 = fmaf(val, {t.ldg(dtype, 'x', 'col0 + b')}, a0);"]
    lines = ["long long xo = (long long)(col0 + b) * n + c0;",
             f"a0 = fmaf(val, {t.ldg(dtype, 'x', 'xo')}, a0);"]
    lines += [f"if (ok{j}) a{j} = fmaf(val, {t.ldg(dtype, 'x', f'xo + {j}')}, a{j});" for j in range(1, v)]
    return lines


def _warp_reduce(op: str, dtype: str, R: int, W: int, v: int) -> list[str]:
    """Sum the lanes of one row (shuffles), then the warps (shared memory), and store y."""
    lines = []
    off = 16
    while off >= R:
        lines += [f"a{j} += __shfl_down_sync(0xffffffff, a{j}, {off});" for j in range(v)]
        off //= 2
    lines.append(f"if (lane < {R}) {{")
    lines += [f"    red[(warp * {R} + lane) * {v} + {j}] = a{j};" for j in range(v)]
    lines += ["}", "__syncthreads();", f"if (threadIdx.x < {R * v}) {{",
              f"    int rr = threadIdx.x / {v};", f"    int j = threadIdx.x % {v};",
              "    float s = 0.0f;",
              f"    for (int q = 0; q < {W}; ++q) {{",
              f"        s += red[(q * {R} + rr) * {v} + j];", "    }",
              f"    int row = band * {R} + rr;"]
    if op == "spmv":
        lines += ["    if (row < n_rows) {", f"        y[row] = {t.from_float(dtype, 's')};", "    }"]
    else:
        lines += ["    if (row < n_rows && c0 + j < n) {",
                  f"        y[(long long)row * n + c0 + j] = {t.from_float(dtype, 's')};", "    }"]
    return lines + ["}"]


def _meta(d: int, ct: str, with_end: bool) -> list[str]:
    """Lines loading tile ``ct``'s metadata into ``tp{d}`` (``te{d}``) and ``w{d}`` (0 past the
    band's last tile), issued ahead of their use so their latency overlaps other work."""
    te = f" te{d} = __ldg(&tile_ptr[tm + 1]);" if with_end else ""
    return [f"if ({ct} < n_ctiles) {{", f"    int tm = band * n_ctiles + {ct};",
            f"    tp{d} = __ldg(&tile_ptr[tm]);{te}",
            f"    w{d} = (unsigned)__ldg(&bitmap[tm * 32 + lane]);", "} else {",
            f"    tp{d} = 0;{f' te{d} = 0;' if with_end else ''} w{d} = 0u;", "}"]


def _prefetch_values(d: int, per16: int, regs: int) -> list[str]:
    """Lines loading the values of the tile in ``tp{d}``/``te{d}`` into ``p0..`` (16-byte loads,
    chunk ``lane + 32*i`` into ``p{i}``)."""
    lines = ["{", f"    int ch = (te{d} - tp{d}) / {per16};",
             f"    const float4* src = reinterpret_cast<const float4*>(bm_val + tp{d});"]
    lines += [f"    if (lane + 32 * {i} < ch) p{i} = src[lane + 32 * {i}];" for i in range(regs)]
    return lines + ["}"]


def _warp_loop(op: str, dtype: str, R: int, W: int, v: int, stage: bool) -> list[str]:
    """The loop over the band's tiles of one warp. Metadata is loaded one tile ahead (two with
    ``stage``); with ``stage``, each tile's values travel through registers one tile ahead
    and through shared memory, so the warp's loads for the next tiles are in flight while it
    multiplies this one."""
    s4 = 1024 * _ESIZE[dtype] // 16  # float4 slots of one warp's staged tile
    per16, regs = 16 // _ESIZE[dtype], s4 // 32
    depth = 3 if stage else 2
    lines = [" ".join(f"int tp{d} = 0;" + (f" int te{d} = 0;" if stage else "") + f" unsigned w{d} = 0u;"
                      for d in range(depth))]
    lines += _meta(0, "warp", stage) + _meta(1, f"warp + {W}", stage)
    if stage:
        lines += [" ".join(f"float4 p{i} = make_float4(0.0f, 0.0f, 0.0f, 0.0f);" for i in range(regs))]
        lines += _prefetch_values(0, per16, regs)
        lines.append(f"const {DTYPES[dtype]}* sv = reinterpret_cast<const {DTYPES[dtype]}*>(stage + warp * (1024 / {per16}));")
    lines.append(f"for (int ct = warp; ct < n_ctiles; ct += {W}) {{")
    body = []
    if stage:
        body += _meta(2, f"ct + {2 * W}", True)
        body.append(f"int ch0 = (te0 - tp0) / {per16};")
        body += [f"if (lane + 32 * {i} < ch0) stage[warp * (1024 / {per16}) + lane + 32 * {i}] = p{i};" for i in range(regs)]
        body.append("__syncwarp();")
        body += _prefetch_values(1, per16, regs)
    else:
        body += _meta(1, f"ct + {W}", False)
    body += ["unsigned w = w0;"] + ([] if stage else ["int tp = tp0;"]) + ["int cnt = __popc(w);"] + _scan()
    val = t.to_float(dtype, "sv[k]") if stage else t.ldg(dtype, "bm_val", "tp + k")
    body += [f"int col0 = (ct * {32 // R} + lane / {R}) * 32;", "while (w != 0u) {",
             "    int b = __ffs((int)w) - 1;", "    w &= w - 1u;", f"    float val = {val};"]
    body += t.indent(_warp_products(op, dtype, v), 1) + ["    ++k;", "}"]
    if stage:
        body += ["__syncwarp();", "tp0 = tp1; te0 = te1; w0 = w1;", "tp1 = tp2; te1 = te2; w1 = w2;"]
    else:
        body += ["tp0 = tp1; w0 = w1;"]
    return lines + t.indent(body, 1) + ["}"]


def warp_render(op: str, dtype: str, params: dict, structure=None):
    allowed = {"R": _WARP_R, "warps": _WARPS, "stage": (False, True)}
    if op == "spmm":
        allowed["v"] = _V
    t.check_params("bitmap_warp", params, allowed)
    R, W, stage = params["R"], params["warps"], params["stage"]
    v = params.get("v", 1)
    if W not in _WARPS_FOR[R]:
        raise ValueError(f"bitmap_warp: warps={W} with R={R}; R={R} takes warps in {_WARPS_FOR[R]} "
                         "(a band of 32 rows has fewer blocks, so more warps share it)")
    smem = W * R * v * 4 + (W * 1024 * _ESIZE[dtype] if stage else 0)
    if smem > _SMEM_LIMIT:
        raise ValueError(f"bitmap_warp: R={R} warps={W} stage={stage} needs {smem} bytes of shared memory "
                         f"in {dtype}, over the {_SMEM_LIMIT} a block has; use fewer warps or stage=False")
    body = [f"__shared__ float red[{W} * {R} * {v}];"]
    if stage:
        body.append(f"__shared__ float4 stage[{W * 1024 * _ESIZE[dtype] // 16}];")
    body += ["int warp = threadIdx.x / 32;", "int lane = threadIdx.x % 32;",
             f"int band = blockIdx.x * 1 + warp / {W};"]
    if op == "spmm":
        body.append(f"int c0 = blockIdx.y * {v};")
        body += [f"bool ok{j} = c0 + {j} < n;" for j in range(1, v)]
    body.append(t.zero_acc(v))
    body += _warp_loop(op, dtype, R, W, v, stage)
    body += _warp_reduce(op, dtype, R, W, v)
    launch = LaunchSpec(block=32 * W, work="bands", per_block=1, tile_n=v if op == "spmm" else 0)
    return t.assemble(op, "bitmap", dtype, launch, body, family="bitmap_warp", params=params,
                      format_params={"R": R})


def _always(op, dtype, n=None, nnz=None) -> bool:
    return True


# ----------------------------------------------------------------------------- wmma

#: (R, G, BN, warps): band height, bands per block, dense columns per block, warps per block;
#: each warp's shared memory holds a G*R x 1024/R weight tile and a 1024/R x BN tile of x
_WMMA_POINTS = ((16, 1, 16, 8), (16, 1, 32, 4), (16, 2, 32, 4), (32, 1, 16, 8), (32, 1, 32, 8),
                (32, 1, 64, 4), (32, 2, 16, 4), (32, 2, 32, 4))
#: the points also rendered with guarded scalar x loads (any n, n_align=1)
_WMMA_SCALAR = ((16, 1, 16, 8), (32, 1, 32, 8))


def _wmma_layout(R: int, G: int, BN: int) -> dict[str, int]:
    """Shared-memory layout of one warp, in elements and 16-byte slots. Row strides are padded
    by 8 elements (16 bytes: fewer bank conflicts, and wmma's ldm stays a multiple of 8); every
    fragment pointer is 32-byte aligned."""
    tw = 1024 // R
    lda, ldx = tw + 8, BN + 8
    a_bytes = G * R * lda * 2
    x_bytes = tw * ldx * 2
    o_bytes = G * R * BN * 4  # the float accumulators, stored over the tiles after the last one
    per_warp = max(a_bytes + x_bytes, o_bytes)
    return {"tw": tw, "lda": lda, "ldx": ldx, "a16": a_bytes // 16, "p16": (per_warp + 31) // 32 * 2}


def _wmma_smem(R: int, G: int, BN: int, W: int) -> int:
    return W * _wmma_layout(R, G, BN)["p16"] * 16


def wmma_space(op: str, dtype: str) -> list[dict]:
    if op != "spmm" or dtype == "f32":
        return []
    pts = [{"R": R, "G": G, "BN": BN, "warps": W, "v": 8} for R, G, BN, W in _WMMA_POINTS]
    return pts + [{"R": R, "G": G, "BN": BN, "warps": W, "v": 1} for R, G, BN, W in _WMMA_SCALAR]


def _x_tile(dtype: str, T: str, tw: int, BN: int, ldx: int, v: int) -> list[str]:
    """Lines staging rows ``ct*tw ..`` and columns ``n0 ..`` of x into ``xs`` (0 outside)."""
    if v == 8:
        return [
            f"    for (int e = lane; e < {tw * BN // 8}; e += 32) {{",
            f"        int i = e / {BN // 8};", f"        int cc = (e % {BN // 8}) * 8;",
            f"        int xr = ct * {tw} + i;",
            "        float4 xv = make_float4(0.0f, 0.0f, 0.0f, 0.0f);",
            "        if (xr < n_cols && n0 + cc < n) {",
            "            xv = reinterpret_cast<const float4*>(x + ((long long)xr * n + n0 + cc))[0];",
            "        }",
            f"        reinterpret_cast<float4*>(xs + i * {ldx} + cc)[0] = xv;", "    }",
        ]
    return [
        f"    for (int e = lane; e < {tw * BN}; e += 32) {{",
        f"        int i = e / {BN};", f"        int j = e % {BN};", f"        int xr = ct * {tw} + i;",
        f"        {T} xv = {t.from_float(dtype, '0.0f')};",
        "        if (xr < n_cols && n0 + j < n) {", "            xv = x[(long long)xr * n + n0 + j];", "        }",
        f"        xs[i * {ldx} + j] = xv;", "    }",
    ]


def _wmma_meta(G: int, ct: str, d: str) -> list[str]:
    """Lines loading tile ``ct``'s metadata of each of the block's bands into ``tp{d}{g}`` and
    ``w{d}{g}`` (0 past the band's tiles or past the last band)."""
    lines = []
    for g in range(G):
        lines += [f"if ({ct} < n_ctiles && band{g} < n_bands) {{", f"    int tm = band{g} * n_ctiles + {ct};",
                  f"    tp{d}{g} = __ldg(&tile_ptr[tm]);", f"    w{d}{g} = (unsigned)__ldg(&bitmap[tm * 32 + lane]);",
                  "} else {", f"    tp{d}{g} = 0; w{d}{g} = 0u;", "}"]
    return lines


def _expand(T: str, G: int, R: int, lda: int) -> list[str]:
    """Lines writing this tile of each of the block's G bands, dense, into ``as``: each lane
    zero-fills its 32-column segment of its row and scatters its stored weights into it (the
    tile's metadata ``tpa{g}``/``wa{g}`` was loaded one tile ahead)."""
    lines = []
    for g in range(G):
        lines += ["{", f"    {T}* seg = as + ({g * R} + lane % {R}) * {lda} + (lane / {R}) * 32;",
                  "    for (int e = 0; e < 4; ++e) {",
                  "        reinterpret_cast<float4*>(seg)[e] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);", "    }",
                  f"    unsigned w = wa{g};", f"    int tp = tpa{g};", "    int cnt = __popc(w);"]
        lines += _scan("    ")
        lines += ["    while (w != 0u) {", "        int b = __ffs((int)w) - 1;", "        w &= w - 1u;",
                  "        seg[b] = __ldg(&bm_val[tp + k]);", "        ++k;", "    }", "}"]
    return lines


def wmma_render(op: str, dtype: str, params: dict, structure=None):
    if op != "spmm" or dtype == "f32":
        raise ValueError(
            f"bitmap_wmma renders f16/bf16 SpMM only (got op={op}, dtype={dtype}): wmma has no fp32 "
            "shape, and tf32 would miss the f32 error bound"
        )
    t.check_params("bitmap_wmma", params, {"R": (16, 32), "G": (1, 2), "BN": (16, 32, 64),
                                           "warps": (4, 8), "v": (1, 8)})
    R, G, BN, W, v = params["R"], params["G"], params["BN"], params["warps"], params["v"]
    smem = _wmma_smem(R, G, BN, W)
    if smem > _SMEM_LIMIT:
        raise ValueError(f"bitmap_wmma: R={R} G={G} BN={BN} warps={W} needs {smem} bytes of shared "
                         f"memory, over the {_SMEM_LIMIT} a block has without opting in; use fewer warps")
    lay = _wmma_layout(R, G, BN)
    tw, lda, ldx = lay["tw"], lay["lda"], lay["ldx"]
    T = "__half" if dtype == "f16" else "__nv_bfloat16"
    ns = "nvcuda::wmma"
    frag = f"{ns}::fragment<{ns}::{{}}, 16, 16, 16, {{}}>"
    rows = [(g, m) for g in range(G) for m in range(R // 16)]
    nbs = range(BN // 16)
    acc = [f"c{g}_{m}_{nb}" for g, m in rows for nb in nbs]
    body = [
        f"__shared__ float4 pool[{W * lay['p16']}];",
        "int warp = threadIdx.x / 32;", "int lane = threadIdx.x % 32;", f"int n0 = blockIdx.y * {BN};",
        f"float4* wp = pool + warp * {lay['p16']};",
        f"{T}* as = reinterpret_cast<{T}*>(wp);", f"{T}* xs = reinterpret_cast<{T}*>(wp + {lay['a16']});",
        f"{frag.format('matrix_a', T + ', ' + ns + '::row_major')} fa;",
    ]
    body += [f"{frag.format('matrix_b', T + ', ' + ns + '::row_major')} fb{nb};" for nb in nbs]
    body += [f"{frag.format('accumulator', 'float')} {c};" for c in acc]
    body += [f"{ns}::fill_fragment({c}, 0.0f);" for c in acc]
    body += [f"int band{g} = blockIdx.x * {G} + {g};" for g in range(G)]
    body += [" ".join(f"int tp{d}{g} = 0; unsigned w{d}{g} = 0u;" for d in "ab" for g in range(G))]
    body += _wmma_meta(G, "warp", "a")
    body.append(f"for (int ct = warp; ct < n_ctiles; ct += {W}) {{")
    body += t.indent(_wmma_meta(G, f"ct + {W}", "b"), 1)
    body += _x_tile(dtype, T, tw, BN, ldx, v)
    body += t.indent(_expand(T, G, R, lda), 1)
    body += ["    __syncwarp();", f"    for (int kk = 0; kk < {tw}; kk += 16) {{"]
    body += [f"        {ns}::load_matrix_sync(fb{nb}, xs + kk * {ldx} + {nb * 16}, {ldx});" for nb in nbs]
    for g, m in rows:
        body.append(f"        {ns}::load_matrix_sync(fa, as + {(g * R + m * 16) * lda} + kk, {lda});")
        body += [f"        {ns}::mma_sync(c{g}_{m}_{nb}, fa, fb{nb}, c{g}_{m}_{nb});" for nb in nbs]
    body += ["    }", "    __syncwarp();"]
    body += ["    " + " ".join(f"tpa{g} = tpb{g}; wa{g} = wb{g};" for g in range(G)), "}",
             "float* os = reinterpret_cast<float*>(wp);"]
    body += [f"{ns}::store_matrix_sync(os + {(g * R + m * 16) * BN + nb * 16}, c{g}_{m}_{nb}, {BN}, "
             f"{ns}::mem_row_major);" for g, m in rows for nb in nbs]
    body += [
        "__syncthreads();", "const float* pf = reinterpret_cast<const float*>(pool);",
        f"for (int e = threadIdx.x; e < {G * R * BN}; e += {32 * W}) {{",
        "    float s = 0.0f;",
        f"    for (int q = 0; q < {W}; ++q) {{", f"        s += pf[q * {lay['p16'] * 4} + e];", "    }",
        f"    int row = blockIdx.x * {G * R} + e / {BN};", f"    int col = n0 + e % {BN};",
        "    if (row < n_rows && col < n) {",
        f"        y[(long long)row * n + col] = {t.from_float(dtype, 's')};", "    }", "}",
    ]
    launch = LaunchSpec(block=32 * W, work="bands", per_block=G, tile_n=BN, n_align=v)
    return t.assemble(op, "bitmap", dtype, launch, body, family="bitmap_wmma", params=params,
                      format_params={"R": R})


def _wmma_applies(op, dtype, n=None, nnz=None) -> bool:
    return op == "spmm" and dtype in ("f16", "bf16")


FAMILIES = (
    t.Family("bitmap_warp", ("spmv", "spmm"), warp_space, warp_render, _always,
             doc="bitmap tiles decoded with __popc/__ffs, warps over a band's tiles; batch 1-4"),
    t.Family("bitmap_wmma", ("spmm",), wmma_space, wmma_render, _wmma_applies,
             doc="bitmap tiles expanded to dense in shared memory, nvcuda::wmma, f16/bf16 SpMM"),
)
