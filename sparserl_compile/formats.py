"""CSR -> the storage layouts kernels consume, exactly as ``contract.FORMATS`` documents them.

``convert(indptr, indices, shape, fmt, params)`` returns a ``FormatData``: the format's
scalars, its int32 structure arrays (every array of the format except the value array), and
``value_map``, one int64 per slot of the value array giving the CSR position whose value goes
there (-1 = padding, value 0). Conversion reads the pattern only; values follow per call by
one gather (``FormatData.gather_values``), so one conversion serves every value set of a
pattern (training-step weights, several verification value sets).

Layouts (``n_rows``/``n_cols``/``nnz`` of the CSR input):

* ``csr``: ``row_ptr``, ``col_idx`` as given.
* ``csr_perm``: plus ``perm``, the rows by descending length, ties in row order (stable).
* ``csr_part``: plus ``part_ptr`` (``n_parts + 1`` entries), greedy row cuts: a part takes
  whole rows until its work reaches ``nnz_per_part``, where a row's work is its length but at
  least 1 (so runs of empty rows are cut too). Rows are never split; one long row may exceed
  the target on its own.
* ``merge``: plus ``part_row``. The merge path walks the list of row ends
  ``row_ptr[1:]`` against the nonzero indices ``0..nnz-1``, taking row end ``i`` before
  nonzero ``j`` when ``row_ptr[i+1] <= j`` (Merrill & Garland). It has
  ``n_rows + nnz`` items cut into ``n_parts = ceil((n_rows + nnz) / items_per_part)``
  pieces. Piece ``p`` starts at diagonal ``d = min(p * items_per_part, n_rows + nnz)``;
  ``part_row[p]`` is the number of row ends taken before diagonal ``d``, i.e. the row piece
  ``p`` starts in, and its first nonzero is ``d - part_row[p]``, which lies in
  ``[row_ptr[part_row[p]], row_ptr[part_row[p]+1]]``. ``part_row[n_parts] = n_rows``.
* ``ell``: ``width`` = longest row; ``ell_col[k*n_rows + i]`` = k-th column of row i or -1.
* ``sell`` (SELL-C-sigma): rows sorted by descending length (stable) inside windows of
  ``sigma`` rows, cut into ``n_slices = ceil(n_rows / C)`` slices; ``perm`` has
  ``n_slices * C`` entries, -1 past ``n_rows``; slice s is as wide as its longest row.
* ``dia``: ``offsets`` = the occupied diagonals (col - row), ascending;
  ``dia_val[d*n_rows + i] = A[i, i + offsets[d]]``.
* ``bsr``: R x C blocks, ``n_brows = ceil(n_rows / R)``, block columns ascending within a
  block row; slots past ``n_rows`` or ``n_cols`` exist with value 0 (kernels must not read
  ``x`` past ``n_cols``: the last block column may overhang).
* ``csr_split`` and ``tcw``: the graph layouts (rows in a locality order, hub rows apart,
  condensed row windows for tensor cores), built by ``graphformats.py``.
* ``bitmap``: bands of R rows, tiles of 1024/R columns, one bit per position
  (``bitmap_geometry``); values in word order, each tile's first value at a multiple of
  ``BITMAP_ALIGN`` (the gaps are padding). Refused when its words exceed ``max_fill`` x nnz
  (+ ``SMALL_SLACK``), i.e. below about 1 % density at the default, or when a row repeats a
  column. ``stored_bytes`` gives what a converted matrix occupies.

Padded formats (ell, sell, dia, bsr) are refused with ``FormatNotSuitable`` when their value
array would exceed ``max_fill`` times nnz (default 3) plus ``SMALL_SLACK`` slots, or 2^31-1
slots (int32 offsets). Loops run under numba; see ``convert`` for measured costs.

This module does not choose a format (the policy and the families do) and does not move
anything to a GPU except in ``to_device``/``gather_values`` on torch tensors.

This module is over 600 lines on purpose: each format's converter stays beside the layout
above that the generated-code contract and the kernels read (docs/kernels.md cites it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from sparserl_compile.contract import FORMATS, OPS
from sparserl_compile.structure import check_csr

#: defaults for the formats' header parameters
DEFAULT_PARAMS: dict[str, dict[str, int]] = {
    "csr_part": {"nnz_per_part": 4096},
    "merge": {"items_per_part": 1024},
    "sell": {"C": 32, "sigma": 256},
    "bsr": {"R": 4, "C": 4},
    "csr_split": {"order": 1, "piece": 64, "hub": 1024, "warps": 8, "split": 1},
    "tcw": {"order": 1, "H": 16},
}

#: padded formats may exceed the nnz budget by this many slots (tiny matrices stay allowed)
SMALL_SLACK = 4096
DEFAULT_MAX_FILL = 3.0
_INT32_MAX = 2**31 - 1


class FormatNotSuitable(ValueError):
    """The matrix does not fit a format within its memory budget (or at all)."""


@dataclass(frozen=True)
class FormatData:
    """One CSR pattern converted to one format (structure only; values come by gather)."""

    fmt: str
    params: dict[str, int]
    scalars: dict[str, int]
    arrays: dict[str, np.ndarray]  # int32 structure arrays, by contract name
    value_map: np.ndarray  # int64, per value-array slot: CSR position, -1 = padding (0)
    value_array: str
    nnz: int
    _device_maps: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def padded_size(self) -> int:
        """Slots of the value array (nnz for the CSR-based formats)."""
        return int(self.value_map.size)

    @property
    def fill(self) -> float:
        """nnz / slots of the value array (1.0 for CSR-based formats and empty matrices)."""
        return self.nnz / self.padded_size if self.padded_size else 1.0

    def gather_values(self, vals):
        """The value array of this format from CSR values (numpy array or torch tensor).

        Torch tensors stay on their device and keep autograd: one ``index_select`` of the
        values with one zero appended, through an index kept per device that sends padding to
        that zero. The index is int32 where the positions fit (4 bytes per slot held beside
        the format, where an int64 map and a mask would take 9: more than a 16-bit weight
        itself).
        """
        if vals.shape[0] != self.nnz:
            raise ValueError(
                f"{vals.shape[0]} values given for a pattern with nnz={self.nnz}"
            )
        if isinstance(vals, np.ndarray):
            if self.nnz == 0:
                return np.zeros(self.value_map.size, dtype=vals.dtype)
            safe = np.where(self.value_map >= 0, self.value_map, 0)
            out = vals[safe]
            out[self.value_map < 0] = 0
            return out
        import torch

        if not isinstance(vals, torch.Tensor):
            raise TypeError(f"values must be a numpy array or torch tensor, got {type(vals).__name__}")
        if self.nnz == 0:
            return vals.new_zeros(self.value_map.size)
        key = str(vals.device)
        index = self._device_maps.get(key)
        if index is None:
            host = np.where(self.value_map >= 0, self.value_map, self.nnz)  # padding -> the zero
            host = host.astype(np.int32 if self.nnz < 2**31 - 1 else np.int64)
            index = self._device_maps[key] = torch.from_numpy(host).to(vals.device)
        return torch.index_select(torch.cat([vals, vals.new_zeros(1)]), 0, index)

    def kernel_args(self, op: str, n: int, arrays: dict, values, x, y) -> list:
        """Launch arguments in contract order: scalars (np.int32), n (spmm), arrays, x, y.

        ``arrays`` maps array names to what the caller already placed where the kernel runs
        (numpy for the CPU executor, torch tensors for the GPU); they are passed untouched.
        """
        if op not in OPS:
            raise ValueError(f"op={op!r}; expected one of {OPS}")
        f = FORMATS[self.fmt]
        args: list = [np.int32(self.scalars[s]) for s in f.scalars]
        if op == "spmm":
            args.append(np.int32(n))
        for name in f.arrays:
            if name == f.value_array:
                args.append(values)
            elif name in arrays:
                args.append(arrays[name])
            else:
                raise KeyError(
                    f"format {self.fmt} needs array {name!r}; got {sorted(arrays)} "
                    "(pass FormatData.arrays moved to the device, e.g. to_device(fd, dev))"
                )
        args += [x, y]
        return args


def to_device(fd: FormatData, device) -> dict:
    """The structure arrays of ``fd`` as int32 torch tensors on ``device``."""
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in fd.arrays.items()}


def floor_bytes(op: str, n_rows: int, n_cols: int, nnz: int, n: int = 1, value_bytes: int = 4,
                fmt: str = "csr") -> int:
    """The fewest bytes one call must move: CSR arrays, x and y once each.

    ``nnz * (value_bytes + 4) + 4 * (n_rows + 1) + value_bytes * n * (n_cols + n_rows)``;
    for SpMV (n = 1) at 4-byte values this is the anchors' floor. ``fmt="bitmap"``: the
    values and one bit per position of the matrix in place of the CSR index arrays
    (``nnz * value_bytes + n_rows * n_cols / 8``), what a kernel of the bitmap format reads
    at least; any other ``fmt`` is held to the CSR floor.
    """
    if op == "spmv":
        n = 1
    elif op != "spmm":
        raise ValueError(f"op={op!r}; expected one of {OPS}")
    dense = value_bytes * n * (n_cols + n_rows)
    if fmt == "bitmap":
        return int(nnz * value_bytes + n_rows * n_cols // 8 + dense)
    return int(nnz * (value_bytes + 4) + 4 * (n_rows + 1) + dense)


# ---------------------------------------------------------------- numba kernels


@njit(cache=True)
def _part_ptr(indptr, n_rows, target):
    out = np.empty(n_rows + 1, np.int32)
    out[0] = 0
    n = 1
    acc = 0
    for i in range(n_rows):
        acc += max(indptr[i + 1] - indptr[i], 1)
        if acc >= target:
            out[n] = i + 1
            n += 1
            acc = 0
    if out[n - 1] != n_rows:
        out[n] = n_rows
        n += 1
    return out[:n]


@njit(cache=True)
def _merge_part_row(indptr, n_rows, nnz, items, n_parts):
    out = np.empty(n_parts + 1, np.int32)
    total = n_rows + nnz
    for p in range(n_parts + 1):
        d = min(p * items, total)
        lo = max(d - nnz, 0)
        hi = min(d, n_rows)
        while lo < hi:
            mid = (lo + hi) >> 1
            if indptr[mid + 1] <= d - mid - 1:
                lo = mid + 1
            else:
                hi = mid
        out[p] = lo
    return out


@njit(cache=True)
def _ell(indptr, indices, n_rows, width):
    col = np.full(n_rows * width, -1, np.int32)
    vm = np.full(n_rows * width, -1, np.int64)
    for i in range(n_rows):
        for k in range(indptr[i + 1] - indptr[i]):
            p = indptr[i] + k
            col[k * n_rows + i] = indices[p]
            vm[k * n_rows + i] = p
    return col, vm


@njit(cache=True)
def _sell_layout(lengths, n_rows, C, sigma, n_slices):
    perm = np.full(n_slices * C, -1, np.int32)
    for w0 in range(0, n_rows, sigma):
        w1 = min(w0 + sigma, n_rows)
        order = np.argsort(-lengths[w0:w1], kind="mergesort")
        for k in range(w1 - w0):
            perm[w0 + k] = w0 + order[k]
    slice_ptr = np.zeros(n_slices + 1, np.int64)
    for s in range(n_slices):
        w = 0
        for lane in range(C):
            r = perm[s * C + lane]
            if r >= 0 and lengths[r] > w:
                w = lengths[r]
        slice_ptr[s + 1] = slice_ptr[s] + w * C
    return perm, slice_ptr


@njit(cache=True)
def _sell_fill(indptr, indices, perm, slice_ptr, C, n_slices):
    total = slice_ptr[n_slices]
    col = np.full(total, -1, np.int32)
    vm = np.full(total, -1, np.int64)
    for s in range(n_slices):
        for lane in range(C):
            r = perm[s * C + lane]
            if r < 0:
                continue
            for k in range(indptr[r + 1] - indptr[r]):
                q = slice_ptr[s] + k * C + lane
                col[q] = indices[indptr[r] + k]
                vm[q] = indptr[r] + k
    return col, vm


@njit(cache=True)
def _dia_offsets(indptr, indices, n_rows, n_cols):
    seen = np.zeros(n_rows + n_cols + 1, np.uint8)
    for i in range(n_rows):
        for p in range(indptr[i], indptr[i + 1]):
            seen[indices[p] - i + n_rows] = 1
    return np.nonzero(seen)[0] - n_rows


@njit(cache=True)
def _dia_fill(indptr, indices, n_rows, n_cols, offsets):
    slot = np.full(n_rows + n_cols + 1, -1, np.int64)
    for d in range(offsets.size):
        slot[offsets[d] + n_rows] = d
    vm = np.full(offsets.size * n_rows, -1, np.int64)
    for i in range(n_rows):
        for p in range(indptr[i], indptr[i + 1]):
            d = slot[indices[p] - i + n_rows]
            vm[d * n_rows + i] = p
    return vm


@njit(cache=True)
def _bsr_count(indptr, indices, n_rows, n_cols, R, C):
    n_brows = (n_rows + R - 1) // R
    n_bcols = (n_cols + C - 1) // C
    stamp = np.full(n_bcols + 1, -1, np.int64)
    ptr = np.zeros(n_brows + 1, np.int64)
    for br in range(n_brows):
        cnt = 0
        for p in range(indptr[br * R], indptr[min(br * R + R, n_rows)]):
            bc = indices[p] // C
            if stamp[bc] != br:
                stamp[bc] = br
                cnt += 1
        ptr[br + 1] = ptr[br] + cnt
    return ptr


@njit(cache=True)
def _bsr_fill(indptr, indices, n_rows, n_cols, R, C, ptr):
    n_brows = ptr.size - 1
    n_bcols = (n_cols + C - 1) // C
    nblk = ptr[n_brows]
    bcol = np.empty(nblk, np.int32)
    vm = np.full(nblk * R * C, -1, np.int64)
    pos = np.full(n_bcols + 1, -1, np.int64)
    stamp = np.full(n_bcols + 1, -1, np.int64)
    for br in range(n_brows):
        r0 = br * R
        r1 = min(r0 + R, n_rows)
        k = ptr[br]
        for p in range(indptr[r0], indptr[r1]):
            bc = indices[p] // C
            if stamp[bc] != br:
                stamp[bc] = br
                bcol[k] = bc
                k += 1
        bcol[ptr[br]:k].sort()
        for q in range(ptr[br], k):
            pos[bcol[q]] = q
        for r in range(r0, r1):
            for p in range(indptr[r], indptr[r + 1]):
                c = indices[p]
                q = pos[c // C]
                vm[(q * R + (r - r0)) * C + (c % C)] = p
    return bcol, vm


# ---------------------------------------------------------------- bitmap tiles

#: band heights of the bitmap format: a tile is always 32 words, R rows x 1024/R columns
BITMAP_R = (1, 2, 4, 8, 16, 32)
#: tile starts in the bitmap value array are multiples of this many values (16-byte loads)
BITMAP_ALIGN = 8


def bitmap_geometry(shape, R: int) -> tuple[int, int, int]:
    """``(n_bands, n_ctiles, tile_cols)`` of the bitmap format for ``shape`` and band height R."""
    if R not in BITMAP_R:
        raise ValueError(f"bitmap: R={R} must be one of {BITMAP_R} (R rows x 1024/R columns per tile)")
    tw = 1024 // R
    return math.ceil(int(shape[0]) / R), math.ceil(int(shape[1]) / tw), tw


@njit(cache=True)
def _row_order(indptr, indices, n_rows):
    """Positions of each row's entries by ascending column; empty when every row is sorted."""
    for i in range(n_rows):
        for p in range(indptr[i] + 1, indptr[i + 1]):
            if indices[p] < indices[p - 1]:
                order = np.arange(indices.size)
                for r in range(n_rows):
                    a, b = indptr[r], indptr[r + 1]
                    order[a:b] = a + np.argsort(indices[a:b], kind="mergesort")
                return order
    return np.empty(0, np.int64)


@njit(cache=True)
def _bitmap_fill(indptr, indices, order, n_rows, R, tw, n_ctiles, n_bands, align):
    """One sweep in the layout's own order (band, tile, word, bit), a cursor per row of the
    band: the words and the value map are written front to back."""
    n_tiles = n_bands * n_ctiles
    words = np.zeros(n_tiles * 32, np.uint32)
    tile_ptr = np.empty(n_tiles + 1, np.int64)
    vm = np.empty(indices.size + (align - 1) * n_tiles, np.int64)
    cur = np.empty(R, np.int64)
    sorted_rows = order.size == 0
    pos = 0
    for b in range(n_bands):
        rows = min(R, n_rows - b * R)
        for r in range(rows):
            cur[r] = indptr[b * R + r]
        for ct in range(n_ctiles):
            t = b * n_ctiles + ct
            tile_ptr[t] = pos
            for q in range(32 // R):
                hi = ct * tw + q * 32 + 32
                for r in range(rows):
                    end = indptr[b * R + r + 1]
                    k = cur[r]
                    bits = np.uint32(0)
                    while k < end:
                        p = k if sorted_rows else order[k]
                        if indices[p] >= hi:
                            break
                        m = np.uint32(1) << np.uint32(indices[p] & 31)
                        if bits & m:  # a repeated column: one bit cannot hold two entries
                            return words, tile_ptr, vm[:0], p
                        bits |= m
                        vm[pos] = p
                        pos += 1
                        k += 1
                    cur[r] = k
                    words[t * 32 + q * R + r] = bits
            while pos % align:
                vm[pos] = -1
                pos += 1
    tile_ptr[n_tiles] = pos
    return words, tile_ptr, vm[:pos], -1


def _bitmap_fits(n_rows: int, n_cols: int, R: int, nnz: int, max_fill: float) -> tuple[int, int, int]:
    """The bitmap geometry, or ``FormatNotSuitable`` when its words exceed the fill budget."""
    n_bands, n_ctiles, tw = bitmap_geometry((n_rows, n_cols), R)
    words = n_bands * n_ctiles * 32
    if words > _INT32_MAX or words > max_fill * nnz + SMALL_SLACK:
        raise FormatNotSuitable(
            f"bitmap: {words} bitmap words (R={R}: {n_bands} bands x {n_ctiles} tiles x 32) for "
            f"nnz={nnz} (density {nnz / max(1, n_rows * n_cols):.4f}) exceed the budget of "
            f"{max_fill:g} x nnz + {SMALL_SLACK}; a bitmap suits denser matrices (pruned weights): "
            "choose a CSR-based format or raise max_fill")
    return n_bands, n_ctiles, tw


def _bitmap(ip, ix, n_rows: int, n_cols: int, R: int, nnz: int, max_fill: float):
    n_bands, n_ctiles, tw = _bitmap_fits(n_rows, n_cols, R, nnz, max_fill)
    words, tile_ptr, vm, dup = _bitmap_fill(ip, ix, _row_order(ip, ix, n_rows), n_rows, R, tw, n_ctiles, n_bands,
                                            BITMAP_ALIGN)
    if dup >= 0:
        row = int(np.searchsorted(ip, dup, side="right") - 1)
        raise FormatNotSuitable(f"bitmap: row {row} lists column {int(ix[dup])} twice; a bitmap holds "
                                "one entry per position (sum the duplicates first)")
    if int(tile_ptr[-1]) > _INT32_MAX:
        raise FormatNotSuitable(f"bitmap: {int(tile_ptr[-1])} value slots exceed int32 offsets; use csr")
    return n_bands, n_ctiles, tile_ptr.astype(np.int32), words.view(np.int32), vm


def stored_bytes(fd: FormatData, value_bytes: int) -> int:
    """Bytes the converted matrix occupies where its kernel runs: the int32 structure arrays
    and the value array (padding included) at ``value_bytes`` per value."""
    return int(sum(a.nbytes for a in fd.arrays.values()) + fd.padded_size * int(value_bytes))


DEFAULT_PARAMS["bitmap"] = {"R": 32}


# ---------------------------------------------------------------- conversion


def _params(fmt: str, params: dict[str, int] | None) -> dict[str, int]:
    f = FORMATS[fmt]
    given = dict(params or {})
    unknown = set(given) - set(f.params)
    if unknown:
        raise ValueError(f"format {fmt} takes parameters {f.params}; unknown {sorted(unknown)}")
    out = {k: int(given.get(k, DEFAULT_PARAMS.get(fmt, {}).get(k, 0))) for k in f.params}
    for k, v in out.items():
        if v < 1:
            raise ValueError(f"format {fmt}: parameter {k}={v} must be >= 1")
    return out


def _check_budget(fmt: str, slots: int, nnz: int, max_fill: float, what: str) -> None:
    if slots > _INT32_MAX:
        raise FormatNotSuitable(
            f"{fmt}: {slots} value slots exceed int32 offsets ({what}); use csr or csr_part"
        )
    if slots > max_fill * nnz + SMALL_SLACK:
        fill = nnz / slots if slots else 1.0
        raise FormatNotSuitable(
            f"{fmt}: {slots} value slots for nnz={nnz} (fill {fill:.3f}, {what}) exceed the "
            f"budget of {max_fill:g} x nnz + {SMALL_SLACK}; choose a CSR-based format or "
            "raise max_fill"
        )


def _ell_fits(lengths, n_rows: int, nnz: int, max_fill: float) -> int:
    """ELL's width (the longest row), or ``FormatNotSuitable`` past the fill budget."""
    width = int(lengths.max()) if n_rows else 0
    _check_budget("ell", n_rows * width, nnz, max_fill, f"{n_rows} rows x width {width}")
    return width


def _dia_fits(ip, ix, n_rows: int, n_cols: int, nnz: int, max_fill: float) -> np.ndarray:
    """DIA's diagonal offsets, or ``FormatNotSuitable`` past the fill budget."""
    offsets = _dia_offsets(ip, ix, n_rows, n_cols).astype(np.int32)
    _check_budget("dia", offsets.size * n_rows, nnz, max_fill, f"{offsets.size} diagonals x {n_rows} rows")
    return offsets


def unfit(indptr, indices, shape, fmt: str, params: dict[str, int] | None = None, *,
          max_fill: float = DEFAULT_MAX_FILL) -> str | None:
    """Why the pattern does not convert to ``fmt`` with header ``params`` (``convert``'s
    ``FormatNotSuitable`` message), or None when it does: the same budget check, without filling
    any array. O(nnz); DIA's offsets, SELL's slice layout and BSR's block count are what
    ``convert`` computes first. The CSR-based formats always fit (None)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {tuple(FORMATS)}")
    p = _params(fmt, params)
    ip, ix, n_rows, n_cols = check_csr(indptr, indices, shape)
    nnz = int(ix.size)
    try:
        if fmt == "ell":
            _ell_fits(np.diff(ip), n_rows, nnz, max_fill)
        elif fmt == "dia":
            _dia_fits(ip, ix, n_rows, n_cols, nnz, max_fill)
        elif fmt == "sell":
            C, sigma = p["C"], p["sigma"]
            n_slices = math.ceil(n_rows / C)
            _, slice_ptr = _sell_layout(np.diff(ip).astype(np.int64), n_rows, C, sigma, n_slices)
            _check_budget(fmt, int(slice_ptr[-1]), nnz, max_fill, f"C={C} sigma={sigma}")
        elif fmt == "bsr":
            R, C = p["R"], p["C"]
            nblk = int(_bsr_count(ip, ix, n_rows, n_cols, R, C)[-1])
            _check_budget(fmt, nblk * R * C, nnz, max_fill, f"{nblk} blocks of {R}x{C}")
        elif fmt == "bitmap":
            _bitmap_fits(n_rows, n_cols, p["R"], nnz, max_fill)
    except FormatNotSuitable as e:
        return str(e)
    return None


def unfit_formats(indptr, indices, shape, *, max_fill: float = DEFAULT_MAX_FILL) -> dict[str, str]:
    """The parameter-free padded formats (ELL, DIA) this pattern does not convert to, each
    with ``convert``'s reason (``unfit``). The policy's grammar leaves these formats out for the
    matrix (``policy.grammar.kernel_grammar(exclude=)``), since a kernel in them could never run
    on it."""
    reasons = {fmt: unfit(indptr, indices, shape, fmt, max_fill=max_fill) for fmt in ("ell", "dia")}
    return {fmt: why for fmt, why in reasons.items() if why is not None}


def convert(indptr, indices, shape, fmt: str, params: dict[str, int] | None = None, *,
            max_fill: float = DEFAULT_MAX_FILL) -> FormatData:
    """Convert a CSR pattern (numpy or torch, any device) to ``fmt``.

    ``params`` are the format's header parameters (``DEFAULT_PARAMS`` fill the missing
    ones). Raises ``FormatNotSuitable`` when a padded format would exceed ``max_fill`` x nnz
    (+ ``SMALL_SLACK``) slots, ``ValueError`` for a malformed pattern or unknown parameter.
    Measured on a shared 2-core machine, 12 M nonzeros (3D stencil, 120^3): csr/csr_perm
    about 70 ms (input checks), csr_part/merge 35 ms, ell 0.23 s, sell 0.29 s, dia 0.23 s,
    a refused bsr 0.08 s; at 1 M nonzeros every format takes under 40 ms.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {tuple(FORMATS)}")
    p = _params(fmt, params)
    ip, ix, n_rows, n_cols = check_csr(indptr, indices, shape)
    nnz = int(ix.size)
    f = FORMATS[fmt]
    scalars: dict[str, int] = {"n_rows": n_rows, "n_cols": n_cols}
    arrays: dict[str, np.ndarray] = {}
    lengths = np.diff(ip)

    if fmt in ("csr", "csr_perm", "csr_part", "merge"):
        arrays["row_ptr"], arrays["col_idx"] = ip, ix
        vmap = np.arange(nnz, dtype=np.int64)
        if fmt == "csr_perm":
            arrays["perm"] = np.argsort(-lengths, kind="stable").astype(np.int32)
        elif fmt == "csr_part":
            arrays["part_ptr"] = _part_ptr(ip, n_rows, p["nnz_per_part"])
            scalars["n_parts"] = int(arrays["part_ptr"].size - 1)
        elif fmt == "merge":
            items = p["items_per_part"]
            n_parts = math.ceil((n_rows + nnz) / items)
            arrays["part_row"] = _merge_part_row(ip, n_rows, nnz, items, n_parts)
            scalars["n_parts"] = n_parts
            scalars["items_per_part"] = items
    elif fmt == "ell":
        width = _ell_fits(lengths, n_rows, nnz, max_fill)
        arrays["ell_col"], vmap = _ell(ip, ix, n_rows, width)
        scalars["width"] = width
    elif fmt == "sell":
        C, sigma = p["C"], p["sigma"]
        n_slices = math.ceil(n_rows / C)
        perm, slice_ptr = _sell_layout(lengths.astype(np.int64), n_rows, C, sigma, n_slices)
        _check_budget(fmt, int(slice_ptr[-1]), nnz, max_fill, f"C={C} sigma={sigma}")
        arrays["perm"], arrays["slice_ptr"] = perm, slice_ptr.astype(np.int32)
        arrays["sell_col"], vmap = _sell_fill(ip, ix, perm, slice_ptr, C, n_slices)
        scalars["n_slices"] = n_slices
    elif fmt == "dia":
        offsets = _dia_fits(ip, ix, n_rows, n_cols, nnz, max_fill)
        vmap = _dia_fill(ip, ix, n_rows, n_cols, offsets)
        arrays["offsets"] = offsets
        scalars["n_diags"] = int(offsets.size)
    elif fmt == "bsr":
        R, C = p["R"], p["C"]
        ptr = _bsr_count(ip, ix, n_rows, n_cols, R, C)
        nblk = int(ptr[-1])
        _check_budget(fmt, nblk * R * C, nnz, max_fill, f"{nblk} blocks of {R}x{C}")
        bcol, vmap = _bsr_fill(ip, ix, n_rows, n_cols, R, C, ptr)
        arrays["bsr_ptr"], arrays["bsr_col"] = ptr.astype(np.int32), bcol
        scalars["n_brows"] = int(ptr.size - 1)
    elif fmt in ("csr_split", "tcw"):
        from sparserl_compile import graphformats

        layout = graphformats.split if fmt == "csr_split" else graphformats.tcw
        extra, arrays, vmap = layout(ip, ix, (n_rows, n_cols), p)
        scalars.update(extra)
    elif fmt == "bitmap":
        scalars["n_bands"], scalars["n_ctiles"], arrays["tile_ptr"], arrays["bitmap"], vmap = _bitmap(
            ip, ix, n_rows, n_cols, p["R"], nnz, max_fill)
    else:  # pragma: no cover - FORMATS and this function must list the same formats
        raise AssertionError(f"format {fmt} has no converter")

    missing = [a for a in f.arrays if a != f.value_array and a not in arrays]
    missing += [s for s in f.scalars if s not in scalars]
    assert not missing, f"converter for {fmt} left out {missing}"
    arrays = {a: np.ascontiguousarray(arrays[a], dtype=np.int32) for a in f.arrays if a != f.value_array}
    return FormatData(fmt, p, {s: int(scalars[s]) for s in f.scalars}, arrays,
                      np.ascontiguousarray(vmap, dtype=np.int64), f.value_array, nnz)


def warm() -> float:
    """Load (or, on a fresh install, JIT-compile) every numba converter and the structure
    statistics for int32 patterns, the types the runtime passes; returns the seconds taken.

    numba caches compiled code on disk (``cache=True``), so this costs about 1-3 s per
    converter once per install and tens of milliseconds per process after that. The sandbox
    workers call it while they wait for their first job, so a first product on a new
    structure does not pay it.
    """
    import time

    from sparserl_compile import structure

    t0 = time.perf_counter()
    n = 8
    rows = np.repeat(np.arange(n), 3)
    cols = (rows + np.tile(np.arange(3), n)) % n
    ip = np.searchsorted(rows, np.arange(n + 1)).astype(np.int32)
    ix = np.sort(cols.reshape(n, 3), axis=1).reshape(-1).astype(np.int32)
    structure.features(ip, ix, (n, n))
    for fmt, params in (("csr_part", None), ("merge", None), ("ell", None), ("sell", {"C": 4, "sigma": 8}),
                        ("dia", None), ("bsr", {"R": 2, "C": 2}), ("bitmap", {"R": 4}),
                        ("csr_split", {"order": 4, "piece": 4, "hub": 3, "warps": 2, "split": 2}), ("tcw", {"order": 2, "H": 4})):
        try:
            convert(ip, ix, (n, n), fmt, params, max_fill=1e9)
        except FormatNotSuitable:  # pragma: no cover - the warm-up pattern suits every format
            pass
    return time.perf_counter() - t0
