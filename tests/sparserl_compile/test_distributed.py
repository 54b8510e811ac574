"""distributed: nnz-balanced partitions, the cost split, and row-partitioned SpMM/SpMV on 2 and 3
gloo processes (spawned, file:// rendezvous) against scipy in float64, gradients included."""

from __future__ import annotations

import os

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from sparserl_compile import matrices
from sparserl_compile.distributed import (
    MULTICAST_OFF_ENV,
    DistributedSparseMatrix,
    RowRange,
    even_ranges,
    partition_rows,
    split_by_cost,
)

# ---------------------------------------------------------------------- partitions


def _cost(m, r: RowRange, w: float = 1.0) -> float:
    return r.nnz + w * r.n_rows


@pytest.mark.parametrize("ws", [1, 2, 3, 7])
@pytest.mark.parametrize("make", [lambda: matrices.stencil2d(20), lambda: matrices.rmat(9, 8, seed=1),
                                  lambda: matrices.banded(50, 3)])
def test_partition_rows_is_contiguous_and_balanced_by_nonzeros(make, ws):
    m = make()
    parts = partition_rows(m.indptr, ws)
    assert len(parts) == ws and parts[0].start == 0 and parts[-1].stop == m.shape[0]
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    assert [p.nnz for p in parts] == [int(m.indptr[p.stop] - m.indptr[p.start]) for p in parts]
    row_cost = np.diff(m.indptr) + 1.0
    total = row_cost.sum()
    for p in parts:  # every range within one row of its fair share
        assert abs(_cost(m, p) - total / ws) <= row_cost.max() + 1e-9


def test_partition_rows_follows_nonzeros_not_rows():
    # one row of 1000 nonzeros, then 999 rows of one: the first rank stops near row 250, not 500
    long = sp.csr_matrix((np.ones(1000), (np.zeros(1000, int), np.arange(1000))), shape=(1000, 1000))
    short = sp.csr_matrix((np.ones(999), (np.arange(1, 1000), np.arange(1, 1000))), shape=(1000, 1000))
    m = (long + short).tocsr()
    a, b = partition_rows(m.indptr, 2)
    assert 245 <= a.stop <= 255  # cost 1001 + 2 per row up to the half of 2999
    assert abs(_cost(m, a) - _cost(m, b)) <= 1001


def test_partition_rows_edge_cases():
    assert partition_rows(np.zeros(1, np.int64), 3) == [RowRange(0, 0, 0)] * 3  # no rows
    empty = sp.csr_matrix((10, 10))  # nnz=0: splits evenly by rows
    assert [p.n_rows for p in partition_rows(empty.indptr, 2)] == [5, 5]
    one = sp.csr_matrix(np.ones((1, 4)))  # one row, more ranks than rows: empty ranges
    parts = partition_rows(one.indptr, 3)
    assert sum(p.n_rows for p in parts) == 1 and sum(p.nnz for p in parts) == 4
    with pytest.raises(ValueError, match="world_size"):
        partition_rows(one.indptr, 0)
    with pytest.raises(ValueError, match="row pointer"):
        partition_rows(np.array([1, 0]), 2)
    assert [r.n_rows for r in even_ranges(10, 3)] == [3, 3, 4]


def test_partition_rows_on_a_real_matrix(shared_matrices):
    m = matrices.load_npz(shared_matrices / "cora_adj.npz")
    parts = partition_rows(m.indptr, 4)
    row_cost = np.diff(m.indptr) + 1.0
    assert max(_cost(m, p) for p in parts) <= row_cost.sum() / 4 + row_cost.max()


def test_split_by_cost_is_deterministic_and_greedy_balanced():
    costs = [100, 1, 50, 50, 7, 3, 99, 0]
    s = split_by_cost(costs, 3)
    assert s == split_by_cost(list(costs), 3)  # same input, same split on every rank
    assert sorted(i for part in s for i in part) == list(range(len(costs)))
    loads = [sum(costs[i] for i in part) for part in s]
    assert max(loads) - min(loads) <= max(costs)  # LPT: within one item of balance
    # LPT walk: 100->r0, 99->r1, 50->r2, 50->r2, 7->r1 (99), 3->r0 (100, tie: lower rank), 1->r2, 0->r2
    assert s == [[0, 5], [4, 6], [1, 2, 3, 7]]
    assert split_by_cost([], 2) == [[], []]
    assert split_by_cost([5, 5], 4) == [[0], [1], [], []]
    with pytest.raises(ValueError):
        split_by_cost([1, -1], 2)


# ---------------------------------------------------------------------- one process


def test_single_process_without_a_process_group_is_the_plain_product():
    A = matrices.rmat(7, 4, seed=3).astype(np.float32)
    D = DistributedSparseMatrix.from_scipy(A)
    assert D.plan.world_size == 1 and D.plan.n_halo == 0 and not D.plan.any_exchange
    X = np.random.default_rng(0).standard_normal((A.shape[0], 3)).astype(np.float32)
    y = D @ torch.from_numpy(X)
    np.testing.assert_allclose(y.numpy(), A.astype(np.float64) @ X.astype(np.float64), rtol=1e-4, atol=1e-4)
    assert D.stats.calls == 1 and D.stats.bytes_sent == 0


def test_errors_say_what_to_do():
    A = matrices.uniform_random(6, 9, 2.0)
    with pytest.raises(ValueError, match="col_ranges="):
        DistributedSparseMatrix.from_scipy(A)
    D = DistributedSparseMatrix.from_scipy(matrices.stencil2d(4))
    with pytest.raises(ValueError, match="local_rows"):
        D @ torch.zeros(3, 2)
    with pytest.raises(ValueError, match="float32"):
        D @ torch.zeros(16, 2, dtype=torch.float64)


# ---------------------------------------------------------------------- several processes


def _cases(ws: int, real: str | None):
    out = [("stencil2d", matrices.stencil2d(9, seed=1), None),
           ("rmat", matrices.rmat(8, 6, seed=2), None)]
    if ws == 2:
        rect = matrices.uniform_random(40, 57, 3.0, seed=4)  # rectangular: X split evenly
        out.append(("rect", rect, even_ranges(57, ws)))
        if real:
            out.append(("cora", matrices.load_npz(real), None))
    return out


def _worker(rank: int, ws: int, init_file: str, real: str | None) -> None:
    from sparserl_compile.distributed import init_process_group

    torch.set_num_threads(1)
    init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws)
    try:
        for k, v in MULTICAST_OFF_ENV.items():
            assert os.environ[k] == v
        _check_cases(rank, ws, real)
    finally:
        import gc

        import torch.distributed as dist

        # tear down only once every object holding the group is gone and both ranks are done:
        # a gloo group destroyed while its peer is still connected, or freed late at
        # interpreter exit, aborts now and then ("terminate called without an active exception")
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def _check_cases(rank: int, ws: int, real: str | None) -> None:
    for name, A, col_ranges in _cases(ws, real):
        A = A.astype(np.float32)
        D = DistributedSparseMatrix.from_scipy(A, col_ranges=col_ranges)
        p = D.plan
        # the plan is what the block needs: every outside column, nothing else
        cols = np.unique(A[p.rows.start:p.rows.stop].indices)
        outside = cols[(cols < p.cols.start) | (cols >= p.cols.stop)]
        np.testing.assert_array_equal(p.halo_cols, outside)
        rng = np.random.default_rng(7)  # same X on every rank
        A64 = A.astype(np.float64)
        for X in (rng.standard_normal((A.shape[1], 5)), rng.standard_normal(A.shape[1])):
            X32 = torch.from_numpy(X.astype(np.float32))
            y = D.gather(D @ D.local_rows(X32))
            want = A64 @ X.astype(np.float32).astype(np.float64)
            scale = abs(A64) @ abs(X)
            err = np.abs(y.numpy().astype(np.float64) - want)
            assert y.shape == want.shape and np.all(err <= 1e-5 * scale + 1e-6), (name, rank, err.max())
        # gradient w.r.t. this rank's rows of X is (A^T G) on those rows
        G = rng.standard_normal((A.shape[0], 4))
        X = rng.standard_normal((A.shape[1], 4))
        x_local = D.local_rows(torch.from_numpy(X.astype(np.float32))).clone().requires_grad_(True)
        y_local = D @ x_local
        (y_local * torch.from_numpy(G[p.rows.start:p.rows.stop].astype(np.float32))).sum().backward()
        want_grad = (A64.T @ G)[p.cols.start:p.cols.stop]
        np.testing.assert_allclose(x_local.grad.numpy(), want_grad, rtol=1e-4, atol=1e-4)
        s = D.stats
        assert s.calls == 3 and 0.0 <= s.comm_share <= 1.0
        assert s.rows_received == 3 * p.n_halo and s.bytes_received == p.n_halo * 4 * (5 + 1 + 4)
        if name == "stencil2d":  # a 2-D grid split in row blocks always has a halo
            assert p.n_halo > 0 and p.any_exchange


@pytest.mark.parametrize("ws", [2, 3])
def test_distributed_spmm_spmv_and_grad_match_scipy_float64(ws, tmp_path):
    real = matrices.shared_matrices_dir()
    real_file = str(real / "cora_adj.npz") if real is not None and (real / "cora_adj.npz").is_file() else None
    torch.multiprocessing.spawn(_worker, args=(ws, str(tmp_path / "pg"), real_file), nprocs=ws, join=True)
