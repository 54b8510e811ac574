"""matrices: generators are deterministic canonical CSR of the stated shape; the shared set loads."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from sparserl_compile import matrices

CASES = {
    "stencil2d": dict(n=12),
    "stencil3d": dict(n=5),
    "banded": dict(n=40, half_bandwidth=3, fill=0.6),
    "block_diagonal": dict(n_blocks=5, block=4, density=0.5),
    "block_random": dict(n_brows=6, n_bcols=5, R=2, C=3, blocks_per_row=2),
    "uniform_random": dict(n_rows=50, n_cols=30, per_row=4.0),
    "rmat": dict(scale=7, edge_factor=4),
    "random_geometric": dict(n=300, avg_degree=6.0),
    "circuit": dict(n=400, per_row=4.0, dense_lines=2, dense_fill=0.3),
}


def _assert_canonical(m: sp.csr_matrix):
    assert isinstance(m, sp.csr_matrix)
    assert m.data.dtype == np.float32
    assert m.indices.dtype == np.int32 and m.indptr.dtype == np.int32
    assert m.indptr[0] == 0 and m.indptr[-1] == m.nnz and np.all(np.diff(m.indptr) >= 0)
    # within each row, strictly increasing columns (sorted, no duplicates)
    inside = np.ones(max(m.nnz - 1, 0), bool)
    starts = m.indptr[1:-1][(m.indptr[1:-1] > 0) & (m.indptr[1:-1] < m.nnz)]
    inside[starts - 1] = False
    assert np.all(np.diff(m.indices.astype(np.int64))[inside] > 0), "unsorted or duplicated row"


def test_every_generator_is_covered():
    assert set(CASES) == set(matrices.GENERATORS)


@pytest.mark.parametrize("name", list(CASES))
def test_generators_deterministic_and_canonical(name):
    a = matrices.generate(name, seed=3, **CASES[name])
    b = matrices.generate(name, seed=3, **CASES[name])
    _assert_canonical(a)
    assert a.shape == b.shape
    assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)
    assert np.array_equal(a.data, b.data)
    c = matrices.generate(name, seed=4, **CASES[name])
    assert not np.array_equal(a.data, c.data) if a.nnz else True


def test_generator_shapes_and_counts():
    n = 12
    s2 = matrices.stencil2d(n)
    assert s2.shape == (n * n, n * n) and s2.nnz == 5 * n * n - 4 * n
    s3 = matrices.stencil3d(5)
    assert s3.shape == (125, 125) and s3.nnz == 7 * 125 - 6 * 25
    band = matrices.banded(40, 3)
    assert band.nnz == 40 * 7 - 2 * (1 + 2 + 3)
    bd = matrices.block_diagonal(5, 4)
    assert bd.shape == (20, 20) and bd.nnz == 5 * 16
    br = matrices.block_random(6, 5, 2, 3, 2)
    assert br.shape == (12, 15) and br.nnz == 6 * 2 * 2 * 3
    ur = matrices.uniform_random(50, 30, 4.0)
    assert ur.shape == (50, 30)
    rm = matrices.rmat(7, 4)
    assert rm.shape == (128, 128) and 0 < rm.nnz <= 4 * 128
    rg = matrices.random_geometric(300, 6.0)
    assert rg.shape == (300, 300)
    assert (rg != rg.T).nnz == 0 or np.array_equal((rg != 0).toarray(), (rg.T != 0).toarray())
    ci = matrices.circuit(2000, 4.0, dense_lines=3, dense_fill=0.2, seed=1)
    pattern = (ci != 0).astype(np.int8)
    assert ci.shape == (2000, 2000) and (pattern != pattern.T).nnz == 0  # symmetric pattern
    assert np.all(ci.diagonal() != 0)  # a full diagonal
    lengths = np.diff(ci.indptr)
    assert np.sum(lengths > 200) == 3 and np.median(lengths) <= 8  # three supply nets, short rows else


def test_canonical_sums_duplicates_and_sorts():
    m = sp.csr_matrix((np.array([1.0, 2.0, 3.0]), np.array([2, 0, 2]), np.array([0, 3])), shape=(1, 3))
    c = matrices.canonical(m)
    _assert_canonical(c)
    assert c.indices.tolist() == [0, 2] and c.data.tolist() == [2.0, 4.0]


def test_unknown_generator_and_file_type():
    with pytest.raises(ValueError, match="unknown generator"):
        matrices.generate("nope")
    with pytest.raises(ValueError, match="unknown matrix file type"):
        matrices.load_matrix("a.csv")


def test_load_npz_round_trip_and_bad_keys(tmp_path):
    m = matrices.uniform_random(20, 10, 2.0, seed=1)
    p = tmp_path / "m.npz"
    np.savez(p, indptr=m.indptr, indices=m.indices, data=m.data, shape=np.array(m.shape))
    back = matrices.load_matrix(p)
    assert (back != m).nnz == 0 and back.shape == m.shape
    q = tmp_path / "bad.npz"
    np.savez(q, foo=np.zeros(3))
    with pytest.raises(ValueError, match="expected keys"):
        matrices.load_npz(q)


def test_shared_manifest_loads_with_stated_sizes(shared_matrices):
    infos = matrices.shared_manifest(shared_matrices)
    assert len(infos) >= 30
    for info in infos:
        m = matrices.load_npz(info.path)
        _assert_canonical(m)
        assert m.shape == (info.n_rows, info.n_cols), info.name
        assert m.nnz == info.nnz, info.name


@pytest.mark.parametrize("n_blocks,block,seed", [(1, 1, 0), (5, 4, 0), (300, 16, 3), (64, 32, 1)])
def test_dense_block_diagonal_is_the_block_diag_of_dense_blocks(n_blocks, block, seed):
    """Dense blocks are built directly, not by ``sp.block_diag`` (seconds at 2e4 blocks); the
    matrix, its values' random stream included, is the one the supervision records measured."""
    rng = np.random.default_rng(seed)
    ref = matrices.canonical(sp.block_diag([sp.csr_matrix(np.ones((block, block)))] * n_blocks, format="csr"))
    ref.data = rng.standard_normal(ref.nnz).astype(np.float32)
    m = matrices.block_diagonal(n_blocks, block, seed=seed)
    assert m.shape == ref.shape and m.has_sorted_indices
    for a in ("indptr", "indices", "data"):
        assert getattr(m, a).dtype == getattr(ref, a).dtype
        np.testing.assert_array_equal(getattr(m, a), getattr(ref, a))


def _block_random_by_blocks(n_brows, n_bcols, R, C, blocks_per_row, seed):
    """block_random as first written, one meshgrid per block: the matrices the records measured."""
    rng = np.random.default_rng(seed)
    rows, cols = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for b in range(n_brows):
        for c in rng.choice(n_bcols, size=min(blocks_per_row, n_bcols), replace=False):
            rr, cc = np.meshgrid(np.arange(R) + b * R, np.arange(C) + c * C, indexing="ij")
            rows.append(rr.ravel())
            cols.append(cc.ravel())
    r, c = np.concatenate(rows), np.concatenate(cols)
    m = matrices.canonical(sp.csr_matrix((np.ones(len(r), np.float32), (r, c)), shape=(n_brows * R, n_bcols * C)))
    m.data = rng.standard_normal(m.nnz).astype(np.float32)
    return m


@pytest.mark.parametrize("args", [(0, 4, 2, 2, 2, 0), (1, 1, 1, 1, 1, 0), (3, 2, 2, 2, 5, 1), (6, 5, 2, 3, 2, 0),
                                  (500, 2000, 4, 4, 5, 1), (300, 300, 8, 2, 3, 2)])
def test_block_random_is_the_matrix_built_block_by_block(args):
    ref, m = _block_random_by_blocks(*args), matrices.block_random(*args)
    assert m.shape == ref.shape
    for a in ("indptr", "indices", "data"):
        assert getattr(m, a).dtype == getattr(ref, a).dtype
        np.testing.assert_array_equal(getattr(m, a), getattr(ref, a))


def test_pruned_weight_masks():
    mag = matrices.pruned_weight(64, 200, 0.7, "magnitude", seed=1)
    _assert_canonical(mag)
    assert mag.shape == (64, 200) and mag.nnz == 64 * 200 - round(0.7 * 64 * 200)
    kept = np.abs(mag.data).min()
    dense = np.random.default_rng(1).standard_normal((64, 200), dtype=np.float32)
    assert np.count_nonzero(np.abs(dense) >= kept) == mag.nnz  # the largest |w| of the whole matrix
    wanda = matrices.pruned_weight(64, 200, 0.7, "wanda", seed=1)
    _assert_canonical(wanda)
    assert np.all(np.diff(wanda.indptr) == 200 - 140)  # the same count in every row
    assert np.array_equal(wanda.indptr, matrices.pruned_weight(64, 200, 0.7, "wanda", seed=1).indptr)
    with pytest.raises(ValueError, match="mask"):
        matrices.pruned_weight(4, 4, 0.5, "random")
    with pytest.raises(ValueError, match="sparsity"):
        matrices.pruned_weight(4, 4, 1.0)


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "bsr", "dia"])
def test_load_npz_reads_every_save_npz_format_as_itself(tmp_path, fmt):
    """scipy.sparse.save_npz names the format; a CSC file used to be read as CSR (a square
    matrix came back transposed)."""
    m = matrices.uniform_random(12, 12, 3.0, seed=2)
    a = m.asformat(fmt) if fmt != "bsr" else m.tobsr(blocksize=(3, 2))
    sp.save_npz(tmp_path / "m.npz", a)
    back = matrices.load_npz(tmp_path / "m.npz")
    _assert_canonical(back)
    np.testing.assert_array_equal(back.toarray(), m.toarray())


@pytest.mark.parametrize("arrays, why", [
    (dict(indptr=np.array([0, 9, 1, 2]), indices=np.array([0, 1]), data=np.ones(2)), "indptr has 4 entries"),
    (dict(indptr=np.array([0, 3, 2]), indices=np.array([0, 1]), data=np.ones(2)), "indptr is not non-decreasing"),
    (dict(row=np.array([0, -1]), col=np.array([0, 1]), data=np.ones(2)), r"row indices span \[-1, 0\]"),
    (dict(indptr=np.array([0, 1, 2]), indices=np.array([0, 1]), data=np.ones((2, 1))), "data must be 1-D"),
    (dict(indptr=np.array([0, 1, 2]), indices=np.array([0, 1]), data=np.ones(2), format=np.array(b"bsr")),
     r"BSR/BSC values must have shape"),
    (dict(indptr=np.array([0, 1, 2]), indices=np.array([0, 1]), data=np.ones(2), format=np.array(b"lil")),
     "format 'lil'"),
])
def test_load_npz_refuses_malformed_arrays_before_scipy_sees_them(tmp_path, arrays, why):
    np.savez(tmp_path / "bad.npz", shape=np.array([2, 2]), **arrays)
    with pytest.raises(ValueError, match=why):
        matrices.load_npz(tmp_path / "bad.npz")


@pytest.mark.parametrize("text, why", [
    ("%%MatrixMarket matrix coordinate real general\n3 3 10000000000\n1 1 1.0\n", "claims 10000000000 entries"),
    ("%%MatrixMarket matrix array real general\n100000 100000\n1.0\n", "claims 10000000000 entries"),
    ("%%MatrixMarket matrix coordinate real general\n3 3 1\n4 1 1.0\n", "Row index out of bounds"),
    ("%%MatrixMarket matrix coordinate real general\n3 3 1\n0 1 1.0\n", "Row index out of bounds"),
    ("%%MatrixMarket matrix coordinate complex general\n1 1 1\n1 1 1.0 2.0\n", "complex matrix"),
    ("%%MatrixMarket matrix coordinate real general\n3 -3 1\n1 1 1.0\n", "is not 3 non-negative integers"),
    ("%%MatrixMarket matrix coordinate real general\n3000000000 3 0\n", "does not fit int32"),
    ("hello\n", "not a Matrix Market matrix"),
])
def test_load_mtx_checks_the_header_before_scipy_allocates(tmp_path, text, why):
    p = tmp_path / "m.mtx"
    p.write_text(text)
    with pytest.raises(ValueError, match=why):
        matrices.load_matrix(p)


def test_load_mtx_gz_round_trip(tmp_path):
    import gzip

    import scipy.io

    m = matrices.uniform_random(9, 7, 2.0, seed=3)
    scipy.io.mmwrite(tmp_path / "m.mtx", m)
    (tmp_path / "m.mtx.gz").write_bytes(gzip.compress((tmp_path / "m.mtx").read_bytes()))
    for name in ("m.mtx", "m.mtx.gz"):
        np.testing.assert_allclose(matrices.load_matrix(tmp_path / name).toarray(), m.toarray(), rtol=1e-6)
