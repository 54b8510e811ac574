"""structure: fingerprint exactness and features checked against brute-force numpy."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparserl_compile import matrices
from sparserl_compile.structure import (
    BLOCK_SIZES,
    FEATURE_NAMES,
    N_HIST_BINS,
    StructureFeatures,
    features,
    fingerprint,
)


def _brute(A: sp.csr_matrix) -> dict:
    """The features recomputed the slow, obvious way."""
    coo = A.tocoo()
    r, c = coo.row.astype(np.int64), coo.col.astype(np.int64)
    lens = np.diff(A.indptr)
    out = {"nnz": A.nnz, "row_min": int(lens.min()) if lens.size else 0,
           "row_max": int(lens.max()) if lens.size else 0, "empty_rows": int((lens == 0).sum())}
    d = c - r
    out["lower_bandwidth"] = int(max(0, (-d).max())) if d.size else 0
    out["upper_bandwidth"] = int(max(0, d.max())) if d.size else 0
    out["n_diags"] = len(set(d.tolist()))
    prof = 0
    for i in range(A.shape[0]):
        cols = A.indices[A.indptr[i]:A.indptr[i + 1]]
        if cols.size:
            prof += max(0, i - int(cols.min()))
    out["profile"] = prof
    out["block_density"] = tuple(
        A.nnz / (len(set(zip((r // b).tolist(), (c // b).tolist()))) * b * b) if A.nnz else 0.0
        for b in BLOCK_SIZES
    )
    gaps = [np.diff(A.indices[A.indptr[i]:A.indptr[i + 1]]) for i in range(A.shape[0])]
    gaps = np.concatenate(gaps) if gaps else np.zeros(0)
    out["mean_col_gap"] = float(np.abs(gaps).mean()) if gaps.size else 0.0
    out["consecutive_frac"] = float((gaps == 1).mean()) if gaps.size else 0.0
    hist = np.zeros(N_HIST_BINS, np.int64)
    for L in lens:
        hist[0 if L == 0 else min(int(np.floor(np.log2(L))) + 1, N_HIST_BINS - 1)] += 1
    out["row_hist"] = tuple(hist.tolist())
    out["row_std"] = float(lens.std()) if lens.size else 0.0
    return out


def _assert_features(A):
    A = matrices.canonical(A)
    f = features(A.indptr, A.indices, A.shape)
    want = _brute(A)
    for k, v in want.items():
        got = getattr(f, k)
        if isinstance(v, float) or (isinstance(v, tuple) and v and isinstance(v[0], float)):
            np.testing.assert_allclose(got, v, rtol=1e-9, atol=1e-12, err_msg=k)
        else:
            assert got == v, k
    assert f.bandwidth == max(f.lower_bandwidth, f.upper_bandwidth)
    if f.n_diags:
        assert f.diag_fill == pytest.approx(A.nnz / (f.n_diags * A.shape[0]))
    vec = f.as_vector()
    assert vec.dtype == np.float32 and vec.shape == (len(FEATURE_NAMES),) and np.all(np.isfinite(vec))
    return f


@pytest.mark.parametrize("A", [
    sp.csr_matrix((4, 6), dtype=np.float32),
    sp.csr_matrix((0, 3), dtype=np.float32),
    sp.csr_matrix(np.ones((1, 17), np.float32)),
    sp.random(31, 9, density=0.3, random_state=1, format="csr"),
    matrices.stencil2d(9),
    matrices.banded(50, 3),
    matrices.block_diagonal(6, 4),
    matrices.rmat(8, 4, seed=1),
], ids=["nnz0", "no_rows", "one_row", "rect", "stencil", "banded", "blockdiag", "rmat"])
def test_features_match_brute_force(A):
    _assert_features(A)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 20), st.integers(1, 20), st.floats(0, 1), st.integers(0, 1000))
def test_features_random(n_rows, n_cols, density, seed):
    _assert_features(sp.random(n_rows, n_cols, density=density, random_state=seed, format="csr"))


def test_features_recognize_structures():
    band = features(*_csr(matrices.banded(400, 2)))
    assert band.n_diags == 5 and band.diag_fill > 0.99 and band.bandwidth == 2
    blk = features(*_csr(matrices.block_diagonal(20, 8)))
    assert blk.block_density[BLOCK_SIZES.index(8)] == 1.0
    assert blk.consecutive_frac == 1.0
    graph = features(*_csr(matrices.rmat(10, 8, seed=0)))
    assert graph.row_cv > 1.0 > band.row_cv  # power-law rows are imbalanced


def test_features_real_matrix(shared_matrices):
    A = matrices.load_npz(shared_matrices / "rajat01.npz")
    f = features(*_csr(A))
    assert (f.n_rows, f.nnz, f.row_max, f.empty_rows) == (6833, 43250, 1442, 0)
    assert f.row_mean == pytest.approx(6.3296, abs=1e-4)


def test_torch_inputs_and_fingerprint():
    A = matrices.stencil2d(6)
    ip, ix = torch.from_numpy(A.indptr.astype(np.int64)), torch.from_numpy(A.indices.astype(np.int64))
    assert features(ip, ix, A.shape) == features(*_csr(A))
    fp = fingerprint(A.indptr, A.indices, A.shape)
    assert fp == fingerprint(ip, ix, A.shape) and len(fp) == 32
    B = A.copy()
    B.data[:] = 7.0  # values never matter
    assert fingerprint(*_csr(B)) == fp
    C = A.tolil()
    C[0, 35] = 1.0
    C = matrices.canonical(C)
    assert fingerprint(*_csr(C)) != fp
    assert fingerprint(A.indptr, A.indices, (A.shape[0], A.shape[1] + 1)) != fp


def test_malformed_csr_is_refused():
    with pytest.raises(ValueError, match="indptr"):
        features(np.array([0, 2, 1]), np.array([0]), (2, 2))
    with pytest.raises(ValueError, match="n_cols"):
        features(np.array([0, 1]), np.array([5]), (1, 2))


def test_feature_names_are_the_vector_layout():
    assert StructureFeatures.FEATURE_NAMES == FEATURE_NAMES
    assert len(set(FEATURE_NAMES)) == len(FEATURE_NAMES)


def _csr(A):
    return A.indptr, A.indices, A.shape


def test_check_csr_reads_every_integer_dtype_without_casting_first():
    """A cast before the check would wrap 2^32 + 1 to 1 and accept it; the check reads the
    values as stored (numpy or torch, signed or unsigned, any width)."""
    import torch

    from sparserl_compile.structure import check_coo, check_csr

    for dt in (np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64):
        ip, ix, n_rows, n_cols = check_csr(np.array([0, 1, 2], dt), np.array([1, 0], dt), (2, 2))
        assert ip.dtype == ix.dtype == np.int32 and ix.tolist() == [1, 0] and (n_rows, n_cols) == (2, 2)
    with pytest.raises(ValueError, match=r"column indices span \[0, 4294967297\]"):
        check_csr(np.array([0, 1, 2]), np.array([0, 2**32 + 1]), (2, 2))
    with pytest.raises(ValueError, match=r"column indices span \[0, 4294967297\]"):
        check_csr(torch.tensor([0, 1, 2]), torch.tensor([0, 2**32 + 1]), (2, 2))
    with pytest.raises(TypeError, match="not integers"):
        check_csr(np.array([0, 1]), np.array([True]), (1, 2))
    with pytest.raises(ValueError, match=r"crow_indices\[-1\] \(2\) != nnz \(1\)"):
        check_csr(np.array([0, 2]), np.array([0]), (1, 2))
    with pytest.raises(ValueError, match="2 column indices but 3 values"):
        check_csr(np.array([0, 2]), np.array([0, 1]), (1, 2), nnz=3)
    r, c, _, _ = check_coo(np.array([1, 0], np.uint8), np.array([0, 1]), (2, 2), nnz=2)
    assert r.tolist() == [1, 0]
    with pytest.raises(ValueError, match=r"row indices span \[-3, 1\] but n_rows is 2"):
        check_coo(np.array([1, -3]), np.array([0, 1]), (2, 2))
