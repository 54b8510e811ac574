"""graphs: the scale generators give symmetric canonical graphs, deterministic in their seed, with
the structure they promise; the normalizations match their definitions (and PyG's gcn_norm)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from sparserl_compile import graphs, matrices

CASES = {
    "rmat_graph": dict(scale=9, edge_factor=8),
    "geometric_graph": dict(n=2000, avg_degree=10.0),
    "community_graph": dict(n=3000, avg_degree=12.0),
}


def _assert_canonical_symmetric(m: sp.csr_matrix, self_loops: bool):
    assert isinstance(m, sp.csr_matrix) and m.shape[0] == m.shape[1]
    assert m.data.dtype == np.float32 and m.indices.dtype == np.int32 and m.indptr.dtype == np.int32
    assert np.all(m.data == 1.0)
    ref = matrices.canonical(m.copy())
    assert np.array_equal(ref.indptr, m.indptr) and np.array_equal(ref.indices, m.indices), "not canonical"
    assert (m != m.T).nnz == 0, "pattern not symmetric"
    diag = m.diagonal()
    assert np.all(diag == 1.0) if self_loops else not diag.any()


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("self_loops", [False, True])
def test_generators_symmetric_canonical_deterministic(name, self_loops):
    a = getattr(graphs, name)(seed=5, self_loops=self_loops, **CASES[name])
    _assert_canonical_symmetric(a, self_loops)
    b = getattr(graphs, name)(seed=5, self_loops=self_loops, **CASES[name])
    assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)
    c = getattr(graphs, name)(seed=6, self_loops=self_loops, **CASES[name])
    assert not (a.nnz == c.nnz and np.array_equal(a.indices, c.indices))


def test_symmetric_csr_merges_duplicates_and_drops_input_loops():
    src = np.array([0, 1, 2, 2, 3], np.int32)
    dst = np.array([1, 0, 2, 3, 0], np.int32)  # (0,1) twice (both ways), a loop at 2
    m = graphs.symmetric_csr(4, src, dst)
    dense = np.zeros((4, 4))
    dense[[0, 1, 2, 3, 0, 3], [1, 0, 3, 2, 3, 0]] = 1
    np.testing.assert_array_equal(m.toarray(), dense)
    with_loops = graphs.symmetric_csr(4, src, dst, self_loops=True)
    np.testing.assert_array_equal(with_loops.toarray(), dense + np.eye(4))
    with pytest.raises(ValueError, match=r"edge endpoints must lie in \[0, 4\)"):
        graphs.symmetric_csr(4, src, np.array([1, 0, 2, 4, 0], np.int32))


def test_rmat_is_skewed_and_shuffle_is_a_relabeling():
    a = graphs.rmat_graph(12, 8, seed=1, shuffle=False)
    b = graphs.rmat_graph(12, 8, seed=1, shuffle=True)
    assert a.shape == (4096, 4096) and a.nnz == b.nnz  # the same graph, vertices relabelled
    deg_a, deg_b = np.diff(a.indptr), np.diff(b.indptr)
    np.testing.assert_array_equal(np.sort(deg_a), np.sort(deg_b))
    assert deg_a.max() > 20 * deg_a.mean()  # power-law hubs
    assert deg_a[0] == deg_a.max()  # unshuffled, vertex 0 is the biggest hub (R-MAT's recursion)
    assert np.argmax(deg_b) != 0 or deg_b[0] != deg_a[0]


def test_geometric_graph_edges_are_the_close_pairs():
    n, d = 1500, 8.0
    m = graphs.geometric_graph(n, d, seed=2)
    xs, ys, _ = graphs._rgg_points(n, 2, max(1, int(1.0 / np.sqrt(d / (np.pi * n)))))
    pts = np.stack([xs, ys], 1)
    r = np.sqrt(d / (np.pi * n))
    dist = np.sqrt(((pts[:, None, :] - pts[None, :, :]) ** 2).sum(-1))
    expect = (dist <= r) & ~np.eye(n, dtype=bool)
    np.testing.assert_array_equal(m.toarray() != 0, expect)
    assert 0.7 * d < m.nnz / n < 1.05 * d  # fewer neighbours near the border only
    # ids follow cells: most neighbours are near in index
    rows = np.repeat(np.arange(n), np.diff(m.indptr))
    assert np.median(np.abs(rows - m.indices)) < n / 10


def test_community_graph_keeps_most_edges_inside_communities():
    n = 4000
    m = graphs.community_graph(n, avg_degree=16, mixing=0.1, min_community=50, max_community=400, seed=3,
                               shuffle=False)
    rows = np.repeat(np.arange(n), np.diff(m.indptr))
    # communities are contiguous id ranges of at most 400: an internal edge spans less than that
    assert np.mean(np.abs(rows - m.indices) < 400) > 0.8
    deg = np.diff(m.indptr)
    assert 10 < deg.mean() < 18 and deg.max() > 5 * deg.mean()  # average degree, power-law tail
    mixed = graphs.community_graph(n, avg_degree=16, mixing=0.9, min_community=50, max_community=400, seed=3,
                                   shuffle=False)
    rows = np.repeat(np.arange(n), np.diff(mixed.indptr))
    assert np.mean(np.abs(rows - mixed.indices) < 400) < 0.4


@pytest.mark.parametrize("kw, what", [
    (dict(scale=0), "scale"), (dict(scale=8, a=0.6, b=0.3, c=0.2), "a, b, c"), (dict(scale=8, edge_factor=0), "edge_factor"),
])
def test_rmat_bad_arguments_say_what(kw, what):
    with pytest.raises(ValueError, match=what):
        graphs.rmat_graph(**kw)


def test_community_and_geometric_bad_arguments_say_what():
    with pytest.raises(ValueError, match="mixing"):
        graphs.community_graph(100, mixing=1.5)
    with pytest.raises(ValueError, match="gamma"):
        graphs.community_graph(100, gamma=1.0)
    with pytest.raises(ValueError, match="avg_degree"):
        graphs.geometric_graph(100, 200)


def _tiny():
    a = sp.csr_matrix(np.array([[0, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 1, 0], [0, 0, 1, 0, 0],
                                [0, 0, 0, 0, 0]], np.float32) * 3.0)  # a loop at 1, an isolated vertex 4
    return a


def test_gcn_normalize_matches_its_definition():
    a = _tiny()
    pattern = (a.toarray() != 0).astype(np.float64)
    with_loops = np.maximum(pattern, np.eye(5))  # an existing loop keeps weight one
    d = with_loops.sum(1)
    np.testing.assert_allclose(graphs.gcn_normalize(a).toarray(), with_loops / np.sqrt(np.outer(d, d)), rtol=1e-6)
    d0 = pattern.sum(1)
    expect = np.where(np.outer(d0, d0) > 0, pattern / np.sqrt(np.maximum(np.outer(d0, d0), 1)), 0)
    np.testing.assert_allclose(graphs.gcn_normalize(a, add_self_loops=False).toarray(), expect, rtol=1e-6)
    with pytest.raises(ValueError, match="square"):
        graphs.gcn_normalize(sp.csr_matrix((3, 4), dtype=np.float32))


def test_mean_normalize_averages_neighbours():
    a = _tiny()
    pattern = (a.toarray() != 0).astype(np.float64)
    deg = pattern.sum(1)
    out = graphs.mean_normalize(a).toarray()
    np.testing.assert_allclose(out[:4], pattern[:4] / deg[:4, None], rtol=1e-6)
    assert not out[4].any()


def test_gcn_normalize_equals_pyg_gcn_norm():
    torch = pytest.importorskip("torch")
    pyg = pytest.importorskip("torch_geometric.nn.conv.gcn_conv", reason="torch_geometric is not installed")
    a = graphs.rmat_graph(8, 4, seed=4)
    coo = a.tocoo()
    ei = torch.from_numpy(np.vstack([coo.row, coo.col]).astype(np.int64))
    ei, w = pyg.gcn_norm(ei, None, a.shape[0], add_self_loops=True)
    ref = sp.csr_matrix((w.numpy(), (ei[1].numpy(), ei[0].numpy())), shape=a.shape).toarray()
    np.testing.assert_allclose(graphs.gcn_normalize(a).toarray(), ref, rtol=1e-5, atol=1e-7)
