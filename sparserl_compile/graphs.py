"""Graph generators at scale (R-MAT, random geometric, community power-law) and GCN normalization.

Each generator returns the adjacency of an undirected graph as canonical CSR
(``matrices.canonical``: float32 values, int32 indices, sorted columns, no duplicates): a
symmetric pattern with unit values, no self loops unless ``self_loops=True`` (then every
diagonal entry is present). The loops run under numba, in parallel over edges or vertices,
so graphs of 10^7-10^8 edges take seconds rather than minutes of numpy.

Randomness is counter-based: every draw is a hash (splitmix64) of ``(seed, stream, index)``,
so a graph depends on its arguments and ``seed`` only, never on the number of threads.

* ``rmat_graph``: Graph500-style R-MAT/Kronecker edges, symmetrized, vertex ids shuffled by
  default (as Graph500 does: without it vertex 0 is the largest hub and ids leak the recursion).
* ``geometric_graph``: points uniform in the unit square, an edge between points closer than
  the radius that gives ``avg_degree``; ids follow a grid of cells of that radius (row-major),
  so neighbours are near in index (``shuffle=True`` hides that order).
* ``community_graph``: a degree-corrected stochastic block model, LFR-like: power-law expected
  degrees (exponent ``gamma``), power-law community sizes (exponent ``beta``), a fraction
  ``mixing`` of each vertex's edges leaving its community; Chung-Lu sampling (targets drawn in
  proportion to expected degree) inside and across communities. Communities are contiguous id
  ranges unless ``shuffle=True``. A vertex whose expected internal degree exceeds its
  community's size gets fewer edges than expected (duplicates merge).

``gcn_normalize(a)`` is D^-1/2 (A + I) D^-1/2 of the pattern of ``a`` (existing self loops are
kept at weight one, as PyG's ``gcn_norm`` with ``add_remaining_self_loops`` does), D the row
sums of A + I; ``mean_normalize(a)`` is D^-1 A (GraphSAGE's mean aggregation).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from numba import njit, prange

_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xBF58476D1CE4E5B9)
_K3 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S32 = np.uint64(32)
_S11 = np.uint64(11)
_MASK32 = np.uint64(0xFFFFFFFF)
_INV53 = 1.0 / 9007199254740992.0  # 2^-53
_INV32 = 1.0 / 4294967296.0  # 2^-32


@njit(inline="always", cache=True)
def _mix(z):
    z = z + _K1
    z = (z ^ (z >> _S30)) * _K2
    z = (z ^ (z >> _S27)) * _K3
    return z ^ (z >> _S31)


@njit(inline="always", cache=True)
def _bits(seed, stream, i):
    """64 random bits for draw ``i`` of ``stream`` under ``seed``."""
    return _mix(_mix(np.uint64(seed) * _K3 + np.uint64(stream)) ^ np.uint64(i))


@njit(inline="always", cache=True)
def _uniform(seed, stream, i):
    """A float64 uniform in [0, 1) for draw ``i`` of ``stream``."""
    return float(_bits(seed, stream, i) >> _S11) * _INV53


def _check(name: str, value, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: {what}")


# ---------------------------------------------------------------- symmetric CSR from edges


@njit(cache=True)
def _count_degrees(n, src, dst):
    deg = np.zeros(n, np.int64)
    for e in range(src.size):
        u, v = src[e], dst[e]
        if u != v:
            deg[u] += 1
            deg[v] += 1
    return deg


@njit(cache=True)
def _scatter(indptr, src, dst, cols):
    pos = indptr[:-1].copy()
    for e in range(src.size):
        u, v = src[e], dst[e]
        if u != v:
            cols[pos[u]] = v
            pos[u] += 1
            cols[pos[v]] = u
            pos[v] += 1


@njit(parallel=True, cache=True)
def _sort_unique_rows(indptr, cols, self_loops):
    """Sort each row, drop duplicates; the kept length per row (plus one for a diagonal)."""
    n = indptr.size - 1
    kept = np.zeros(n, np.int64)
    for r in prange(n):
        a, b = indptr[r], indptr[r + 1]
        if b > a:
            cols[a:b] = np.sort(cols[a:b])
            k = 1
            for j in range(a + 1, b):
                if cols[j] != cols[a + k - 1]:
                    cols[a + k] = cols[j]
                    k += 1
            kept[r] = k
        if self_loops:
            kept[r] += 1
    return kept


@njit(parallel=True, cache=True)
def _compact(indptr, cols, new_ptr, self_loops):
    n = indptr.size - 1
    out = np.empty(new_ptr[n], np.int32)
    for r in prange(n):
        a = indptr[r]
        k = new_ptr[r + 1] - new_ptr[r] - (1 if self_loops else 0)
        o = new_ptr[r]
        placed = not self_loops
        for j in range(k):
            c = cols[a + j]
            if not placed and c > r:
                out[o] = r
                o += 1
                placed = True
            out[o] = c
            o += 1
        if not placed:
            out[o] = r
    return out


def symmetric_csr(n: int, src: np.ndarray, dst: np.ndarray, *, self_loops: bool = False) -> sp.csr_matrix:
    """The symmetric 0/1 adjacency of the undirected edges ``(src[i], dst[i])`` as canonical
    CSR: both directions, duplicates merged, input self loops dropped, and every diagonal entry
    added when ``self_loops``."""
    src = np.ascontiguousarray(src)
    dst = np.ascontiguousarray(dst)
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"src and dst must be 1-D of one length, got shapes {src.shape} and {dst.shape}")
    if src.size and (min(int(src.min()), int(dst.min())) < 0 or max(int(src.max()), int(dst.max())) >= n):
        raise ValueError(f"edge endpoints must lie in [0, {n}), got [{min(src.min(), dst.min())}, "
                         f"{max(src.max(), dst.max())}]")
    deg = _count_degrees(n, src, dst)
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(deg, out=indptr[1:])
    cols = np.empty(int(indptr[-1]), np.int32)
    _scatter(indptr, src, dst, cols)
    kept = _sort_unique_rows(indptr, cols, self_loops)
    new_ptr = np.zeros(n + 1, np.int64)
    np.cumsum(kept, out=new_ptr[1:])
    if new_ptr[-1] >= 2**31:
        raise ValueError(f"{int(new_ptr[-1])} nonzeros do not fit int32 indices (sparserl's index type)")
    out = _compact(indptr, cols, new_ptr, self_loops)
    m = sp.csr_matrix((np.ones(out.size, np.float32), out, new_ptr.astype(np.int32)), shape=(n, n))
    m.has_sorted_indices = True
    return m


def _shuffle_ids(n: int, seed: int, src: np.ndarray, dst: np.ndarray) -> None:
    """Relabel vertices by a random permutation of ``range(n)`` (in place)."""
    perm = np.argsort(_keys(n, seed, 99), kind="stable").astype(src.dtype)
    np.take(perm, src, out=src)
    np.take(perm, dst, out=dst)


@njit(parallel=True, cache=True)
def _keys(n, seed, stream):
    out = np.empty(n, np.uint64)
    for i in prange(n):
        out[i] = _bits(seed, stream, i)
    return out


# ---------------------------------------------------------------- R-MAT


@njit(parallel=True, cache=True)
def _rmat_edges(scale, m, a, b, c, seed):
    src = np.empty(m, np.int32)
    dst = np.empty(m, np.int32)
    ab, abc = a + b, a + b + c
    for e in prange(m):
        u = 0
        v = 0
        z = np.uint64(0)
        for bit in range(scale):
            if bit % 2 == 0:  # one 64-bit draw serves two levels (32 bits each)
                z = _bits(seed, 1 + bit // 2, e)
                r = float(z & _MASK32) * _INV32
            else:
                r = float(z >> _S32) * _INV32
            if r > ab:  # quadrants c, d: source bit set
                u |= 1 << bit
                if r > abc:  # quadrant d: target bit set too
                    v |= 1 << bit
            elif r > a:  # quadrant b: target bit set
                v |= 1 << bit
        src[e] = u
        dst[e] = v
    return src, dst


def rmat_graph(scale: int, edge_factor: float = 16, a: float = 0.57, b: float = 0.19, c: float = 0.19,
               seed: int = 0, shuffle: bool = True, self_loops: bool = False) -> sp.csr_matrix:
    """Undirected R-MAT graph: 2^scale vertices, ``edge_factor * 2^scale`` edges drawn
    (Graph500's parameters by default), symmetrized; duplicates merge, so the matrix has fewer
    than ``2 * edge_factor * 2^scale`` nonzeros. ``shuffle``: vertex ids randomly permuted."""
    _check("scale", scale, isinstance(scale, (int, np.integer)) and 1 <= scale <= 30, "must be an int in 1..30")
    _check("edge_factor", edge_factor, edge_factor > 0, "must be positive")
    _check("a, b, c", (a, b, c), min(a, b, c) >= 0 and a + b + c < 1, "need a, b, c >= 0 and a + b + c < 1")
    n = 1 << int(scale)
    src, dst = _rmat_edges(int(scale), int(round(edge_factor * n)), float(a), float(b), float(c), int(seed))
    if shuffle:
        _shuffle_ids(n, int(seed), src, dst)
    return symmetric_csr(n, src, dst, self_loops=self_loops)


# ---------------------------------------------------------------- random geometric


@njit(parallel=True, cache=True)
def _rgg_points(n, seed, g):
    """Points sorted by cell (row-major cells of side 1/g): coordinates and cell pointers."""
    x = np.empty(n)
    y = np.empty(n)
    cell = np.empty(n, np.int64)
    for i in prange(n):
        x[i] = _uniform(seed, 1, i)
        y[i] = _uniform(seed, 2, i)
        cell[i] = min(int(y[i] * g), g - 1) * g + min(int(x[i] * g), g - 1)
    order = np.argsort(cell, kind="mergesort")
    xs, ys = x[order], y[order]
    cptr = np.zeros(g * g + 1, np.int64)
    for i in range(n):
        cptr[cell[order[i]] + 1] += 1
    for k in range(g * g):
        cptr[k + 1] += cptr[k]
    return xs, ys, cptr


@njit(inline="always", cache=True)
def _rgg_row(i, xs, ys, cptr, g, r2, cols, o, fill, self_loops):
    """Neighbours of point i in increasing index (cells visited in increasing cell order)."""
    cx = min(int(xs[i] * g), g - 1)
    cy = min(int(ys[i] * g), g - 1)
    k = 0
    placed = not self_loops
    for dy in range(-1, 2):
        yy = cy + dy
        if yy < 0 or yy >= g:
            continue
        for dx in range(-1, 2):
            xx = cx + dx
            if xx < 0 or xx >= g:
                continue
            c = yy * g + xx
            for j in range(cptr[c], cptr[c + 1]):
                if not placed and j >= i:
                    if fill:
                        cols[o + k] = i
                    k += 1
                    placed = True
                if j == i:
                    continue
                ddx = xs[i] - xs[j]
                ddy = ys[i] - ys[j]
                if ddx * ddx + ddy * ddy <= r2:
                    if fill:
                        cols[o + k] = j
                    k += 1
    if not placed:
        if fill:
            cols[o + k] = i
        k += 1
    return k


@njit(parallel=True, cache=True)
def _rgg(n, seed, radius, self_loops):
    g = max(1, int(1.0 / radius))  # cells at least one radius wide: neighbours are in the 3 x 3 block
    xs, ys, cptr = _rgg_points(n, seed, g)
    r2 = radius * radius
    dummy = np.empty(0, np.int32)
    counts = np.empty(n, np.int64)
    for i in prange(n):
        counts[i] = _rgg_row(i, xs, ys, cptr, g, r2, dummy, 0, False, self_loops)
    indptr = np.zeros(n + 1, np.int64)
    for i in range(n):
        indptr[i + 1] = indptr[i] + counts[i]
    cols = np.empty(indptr[n], np.int32)
    for i in prange(n):
        _rgg_row(i, xs, ys, cptr, g, r2, cols, indptr[i], True, self_loops)
    return indptr, cols


def geometric_graph(n: int, avg_degree: float, seed: int = 0, shuffle: bool = False,
                    self_loops: bool = False) -> sp.csr_matrix:
    """Random geometric graph of ``n`` points in the unit square, radius
    ``sqrt(avg_degree / (pi n))`` (fewer neighbours near the border); ids in cell order unless
    ``shuffle``."""
    _check("n", n, isinstance(n, (int, np.integer)) and 1 <= n < 2**31, "must be an int in 1..2^31-1")
    _check("avg_degree", avg_degree, 0 < avg_degree < n, f"must be in (0, n={n})")
    indptr, cols = _rgg(int(n), int(seed), float(np.sqrt(avg_degree / (np.pi * n))), bool(self_loops))
    if indptr[-1] >= 2**31:
        raise ValueError(f"{int(indptr[-1])} nonzeros do not fit int32 indices (sparserl's index type)")
    m = sp.csr_matrix((np.ones(cols.size, np.float32), cols, indptr.astype(np.int32)), shape=(n, n))
    if shuffle:
        coo = m.tocoo()
        upper = coo.row < coo.col
        src, dst = coo.row[upper].astype(np.int32), coo.col[upper].astype(np.int32)
        _shuffle_ids(n, int(seed), src, dst)
        return symmetric_csr(n, src, dst, self_loops=self_loops)
    m.has_sorted_indices = True
    return m


# ---------------------------------------------------------------- community power-law


def _power_law(rng_u: np.ndarray, lo: float, hi: float, exponent: float) -> np.ndarray:
    """Inverse-CDF draws of a power law p(x) ~ x^-exponent truncated to [lo, hi]."""
    e = 1.0 - exponent
    return (lo**e + rng_u * (hi**e - lo**e)) ** (1.0 / e)


@njit(parallel=True, cache=True)
def _community_edges(w, cw, comm_of, cstart, cend, stub_ptr, mixing, seed):
    m = stub_ptr[-1]
    src = np.empty(m, np.int32)
    dst = np.empty(m, np.int32)
    total = cw[-1]
    for i in prange(w.size):
        k = comm_of[i]
        lo, hi = cw[cstart[k]], cw[cend[k]]
        for e in range(stub_ptr[i], stub_ptr[i + 1]):
            if _uniform(seed, 3, e) < mixing:  # an edge out of the community: any target by weight
                t = _uniform(seed, 4, e) * total
            else:
                t = lo + _uniform(seed, 4, e) * (hi - lo)
            j = np.searchsorted(cw, t, side="right") - 1
            src[e] = i
            dst[e] = min(max(j, 0), w.size - 1)
    return src, dst


def community_graph(n: int, avg_degree: float = 16.0, gamma: float = 2.5, mixing: float = 0.2,
                    beta: float = 1.5, min_community: int = 32, max_community: int | None = None,
                    max_degree: int | None = None, seed: int = 0, shuffle: bool = True,
                    self_loops: bool = False) -> sp.csr_matrix:
    """Power-law graph with community structure (see the module doc). Community sizes in
    ``[min_community, max_community]`` (default ``max(min_community, n // 50)``), expected degrees
    in ``[1, max_degree]`` (default ``sqrt(n) * avg_degree / 2``), scaled to mean ``avg_degree``."""
    _check("n", n, isinstance(n, (int, np.integer)) and 2 <= n < 2**31, "must be an int in 2..2^31-1")
    _check("avg_degree", avg_degree, 0 < avg_degree < n, f"must be in (0, n={n})")
    _check("gamma", gamma, gamma > 1, "the degree exponent must be > 1")
    _check("beta", beta, beta > 1, "the community-size exponent must be > 1")
    _check("mixing", mixing, 0 <= mixing <= 1, "the fraction of edges leaving a community must be in [0, 1]")
    c_hi = int(max_community or max(min_community, n // 50))
    _check("min_community", min_community, 1 <= min_community <= min(c_hi, n), f"must be in 1..{min(c_hi, n)}")
    d_hi = float(max_degree or max(avg_degree, np.sqrt(n) * avg_degree / 2))
    rng = np.random.default_rng(seed)
    w = _power_law(rng.random(n), 1.0, d_hi, gamma)
    w = np.minimum(w * (avg_degree / w.mean()), d_hi)
    # community sizes by the power law until every vertex has one (the last one cut to fit)
    sizes = np.clip(_power_law(rng.random(n // min_community + 1), min_community, c_hi, beta).astype(np.int64),
                    min_community, c_hi)  # (rounding may land a hair below min_community)
    cend = np.cumsum(sizes)
    k = int(np.searchsorted(cend, n)) + 1
    cend = np.minimum(cend[:k], n)
    cstart = np.concatenate([[0], cend[:-1]])
    comm_of = np.repeat(np.arange(k, dtype=np.int64), cend - cstart)
    cw = np.zeros(n + 1)
    np.cumsum(w, out=cw[1:])
    # each vertex emits about w/2 edges: with the targets' half its expected degree is w
    half = w / 2
    stubs = np.floor(half).astype(np.int64) + (rng.random(n) < half - np.floor(half))
    stub_ptr = np.zeros(n + 1, np.int64)
    np.cumsum(stubs, out=stub_ptr[1:])
    src, dst = _community_edges(w, cw, comm_of, cstart, cend, stub_ptr, float(mixing), int(seed))
    if shuffle:
        _shuffle_ids(n, int(seed), src, dst)
    return symmetric_csr(n, src, dst, self_loops=self_loops)


# ---------------------------------------------------------------- normalizations


@njit(parallel=True, cache=True)
def _diagonal_counts(indptr, indices):
    """Row lengths once every missing diagonal entry is added."""
    n = indptr.size - 1
    out = np.empty(n, np.int64)
    for r in prange(n):
        has = False
        for j in range(indptr[r], indptr[r + 1]):
            if indices[j] == r:
                has = True
                break
        out[r] = indptr[r + 1] - indptr[r] + (0 if has else 1)
    return out


@njit(parallel=True, cache=True)
def _fill_with_diagonal(indptr, indices, new_ptr):
    n = indptr.size - 1
    out = np.empty(new_ptr[n], np.int32)
    for r in prange(n):
        o = new_ptr[r]
        placed = new_ptr[r + 1] - new_ptr[r] == indptr[r + 1] - indptr[r]  # already has one
        for j in range(indptr[r], indptr[r + 1]):
            if not placed and indices[j] > r:
                out[o] = r
                o += 1
                placed = True
            out[o] = indices[j]
            o += 1
        if not placed:
            out[o] = r
    return out


@njit(parallel=True, cache=True)
def _sym_scale(indptr, indices, dinv, out):
    for r in prange(indptr.size - 1):
        for j in range(indptr[r], indptr[r + 1]):
            out[j] = dinv[r] * dinv[indices[j]]


def _pattern(a, add_diagonal: bool) -> tuple[np.ndarray, np.ndarray]:
    """(indptr int64, indices int32) of the canonical pattern of ``a``, with every diagonal
    entry present when ``add_diagonal``."""
    from sparserl_compile.matrices import canonical

    a = canonical(a)
    indptr = a.indptr.astype(np.int64)
    if not add_diagonal:
        return indptr, a.indices
    new_ptr = np.zeros(a.shape[0] + 1, np.int64)
    np.cumsum(_diagonal_counts(indptr, a.indices), out=new_ptr[1:])
    if new_ptr[-1] == a.nnz:
        return indptr, a.indices
    return new_ptr, _fill_with_diagonal(indptr, a.indices, new_ptr)


def gcn_normalize(a: sp.spmatrix, add_self_loops: bool = True) -> sp.csr_matrix:
    """D^-1/2 (A + I) D^-1/2 over the pattern of the square matrix ``a`` (values ignored, every
    self loop of weight one), D = row sums of A + I; without ``add_self_loops`` D^-1/2 A D^-1/2.
    Rows without entries stay empty. Float32, canonical."""
    if a.shape[0] != a.shape[1]:
        raise ValueError(f"gcn_normalize needs a square adjacency, got shape {a.shape}")
    indptr, indices = _pattern(a, add_self_loops)
    if indptr[-1] >= 2**31:
        raise ValueError(f"{int(indptr[-1])} nonzeros do not fit int32 indices (sparserl's index type)")
    deg = np.diff(indptr).astype(np.float64)
    dinv = np.where(deg > 0, 1.0 / np.sqrt(np.maximum(deg, 1.0)), 0.0)
    data = np.empty(indices.size, np.float64)
    _sym_scale(indptr, indices, dinv, data)
    m = sp.csr_matrix((data.astype(np.float32), indices, indptr.astype(np.int32)), shape=a.shape)
    m.has_sorted_indices = True
    return m


def mean_normalize(a: sp.spmatrix) -> sp.csr_matrix:
    """D^-1 A over the pattern of ``a`` (the mean over each row's neighbours; empty rows stay
    empty). Float32, canonical."""
    from sparserl_compile.matrices import canonical

    p = canonical(a).copy()
    deg = np.diff(p.indptr).astype(np.float64)
    p.data = np.repeat(1.0 / np.maximum(deg, 1.0), np.diff(p.indptr)).astype(np.float32)
    return p
