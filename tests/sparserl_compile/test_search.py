"""search: the pruned space per matrix kind is sane and its rules are applied."""

from __future__ import annotations

import dataclasses

from sparserl_compile import matrices, structure
from sparserl_compile.problem import Problem
from sparserl_compile.search import SearchProvider


def _problem(m, op="spmv", n=1):
    return Problem(op, "f32", n, m.shape[0], m.shape[1], m.nnz, m.indptr, m.indices,
                   structure.fingerprint(m.indptr, m.indices, m.shape), "sm_90")


def _formats(cands):
    return {c.header.format for c in cands}


def test_stencil_keeps_dia_and_powerlaw_drops_it():
    sp = SearchProvider()
    st = sp.candidates(_problem(matrices.stencil2d(40)))
    rep = sp.last_report
    assert "dia" in _formats(st) and 10 <= len(st) <= rep.space
    rm = sp.candidates(_problem(matrices.rmat(12, 8, seed=1)))
    assert "dia" not in _formats(rm) and "ell" not in _formats(rm)
    assert sp.last_report.pruned and sum(sp.last_report.pruned.values()) + len(rm) == sp.last_report.space


def test_block_matrix_keeps_bsr_and_random_drops_it():
    sp = SearchProvider()
    assert "bsr" in _formats(sp.candidates(_problem(matrices.block_diagonal(64, 8))))
    assert "bsr" not in _formats(sp.candidates(_problem(matrices.uniform_random(3000, 3000, 5))))


def test_spmm_alignment_and_k_limit():
    sp = SearchProvider()
    m = matrices.stencil2d(20)
    odd = sp.candidates(_problem(m, "spmm", 6))
    assert all(6 % c.header.launch.n_align == 0 for c in odd)
    assert len(sp.candidates(_problem(m, "spmm", 32), k=5)) == 5


def test_real_matrices_get_a_sane_number_of_points(shared_matrices):
    sp = SearchProvider()
    for name in ("add32", "bcsstk13", "wiki-Vote"):
        m = matrices.load_npz(shared_matrices / f"{name}.npz")
        cands = sp.candidates(_problem(m))
        assert 5 <= len(cands) <= 200, (name, sp.last_report)
        assert {"csr", "csr_part", "merge"} <= _formats(cands)
        assert sp.last_report.seconds < 10


def test_format_plausible_follows_the_pruning_rules():
    from sparserl_compile import matrices, search, structure

    band = matrices.banded(2000, 3)
    rnd = matrices.uniform_random(2000, 2000, 8, seed=0)
    blocks = matrices.block_diagonal(200, 8)
    f = {name: structure.features(m.indptr, m.indices, m.shape)
         for name, m in (("band", band), ("rnd", rnd), ("blocks", blocks))}
    assert search.format_plausible("dia", f["band"]) and not search.format_plausible("dia", f["rnd"])
    assert search.format_plausible("bsr", f["blocks"]) and not search.format_plausible("bsr", f["rnd"])
    assert all(search.format_plausible(x, f["rnd"]) for x in ("csr", "merge", "csr_part", "sell"))


def test_graph_families_are_proposed_where_they_suit():
    sp = SearchProvider()
    graph = matrices.rmat(12, 8, seed=1)
    fams = lambda cands: {c.family for c in cands}  # noqa: E731
    f32 = sp.candidates(_problem(graph, "spmm", 128))
    assert "csr_split" in fams(f32) and "tcw_wmma" not in fams(f32)
    assert {dict(c.params)["order"] for c in f32 if c.family == "csr_split"} == {1, 2, 3, 4}
    bf16 = sp.candidates(dataclasses.replace(_problem(graph, "spmm", 64), dtype="bf16"))
    assert {"csr_split", "tcw_wmma"} <= fams(bf16)
    # no point whose lanes span more columns than n when a narrower one fits
    assert all(c.header.launch.tile_n <= 64 for c in bf16 if c.family in ("csr_split", "tcw_wmma"))
    narrow = sp.candidates(_problem(graph, "spmm", 16))
    assert {c.header.launch.tile_n for c in narrow if c.family == "csr_split"} == {32}
    assert "csr_split" not in fams(sp.candidates(_problem(graph, "spmm", 8)))
    assert "csr_split" not in fams(sp.candidates(_problem(graph)))  # SpMV
    mesh = sp.candidates(_problem(matrices.stencil2d(40), "spmm", 128))
    assert "csr_split" not in fams(mesh) and sp.last_report.pruned["csr_split: rows too regular"] > 0
    rect = matrices.rmat(9, 8, seed=2)[:, :300]  # rectangular: RCM falls back to BFS, so only BFS is kept
    orders = {dict(c.params)["order"] for c in sp.candidates(_problem(rect, "spmm", 64)) if c.family == "csr_split"}
    assert orders == {1, 2, 4}
def _problem_of(m, op, n, dtype="bf16"):
    return Problem(op, dtype, n, m.shape[0], m.shape[1], m.nnz, m.indptr, m.indices,
                   structure.fingerprint(m.indptr, m.indices, m.shape), "sm_90")


def test_pruned_weights_get_the_bitmap_families_first():
    from sparserl_compile import search

    w = matrices.pruned_weight(512, 1024, 0.7, "wanda")
    sp = SearchProvider()
    f = structure.features(w.indptr, w.indices, w.shape)
    assert search.weight_like(f) and search.format_plausible("bitmap", f)
    for op, n, fams, v in (("spmv", 1, {"bitmap_warp"}, None), ("spmm", 1, {"bitmap_warp"}, 1),
                           ("spmm", 2, {"bitmap_warp"}, 2), ("spmm", 4, {"bitmap_warp"}, 4),
                           ("spmm", 8, {"bitmap_warp", "bitmap_wmma"}, 4), ("spmm", 32, {"bitmap_wmma"}, None)):
        cands = sp.candidates(_problem_of(w, op, n))
        first = [c for c in cands if c.header.format == "bitmap"]
        assert cands[:len(first)] == first, "bitmap points come first in the proposal"
        assert {c.family for c in first} == fams, (op, n)
        for c in first:
            p = dict(c.params)
            if c.family == "bitmap_warp" and op == "spmm":
                assert p["v"] == v
            if c.family == "bitmap_wmma":
                assert p["BN"] <= max(16, n) and n % c.header.launch.n_align == 0
    assert len(sp.candidates(_problem_of(w, "spmm", 8), k=3)) == 3


def test_graphs_get_no_bitmap_points():
    from sparserl_compile import search

    g = matrices.rmat(12, 8, seed=1)
    f = structure.features(g.indptr, g.indices, g.shape)
    assert not search.weight_like(f) and not search.format_plausible("bitmap", f)
    sp = SearchProvider()
    cands = sp.candidates(_problem_of(g, "spmm", 8))
    assert "bitmap" not in _formats(cands)
    assert sp.last_report.pruned.get("bitmap: too sparse for one bit per position")
