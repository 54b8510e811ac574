"""bench: result statistics and the impossible-speed rule (CPU); timing sanity on the GPU."""

from __future__ import annotations

import pytest

from sparserl_compile import bench, formats


def test_bench_result_statistics():
    r = bench.BenchResult.from_samples([5.0, 1.0, 3.0, 2.0, 4.0], "events", True)
    assert r.median_us == 3.0 and r.p10_us < r.median_us < r.p90_us
    assert r.to_dict()["reps"] == 5
    with pytest.raises(ValueError, match="no timing samples"):
        bench.BenchResult.from_samples([], "events", True)


def test_csr_tensor_is_the_matrix_and_warns_nothing():
    # torch 2.11 warned in every worker even with check_invariants=False; the logs filled with it
    import warnings

    import torch

    crow, col = torch.tensor([0, 2, 2, 3]), torch.tensor([0, 2, 1])
    vals = torch.tensor([1.0, 2.0, 3.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = bench.csr_tensor(torch, crow, col, vals, (3, 4))
    assert a.layout == torch.sparse_csr and tuple(a.shape) == (3, 4)
    assert a.to_dense().tolist() == [[1, 0, 2, 0], [0, 0, 0, 0], [0, 3, 0, 0]]


def test_hot_timing_takes_enough_calls_for_a_replay_and_bounds_their_outputs():
    assert bench.hot_launches(20.0) == 100 and bench.hot_launches(1.0) == 100
    assert bench.hot_launches(200.0) == 10 and bench.hot_launches(5000.0) == 3
    assert bench.hot_launches(20.0, out_bytes=bench.HOT_OUTPUT_BYTES // 8) == 8
    assert bench.hot_launches(20.0, out_bytes=bench.HOT_OUTPUT_BYTES) == 2  # never fewer than two


def test_impossible_speed_rule():
    floor = 10.0
    assert bench.is_impossible(10.0 / (bench.IMPOSSIBLE_SLACK + 0.1), floor)
    assert not bench.is_impossible(9.0, floor)  # within the slack of a real copy
    assert not bench.is_impossible(50.0, floor)


@pytest.mark.gpu
def test_hide_host_keeps_a_slow_host_path_out_of_the_event_time():
    """A call whose host part outlasts the L2 flush leaks that time into its events unless
    the GPU is kept busy longer (what torch.sparse's mv and the runtime's Python path need)."""
    import time

    import torch

    a = torch.empty(1024, device="cuda")

    def slow_host():
        time.sleep(300e-6)  # a host path far longer than the flush
        a.fill_(1.0)

    leaky = bench.time_fn(slow_host, reps=10).median_us
    hidden = bench.time_fn(slow_host, reps=10, hide_host_us=2000).median_us
    assert bench.sleep_cycles_per_us() > 100  # a GPU clock of more than 100 MHz
    assert leaky > 150 and hidden < 50, (leaky, hidden)
    print(f"\nslow host path: {leaky:.1f} us flushed only, {hidden:.1f} us with the host hidden")


@pytest.mark.gpu
def test_copy_bandwidth_and_flushed_timing_are_plausible():
    import torch

    bw = bench.copy_bandwidth()
    assert 2e11 < bw < 2e13, bw  # 0.2 - 20 TB/s
    a = torch.empty(64 * 2**20 // 4, device="cuda")
    r = bench.time_fn(lambda: a.fill_(1.0), reps=10)
    expect = bench.floor_us(a.numel() * 4, bw) / 2  # a fill writes only
    assert r.median_us > 0.5 * expect and r.l2_flushed
    g = bench.time_graph(lambda: a[:1024].fill_(2.0), launches=50, reps=3)
    assert 0 < g.median_us < r.median_us
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; 64 MiB fill {r.median_us:.1f} us; 4 KiB fill in a graph {g.median_us:.2f} us")


@pytest.mark.gpu
def test_reference_timing_int32_and_int64():
    from sparserl_compile import matrices

    m = matrices.stencil2d(300)
    ref = bench.time_reference(m.indptr, m.indices, m.shape, op="spmv", reps=10)
    assert set(ref) == {"int32", "int64"} and all(r.median_us > 0 for r in ref.values())
    floor = bench.floor_us(formats.floor_bytes("spmv", *m.shape, m.nnz))
    assert not bench.is_impossible(ref["int32"].median_us, floor)


@pytest.mark.gpu
def test_reference_graph_timing_is_a_hot_l2_figure_for_short_products():
    """``graph_below_us`` adds a CUDA-graph (hot L2) timing of cuSPARSE for the first index
    type, which the selection compares with the candidates' own graph figures."""
    from sparserl_compile import matrices

    m = matrices.stencil2d(300)  # 4.5e5 nonzeros: ~10-30 us flushed
    ref = bench.time_reference(m.indptr, m.indices, m.shape, op="spmv", reps=10, graph_below_us=1e6)
    assert set(ref) == {"int32", "int64", "int32_graph"}, set(ref)
    assert ref["int32_graph"].method in ("graph", "events_hot") and not ref["int32_graph"].l2_flushed
    assert 0 < ref["int32_graph"].median_us < ref["int32"].median_us  # cached operands, no host gaps
    none = bench.time_reference(m.indptr, m.indices, m.shape, op="spmv", reps=5, graph_below_us=0.0)
    assert set(none) == {"int32", "int64"}
    print(f"\ncuSPARSE SpMV 2D stencil 300^2: flushed {ref['int32'].median_us:.1f} us, "
          f"graph {ref['int32_graph'].median_us:.1f} us")


@pytest.mark.gpu
def test_side_by_side_timing_orders_a_small_and_a_large_fill():
    import torch

    big = torch.empty(64 * 2**20 // 4, device="cuda")
    small = big[: 2**16]
    ours, theirs = bench.time_side_by_side(lambda: small.fill_(1.0), lambda: big.fill_(1.0), reps=10)
    assert 0 < ours < theirs, (ours, theirs)  # 256 KiB written vs 64 MiB


@pytest.mark.gpu
def test_before_runs_ahead_of_every_timed_call_outside_the_events():
    """``before`` (the sandbox's re-poisoning) runs before every call, warm-up included, and
    its work is not in the call's time: a 64 MiB fill before a 4 KiB one."""
    import torch

    big = torch.empty(64 * 2**20 // 4, device="cuda")
    small = torch.empty(1024, device="cuda")
    count = []

    def before():
        count.append(1)
        big.fill_(float("nan"))

    r = bench.time_fn(lambda: small.fill_(1.0), warmup=2, reps=7, before=before)
    assert len(count) == 9
    assert r.median_us < bench.time_fn(lambda: big.fill_(1.0), reps=5).median_us / 4
    count.clear()
    h = bench.time_hot(lambda k: small.fill_(float(k)), 5, reps=3, before=before)
    assert len(count) == 4 and h.method == "graph" and not h.l2_flushed  # once before the first replay, then per rep


def test_dense_matrix_from_host_or_torch_patterns():
    import numpy as np
    import scipy.sparse as sp
    import torch

    m = sp.random(13, 7, density=0.4, format="csr", random_state=3, dtype=np.float32)
    vals = torch.from_numpy(m.data)
    want = torch.from_numpy(m.toarray())
    assert torch.equal(bench.dense_matrix(m.indptr, m.indices, m.shape, vals), want)
    ip, ix = torch.from_numpy(m.indptr.astype(np.int32)), torch.from_numpy(m.indices.astype(np.int32))
    half = bench.dense_matrix(ip, ix, m.shape, vals.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16 and torch.equal(half, want.to(torch.bfloat16))
    empty = sp.csr_matrix((4, 5), dtype=np.float32)
    assert torch.equal(bench.dense_matrix(empty.indptr, empty.indices, (4, 5), torch.zeros(0)), torch.zeros(4, 5))


@pytest.mark.gpu
def test_dense_timing_both_ways_beside_the_reference():
    """``time_dense``: the dense product timed as the reference is (flushed, then hot)."""
    from sparserl_compile import matrices

    m = matrices.stencil2d(40)  # 1600 x 1600, 5 per row: 10 MB dense in float32
    for op, n in (("spmv", 1), ("spmm", 16)):
        d = bench.time_dense(m.indptr, m.indices, m.shape, op=op, n=n, dtype="bf16", reps=5)
        assert set(d) == {"dense", "dense_graph"} and d["dense"].l2_flushed and not d["dense_graph"].l2_flushed
        assert d["dense"].median_us > 0 and d["dense_graph"].median_us > 0
