"""Row orders and the two graph layouts, ``csr_split`` and ``tcw`` (called by ``formats.convert``).

Power-law graphs defeat plain CSR SpMM in two ways: a few hub rows hold a large share of the
nonzeros (one warp per row leaves them to one warp while the rest of the GPU idles), and the
rows that touch the same dense rows of ``X`` are far apart, so each gathered row of ``X`` is
evicted from the L2 before its next use. Both layouts here fix the structure ahead of time
(it is known before the first call) and carry everything a kernel needs to run the rows in a
better order while writing each result to the user's row.

Row orders (the ``order`` header parameter of both layouts):

* ``1`` natural: rows as given.
* ``2`` degree: rows by descending length (stable), the longest first.
* ``3`` rcm: reverse Cuthill-McKee (``scipy.sparse.csgraph.reverse_cuthill_mckee`` on the
  pattern plus its transpose) for square matrices: rows that share neighbours become close.
  Rectangular matrices fall back to ``4``.
* ``4`` bfs: breadth-first over the row-column bipartite graph, started from the longest
  unvisited row: the rows that share a column (and so read the same row of ``X``) are
  listed together. A cheap stand-in for community orders (Rabbit order).

Layouts (``n_rows``/``n_cols``/``nnz`` of the CSR input):

* ``csr_split`` (parameters ``order``, ``piece``, ``hub``, ``warps``, ``split``): the CSR
  rows stored in processing order: the hub rows (length >= ``hub``) first, in the row order,
  each cut into ``min(split, ceil(length / hub))`` chunks of near-equal length (one chunk,
  the whole row, for ``split = 1``), then the other rows in the row order. Stored row ``k``
  (a row or a hub chunk) belongs to the user's row ``row_id[k]``; ``srow_ptr`` (stored rows
  + 1 entries), ``scol`` and the values follow the stored order. The ``n_hubs`` hub chunks
  come first; the later stored rows are cut greedily into pieces of at most ``piece`` work
  (a row's work is its length, at least 1; a longer row is a piece of its own):
  ``piece_ptr`` holds ``n_pieces + 1`` stored-row bounds. ``n_parts = n_hubs * warps +
  n_pieces``: launched with ``warps`` warps per block over ``parts``, the first ``n_hubs``
  blocks take one hub chunk each (all warps of the block), every later warp one piece. With
  ``split > 1`` the chunks of one row are summed into it (``atomicAdd``, ``zero_output``).
* ``tcw`` (parameters ``order``, ``H``): condensed row windows for tensor cores (TC-GNN,
  DTC-SpMM). The rows in the row order are cut into ``n_parts = ceil(n_rows / H)`` windows of
  ``H`` rows; ``row_id[w*H + r]`` is the user's row of row ``r`` of window ``w`` (-1 past
  ``n_rows``). A window's distinct columns, ascending, are cut into tiles of ``TILE_K`` = 16;
  tiles ``win_ptr[w] .. win_ptr[w+1]-1`` belong to window ``w``, and ``tile_col[t*16 + j]`` is
  the column of condensed column ``j`` of tile ``t`` (-1 = padding: that row of ``X`` reads
  as zero). The nonzeros of tile ``t`` are ``tile_ptr[t] .. tile_ptr[t+1]-1``, each with its
  place in the dense ``H x 16`` tile, ``tcw_pos[q] = r*16 + j``, and its value in the value
  array at ``q``. No value slot is padding: the kernel zero-fills a tile before scattering.

Orders 3 and 4 are kept per pattern (a BLAKE2b digest of indptr, indices and shape) for the
last few patterns, so the candidates of one search pay for them once.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict

import numpy as np
from numba import njit

#: order code -> name (the ``order`` header parameter)
ORDERS = {1: "natural", 2: "degree", 3: "rcm", 4: "bfs"}
#: format parameters that change only the stored arrays, never the kernel text (the kernel reads
#: the row map the layout stores)
LAYOUT_ONLY_PARAMS = frozenset({"order"})
#: condensed columns per tensor-core tile (the k of the wmma shapes the tcw kernels use)
TILE_K = 16
MAX_WINDOW = 64
MAX_WARPS = 32

_CACHE: "OrderedDict[tuple, np.ndarray]" = OrderedDict()
_CACHE_SIZE = 4
_LOCK = threading.Lock()


def order_name(code: int) -> str:
    """The name of order ``code``; a ValueError lists the codes."""
    try:
        return ORDERS[int(code)]
    except KeyError:
        raise ValueError(f"order={code}: expected one of {ORDERS}") from None


# ---------------------------------------------------------------- orders


@njit(cache=True)
def _transpose(ip, ix, n_cols):
    """CSC of the pattern: (col_ptr, row of each entry)."""
    cp = np.zeros(n_cols + 1, np.int64)
    for p in range(ix.size):
        cp[ix[p] + 1] += 1
    for c in range(n_cols):
        cp[c + 1] += cp[c]
    fill = cp[:-1].copy()
    cr = np.empty(ix.size, np.int32)
    for r in range(ip.size - 1):
        for p in range(ip[r], ip[r + 1]):
            c = ix[p]
            cr[fill[c]] = r
            fill[c] += 1
    return cp, cr


@njit(cache=True)
def _bfs(ip, ix, cp, cr, seeds):
    n_rows = ip.size - 1
    seen_row = np.zeros(n_rows, np.bool_)
    seen_col = np.zeros(cp.size - 1, np.bool_)
    out = np.empty(n_rows, np.int32)
    head = 0
    tail = 0
    for s in seeds:
        if seen_row[s]:
            continue
        seen_row[s] = True
        out[tail] = s
        tail += 1
        while head < tail:
            r = out[head]
            head += 1
            for p in range(ip[r], ip[r + 1]):
                c = ix[p]
                if seen_col[c]:
                    continue
                seen_col[c] = True
                for q in range(cp[c], cp[c + 1]):
                    r2 = cr[q]
                    if not seen_row[r2]:
                        seen_row[r2] = True
                        out[tail] = r2
                        tail += 1
    return out


def _digest(ip: np.ndarray, ix: np.ndarray, shape) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(ip).view(np.uint8))
    h.update(np.ascontiguousarray(ix).view(np.uint8))
    h.update(f"{shape[0]}x{shape[1]}".encode())
    return h.digest()


def row_order(ip: np.ndarray, ix: np.ndarray, shape, order: int) -> np.ndarray:
    """The rows of the CSR pattern (int32 ``ip``/``ix``) in order ``order`` (``ORDERS``), as an
    int32 permutation: position k holds the k-th row to process."""
    name = order_name(order)
    n_rows, n_cols = int(shape[0]), int(shape[1])
    lengths = np.diff(ip)
    if name == "natural":
        return np.arange(n_rows, dtype=np.int32)
    if name == "degree":
        return np.argsort(-lengths, kind="stable").astype(np.int32)
    key = (_digest(ip, ix, shape), name)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    if name == "rcm" and n_rows == n_cols and n_rows > 0:
        import scipy.sparse as sp
        from scipy.sparse.csgraph import reverse_cuthill_mckee

        a = sp.csr_matrix((np.ones(ix.size, np.int8), ix, ip), shape=(n_rows, n_cols))
        out = np.ascontiguousarray(reverse_cuthill_mckee(a, symmetric_mode=False), dtype=np.int32)
    else:
        cp, cr = _transpose(ip, ix, n_cols)
        seeds = np.argsort(-lengths, kind="stable").astype(np.int32)
        out = _bfs(ip, ix, cp, cr, seeds)
    out.setflags(write=False)
    with _LOCK:
        _CACHE[key] = out
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return out


# ---------------------------------------------------------------- csr_split


@njit(cache=True)
def _split_layout(ix, starts, ends, n_hubs, piece):
    n = starts.size
    srow_ptr = np.empty(n + 1, np.int64)
    srow_ptr[0] = 0
    for k in range(n):
        srow_ptr[k + 1] = srow_ptr[k] + ends[k] - starts[k]
    vm = np.empty(srow_ptr[n], np.int64)
    scol = np.empty(srow_ptr[n], np.int32)
    for k in range(n):
        q = srow_ptr[k]
        for p in range(starts[k], ends[k]):
            vm[q] = p
            scol[q] = ix[p]
            q += 1
    pp = np.empty(n - n_hubs + 1, np.int32)
    pp[0] = n_hubs
    m = 1
    acc = 0
    for k in range(n_hubs, n):
        w = max(srow_ptr[k + 1] - srow_ptr[k], 1)
        if acc > 0 and acc + w > piece:
            pp[m] = k
            m += 1
            acc = 0
        acc += w
    if pp[m - 1] != n:
        pp[m] = n
        m += 1
    return srow_ptr, scol, vm, pp[:m]


def split(ip, ix, shape, p: dict[str, int]):
    """``csr_split`` of an int32 CSR pattern: (scalars, arrays, value_map)."""
    n_rows, n_cols = int(shape[0]), int(shape[1])
    if p["warps"] > MAX_WARPS:
        raise ValueError(f"csr_split: warps={p['warps']} exceeds the {MAX_WARPS} warps of a 1024-thread block")
    order = row_order(ip, ix, shape, p["order"])
    lengths = np.diff(ip).astype(np.int64)
    is_hub = lengths[order] >= p["hub"]
    hubs, rest = order[is_hub], order[~is_hub]
    L = lengths[hubs]
    cuts = np.minimum(p["split"], np.maximum(-(-L // p["hub"]), 1))  # chunks per hub row
    owner = np.repeat(np.arange(hubs.size), cuts)
    j = np.arange(owner.size) - np.repeat(np.cumsum(cuts) - cuts, cuts)  # chunk index within its row
    base = ip[hubs].astype(np.int64)[owner]
    starts = np.concatenate([base + (L[owner] * j) // cuts[owner], ip[rest].astype(np.int64)])
    ends = np.concatenate([base + (L[owner] * (j + 1)) // cuts[owner], ip[rest + 1].astype(np.int64)])
    n_hubs = int(owner.size)
    srow_ptr, scol, vm, piece_ptr = _split_layout(ix, starts, ends, n_hubs, p["piece"])
    n_pieces = int(piece_ptr.size - 1)
    scalars = {"n_rows": n_rows, "n_cols": n_cols, "n_hubs": n_hubs,
               "n_parts": n_hubs * p["warps"] + n_pieces}
    arrays = {"row_id": np.concatenate([hubs[owner], rest]).astype(np.int32), "piece_ptr": piece_ptr,
              "srow_ptr": srow_ptr, "scol": scol}
    return scalars, arrays, vm


# ---------------------------------------------------------------- tcw


@njit(cache=True)
def _tcw_count(ip, ix, order, H, n_cols):
    n_rows = order.size
    n_win = (n_rows + H - 1) // H
    stamp = np.full(n_cols + 1, -1, np.int64)
    win_ptr = np.zeros(n_win + 1, np.int64)
    for w in range(n_win):
        d = 0
        for k in range(w * H, min(w * H + H, n_rows)):
            r = order[k]
            for p in range(ip[r], ip[r + 1]):
                c = ix[p]
                if stamp[c] != w:
                    stamp[c] = w
                    d += 1
        win_ptr[w + 1] = win_ptr[w] + (d + 15) // 16
    return win_ptr


@njit(cache=True)
def _tcw_fill(ip, ix, order, H, n_cols, win_ptr):
    n_rows = order.size
    n_win = win_ptr.size - 1
    n_tiles = win_ptr[n_win]
    nnz = ix.size
    tile_col = np.full(n_tiles * 16, -1, np.int32)
    tile_ptr = np.zeros(n_tiles + 1, np.int64)
    pos = np.empty(nnz, np.int32)
    vm = np.empty(nnz, np.int64)
    row_id = np.full(n_win * H, -1, np.int32)
    stamp = np.full(n_cols + 1, -1, np.int64)
    rank = np.zeros(n_cols + 1, np.int64)
    cols = np.empty(max(nnz, 1), np.int32)
    fill = np.zeros(n_tiles + 1, np.int64)
    for w in range(n_win):
        d = 0
        r0 = w * H
        r1 = min(r0 + H, n_rows)
        for k in range(r0, r1):
            r = order[k]
            row_id[k] = r
            for p in range(ip[r], ip[r + 1]):
                c = ix[p]
                if stamp[c] != w:
                    stamp[c] = w
                    cols[d] = c
                    d += 1
        srt = np.sort(cols[:d])
        t0 = win_ptr[w]
        t1 = win_ptr[w + 1]
        for j in range(d):
            rank[srt[j]] = j
            tile_col[t0 * 16 + j] = srt[j]
        for k in range(r0, r1):
            r = order[k]
            for p in range(ip[r], ip[r + 1]):
                tile_ptr[t0 + rank[ix[p]] // 16 + 1] += 1
        for t in range(t0, t1):
            tile_ptr[t + 1] += tile_ptr[t]
            fill[t] = tile_ptr[t]
        for k in range(r0, r1):
            r = order[k]
            for p in range(ip[r], ip[r + 1]):
                c = rank[ix[p]]
                t = t0 + c // 16
                q = fill[t]
                fill[t] += 1
                pos[q] = (k - r0) * 16 + c % 16
                vm[q] = p
    return row_id, tile_col, tile_ptr, pos, vm


def tcw(ip, ix, shape, p: dict[str, int]):
    """``tcw`` of an int32 CSR pattern: (scalars, arrays, value_map)."""
    n_rows, n_cols = int(shape[0]), int(shape[1])
    H = p["H"]
    if H > MAX_WINDOW:
        raise ValueError(f"tcw: H={H} rows per window exceeds {MAX_WINDOW}")
    order = row_order(ip, ix, shape, p["order"]).copy()  # writable: one numba specialization for every order
    win_ptr = _tcw_count(ip, ix, order, H, n_cols)
    row_id, tile_col, tile_ptr, pos, vm = _tcw_fill(ip, ix, order, H, n_cols, win_ptr)
    if tile_ptr[-1] > np.iinfo(np.int32).max or tile_col.size > np.iinfo(np.int32).max:
        raise ValueError(f"tcw: {win_ptr[-1]} tiles exceed int32 offsets")
    scalars = {"n_rows": n_rows, "n_cols": n_cols, "n_parts": int(math.ceil(n_rows / H))}
    arrays = {"row_id": row_id, "win_ptr": win_ptr, "tile_col": tile_col, "tile_ptr": tile_ptr, "tcw_pos": pos}
    return scalars, arrays, vm


def tile_density(fd) -> float:
    """Nonzeros per dense slot of a ``tcw`` layout's tiles (0 for an empty one): how much of
    each tensor-core multiply is useful work."""
    n_tiles = int(fd.arrays["win_ptr"][-1])
    return fd.nnz / (n_tiles * fd.params["H"] * TILE_K) if n_tiles else 0.0
