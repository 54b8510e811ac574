"""The graph families, csr_split and tcw_wmma: full verification over the widths they claim.

Both run on the CPU executor (``verify(..., executor="cpu")``: every check but the cuSPARSE
comparison; tcw_wmma's tensor-core calls through the executor's wmma emulation) on a
power-law graph with hub rows and on real graphs of the shared set, at widths below, at and
above a warp's column span; the GPU twins run the same points with ``executor="gpu"``.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparserl_compile import compiler, contract, kernels, matrices, verify
from sparserl_compile.kernels import split, tcw

GRAPHS = ("cora_adj", "citeseer_adj", "hep-th", "polblogs", "PGPgiantcompo", "wiki-Vote")


def hub_graph(seed: int = 0):
    """R-MAT 2^11 plus three rows of 700-1300 entries (hub rows at the space's threshold 512),
    an emptied row and the R-MAT's own empty rows."""
    m = matrices.rmat(11, 4, seed=seed).tolil()
    rng = np.random.default_rng(seed)
    for r, length in ((5, 700), (77, 1300), (1500, 1000)):
        cols = rng.choice(m.shape[1], size=length, replace=False)
        m[r, cols] = rng.standard_normal(length)
    m[9, :] = 0
    return matrices.canonical(m.tocsr())


def _point(dtype: str, v: int, order: int, piece: int = 32, hub: int = 512, warps: int = 8, split_: int = 1):
    return kernels.render("csr_split", "spmm", dtype, {"v": v, "order": order, "piece": piece, "hub": hub,
                                                       "warps": warps, "split": split_})


def _widths(dtype: str, v: int) -> list[int]:
    """Below one warp's span (lanes idle), exactly one, and one and a half (a partial tile)."""
    span = 32 * v
    return [max(v, span // 2), span, span + span // 2]


def _cases(dtype: str) -> list[tuple[int, int, int, int]]:
    """(v, order, piece, n): every v at each of its widths, orders and pieces rotating."""
    out, k = [], 0
    for v in split._VS[dtype]:
        for n in _widths(dtype, v):
            out.append((v, 1 + k % 4, (32, 128)[k % 2], n))
            k += 1
    return out


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_csr_split_verifies_on_the_cpu_over_its_widths(dtype):
    m = hub_graph()
    assert (np.diff(m.indptr) >= 512).sum() == 3
    for v, order, piece, n in _cases(dtype):
        c = _point(dtype, v, order, piece)
        r = verify.verify(c, m, executor="cpu", n=n, value_sets=1)
        assert r.ok, (c.name, n, r.reason)
        assert "deterministic" in r.checks_passed and "stale" in r.checks_passed


def test_csr_split_wide_hub_blocks_verify_on_the_cpu():
    m = hub_graph(seed=1)
    for dtype, v, order in (("f32", 4, 3), ("bf16", 8, 4)):
        c = _point(dtype, v, order, piece=128, hub=512, warps=16)
        r = verify.verify(c, m, executor="cpu", n=32 * v, value_sets=1)
        assert r.ok, (c.name, r.reason)


def test_csr_split_hub_chunks_summed_with_atomics_verify_on_the_cpu():
    m = hub_graph(seed=2)
    for v, order, n in ((1, 2, 48), (4, 4, 128)):
        c = _point("f32", v, order, piece=128, split_=16)
        assert c.header.launch.zero_output and "atomicAdd" in c.source
        r = verify.verify(c, m, executor="cpu", n=n, value_sets=2)
        assert r.ok, (c.name, r.reason)
    with pytest.raises(ValueError, match="f32 only"):
        _point("bf16", 8, 1, split_=16)


@pytest.mark.parametrize("name", GRAPHS)
def test_csr_split_on_real_graphs(shared_matrices, name):
    m = matrices.load_npz(shared_matrices / f"{name}.npz")
    k = GRAPHS.index(name)
    dtype = ("f32", "bf16", "f16")[k % 3]
    v = split._VS[dtype][k % 3]
    c = _point(dtype, v, 1 + k % 4, (32, 128)[k % 2])
    r = verify.verify(c, m, executor="cpu", n=64 if 32 * v <= 64 else 32 * v, value_sets=1)
    assert r.ok, (c.name, name, r.reason)


def test_csr_split_points_are_all_rendered_and_checked():
    for dtype in contract.DTYPES:
        pts = split.space("spmm", dtype)
        assert {p["v"] for p in pts} == set(split._VS[dtype])
        assert {p["order"] for p in pts} == {1, 2, 3, 4}
        for p in pts:
            c = kernels.render("csr_split", "spmm", dtype, p)
            assert c.header.launch.tile_n == 32 * p["v"] and c.header.launch.n_align == p["v"]
            assert c.header.launch.block == 32 * p["warps"]
            assert c.header.launch.zero_output == (p["split"] > 1) and (p["split"] == 1 or dtype == "f32")
    assert split.space("spmv", "f32") == []


def test_render_errors_name_the_problem():
    with pytest.raises(ValueError, match="v=8"):
        kernels.render("csr_split", "spmm", "f32", {"v": 8, "order": 1, "piece": 32, "hub": 512, "warps": 8, "split": 1})
    with pytest.raises(ValueError, match="renders"):
        kernels.render("csr_split", "spmv", "f32", {"v": 1, "order": 1, "piece": 32, "hub": 512, "warps": 8, "split": 1})
    with pytest.raises(ValueError, match="f16/bf16"):
        kernels.family("tcw_wmma").render("spmm", "f32", {"H": 16, "nt": 2, "order": 1, "warps": 4})
    with pytest.raises(ValueError, match="nt=3"):
        kernels.render("tcw_wmma", "spmm", "bf16", {"H": 16, "nt": 3, "order": 1, "warps": 4})


def test_tcw_points_compile_for_sm90():
    shapes = {}
    for dtype in ("f16", "bf16"):
        for p in tcw.space("spmm", dtype):
            shapes.setdefault((dtype, p["H"], p["nt"]), p)
    assert len(shapes) == 8
    for (dtype, _, _), p in shapes.items():
        c = kernels.render("tcw_wmma", "spmm", dtype, p)
        assert c.header.launch.n_align == 8 and c.header.format == "tcw"
        assert compiler.compile_cubin(c.source, "sm_90").cubin[:4] == b"\x7fELF"
    assert tcw.space("spmm", "f32") == [] and tcw.space("spmv", "bf16") == []


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_tcw_verifies_on_the_cpu_over_its_widths(dtype, shared_matrices):
    """Every window height and column width, each order once per dtype, at a width below a
    warp's columns and one past it (a partial tile), on the hub graph and on Cora."""
    graphs = [hub_graph(), matrices.load_npz(shared_matrices / "cora_adj.npz")]
    pts = tcw.space("spmm", dtype)
    for k, (H, nt) in enumerate(((16, 2), (16, 4), (8, 2), (8, 4))):
        p = next(q for q in pts if q["H"] == H and q["nt"] == nt and q["order"] == 1 + (k + (dtype == "f16")) % 4)
        c = kernels.render("tcw_wmma", "spmm", dtype, p)
        for n in (16, c.header.launch.tile_n + 8):
            r = verify.verify(c, graphs[k % 2], executor="cpu", n=n, value_sets=1)
            assert r.ok, (c.name, n, r.reason)


# ------------------------------------------------------------------ the GPU twins


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_csr_split_verifies_on_the_gpu(dtype):
    m = hub_graph()
    for v, order, piece, n in _cases(dtype):
        c = _point(dtype, v, order, piece)
        r = verify.verify(c, m, executor="gpu", n=n, value_sets=2)
        assert r.ok, (c.name, n, r.reason)
        if dtype == "f32" and order % 2 == 0:
            c = _point(dtype, v, order, 128, split_=16)
            r = verify.verify(c, m, executor="gpu", n=n, value_sets=2)
            assert r.ok, (c.name, n, r.reason)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_tcw_verifies_on_the_gpu(dtype, shared_matrices):
    graphs = [hub_graph()] + [matrices.load_npz(shared_matrices / f"{g}.npz") for g in ("cora_adj", "wiki-Vote")]
    for k, p in enumerate(tcw.space("spmm", dtype)):
        c = kernels.render("tcw_wmma", "spmm", dtype, p)
        tn = c.header.launch.tile_n
        for n in (16, tn, tn + 8 * (k % 3 + 1)):
            r = verify.verify(c, graphs[k % len(graphs)], executor="gpu", n=n, value_sets=2)
            assert r.ok, (c.name, n, r.reason)
