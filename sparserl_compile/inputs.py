"""Every way a sparse matrix enters sparserl, checked before any library routine touches it.

The index arrays of a scipy, torch or cupy sparse matrix are whatever their builder put there:
nothing checked them. Library routines trust them: scipy's ``sum_duplicates`` on a CSR whose
``indptr`` is not monotone writes out of bounds (a segfault or a corrupted heap), torch's
``coalesce`` drops a negative COO index without a word. So here every entry path reads the
raw arrays directly (``indptr``/``indices``, ``row``/``col``, ``crow_indices``/``col_indices``,
``ccol_indices``/``row_indices``, ``_indices()``, a BSR's block pointers, a LIL's row lists),
copies them to the host, checks them with numpy (``structure.check_csr``/``check_coo``), and
only then builds the canonical pattern itself: int32 indices, columns strictly increasing
within each row. No scipy, torch or cupy routine sees an index array before it passed.

``read(a)`` takes a torch sparse tensor (COO, CSR, CSC, BSR, BSC), a ``scipy.sparse`` matrix or array
(CSR, CSC, COO, BSR, LIL, DIA, DOK) or a ``cupyx.scipy.sparse`` matrix and returns its
``Pattern`` and values; ``csr``/``csc``/``coo`` take raw arrays. The pattern's arrays are its
own (never views of the caller's, which the caller may change later). When the stored order is
not canonical (rows unsorted, duplicates), ``Pattern.reorder`` maps the stored values onto the
canonical entries, summing duplicates in the values' own dtype on their own device: the one
COO-to-CSR conversion of the package. ``tensor.py`` (``sparsify``, ``from_csr``, unpickling),
``dispatch.py`` (native operands) and ``matrices.py`` (``.npz``/``.mtx``) all enter here.

Values are not checked here beyond their count and shape (NaN and inf are legal values);
their dtype is the caller's business (``tensor.py`` takes float16/bfloat16/float32/float64).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from sparserl_compile.structure import INT32_MAX, check_coo, check_csr, check_shape, host_index_array


@dataclass(frozen=True)
class Reorder:
    """How the stored entries of a non-canonical matrix become the canonical ones."""

    order: np.ndarray  # int64: stored positions, in canonical order (sorted by row, then column)
    starts: np.ndarray  # int64: where each canonical entry's run of duplicates begins in ``order``
    inverse: np.ndarray  # int64: for each position of ``order``, its canonical entry

    def apply(self, values):
        """The canonical values: stored ``values`` (a torch tensor or a numpy array) permuted and
        duplicates summed, in their dtype and on their device."""
        if isinstance(values, np.ndarray):
            v = values[self.order]
            return np.add.reduceat(v, self.starts) if v.size else v
        import torch

        dev = values.device
        picked = values[torch.from_numpy(self.order).to(dev)]
        return values.new_zeros(self.starts.size).index_add_(0, torch.from_numpy(self.inverse).to(dev), picked)


@dataclass(frozen=True)
class Pattern:
    """A checked, canonical CSR pattern (host int32 arrays owned by this object)."""

    indptr: np.ndarray
    indices: np.ndarray
    n_rows: int
    n_cols: int
    reorder: Reorder | None = None  # None: the stored entries were already in canonical order

    @property
    def shape(self) -> tuple[int, int]:
        return self.n_rows, self.n_cols

    @property
    def nnz(self) -> int:
        return int(self.indices.size)

    def values(self, stored):
        """``stored`` values in this pattern's canonical order (see ``Reorder.apply``)."""
        return stored if self.reorder is None else self.reorder.apply(stored)


# -------------------------------------------------------------------- raw arrays


def _own(a, name: str) -> np.ndarray:
    """A host copy of an index array that no one else holds (checked later, used after)."""
    return np.array(host_index_array(a, name), copy=True)


def is_canonical(indptr: np.ndarray, indices: np.ndarray) -> bool:
    """Columns strictly increasing within every row (sorted, no duplicates) of a checked CSR."""
    if indices.size < 2:
        return True
    inner = np.ones(indices.size - 1, dtype=bool)
    starts = indptr[1:-1]
    starts = starts[(starts > 0) & (starts < indices.size)]
    inner[starts - 1] = False
    return bool(np.all(indices[1:][inner] > indices[:-1][inner]))


def csr(indptr, indices, shape, nnz: int | None = None, *, ptr: str = "crow_indices") -> Pattern:
    """The canonical pattern of raw CSR arrays (checked by ``structure.check_csr``)."""
    ip, ix, n_rows, n_cols = check_csr(_own(indptr, ptr), _own(indices, "column indices"), shape, nnz, ptr=ptr)
    if is_canonical(ip, ix):
        return Pattern(ip, ix, n_rows, n_cols)
    rows = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(ip))
    return _from_coords(rows, ix, n_rows, n_cols)


def csc(indptr, indices, shape, nnz: int | None = None, *, ptr: str = "ccol_indices") -> Pattern:
    """The canonical (CSR) pattern of raw CSC arrays: checked as the CSR of the transpose."""
    n_rows, n_cols = check_shape(shape)
    ip = _own(indptr, ptr)
    if ip.size != n_cols + 1:
        raise ValueError(f"{ptr} has {ip.size} entries but the shape {n_rows}x{n_cols} needs n_cols + 1 = "
                         f"{n_cols + 1} (a CSC matrix points into its columns): pass the matching shape")
    ip, ix, _, _ = check_csr(ip, _own(indices, "row indices"), (n_cols, n_rows), nnz, ptr=ptr, idx="row")
    cols = np.repeat(np.arange(n_cols, dtype=np.int64), np.diff(ip))
    return _from_coords(ix, cols, n_rows, n_cols)


def coo(row, col, shape, nnz: int | None = None) -> Pattern:
    """The canonical pattern of raw COO coordinates (checked by ``structure.check_coo``)."""
    r, c, n_rows, n_cols = check_coo(_own(row, "row indices"), _own(col, "column indices"), shape, nnz)
    return _from_coords(r, c, n_rows, n_cols)


def _from_coords(rows: np.ndarray, cols: np.ndarray, n_rows: int, n_cols: int) -> Pattern:
    """Checked coordinates -> canonical CSR: sort by (row, column), duplicates merged."""
    indptr = np.zeros(n_rows + 1, dtype=np.int64)
    if rows.size == 0:
        return Pattern(indptr.astype(np.int32), np.zeros(0, np.int32), n_rows, n_cols)
    keys = rows.astype(np.int64) * n_cols + cols.astype(np.int64)  # < 2^62: both fit int32
    if bool(np.all(keys[1:] > keys[:-1])):  # canonical as stored
        np.cumsum(np.bincount(rows, minlength=n_rows), out=indptr[1:])
        return Pattern(indptr.astype(np.int32), cols.astype(np.int32), n_rows, n_cols)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    first = np.empty(sorted_keys.size, dtype=bool)
    first[0] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    inverse = np.cumsum(first) - 1
    uniq = sorted_keys[starts]
    new_rows = uniq // n_cols
    np.cumsum(np.bincount(new_rows, minlength=n_rows), out=indptr[1:])
    return Pattern(indptr.astype(np.int32), (uniq % n_cols).astype(np.int32), n_rows, n_cols,
                   Reorder(order, starts, inverse))


# -------------------------------------------------------------------- matrices


def _values(data, nnz_name: str = "values"):
    """A value array of a scipy/cupy matrix as numpy, 1-D."""
    v = np.asarray(data)
    if v.ndim != 1:
        raise ValueError(f"{nnz_name} must be 1-D (one per stored entry), got shape {tuple(v.shape)}")
    return v


def read(a):
    """``(Pattern, stored values)`` of a torch sparse tensor, a scipy.sparse matrix or a
    cupyx.scipy.sparse matrix; the values are a torch tensor (torch, cupy) or a numpy array
    (scipy), not yet reordered (``Pattern.values`` does that). ``TypeError`` for anything else."""
    import torch

    if isinstance(a, torch.Tensor):
        return read_torch(a)
    mod = type(a).__module__
    if mod.startswith("scipy.sparse"):
        return read_scipy(a)
    if mod.startswith(("cupyx", "cupy")):
        return read_cupy(a)
    raise TypeError(f"cannot read a {mod}.{type(a).__name__} as a sparse matrix: pass a torch sparse tensor, "
                    "a scipy.sparse matrix or a cupyx.scipy.sparse matrix")


def read_torch(a):
    """A torch sparse COO, CSR, CSC, BSR or BSC matrix (no batch or dense dimensions)."""
    import torch

    if a.layout == torch.sparse_coo:
        if a.sparse_dim() != 2 or a.dense_dim() != 0:
            raise ValueError(f"a 2-D COO matrix without dense dimensions is needed, got sparse_dim="
                             f"{a.sparse_dim()}, dense_dim={a.dense_dim()}")
        idx, vals = a._indices(), a._values()  # as stored: coalesce() would act on them unchecked
        if idx.dim() != 2 or idx.shape[0] != 2:
            raise ValueError(f"COO indices must have shape (2, nnz), got {tuple(idx.shape)}")
        return coo(idx[0], idx[1], tuple(a.shape), vals.shape[0]), vals.detach()
    if a.layout in (torch.sparse_csr, torch.sparse_csc):
        vals = a.values()
        if a.dim() != 2 or vals.dim() != 1:
            raise ValueError(f"a 2-D {a.layout} matrix without batch or dense dimensions is needed, got shape "
                             f"{tuple(a.shape)} with values of shape {tuple(vals.shape)}")
        if a.layout == torch.sparse_csr:
            return csr(a.crow_indices(), a.col_indices(), tuple(a.shape), vals.shape[0]), vals.detach()
        return csc(a.ccol_indices(), a.row_indices(), tuple(a.shape), vals.shape[0]), vals.detach()
    if a.layout in (torch.sparse_bsr, torch.sparse_bsc):
        if a.dim() != 2:
            raise ValueError(f"a 2-D {a.layout} matrix without batch dimensions is needed, got shape {tuple(a.shape)}")
        if a.layout == torch.sparse_bsr:
            return _blocks(a.values().detach(), a.crow_indices(), a.col_indices(), check_shape(tuple(a.shape)),
                           ptr="crow_indices", idx="block column")
        return _blocks(a.values().detach(), a.ccol_indices(), a.row_indices(), check_shape(tuple(a.shape)),
                       ptr="ccol_indices", idx="block row", by_columns=True)
    raise TypeError(f"sparse layout {a.layout} is not supported: pass a COO, CSR, CSC, BSR or BSC tensor "
                    "(or a dense one)")


def read_scipy(m):
    """A scipy.sparse matrix or array of any format, its arrays checked before scipy converts it."""
    fmt = getattr(m, "format", None)
    shape = check_shape(getattr(m, "shape", None))
    if fmt in ("csr", "csc"):
        data = _values(m.data, "data")
        build = csr if fmt == "csr" else csc
        return build(m.indptr, m.indices, shape, data.size, ptr="indptr"), data
    if fmt == "coo":
        data = _values(m.data, "data")
        return coo(m.row, m.col, shape, data.size), data
    if fmt == "bsr":
        return _read_bsr(m, shape)
    if fmt == "lil":
        return _read_lil(m, shape)
    if fmt in ("dia", "dok"):
        # no index array to corrupt: DIA is offsets over a dense band, DOK a dict whose keys scipy
        # checks on insertion; their COO conversion is numpy code whose result is checked next
        try:
            c = m.tocoo()
        except (ValueError, IndexError, TypeError) as e:
            raise ValueError(f"cannot read the {fmt.upper()} matrix: {e}") from None
        return read_scipy(c)
    raise TypeError(f"scipy.sparse format {fmt!r} is not supported; convert the matrix with .tocsr()")


def _read_bsr(m, shape):
    return _blocks(np.asarray(m.data), m.indptr, m.indices, shape, ptr="indptr", idx="block column")


def _blocks(data, indptr, indices, shape, *, ptr: str, idx: str, by_columns: bool = False):
    """The pattern and values of a block matrix: ``data`` (n_blocks, R, C) (numpy or torch),
    ``indptr`` over block rows and ``indices`` of block columns (BSR), or over block columns and
    of block rows when ``by_columns`` (torch's BSC); every stored block entry is an entry."""
    if data.ndim != 3:
        raise ValueError(f"BSR/BSC values must have shape (n_blocks, R, C), got {tuple(data.shape)}")
    nb, R, C = data.shape
    n_rows, n_cols = shape
    if R < 1 or C < 1 or n_rows % R or n_cols % C:
        raise ValueError(f"blocks of {R}x{C} do not tile the shape {n_rows}x{n_cols}")
    grid = (n_cols // C, n_rows // R) if by_columns else (n_rows // R, n_cols // C)
    ip, ix, n_major, _ = check_csr(_own(indptr, ptr), _own(indices, f"{idx} indices"), grid, nb, ptr=ptr, idx=idx)
    brow = np.repeat(np.arange(n_major, dtype=np.int64), np.diff(ip))
    if by_columns:
        brow, ix = ix.astype(np.int64), brow
    rows = (brow[:, None, None] * R + np.arange(R)[None, :, None]) + np.zeros((1, 1, C), np.int64)
    cols = (ix.astype(np.int64)[:, None, None] * C + np.arange(C)[None, None, :]) + np.zeros((1, R, 1), np.int64)
    if rows.size > INT32_MAX:
        raise ValueError(f"the BSR matrix stores {rows.size} entries: more than int32 indices can address")
    return _from_coords(rows.ravel(), cols.ravel(), n_rows, n_cols), data.reshape(-1)


def _read_lil(m, shape):
    """LIL rows are Python lists: flattened here (scipy's own flattening writes by the row
    lists' lengths into arrays sized by the shape)."""
    rows_obj, data_obj = np.asarray(m.rows, dtype=object), np.asarray(m.data, dtype=object)
    n_rows = shape[0]
    if rows_obj.shape != (n_rows,) or data_obj.shape != (n_rows,):
        raise ValueError(f"a LIL matrix of {n_rows} rows has rows/data of shapes {rows_obj.shape}/{data_obj.shape}")
    lengths = np.fromiter((len(r) for r in rows_obj), dtype=np.int64, count=n_rows)
    if any(len(d) != n for d, n in zip(data_obj, lengths)):
        raise ValueError("a LIL row has a different number of columns and values: the matrix is malformed")
    cols = np.asarray(list(chain.from_iterable(rows_obj)))
    vals = np.asarray(list(chain.from_iterable(data_obj)), dtype=m.dtype)
    cols = cols.astype(np.int64) if cols.size == 0 else cols
    rows = np.repeat(np.arange(n_rows, dtype=np.int64), lengths)
    return coo(rows, cols, shape, vals.size), vals


def read_cupy(m):
    """A cupyx.scipy.sparse matrix (recognised by its module, cupy is never imported here): its
    device arrays are read through DLPack, copied to the host and checked."""
    import torch

    fmt = getattr(m, "format", None)
    shape = check_shape(getattr(m, "shape", None))
    if fmt not in ("csr", "csc", "coo"):
        if not hasattr(m, "tocoo"):
            raise TypeError(f"cupyx.scipy.sparse format {fmt!r} is not supported; convert it with .tocsr()")
        m, fmt = m.tocoo(), "coo"
    vals = torch.from_dlpack(m.data)
    if vals.dim() != 1:
        raise ValueError(f"data must be 1-D (one per stored entry), got shape {tuple(vals.shape)}")
    if fmt == "coo":
        p = coo(torch.from_dlpack(m.row), torch.from_dlpack(m.col), shape, vals.shape[0])
    else:
        build = csr if fmt == "csr" else csc
        p = build(torch.from_dlpack(m.indptr), torch.from_dlpack(m.indices), shape, vals.shape[0], ptr="indptr")
    return p, vals


__all__ = ["Pattern", "Reorder", "read", "read_torch", "read_scipy", "read_cupy", "csr", "csc", "coo",
           "is_canonical"]
