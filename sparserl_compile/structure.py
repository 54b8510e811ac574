"""Structure analysis: the exact fingerprint of a sparsity pattern and its features.

``fingerprint`` is a BLAKE2b-128 digest of (n_rows, n_cols, indptr as int32, indices as
int32): two patterns share a fingerprint only if they are the same pattern, whatever the
values. It keys every cache, so it is computed outside traced code, once per tensor.

``features`` summarizes a pattern in a fixed set of numbers (``StructureFeatures``): row
length statistics, bandwidth and profile, diagonal occupancy, block densities, column
locality. They describe the pattern for the policy, for format choice and for reports; they
are *not* a key (two patterns can share all features) and they never look at values. The
loops run under numba (``@njit(cache=True)``) in O(nnz) per statistic, so a 10^7-nonzero
matrix costs a few tens of milliseconds; the first call in a fresh environment pays the JIT
compile (about a second, then cached on disk by numba).

``check_csr`` is the one CSR validator every input path uses (``inputs.py``, the loaders,
``formats``, ``features``): it reads the raw index arrays without casting them and names the
first broken invariant. ``check_shape`` and ``host_index_array`` are its parts.

Inputs are CSR index arrays as numpy arrays or torch tensors on any device (GPU tensors are
copied to the host once). Column indices are expected sorted within rows (canonical CSR);
the statistics stay defined for unsorted rows, but the locality figures then describe the
stored order.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
from numba import njit

FINGERPRINT_VERSION = 1

#: block sizes (square R x R) whose density ``features`` reports
BLOCK_SIZES = (2, 3, 4, 6, 8)

#: bins of the row-length histogram: bin 0 = empty rows, bin k (1 <= k < 15) = lengths in
#: [2^(k-1), 2^k), bin 15 = lengths >= 2^14
N_HIST_BINS = 16


def _host_int32(a) -> np.ndarray:
    """A contiguous int32 numpy view of a numpy array or a torch tensor (any device)."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    if torch is not None and isinstance(a, torch.Tensor):
        a = a.detach()
        if a.dtype != torch.int32:
            a = a.to(torch.int32)
        return a.contiguous().cpu().numpy()
    return np.ascontiguousarray(a, dtype=np.int32)


def fingerprint(indptr, indices, shape) -> str:
    """Exact structure fingerprint (32 hex chars) of a CSR pattern.

    ``indptr``/``indices`` may be numpy arrays or torch tensors on any device (GPU tensors are
    copied to the host once; callers memoize the result per tensor).
    """
    n_rows, n_cols = (int(s) for s in shape)
    h = hashlib.blake2b(digest_size=16, person=b"sparserl-fp%d" % FINGERPRINT_VERSION)
    h.update(np.asarray([n_rows, n_cols], dtype=np.int64).tobytes())
    ip = _host_int32(indptr)
    ix = _host_int32(indices)
    h.update(np.asarray([ip.size, ix.size], dtype=np.int64).tobytes())
    h.update(ip.tobytes())
    h.update(ix.tobytes())
    return h.hexdigest()


INT32_MAX = 2**31 - 1


def _torch_index_dtypes(torch) -> frozenset:
    """The torch integer dtypes an index array may use (values read exactly; unsigned ones
    exist from torch 2.3 on)."""
    names = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
    return frozenset(getattr(torch, n) for n in names if hasattr(torch, n))


def host_index_array(a, name: str) -> np.ndarray:
    """A 1-D host numpy array holding exactly the integers of the index array ``a`` (a numpy
    array, a torch tensor on any device, or a sequence). Nothing is cast, so a value can never
    wrap on the way in; ``TypeError`` for a non-integer dtype, ``ValueError`` for any other
    shape than 1-D. A numpy input is returned as it is (callers that keep it copy it first)."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    if torch is not None and isinstance(a, torch.Tensor):
        if a.layout != torch.strided:
            raise TypeError(f"{name} must be a dense tensor, got layout {a.layout}")
        if a.dtype not in _torch_index_dtypes(torch):
            raise TypeError(f"{name} are not integers (dtype {a.dtype}): pass the indices as an integer "
                            "tensor (e.g. .long())")
        if a.device.type == "meta":
            raise ValueError(f"{name} is on the meta device: it holds no indices to read")
        a = a.detach().cpu().numpy()
    else:
        try:
            a = np.asarray(a)
        except (ValueError, TypeError) as e:
            raise TypeError(f"{name} is not an array of integers: {e}") from None
        if a.dtype.kind not in "iu":
            raise TypeError(f"{name} are not integers (dtype {a.dtype}): pass an integer array "
                            "(e.g. .astype(np.int64)); a cast would silently change non-integer values")
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(a.shape)}")
    return a


def check_shape(shape) -> tuple[int, int]:
    """``(n_rows, n_cols)`` as Python ints: two non-negative integers that fit int32, else a
    ``ValueError`` naming what was given."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    if shape is None or isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__") or len(shape) != 2:
        raise ValueError(f"shape must be (n_rows, n_cols), got {shape!r}")

    def is_int(s) -> bool:
        if isinstance(s, bool) or isinstance(s, np.bool_):
            return False
        if isinstance(s, (int, np.integer)):
            return True
        return (torch is not None and isinstance(s, torch.Tensor) and s.dim() == 0
                and not s.dtype.is_floating_point and not s.dtype.is_complex and s.dtype != torch.bool)

    if not all(is_int(s) for s in shape):
        raise ValueError(f"shape must be two integers (n_rows, n_cols), got {tuple(shape)!r}")
    n_rows, n_cols = (int(s) for s in shape)
    if n_rows < 0 or n_cols < 0:
        raise ValueError(f"shape {(n_rows, n_cols)} has a negative dimension")
    if n_rows > INT32_MAX or n_cols > INT32_MAX:
        raise ValueError(
            f"shape {n_rows}x{n_cols} does not fit int32 indices; sparserl kernels index with int32: "
            "split the matrix into blocks below 2^31"
        )
    return n_rows, n_cols


def check_csr(indptr, indices, shape, nnz: int | None = None, *, ptr: str = "crow_indices",
              idx: str = "column") -> tuple[np.ndarray, np.ndarray, int, int]:
    """The one CSR validator: ``(indptr, indices, n_rows, n_cols)`` with int32 host arrays, or a
    ``ValueError``/``TypeError`` naming the first broken invariant.

    Reads the raw arrays (numpy, torch on any device) without casting them first, and checks:
    integer dtypes, 1-D, the shape (two non-negative integers that fit int32), nnz fits int32,
    ``len(indptr) == n_rows + 1``, ``len(indices) == nnz`` (the number of values, when given),
    ``indptr[0] == 0``, ``indptr[-1] == nnz``, ``indptr`` non-decreasing and every index in
    ``[0, n_cols)``. Sorted or unique indices within a row are not required. ``ptr``/``idx``
    name the arrays in messages (a CSC matrix is checked as the CSR of its transpose). The
    returned arrays may share memory with the inputs; callers that keep them copy first.
    """
    n_rows, n_cols = check_shape(shape)
    ip = host_index_array(indptr, ptr)
    ix = host_index_array(indices, f"{idx} indices")
    if ix.size > INT32_MAX:
        raise ValueError(f"nnz={ix.size} does not fit int32 indices; split the matrix into blocks below 2^31 "
                         "nonzeros")
    if ip.size != n_rows + 1:
        raise ValueError(
            f"{ptr} has {ip.size} entries but the shape {n_rows}x{n_cols} needs "
            f"n_rows + 1 = {n_rows + 1}: pass the matching shape"
        )
    if nnz is not None and ix.size != nnz:
        raise ValueError(f"{ix.size} {idx} indices but {nnz} values: the sparse matrix is malformed")
    first, last = int(ip[0]), int(ip[-1])
    if first != 0:
        raise ValueError(f"{ptr}[0] ({first}) != 0: the sparse matrix is malformed")
    if last != ix.size:
        raise ValueError(
            f"{ptr}[-1] ({last}) != nnz ({ix.size}): the sparse matrix is malformed; "
            "build it with check_invariants=True"
        )
    if n_rows:
        bad = np.flatnonzero(ip[1:] < ip[:-1])
        if bad.size:
            k = int(bad[0])
            raise ValueError(
                f"{ptr} is not non-decreasing: {ptr}[{k + 1}] ({int(ip[k + 1])}) < "
                f"{ptr}[{k}] ({int(ip[k])}); the sparse matrix is malformed"
            )
    if ix.size:
        lo, hi = int(ix.min()), int(ix.max())
        if lo < 0 or hi >= n_cols:
            dim = "n_cols" if idx == "column" else "n_rows" if idx == "row" else "the dimension"
            raise ValueError(
                f"{idx} indices span [{lo}, {hi}] but {dim} is {n_cols}: an index is out of "
                "range; fix the indices or pass the right shape"
            )
    # every value is now in [0, nnz] (indptr) or [0, n_cols) (indices): int32 holds it exactly
    return ip.astype(np.int32, copy=False), ix.astype(np.int32, copy=False), n_rows, n_cols


def check_coo(row, col, shape, nnz: int | None = None) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The COO counterpart of ``check_csr``: ``(row, col, n_rows, n_cols)`` as host integer
    arrays (not cast), or a ``ValueError``/``TypeError`` naming the problem: integer dtypes, 1-D,
    equal lengths (and ``nnz``, the number of values, when given), nnz fits int32, every row in
    ``[0, n_rows)`` and every column in ``[0, n_cols)`` (so no negative index)."""
    n_rows, n_cols = check_shape(shape)
    r = host_index_array(row, "row indices")
    c = host_index_array(col, "column indices")
    if r.size != c.size or (nnz is not None and r.size != nnz):
        values = "" if nnz is None else f" and {nnz} values"
        raise ValueError(f"{r.size} row indices, {c.size} column indices{values}: the sparse matrix is malformed")
    if r.size > INT32_MAX:
        raise ValueError(f"nnz={r.size} does not fit int32 indices; split the matrix into blocks below 2^31 "
                         "nonzeros")
    for name, ix, n, dim in ((("row", r, n_rows, "n_rows")), ("column", c, n_cols, "n_cols")):
        if ix.size:
            lo, hi = int(ix.min()), int(ix.max())
            if lo < 0 or hi >= n:
                raise ValueError(f"{name} indices span [{lo}, {hi}] but {dim} is {n}: an index is out of "
                                 "range; fix the indices or pass the right shape")
    return r, c, n_rows, n_cols


@dataclass(frozen=True)
class StructureFeatures:
    """Numbers that describe one sparsity pattern (values are never read).

    Row lengths are nonzeros per row. "Pairs" are consecutive stored nonzeros of one row.
    """

    n_rows: int
    n_cols: int
    nnz: int
    density: float  # nnz / (n_rows * n_cols), 0 for an empty shape
    row_min: int  # shortest row
    row_max: int  # longest row
    row_mean: float  # nnz / n_rows
    row_std: float  # population standard deviation of row lengths
    row_cv: float  # row_std / row_mean (0 when there are no nonzeros): load imbalance
    empty_rows: int  # rows without nonzeros
    row_hist: tuple[int, ...]  # N_HIST_BINS counts: [0], [1,2), [2,4), ... [2^14, inf)
    lower_bandwidth: int  # max(row - col) over nonzeros, 0 if none below the diagonal
    upper_bandwidth: int  # max(col - row) over nonzeros, 0 if none above the diagonal
    bandwidth: int  # max |col - row|
    profile: int  # sum over rows of max(0, row - first column): the lower envelope size
    n_diags: int  # distinct occupied diagonals (col - row offsets)
    diag_fill: float  # nnz / (n_diags * n_rows): how full a DIA layout would be
    block_density: tuple[float, ...]  # per BLOCK_SIZES b: nnz / (occupied b x b blocks * b*b)
    mean_col_gap: float  # mean |col - previous col| over pairs (0 without pairs)
    consecutive_frac: float  # fraction of pairs with col == previous col + 1

    FEATURE_NAMES = ()  # filled below the class: names of as_vector() entries

    def as_vector(self) -> np.ndarray:
        """A fixed-length float32 vector (``FEATURE_NAMES`` order), counts log-scaled.

        Counts and lengths enter as log2(1 + v); ratios in [0, 1] enter as they are; the
        histogram enters as fractions of rows.
        """
        lg = lambda v: math.log2(1.0 + float(v))  # noqa: E731
        rows = max(self.n_rows, 1)
        v = [
            lg(self.n_rows), lg(self.n_cols), lg(self.nnz), self.density,
            lg(self.row_min), lg(self.row_max), lg(self.row_mean), lg(self.row_std), self.row_cv,
            self.empty_rows / rows,
            *(h / rows for h in self.row_hist),
            lg(self.lower_bandwidth), lg(self.upper_bandwidth), lg(self.bandwidth), lg(self.profile),
            lg(self.n_diags), self.diag_fill,
            *self.block_density,
            lg(self.mean_col_gap), self.consecutive_frac,
        ]
        return np.asarray(v, dtype=np.float32)


FEATURE_NAMES: tuple[str, ...] = (
    "log2_n_rows", "log2_n_cols", "log2_nnz", "density",
    "log2_row_min", "log2_row_max", "log2_row_mean", "log2_row_std", "row_cv",
    "empty_row_frac",
    *(f"row_hist_{k}" for k in range(N_HIST_BINS)),
    "log2_lower_bandwidth", "log2_upper_bandwidth", "log2_bandwidth", "log2_profile",
    "log2_n_diags", "diag_fill",
    *(f"block_density_{b}x{b}" for b in BLOCK_SIZES),
    "log2_mean_col_gap", "consecutive_frac",
)
StructureFeatures.FEATURE_NAMES = FEATURE_NAMES


@njit(cache=True)
def _row_pass(indptr, indices, n_rows, n_cols, n_bins):
    """One pass over the pattern: row stats, bands, profile, diagonals, locality."""
    hist = np.zeros(n_bins, np.int64)
    diag_seen = np.zeros(n_rows + n_cols + 1, np.uint8)
    rmin = np.int64(1) << 62
    rmax = np.int64(0)
    sumsq = 0.0
    empty = 0
    lower = 0
    upper = 0
    profile = np.int64(0)
    n_diags = 0
    gap_sum = 0.0
    pairs = np.int64(0)
    consec = np.int64(0)
    for i in range(n_rows):
        a = indptr[i]
        b = indptr[i + 1]
        ln = b - a
        if ln < rmin:
            rmin = ln
        if ln > rmax:
            rmax = ln
        sumsq += float(ln) * float(ln)
        if ln == 0:
            empty += 1
            hist[0] += 1
            continue
        k = 1
        v = ln
        while v > 1 and k < n_bins - 1:
            v >>= 1
            k += 1
        hist[k] += 1
        first = indices[a]
        for p in range(a, b):
            c = indices[p]
            if c < first:
                first = c
            d = c - i
            if d > upper:
                upper = d
            if -d > lower:
                lower = -d
            slot = d + n_rows
            if diag_seen[slot] == 0:
                diag_seen[slot] = 1
                n_diags += 1
            if p > a:
                g = c - indices[p - 1]
                if g == 1:
                    consec += 1
                gap_sum += abs(g)
                pairs += 1
        if i > first:
            profile += i - first
    if n_rows == 0:
        rmin = 0
    return rmin, rmax, sumsq, empty, hist, lower, upper, profile, n_diags, gap_sum, pairs, consec


@njit(cache=True)
def _count_blocks(indptr, indices, n_rows, n_cols, R, C):
    """Number of occupied R x C blocks (distinct (row // R, col // C) pairs)."""
    n_bcols = (n_cols + C - 1) // C
    stamp = np.full(n_bcols + 1, -1, np.int64)
    count = np.int64(0)
    n_brows = (n_rows + R - 1) // R
    for br in range(n_brows):
        r0 = br * R
        r1 = min(r0 + R, n_rows)
        for p in range(indptr[r0], indptr[r1]):
            bc = indices[p] // C
            if stamp[bc] != br:
                stamp[bc] = br
                count += 1
    return count


def features(indptr, indices, shape) -> StructureFeatures:
    """Compute ``StructureFeatures`` of a CSR pattern (numpy arrays or torch tensors)."""
    ip, ix, n_rows, n_cols = check_csr(indptr, indices, shape, ptr="indptr")
    nnz = int(ix.size)
    (rmin, rmax, sumsq, empty, hist, lower, upper, profile, n_diags, gap_sum, pairs,
     consec) = _row_pass(ip, ix, n_rows, n_cols, N_HIST_BINS)
    mean = nnz / n_rows if n_rows else 0.0
    var = max(sumsq / n_rows - mean * mean, 0.0) if n_rows else 0.0
    std = math.sqrt(var)
    blocks = []
    for b in BLOCK_SIZES:
        nb = int(_count_blocks(ip, ix, n_rows, n_cols, b, b))
        blocks.append(nnz / (nb * b * b) if nb else 0.0)
    cells = n_rows * n_cols
    return StructureFeatures(
        n_rows=n_rows,
        n_cols=n_cols,
        nnz=nnz,
        density=nnz / cells if cells else 0.0,
        row_min=int(rmin),
        row_max=int(rmax),
        row_mean=mean,
        row_std=std,
        row_cv=std / mean if mean > 0 else 0.0,
        empty_rows=int(empty),
        row_hist=tuple(int(h) for h in hist),
        lower_bandwidth=int(lower),
        upper_bandwidth=int(upper),
        bandwidth=int(max(lower, upper)),
        profile=int(profile),
        n_diags=int(n_diags),
        diag_fill=nnz / (n_diags * n_rows) if n_diags and n_rows else 0.0,
        block_density=tuple(blocks),
        mean_col_gap=float(gap_sum / pairs) if pairs else 0.0,
        consecutive_frac=float(consec / pairs) if pairs else 0.0,
    )
