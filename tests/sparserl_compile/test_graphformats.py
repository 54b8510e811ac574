"""graphformats: the row orders and the csr_split / tcw layouts, on small exact examples.

The layouts' products are checked literally against scipy for every format in
``test_formats.py``; here: what each order puts where, and the arrays of hand-made cases.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from sparserl_compile import graphformats, matrices
from sparserl_compile.formats import convert


def _pattern(dense) -> sp.csr_matrix:
    return matrices.canonical(sp.csr_matrix(np.asarray(dense, np.float32)))


def _shuffled(m: sp.csr_matrix, seed: int) -> tuple[sp.csr_matrix, np.ndarray]:
    """``m`` with rows and columns renumbered by one random permutation (a graph relabelled)."""
    p = np.random.default_rng(seed).permutation(m.shape[0])
    return matrices.canonical(m[p][:, p]), p


@pytest.mark.parametrize("order", sorted(graphformats.ORDERS))
@pytest.mark.parametrize("make", [lambda: matrices.rmat(10, 4, seed=2), lambda: matrices.uniform_random(300, 70, 3),
                                  lambda: sp.csr_matrix((0, 5), dtype=np.float32),
                                  lambda: sp.csr_matrix((6, 6), dtype=np.float32)])
def test_every_order_is_a_permutation(order, make):
    m = matrices.canonical(make())
    o = graphformats.row_order(m.indptr, m.indices, m.shape, order)
    assert o.dtype == np.int32 and sorted(o.tolist()) == list(range(m.shape[0]))


def test_degree_order_is_longest_first_and_stable():
    m = _pattern([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 0], [1, 0, 1]])
    assert graphformats.row_order(m.indptr, m.indices, m.shape, 2).tolist() == [2, 0, 4, 1, 3]
    assert graphformats.row_order(m.indptr, m.indices, m.shape, 1).tolist() == [0, 1, 2, 3, 4]


def _bandwidth(m: sp.csr_matrix, order: np.ndarray) -> int:
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size)
    rows = np.repeat(np.arange(m.shape[0]), np.diff(m.indptr))
    return int(np.abs(inv[rows] - inv[m.indices]).max())


def test_rcm_recovers_a_band_from_a_relabelled_banded_graph():
    band = matrices.banded(400, 3, seed=1)
    m, _ = _shuffled(band, 3)
    natural = _bandwidth(m, np.arange(400))
    rcm = graphformats.row_order(m.indptr, m.indices, m.shape, 3)
    assert natural > 200 and _bandwidth(m, rcm) <= 12


def test_bfs_lists_the_rows_of_one_community_together():
    blocks, p = _shuffled(matrices.block_diagonal(10, 12, density=0.6, seed=4), 5)
    o = graphformats.row_order(blocks.indptr, blocks.indices, blocks.shape, 4)
    community = p[o] // 12  # new row i was row p[i] of the block-diagonal matrix
    assert int((np.diff(community) != 0).sum()) == 9  # ten communities, each visited in one run


def test_rectangular_rcm_falls_back_to_bfs():
    m = matrices.uniform_random(50, 20, 2, seed=1)
    a = graphformats.row_order(m.indptr, m.indices, m.shape, 3)
    b = graphformats.row_order(m.indptr, m.indices, m.shape, 4)
    assert a.tolist() == b.tolist()


def test_costly_orders_are_kept_per_pattern():
    m = matrices.rmat(9, 4, seed=7)
    a = graphformats.row_order(m.indptr, m.indices, m.shape, 3)
    assert graphformats.row_order(m.indptr.copy(), m.indices.copy(), m.shape, 3) is a
    assert not a.flags.writeable
    other = matrices.rmat(9, 4, seed=8)
    assert graphformats.row_order(other.indptr, other.indices, other.shape, 3) is not a


def test_split_layout_of_a_small_graph():
    # row lengths 1, 5, 0, 2, 6, 1: hubs (>= 5) are rows 1 and 4; pieces of work <= 2
    m = _pattern([[1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0], [0] * 6, [0, 1, 0, 1, 0, 0],
                  [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]])
    fd = convert(m.indptr, m.indices, m.shape, "csr_split", {"order": 1, "piece": 2, "hub": 5, "warps": 4})
    a = fd.arrays
    assert a["row_id"].tolist() == [1, 4, 0, 2, 3, 5]
    assert a["srow_ptr"].tolist() == [0, 5, 11, 12, 12, 14, 15]
    # works 1, 1 | 2 | 1
    assert a["piece_ptr"].tolist() == [2, 4, 5, 6]
    assert fd.scalars == {"n_rows": 6, "n_cols": 6, "n_hubs": 2, "n_parts": 2 * 4 + 3}
    assert fd.value_map[:5].tolist() == list(range(1, 6))  # row 1's entries come first
    assert fd.value_array == "sval" and fd.fill == 1.0


def test_split_cuts_hub_rows_into_chunks():
    # one row of 10 and one of 3 with hub=3: min(split, ceil(len/3)) chunks of near-equal length
    m = _pattern([[1] * 10 + [0] * 2, [1, 1, 1] + [0] * 9, [0, 1] + [0] * 10])
    fd = convert(m.indptr, m.indices, m.shape, "csr_split", {"order": 1, "piece": 8, "hub": 3, "warps": 2, "split": 3})
    a = fd.arrays
    assert a["row_id"].tolist() == [0, 0, 0, 1, 2] and fd.scalars["n_hubs"] == 4
    assert np.diff(a["srow_ptr"]).tolist() == [3, 3, 4, 3, 1]
    assert a["piece_ptr"].tolist() == [4, 5] and fd.scalars["n_parts"] == 4 * 2 + 1
    one = convert(m.indptr, m.indices, m.shape, "csr_split", {"order": 1, "piece": 8, "hub": 3, "warps": 2, "split": 1})
    assert one.arrays["row_id"].tolist() == [0, 1, 2] and one.scalars["n_hubs"] == 2


def test_tcw_layout_of_a_small_graph():
    # H = 2: windows {0, 1}, {2, 3}; window 0 reads columns {0, 3, 17}, window 1 none
    m = _pattern([[1] + [0] * 16 + [1] + [0] * 2, [0, 0, 0, 1] + [0] * 16, [0] * 20, [0] * 20])
    fd = convert(m.indptr, m.indices, m.shape, "tcw", {"order": 1, "H": 2})
    a = fd.arrays
    assert fd.scalars["n_parts"] == 2
    assert a["win_ptr"].tolist() == [0, 1, 1]
    assert a["tile_col"].tolist() == [0, 3, 17] + [-1] * 13
    assert a["tile_ptr"].tolist() == [0, 3]
    # row 0: columns 0 and 17 -> condensed 0 and 2; row 1: column 3 -> condensed 1
    assert sorted(a["tcw_pos"].tolist()) == [0, 2, 16 + 1]
    assert a["row_id"].tolist() == [0, 1, 2, 3]
    assert graphformats.tile_density(fd) == pytest.approx(3 / 32)


def test_tcw_windows_follow_the_order_and_pad_the_last_window():
    m = matrices.rmat(7, 4, seed=1)
    fd = convert(m.indptr, m.indices, m.shape, "tcw", {"order": 2, "H": 16})
    order = graphformats.row_order(m.indptr, m.indices, m.shape, 2)
    rid = fd.arrays["row_id"]
    assert rid[:m.shape[0]].tolist() == order.tolist() and rid.size == 8 * 16


def test_bad_parameters_say_what_is_wrong():
    m = matrices.rmat(6, 4)
    with pytest.raises(ValueError, match="order=5"):
        convert(m.indptr, m.indices, m.shape, "csr_split", {"order": 5})
    with pytest.raises(ValueError, match="warps=33"):
        convert(m.indptr, m.indices, m.shape, "csr_split", {"warps": 33})
    with pytest.raises(ValueError, match="H=65"):
        convert(m.indptr, m.indices, m.shape, "tcw", {"H": 65})
    with pytest.raises(ValueError, match=">= 1"):
        convert(m.indptr, m.indices, m.shape, "tcw", {"order": 0})
