"""The structure encoder: how the policy sees where a matrix's nonzeros are.

Two steps, one on the host and one in the model:

1. ``prepare_structure(indptr, indices, shape)`` (numpy, no torch) picks the nonzeros the
   model looks at and computes the structure feature vector. Small matrices give all of
   their nonzeros. Larger ones give a *stratified sample* of at most ``max_points``: rows are
   cut into ``row_blocks`` contiguous blocks and into row-length classes (``floor(log2(len))``),
   every non-empty (block, class) cell gets at least one point and the rest of the budget is
   spread in proportion to the cell's nonzeros, so a handful of very long rows, a dense band
   or an empty region are all represented even when they hold little of the total. The sample
   is deterministic (seeded by the shape and nnz).
2. ``StructureEncoder`` (torch) maps each point's row, column and diagonal offset (col-row),
   each normalized by the matrix shape to [0, 1] or [-1, 1], through separate banks of
   sinusoidal frequencies, adds the point's (normalized log) row length, runs a small MLP,
   and attention-pools the points into ``n_slots`` prefix vectors with learned queries. The
   feature vector (``sparserl_compile.structure.features(...).as_vector()``) is projected to
   one more prefix vector. The result, ``(batch, n_slots + 1, d_model)``, goes into
   ``inputs_embeds`` before the token embeddings.

With ``sinusoidal=False`` (an ablation) the four raw coordinates are projected linearly
instead. The encoder does not see values: kernels depend on the pattern only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass
class PreparedStructure:
    """The encoder's input for one matrix (host arrays, float32)."""

    points: np.ndarray  # (m, 4): row/n_rows, col/n_cols, (col-row)/max(shape), log2(1+rowlen)/16
    features: np.ndarray  # (F,) structure features
    n_rows: int
    n_cols: int
    nnz: int
    sampled: bool  # False when every nonzero is present


def _basic_features(indptr: np.ndarray, indices: np.ndarray, shape) -> np.ndarray:
    """Shape and row-length summary, used only when ``structure.features`` is not available."""
    n_rows, n_cols = shape
    lens = np.diff(indptr).astype(np.float64) if n_rows else np.zeros(1)
    nnz = float(indptr[-1]) if len(indptr) else 0.0
    rows = np.repeat(np.arange(n_rows), np.diff(indptr)) if nnz else np.zeros(0)
    off = (indices.astype(np.float64) - rows) if nnz else np.zeros(1)
    return np.array([
        math.log2(1 + n_rows), math.log2(1 + n_cols), math.log2(1 + nnz),
        math.log2(1 + lens.mean()), math.log2(1 + lens.max()), lens.std() / (1 + lens.mean()),
        float((lens == 0).mean()), math.log2(1 + np.abs(off).max()),
        math.log2(1 + np.abs(off).mean()), nnz / max(1.0, float(n_rows) * n_cols),
        float(n_rows == n_cols), 0.0, 0.0, 0.0, 0.0, 0.0,
    ], dtype=np.float32)


def structure_features(indptr, indices, shape) -> np.ndarray:
    """``sparserl_compile.structure.features(...).as_vector()``, or a 16-value stand-in.

    The stand-in (shape, row-length and bandwidth summary) exists only while the runtime's
    feature extractor is missing; a checkpoint records its feature width and refuses inputs
    of another width.
    """
    try:
        from sparserl_compile.structure import features
    except ImportError:
        return _basic_features(np.asarray(indptr), np.asarray(indices), tuple(shape))
    return np.asarray(features(indptr, indices, shape).as_vector(), dtype=np.float32)


def sample_nonzeros(indptr: np.ndarray, max_points: int, row_blocks: int = 16) -> np.ndarray:
    """Positions (into ``indices``) of at most ``max_points`` nonzeros, stratified as above.

    A nonzero's cell (row block x row-length class) is its row's, so the cells and their
    sizes are counted over rows and the drawn offsets within a cell are mapped back to
    positions through the cell's rows: O(rows + points) after one pass over the row lengths,
    not a sort of all nonzeros (4 s for 10^7 nonzeros on the development CPU). The draws are
    the ones a per-nonzero grouping would make (same cells, same order, same generator calls)."""
    indptr = np.asarray(indptr, dtype=np.int64)
    nnz = int(indptr[-1]) if indptr.size else 0
    if nnz <= max_points:
        return np.arange(nnz, dtype=np.int64)
    n_rows = indptr.size - 1
    lens = np.diff(indptr)
    rows = np.flatnonzero(lens)  # only rows with nonzeros have cells
    cls = np.floor(np.log2(lens[rows])).astype(np.int64)
    cell = (rows * row_blocks // max(n_rows, 1)) * 64 + cls
    present = np.bincount(cell, minlength=row_blocks * 64) > 0  # cells are small ints: no sort
    uniq = np.flatnonzero(present)
    rank = np.cumsum(present) - 1
    inv = rank[cell].astype(np.int16 if uniq.size < 2**15 else np.int64)  # int16: a radix argsort below
    counts = np.bincount(inv, weights=lens[rows], minlength=uniq.size).astype(np.int64)
    rng = np.random.default_rng(n_rows * 1_000_003 + nnz)
    if uniq.size >= max_points:  # more cells than budget: one point from the largest cells
        keep_cells = np.argsort(-counts, kind="stable")[:max_points]
        quota = np.zeros(uniq.size, np.int64)
        quota[keep_cells] = 1
    else:
        extra = max_points - uniq.size
        quota = 1 + np.floor(extra * counts / nnz).astype(np.int64)
        quota = np.minimum(quota, counts)
    by_cell = rows[np.argsort(inv, kind="stable")]  # rows grouped by cell, in row order
    row_starts = np.concatenate([[0], np.cumsum(np.bincount(inv, minlength=uniq.size))])
    picks = []
    for c in range(uniq.size):
        if quota[c] == 0:
            continue
        cell_rows = by_cell[row_starts[c]:row_starts[c + 1]]
        before = np.concatenate([[0], np.cumsum(lens[cell_rows])])  # the cell's nonzeros before each row
        k = rng.choice(int(counts[c]), size=int(quota[c]), replace=False)  # offsets within the cell
        j = np.searchsorted(before, k, side="right") - 1
        picks.append(indptr[cell_rows[j]] + (k - before[j]))
    return np.sort(np.concatenate(picks))


def prepare_structure(indptr, indices, shape, max_points: int = 1024, row_blocks: int = 16,
                      features: np.ndarray | None = None) -> PreparedStructure:
    """Host-side input of the encoder for one CSR pattern (see the module docstring)."""
    indptr = np.asarray(indptr, dtype=np.int64)
    indices = np.asarray(indices, dtype=np.int64)
    n_rows, n_cols = (int(s) for s in shape)
    if indptr.size != n_rows + 1:
        raise ValueError(f"indptr has {indptr.size} entries for {n_rows} rows (expected n_rows+1)")
    nnz = int(indptr[-1]) if indptr.size else 0
    if indices.size != nnz:
        raise ValueError(f"indices has {indices.size} entries but indptr[-1] = {nnz}")
    pos = sample_nonzeros(indptr, max_points, row_blocks)
    lens = np.diff(indptr)
    rows = np.searchsorted(indptr, pos, side="right") - 1
    cols = indices[pos]
    scale = max(n_rows, n_cols, 1)
    pts = np.stack([
        rows / max(n_rows, 1), cols / max(n_cols, 1), (cols - rows) / scale,
        np.log2(1 + lens[rows]) / 16.0,
    ], axis=1).astype(np.float32) if pos.size else np.zeros((0, 4), np.float32)
    feats = structure_features(indptr, indices, (n_rows, n_cols)) if features is None else features
    return PreparedStructure(pts, np.asarray(feats, np.float32), n_rows, n_cols, nnz, pos.size < nnz)


@dataclass
class StructureBatch:
    """A padded batch of prepared structures as torch tensors."""

    points: torch.Tensor  # (B, M, 4) float32
    mask: torch.Tensor  # (B, M) bool, True where a point is present
    features: torch.Tensor  # (B, F) float32

    @classmethod
    def collate(cls, items: list[PreparedStructure]) -> "StructureBatch":
        m = max(1, max(it.points.shape[0] for it in items))
        pts = np.zeros((len(items), m, 4), np.float32)
        mask = np.zeros((len(items), m), bool)
        for i, it in enumerate(items):
            pts[i, : len(it.points)] = it.points
            mask[i, : len(it.points)] = True
        feats = np.stack([it.features for it in items]).astype(np.float32)
        return cls(torch.from_numpy(pts), torch.from_numpy(mask), torch.from_numpy(feats))

    def to(self, device) -> "StructureBatch":
        return StructureBatch(self.points.to(device), self.mask.to(device), self.features.to(device))

    def repeat(self, k: int) -> "StructureBatch":
        """Each item repeated ``k`` times (for k samples of the same matrix)."""
        return StructureBatch(self.points.repeat_interleave(k, 0), self.mask.repeat_interleave(k, 0),
                              self.features.repeat_interleave(k, 0))


def sinusoidal(x: torch.Tensor, n_freqs: int) -> torch.Tensor:
    """(..., ) values in about [-1, 1] -> (..., 2*n_freqs): sin/cos at pi * 2^k, k < n_freqs.

    Frequencies up to 2^(n_freqs-1) resolve positions down to about 1/2^n_freqs of the
    matrix, so 12 banks separate rows of a 4096-row matrix.
    """
    freqs = math.pi * (2.0 ** torch.arange(n_freqs, device=x.device, dtype=x.dtype))
    ang = x.unsqueeze(-1) * freqs
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


def point_mlp(d_model: int, n_freqs: int, sinusoidal: bool) -> nn.Sequential:
    """The per-point MLP of ``StructureEncoder``: the sinusoidal banks of row, column and diagonal
    offset plus the row length (``sinusoidal``), or the four raw coordinates, to ``d_model``."""
    d_in = 3 * 2 * n_freqs + 1 if sinusoidal else 4
    return nn.Sequential(nn.Linear(d_in, d_model), nn.GELU(), nn.Linear(d_model, d_model))


class StructureEncoder(nn.Module):
    """Points + features -> ``n_slots + 1`` prefix vectors of width ``d_model``."""

    def __init__(self, d_model: int, n_features: int, n_slots: int = 16, n_freqs: int = 12,
                 n_heads: int = 4, sinusoidal: bool = True):
        super().__init__()
        self.n_freqs, self.use_sin, self.n_features = n_freqs, sinusoidal, n_features
        self.point_mlp = point_mlp(d_model, n_freqs, sinusoidal)
        self.queries = nn.Parameter(torch.randn(n_slots, d_model) * 0.02)
        self.pool = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.empty = nn.Parameter(torch.zeros(1, 1, d_model))  # the "no nonzeros" point
        self.feat_norm = nn.LayerNorm(n_features)
        self.feat_proj = nn.Sequential(nn.Linear(n_features, d_model), nn.GELU(), nn.Linear(d_model, d_model))
        self.out_norm = nn.LayerNorm(d_model)

    def embed_points(self, points: torch.Tensor) -> torch.Tensor:
        if not self.use_sin:
            return points
        r, c, d, l = points.unbind(-1)
        # separate frequency banks for row, column and diagonal offset; row length as is
        return torch.cat([sinusoidal(r, self.n_freqs), sinusoidal(c, self.n_freqs),
                          sinusoidal(d, self.n_freqs), l.unsqueeze(-1)], dim=-1)

    def forward(self, batch: StructureBatch) -> torch.Tensor:
        if batch.features.shape[-1] != self.n_features:
            raise ValueError(
                f"structure features have width {batch.features.shape[-1]} but this policy was "
                f"built for {self.n_features}: the feature extractor changed since the "
                "checkpoint was trained; retrain or use a matching sparserl version"
            )
        h = self.point_mlp(self.embed_points(batch.points))  # (B, M, d)
        b = h.shape[0]
        # an always-present "empty" key keeps attention defined for matrices without nonzeros
        h = torch.cat([self.empty.expand(b, 1, -1).to(h.dtype), h], dim=1)
        mask = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=h.device), batch.mask], dim=1)
        q = self.queries.unsqueeze(0).expand(b, -1, -1).to(h.dtype)
        pooled, _ = self.pool(q, h, h, key_padding_mask=~mask, need_weights=False)
        f = batch.features
        f = torch.sign(f) * torch.log1p(f.abs())  # counts of millions and ratios on one scale
        feat = self.feat_proj(self.feat_norm(f)).unsqueeze(1)
        return self.out_norm(torch.cat([pooled, feat], dim=1))
