"""The kernel space: hand-written CUDA C families with declared parameters.

Each family (``FAMILIES``) is a template rendered in Python per (op, dtype, parameters) into a
``contract.Candidate``: the two header lines, then one ``extern "C" __global__ void
sparserl_kernel`` with exactly ``contract.signature_c(op, format, dtype)``. The space is what
the policy learns from (supervision targets), what it is measured against, and the runtime's
fallback search when no policy is loaded. ``KERNEL_SPACE_VERSION`` is part of every cache key:
bump it whenever a template's text changes.

Families (module: names): ``csr``: csr_scalar, csr_vector, csr_rowgroup, csr_smem;
``balanced``: csr_part, merge; ``padded``: ell, sell; ``dia``: dia; ``bsr``: bsr, bsr_wmma;
``baked``: baked (only with a structure of at most ``baked.MAX_NNZ`` nonzeros);
``split``: csr_split (SpMM on graphs: hub rows apart, merged short rows, locality order);
``tcw``: tcw_wmma (SpMM on tensor cores over condensed row windows, f16/bf16); ``bitmap``:
bitmap_warp, bitmap_wmma (pruned weights: bitmap tiles, values packed in the weight's dtype).

All values are f32, f16 (``__half``) or bf16 (``__nv_bfloat16``) and accumulate in float.
SpMM kernels are correct for any dense width ``n`` with ``n % n_align == 0`` (header line 2).

Idioms. The templates keep to this small set, which the policy grammar
(``sparserl_compile/grammar/kernel.lark``) and the CPU executor (``simt/``) both cover:

* types ``int``, ``unsigned``, ``long long``, ``bool``, ``float``, ``__half``,
  ``__nv_bfloat16``, ``float2``/``float4``, ``__half2``/``__nv_bfloat162``, pointers to them;
  local declarations with initializers; C casts ``(long long)e``;
* ``a[i]`` indexing, ``__ldg(&a[i])``, vector loads/stores
  ``reinterpret_cast<const float4*>(x + off)[0]`` (``float2``, ``__half2``,
  ``__nv_bfloat162`` likewise; stores without ``const``), ``.x .y .z .w`` members,
  ``make_float2``/``make_float4``; 4 or 8 16-bit values read as one ``float2``/``float4`` and
  viewed as pairs through ``reinterpret_cast<const __nv_bfloat162*>(&local)`` (csr_split);
* ``threadIdx.x``, ``blockIdx.x``, ``blockIdx.y`` (indices are computed from literal block
  sizes that match the header);
* ``__shfl_down_sync(0xffffffff, v, k)`` (reductions; the grammar also admits
  ``__shfl_xor_sync``/``__shfl_sync``), ``__syncwarp()``;
* static ``__shared__ T buf[N];``; ``__syncthreads()`` where the warps of a block share work
  (csr_split's hub blocks, reached by every thread of the block) or combine partial sums
  (``bitmap``);
* ``unsigned`` words, ``& | >> <<``, ``__popc``, ``__ffs`` and ``__shfl_up_sync`` (warp prefix
  sums) in the ``bitmap`` families;
* ``atomicAdd(float*, float)`` (merge, csr_split with ``split > 1``), ``min``, ``fmaf``;
* ``__half2float``, ``__float2half_rn``, ``__bfloat162float``, ``__float2bfloat16_rn``,
  ``__half22float2``, ``__bfloat1622float2``, ``__floats2half2_rn``,
  ``__floats2bfloat162_rn``;
* ``for``/``while``/``if``/``else``/``return``, compound statements,
  ``+= -= &= ++ % / * + - < <= >= == != &&``;
* ``nvcuda::wmma`` (``fragment``, ``fill_fragment``, ``load_matrix_sync``, ``mma_sync``,
  ``store_matrix_sync``) in ``bsr_wmma``, ``tcw_wmma`` and ``bitmap_wmma`` (the CPU executor
  emulates it).
"""

from __future__ import annotations

from sparserl_compile import contract
from sparserl_compile.kernels import baked, balanced, bitmap, bsr, csr, dia, padded, split, tcw
from sparserl_compile.kernels.template import Family

KERNEL_SPACE_VERSION = "3"

FAMILIES: tuple[Family, ...] = (
    *csr.FAMILIES,
    *balanced.FAMILIES,
    *padded.FAMILIES,
    *dia.FAMILIES,
    *bsr.FAMILIES,
    *baked.FAMILIES,
    *split.FAMILIES,
    *tcw.FAMILIES,
    *bitmap.FAMILIES,
)

_BY_NAME = {f.name: f for f in FAMILIES}


def family(name: str) -> Family:
    """The family called ``name``; a KeyError lists the known names."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown kernel family {name!r}; known: {sorted(_BY_NAME)}") from None


def render(family_name: str, op: str, dtype: str, params: dict, structure=None) -> contract.Candidate:
    """Render one point of one family."""
    f = family(family_name)
    if op not in f.ops:
        raise ValueError(f"family {family_name} renders {f.ops}, not {op!r}")
    return f.render(op, dtype, dict(params), structure)


def space(op: str, dtype: str, *, n: int | None = None, structure=None) -> list[contract.Candidate]:
    """Every applicable point of the space for (op, dtype), rendered.

    ``n`` (SpMM dense width) drops points whose ``n_align`` does not divide it. Baked kernels
    are included only when ``structure`` (a CSR matrix: ``indptr``, ``indices``, ``shape``) is
    given and has at most ``baked.MAX_NNZ`` nonzeros.
    """
    if op not in contract.OPS:
        raise ValueError(f"op={op!r}: expected one of {contract.OPS}")
    if dtype not in contract.DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {tuple(contract.DTYPES)}")
    if op == "spmv" and n not in (None, 1):
        raise ValueError(f"n={n} given for spmv; the dense width applies to spmm only")
    nnz = int(structure.indptr[-1]) if structure is not None else None
    out: list[contract.Candidate] = []
    for f in FAMILIES:
        if op not in f.ops or not f.applies(op, dtype, n=n, nnz=nnz):
            continue
        if f.needs_structure and structure is None:
            continue
        for p in f.space(op, dtype):
            c = f.render(op, dtype, p, structure)
            if op == "spmm" and n is not None and n % c.header.launch.n_align:
                continue
            out.append(c)
    return out
