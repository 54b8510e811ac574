"""Structure-baked kernels for small matrices: the pattern unrolled into straight-line code.

For a matrix of at most ``MAX_NNZ`` nonzeros the kernel needs no index arrays at all: every
row's nonzeros become literal ``fmaf`` terms (``vals[k]`` at a literal ``k``, ``x`` at a
literal column), and the row is picked by a balanced tree of ``if (row < R)`` tests over the
non-empty rows (empty rows store 0). The format is plain ``csr`` so the launcher passes the
usual arrays; the kernel ignores ``row_ptr`` and ``col_idx`` and reads only ``vals`` (values
may change between calls, the pattern may not: the cache key holds the fingerprint).

SpMV uses one thread per row (threads of a warp take different branches, which costs little
at this size and removes every dependent index load). SpMM uses one warp per row (the branch
is warp-uniform) with lanes across ``v``-wide dense columns.

These kernels are only meaningful for the exact pattern they were rendered from; ``render``
refuses a missing or too-large structure.
"""

from __future__ import annotations

import numpy as np

from sparserl_compile.contract import LaunchSpec
from sparserl_compile.kernels import template as t

MAX_NNZ = 2048


def baked_space(op: str, dtype: str) -> list[dict]:
    if op == "spmv":
        return [{"block": b} for b in (32, 128)]
    return [{"v": v} for v in (1, t.max_vec(dtype))]


def _rows(structure) -> tuple[int, int, np.ndarray, np.ndarray]:
    if structure is None:
        raise ValueError("baked kernels need the CSR structure: render(..., structure=csr_matrix)")
    n_rows, n_cols = (int(s) for s in structure.shape)
    indptr = np.asarray(structure.indptr, dtype=np.int64)
    indices = np.asarray(structure.indices, dtype=np.int64)
    nnz = int(indptr[-1]) if len(indptr) else 0
    if len(indptr) != n_rows + 1:
        raise ValueError(f"structure: indptr has {len(indptr)} entries, expected n_rows + 1 = {n_rows + 1}")
    if nnz > MAX_NNZ:
        raise ValueError(f"baked kernels unroll at most {MAX_NNZ} nonzeros; this matrix has {nnz}")
    return n_rows, n_cols, indptr, indices


def _tree(rows: list[int], leaf, depth: int = 0) -> list[str]:
    """Balanced if-tree over the sorted non-empty ``rows``; ``leaf(r)`` gives a row's lines."""
    if len(rows) == 1:
        r = rows[0]
        return [f"if (row == {r}) {{"] + t.indent(leaf(r), 1) + ["}"]
    mid = len(rows) // 2
    return (
        [f"if (row < {rows[mid]}) {{"] + t.indent(_tree(rows[:mid], leaf), 1)
        + ["} else {"] + t.indent(_tree(rows[mid:], leaf), 1) + ["}"]
    )


def baked_render(op: str, dtype: str, params: dict, structure=None):
    n_rows, n_cols, indptr, indices = _rows(structure)
    nonempty = [i for i in range(n_rows) if indptr[i + 1] > indptr[i]]
    if op == "spmv":
        t.check_params("baked", params, {"block": (32, 64, 128, 256)})
        b = params["block"]

        def leaf(r: int) -> list[str]:
            return [
                f"acc = fmaf({t.ldg(dtype, 'vals', str(k))}, {t.ldg(dtype, 'x', str(int(indices[k])))}, acc);"
                for k in range(int(indptr[r]), int(indptr[r + 1]))
            ]

        body = [f"int row = blockIdx.x * {b} + threadIdx.x;", "if (row >= n_rows) return;", "float acc = 0.0f;"]
        if nonempty:
            body += _tree(nonempty, leaf)
        body.append(f"y[row] = {t.from_float(dtype, 'acc')};")
        launch = LaunchSpec(block=b, work="rows", per_block=b)
    else:
        t.check_params("baked", params, {"v": (1, t.max_vec(dtype))})
        v = params["v"]
        b = 128

        def leaf(r: int) -> list[str]:
            out = []
            for k in range(int(indptr[r]), int(indptr[r + 1])):
                out += ["{", f"    float v = {t.ldg(dtype, 'vals', str(k))};"]
                out += t.indent(t.accumulate_x(dtype, v, str(int(indices[k])), "v"), 1) + ["}"]
            return out

        body = [f"int row = blockIdx.x * {b // 32} + threadIdx.x / 32;", "if (row >= n_rows) return;"]
        body += t.spmm_columns(dtype, 32, v) + ["if (!col_ok) return;", t.zero_acc(v)]
        if nonempty:
            body += _tree(nonempty, leaf)
        body += t.store_y(dtype, v, "row")
        launch = LaunchSpec(block=b, work="rows", per_block=b // 32, tile_n=32 * v, n_align=v)
    return t.assemble(op, "csr", dtype, launch, body, family="baked", params=params)


def baked_applies(op, dtype, n=None, nnz=None) -> bool:
    return nnz is not None and nnz <= MAX_NNZ


FAMILIES = (
    t.Family("baked", ("spmv", "spmm"), baked_space, baked_render, baked_applies, needs_structure=True,
             doc="pattern unrolled into literal code, nnz <= 2048"),
)
