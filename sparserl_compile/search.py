"""The search provider ("oracle"): every applicable point of the kernel space, cheaply pruned.

``SearchProvider().candidates(problem, k)`` asks ``kernels.space(op, dtype, n=, structure=)``
for all family points that apply to the problem, then drops the ones that cannot win or
cannot run, by structure rules computed once per pattern (``structure.features``):

* ``n_align``: SpMM kernels whose ``n_align`` does not divide ``n`` (they cannot run).
* ``dia``: only with at most ``MAX_DIAGS`` occupied diagonals filled at least
  ``MIN_DIAG_FILL`` (banded and stencil matrices); otherwise it reads mostly zeros.
* ``ell``: only when the padded size ``row_max * n_rows`` is at most ``MAX_PAD`` x nnz.
* ``bsr``: only when its R x C blocks are at least ``MIN_BLOCK_DENSITY`` full (from the
  square-block densities of ``structure.features`` where R == C, else by conversion).
* ``csr_split`` (graph SpMM): only on irregular patterns (row-length coefficient of
  variation at least ``SPLIT_MIN_CV``: graphs, circuits, not meshes or stencils) and widths of
  at least ``GRAPH_MIN_N``; a point whose lanes span more columns than ``n`` is dropped when a
  narrower vector of the dtype fits (its extra lanes would idle); order 3 (RCM) is dropped
  for rectangular matrices, where it falls back to order 4; the hub-row variants (wide hub
  blocks, hub rows cut into atomically summed chunks) only where some row reaches their hub
  threshold.
* ``tcw_wmma`` (tensor cores): widths of at least ``GRAPH_MIN_N``, and a point whose warp
  spans more columns than ``n`` is dropped when the narrower one fits; the same RCM rule.
* padded formats (ell, sell, dia, bsr) and bitmap whose conversion raises
  ``FormatNotSuitable`` (``formats.convert`` is run once per distinct (format, parameters) to
  find out).
* ``bitmap`` families: only at a density of at least ``MIN_BITMAP_DENSITY`` (below it one bit
  per position costs more than CSR's column index per entry) and within the budget of
  ``formats.unfit``; ``bitmap_warp`` (CUDA cores) up to ``BITMAP_WARP_MAX_N`` dense columns,
  with as many accumulators ``v`` as the width needs (1, 2, else 4), ``bitmap_wmma`` (tensor
  cores) from ``BITMAP_WMMA_MIN_N`` columns, no wider a column tile than the width needs.

On weight-like patterns (``weight_like``: a pruned ``nn.Linear`` weight, dense enough for a
bitmap, many stored entries per row) the bitmap points come first, the rest of the space after
them in its own order; elsewhere the space's order is kept.

``k`` (if positive) keeps the first ``k`` points in that order; the points after them are not
examined (on a large weight a BSR conversion alone takes seconds). What pruning cost
and what it removed is in ``SearchProvider.last_report`` (a ``SearchReport``); the search
itself (compile, verify, time) is ``select.choose`` over these candidates.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from sparserl_compile.contract import Candidate
from sparserl_compile.problem import Provider

MAX_DIAGS = 128
MIN_DIAG_FILL = 0.3
MAX_PAD = 3.0
MIN_BLOCK_DENSITY = 0.4
SPLIT_MIN_CV = 0.8
GRAPH_MIN_N = 16
_PADDED = ("ell", "sell", "dia", "bsr", "bitmap")  # formats whose conversion may be refused
#: bitmap formats at densities of at least 1/32: there one bit per position is no more than a
#: 4-byte column index per stored entry
MIN_BITMAP_DENSITY = 1 / 32
#: the widths each bitmap family is proposed for
BITMAP_WARP_MAX_N = 8
BITMAP_WMMA_MIN_N = 8
#: weight-like patterns: at least this many stored entries per row on average
WEIGHT_MIN_ROW_MEAN = 32


@dataclass(frozen=True)
class SearchReport:
    """What one ``candidates`` call did: space size, kept points, pruning reasons, cost."""

    space: int
    kept: int
    pruned: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    conversions: int = 0

    def to_dict(self) -> dict:
        return {"space": self.space, "kept": self.kept, "pruned": dict(self.pruned),
                "seconds": round(self.seconds, 4), "conversions": self.conversions}


class _Pattern:
    __slots__ = ("indptr", "indices", "shape")

    def __init__(self, indptr, indices, shape):
        self.indptr, self.indices, self.shape = indptr, indices, shape


class SearchProvider(Provider):
    """Proposes the pruned kernel space for a problem, in the space's own order."""

    name = "search"

    def __init__(self, *, check_formats: bool = True):
        self.check_formats = check_formats
        self.last_report: SearchReport | None = None

    def candidates(self, problem, k: int = 0, *, features=None) -> list[Candidate]:
        """The kept points, in the space's order (the first ``k``; all for ``k=0``).
        ``features``: the problem's ``structure.features``, when the caller has them."""
        from sparserl_compile import kernels, structure

        t0 = time.perf_counter()
        pat = pattern_of(problem)
        feats = features if features is not None else structure.features(pat.indptr, pat.indices, pat.shape)
        n = 1 if problem.op == "spmv" else int(problem.n)
        space = kernels.space(problem.op, problem.dtype, n=n, structure=pat)
        if weight_like(feats):  # the bitmap points first (a stable sort keeps both orders)
            space.sort(key=lambda c: c.header.format != "bitmap")
        pruned: Counter[str] = Counter()
        suitable: dict[tuple, str | None] = {}
        kept: list[Candidate] = []
        for c in space:
            if k and k > 0 and len(kept) >= k:  # not examined: no format conversion for them
                pruned["beyond k"] += 1
                continue
            why = self._rule(c, feats, n)
            if why is None and self.check_formats:
                why = format_unsuitable(pat, c, suitable)
            if why is not None:
                pruned[why] += 1
                continue
            kept.append(c)
        self.last_report = SearchReport(len(space), len(kept), dict(pruned), time.perf_counter() - t0,
                                        len(suitable))
        return kept

    @staticmethod
    def _rule(c: Candidate, f, n: int) -> str | None:
        """Why this point is pruned (None: keep it)."""
        fmt = c.header.format
        if n % c.header.launch.n_align:
            return "n_align"
        if fmt == "bitmap":
            return _bitmap_rule(c, f, n)
        if fmt == "dia" and (f.n_diags > MAX_DIAGS or f.diag_fill < MIN_DIAG_FILL):
            return "dia: too many or too sparse diagonals"
        if fmt == "ell" and f.row_max * f.n_rows > MAX_PAD * f.nnz + 4096:
            return "ell: too much padding"
        if c.family in ("csr_split", "tcw_wmma"):
            return _graph_rule(c, f, n)
        if fmt == "bsr":
            from sparserl_compile import structure

            p = c.header.params
            if p.get("R") == p.get("C") and p.get("R") in getattr(structure, "BLOCK_SIZES", ()):
                dens = f.block_density[list(structure.BLOCK_SIZES).index(p["R"])]
                if dens < MIN_BLOCK_DENSITY:
                    return "bsr: blocks too sparse"
        return None


def _graph_rule(c: Candidate, f, n: int) -> str | None:
    """Why a graph-family point is pruned (see the module docstring), None to keep it."""
    p = dict(c.params)
    if n < GRAPH_MIN_N:
        return "graph families: width below GRAPH_MIN_N"
    if p.get("order") == 3 and f.n_rows != f.n_cols:
        return "graph families: rcm on a rectangular matrix is bfs"
    narrowest = {"csr_split": 32 * (1 if c.header.dtype == "f32" else 2), "tcw_wmma": 32}[c.family]
    if c.header.launch.tile_n > n and c.header.launch.tile_n > narrowest:
        return "graph families: wider than n"
    if c.family == "csr_split" and f.row_cv < SPLIT_MIN_CV:
        return "csr_split: rows too regular"
    if c.family == "csr_split" and f.row_max < p["hub"] and (p["split"] > 1 or p["warps"] > 8):
        return "csr_split: no hub rows for its hub blocks"
    return None


def weight_like(f) -> bool:
    """Whether a pattern with ``structure.features`` ``f`` looks like a pruned linear weight:
    dense enough for a bitmap and with many stored entries per row."""
    return f.density >= MIN_BITMAP_DENSITY and f.row_mean >= WEIGHT_MIN_ROW_MEAN


def _bitmap_rule(c: Candidate, f, n: int) -> str | None:
    """Why a bitmap point is pruned (None: keep it); see the module docstring."""
    if f.density < MIN_BITMAP_DENSITY:
        return "bitmap: too sparse for one bit per position"
    p = dict(c.params)
    if c.family == "bitmap_warp" and c.header.op == "spmm":
        if n > BITMAP_WARP_MAX_N:
            return "bitmap_warp: wider than it serves"
        if p.get("v") != (1 if n <= 1 else 2 if n == 2 else 4):
            return "bitmap_warp: v does not fit the width"
    if c.family == "bitmap_wmma":
        if n < BITMAP_WMMA_MIN_N:
            return "bitmap_wmma: narrower than it serves"
        if p.get("BN", 16) > max(16, 1 << (n - 1).bit_length()):
            return "bitmap_wmma: BN wider than the width"
    return None


def format_plausible(fmt: str, f) -> bool:
    """Whether a kernel of format ``fmt`` can win on a pattern with ``structure.features``
    ``f``, by the same rules that prune the space (DIA diagonals, ELL padding, BSR block
    density at any of the square block sizes, csr_split's irregular rows, bitmap density). For
    providers that pick a format before the parameters (the policy's format-diverse decoding)."""
    from sparserl_compile import structure

    if fmt == "dia":
        return f.n_diags <= MAX_DIAGS and f.diag_fill >= MIN_DIAG_FILL
    if fmt == "ell":
        return f.row_max * f.n_rows <= MAX_PAD * f.nnz + 4096
    if fmt == "csr_split":
        return f.row_cv >= SPLIT_MIN_CV
    if fmt == "bsr":
        sizes = getattr(structure, "BLOCK_SIZES", ())
        return any(d >= MIN_BLOCK_DENSITY for d in list(f.block_density)[:len(sizes)])
    if fmt == "bitmap":
        return f.density >= MIN_BITMAP_DENSITY
    return True


def pattern_of(problem) -> _Pattern:
    """The problem's pattern (int32 host arrays and shape)."""
    return _Pattern(np.asarray(problem.indptr, np.int32), np.asarray(problem.indices, np.int32),
                    (int(problem.n_rows), int(problem.n_cols)))


def format_unsuitable(pat, c: Candidate, memo: dict) -> str | None:
    """Why the pattern does not convert to ``c``'s padded format (None: it does, or the format
    is not padded). ``memo`` keeps the verdict per (format, format parameters)."""
    if c.header.format not in _PADDED:
        return None
    key = (c.header.format, c.header.format_params)
    if key not in memo:
        memo[key] = _convert_problem(pat, c)
    return memo[key]


def _convert_problem(pat, c: Candidate) -> str | None:
    from sparserl_compile import formats

    fmt, params = c.header.format, c.header.params
    if fmt != "bsr":  # the budget check alone, nothing filled (BSR's block density needs its fill)
        return None if formats.unfit(pat.indptr, pat.indices, pat.shape, fmt, params) is None else f"{fmt}: FormatNotSuitable"
    try:
        fd = formats.convert(pat.indptr, pat.indices, pat.shape, fmt, params)
    except formats.FormatNotSuitable:
        return f"{fmt}: FormatNotSuitable"
    if fmt == "bsr" and fd.fill < MIN_BLOCK_DENSITY:
        return "bsr: blocks too sparse"
    return None
