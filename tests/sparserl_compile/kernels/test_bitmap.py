"""The bitmap families on pruned weights: every verification check on the CPU executor at the
widths each point serves (magnitude and Wanda-like masks, 50 / 70 / 90 %), their parameter
checks, and the same on the GPU (marked ``gpu``)."""

from __future__ import annotations

import pytest

from sparserl_compile import kernels, matrices, verify

#: 72 rows, 600 columns: bands and column tiles overhang the matrix at every R
SHAPE = (72, 600)
CASES = [(mask, s) for mask in ("magnitude", "wanda") for s in (0.5, 0.7, 0.9)]

WARP_SPMV = [{"R": 8, "warps": 4, "stage": False}, {"R": 16, "warps": 8, "stage": True},
             {"R": 32, "warps": 16, "stage": True}, {"R": 32, "warps": 8, "stage": False}]
#: (point, widths): each v at the widths the search proposes it for, and one past (two y tiles)
WARP_SPMM = [({"R": 8, "warps": 8, "stage": True, "v": 1}, (1, 3)),
             ({"R": 32, "warps": 16, "stage": False, "v": 2}, (2, 3)),
             ({"R": 16, "warps": 4, "stage": False, "v": 4}, (3, 4, 8)),
             ({"R": 32, "warps": 8, "stage": True, "v": 4}, (4, 5))]
WMMA = [({"R": 16, "G": 1, "BN": 16, "warps": 8, "v": 8}, (8, 16)),
        ({"R": 32, "G": 2, "BN": 32, "warps": 4, "v": 8}, (40,)),
        ({"R": 32, "G": 1, "BN": 32, "warps": 8, "v": 1}, (12,))]


def _weight(mask: str, sparsity: float, shape=SHAPE):
    return matrices.pruned_weight(*shape, sparsity, mask, seed=int(sparsity * 10))


def _check(family: str, op: str, dtype: str, params: dict, m, n: int, executor: str = "cpu") -> None:
    c = kernels.render(family, op, dtype, params)
    r = verify.verify(c, m, executor=executor, n=n)
    assert r.ok, f"{c.name} {dtype} n={n}: {r.reason}"


@pytest.mark.parametrize("mask,sparsity", CASES)
def test_bitmap_warp_passes_verification_on_pruned_weights(mask, sparsity):
    m = _weight(mask, sparsity)
    for p in WARP_SPMV:
        _check("bitmap_warp", "spmv", "bf16", p, m, 1)
    for p, widths in WARP_SPMM:
        for n in widths:
            _check("bitmap_warp", "spmm", "bf16", p, m, n)


@pytest.mark.parametrize("mask,sparsity", [("magnitude", 0.5), ("wanda", 0.7), ("magnitude", 0.9)])
def test_bitmap_wmma_passes_verification_on_pruned_weights(mask, sparsity):
    """The tensor-core family runs on the CPU executor's wmma emulation."""
    m = _weight(mask, sparsity)
    for p, widths in WMMA:
        for n in widths:
            _check("bitmap_wmma", "spmm", "bf16", p, m, n)


def test_other_dtypes():
    m = _weight("wanda", 0.7)
    _check("bitmap_warp", "spmv", "f32", WARP_SPMV[1], m, 1)
    _check("bitmap_warp", "spmm", "f32", WARP_SPMM[1][0], m, 2)
    _check("bitmap_warp", "spmm", "f16", WARP_SPMM[2][0], m, 4)
    _check("bitmap_wmma", "spmm", "f16", WMMA[0][0], m, 16)


def test_edges_of_the_layout():
    """Empty rows, a full row, a matrix narrower than one column tile, a single row."""
    m = _weight("magnitude", 0.7, (40, 70)).tolil()
    m[3, :] = 0
    m[17, :] = 1.0
    m = matrices.canonical(m.tocsr())
    one_row = _weight("wanda", 0.5, (1, 300))
    for mat in (m, one_row):
        _check("bitmap_warp", "spmv", "bf16", WARP_SPMV[0], mat, 1)
        _check("bitmap_warp", "spmm", "bf16", WARP_SPMM[3][0], mat, 5)
        _check("bitmap_wmma", "spmm", "bf16", WMMA[1][0], mat, 8)


def test_nonfinite_leniency_counts_the_unstored_positions():
    """NaN is accepted exactly where a position the pattern does not store meets a non-finite
    x (what a dense tile computes there); the complement is counted, never built."""
    import types

    import numpy as np

    m = _weight("magnitude", 0.7, (30, 50))
    x = np.ones((50, 3), np.float32)
    x[[4, 17], 0] = np.inf
    x[9, 2] = np.nan
    runner = types.SimpleNamespace(executor="cpu", pattern=verify.Pattern.of(m),
                                   header=types.SimpleNamespace(dtype="f32"))
    got = verify._lenient_unstored(runner, x)
    unstored = (m.toarray() == 0).astype(np.float32)
    assert np.array_equal(got, unstored @ (~np.isfinite(x)).astype(np.float32) > 0)
    assert got[:, 1].sum() == 0 and got[:, 0].any()


def test_parameters_are_checked():
    with pytest.raises(ValueError, match="f16/bf16"):
        kernels.render("bitmap_wmma", "spmm", "f32", WMMA[0][0])
    with pytest.raises(ValueError, match="shared memory"):
        kernels.render("bitmap_wmma", "spmm", "bf16", {"R": 16, "G": 1, "BN": 64, "warps": 8, "v": 8})
    with pytest.raises(ValueError, match="R=4"):
        kernels.render("bitmap_warp", "spmv", "bf16", {"R": 4, "warps": 4, "stage": False})
    with pytest.raises(ValueError, match="R=32 takes warps in"):
        kernels.render("bitmap_warp", "spmv", "bf16", {"R": 32, "warps": 4, "stage": False})
    with pytest.raises(ValueError, match="shared memory"):
        kernels.render("bitmap_warp", "spmv", "f32", {"R": 32, "warps": 16, "stage": True})
    with pytest.raises(ValueError, match="missing"):
        kernels.render("bitmap_warp", "spmm", "bf16", WARP_SPMV[0])  # SpMM needs v


def test_space_points_and_launch_geometry():
    for op, dtype in (("spmv", "f32"), ("spmm", "bf16")):
        pts = [c for c in kernels.space(op, dtype) if c.header.format == "bitmap"]
        assert {c.family for c in pts} == ({"bitmap_warp"} if op == "spmv" else {"bitmap_warp", "bitmap_wmma"})
        for c in pts:
            h = c.header
            assert h.launch.work == "bands" and not h.launch.zero_output and "atomicAdd" not in c.source
            assert h.launch.block == 32 * dict(c.params)["warps"]
            if c.family == "bitmap_wmma":  # one block per G bands, BN dense columns per grid.y
                p = dict(c.params)
                assert (h.launch.per_block, h.launch.tile_n, h.launch.n_align) == (p["G"], p["BN"], p["v"])


# ----------------------------------------------------------------------------- GPU twin


@pytest.mark.gpu
@pytest.mark.parametrize("mask,sparsity,dtypes", [("magnitude", 0.5, ("bf16", "f16")), ("wanda", 0.7, ("bf16",)),
                                                  ("magnitude", 0.9, ("bf16",))])
def test_every_bitmap_point_verifies_on_the_gpu(mask, sparsity, dtypes):
    """Every point of both families, at the widths the search proposes it for, with every
    check including the comparison with cuSPARSE, on a weight larger than a few tiles."""
    from sparserl_compile.search import BITMAP_WMMA_MIN_N

    m = _weight(mask, sparsity, (1000, 3000))
    bad = []
    for dtype in dtypes:
        for c in kernels.space("spmv", dtype) + kernels.space("spmm", dtype):
            if c.header.format != "bitmap":
                continue
            p = dict(c.params)
            if c.header.op == "spmv":
                widths = (1,)
            elif c.family == "bitmap_warp":
                widths = {1: (1,), 2: (2,), 4: (3, 4, 8)}[p["v"]]
            else:
                widths = tuple(n for n in (BITMAP_WMMA_MIN_N, 16, 32, 64, 40) if n % p["v"] == 0 and n >= p["BN"] // 2)
            for n in widths:
                r = verify.verify(c, m, executor="gpu", n=n)
                if not r.ok:
                    bad.append(f"{c.name} {dtype} n={n}: {r.reason[:300]}")
    assert not bad, "\n".join(bad[:20])
