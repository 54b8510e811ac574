"""policy.screen: the probe of a matrix, and the CPU screen that leaves out candidates the GPU
would reject (header, format fit, verification on the probe)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from sparserl_compile.policy.screen import PROBE_ROWS, Screen, probe_pattern
from sparserl_compile import kernels, matrices


def _pattern_rows(p, r):
    return sorted(p.indices[p.indptr[r]:p.indptr[r + 1]].tolist())


def test_probe_of_a_small_matrix_is_the_matrix():
    A = matrices.uniform_random(300, 200, 5, seed=1)
    p = probe_pattern(A.indptr, A.indices, A.shape, n=32)
    assert p.shape == A.shape
    assert np.array_equal(p.indptr, A.indptr) and np.array_equal(p.indices, A.indices)


def test_probe_keeps_the_first_rows_and_their_columns():
    A = matrices.banded(5000, 3)
    p = probe_pattern(A.indptr, A.indices, A.shape)
    assert p.shape == (PROBE_ROWS, 5000) and p.nnz == A.indptr[PROBE_ROWS]
    assert np.array_equal(p.indices, A.indices[:p.nnz])


def test_probe_shifts_or_renumbers_columns_when_x_would_be_too_large():
    """A wide SpMM operand: columns shifted to start at the first used (rounded down to 64) when
    they span little, renumbered in order when they span much; rows stay sorted, counts kept."""
    n = 100_000
    band = matrices.banded(n, 2)  # rows 0-511 touch columns 0-513: the shift keeps them
    rows = np.arange(n)
    shifted = sp.csr_matrix((np.ones(n), (rows, (rows + 70_000) % n)), shape=(n, n))
    spread = matrices.uniform_random(n, n, 4, seed=3)
    for A, kind in ((band, "kept"), (shifted, "shift"), (spread, "renumber")):
        p = probe_pattern(A.indptr, A.indices, A.shape, n=128, max_x=1 << 20)
        assert p.shape[1] * 128 <= 1 << 20 or kind == "kept"
        assert np.array_equal(p.indptr, A.indptr[:PROBE_ROWS + 1])
        for r in (0, 100, PROBE_ROWS - 1):
            got, want = _pattern_rows(p, r), sorted(A.indices[A.indptr[r]:A.indptr[r + 1]].tolist())
            assert list(p.indices[p.indptr[r]:p.indptr[r + 1]]) == got  # still sorted
            assert len(got) == len(want)
        if kind == "shift":
            lo = (70_000 // 64) * 64
            assert _pattern_rows(p, 5) == [70_005 - lo] and p.shape[1] == 70_000 + PROBE_ROWS - lo
        if kind == "renumber":
            assert p.shape[1] == np.unique(A.indices[:A.indptr[PROBE_ROWS]]).size


def _src(family, op, params, A):
    return kernels.render(family, op, "f32", params, A).source


@pytest.fixture(scope="module")
def screen():
    with Screen(2) as s:
        yield s


def test_screen_passes_correct_kernels_and_says_why_it_leaves_others_out(screen):
    """A family kernel passes; a merge kernel whose body keeps another items_per_part than its
    header (what a departure from the greedy kernel often writes) fails on the probe; BSR blocks
    a scattered matrix cannot hold fail the fit; a header of another op fails the header."""
    A = matrices.uniform_random(4000, 4000, 8, seed=2)
    good = _src("csr_scalar", "spmv", {"block": 128}, A)
    merge = _src("merge", "spmv", {"block": 128, "items_per_part": 32}, A)
    mismatched = merge.replace("p * 32", "p * 16").replace("d0 + 32", "d0 + 16")
    assert mismatched != merge
    bsr = _src("bsr", "spmv", {"R": 4, "C": 4}, A)
    spmm = _src("csr_scalar", "spmm", {"block": 128, "tile_n": 4}, A)
    verdicts = screen.check(A.indptr, A.indices, A.shape, "spmv", "f32", 1, [good, merge, mismatched, bsr, spmm])
    assert verdicts[0] is None and verdicts[1] is None
    assert verdicts[2].startswith("probe wrong") or verdicts[2].startswith("probe fault")
    assert verdicts[3].startswith("format: bsr:") and "blocks of 4x4" in verdicts[3]
    assert verdicts[4].startswith("header:") and "spmm/f32" in verdicts[4]
    assert screen.counts["passed"] >= 2 and screen.counts["probe"] >= 1


def test_screen_on_a_real_matrix(screen, shared_matrices):
    """On a real FEM matrix the family kernels of every format it fits pass, and an SpMM kernel
    whose launch header asks for twice the columns its body covers fails on the probe."""
    A = matrices.load_npz(shared_matrices / "bcsstk13.npz")
    ok = [_src("csr_scalar", "spmm", {"block": 128, "tile_n": 4}, A), _src("ell", "spmm", {"g": 32, "v": 1}, A)]
    tile = ok[0]
    head, rest = tile.split("\n", 1)
    launch, body = rest.split("\n", 1)
    assert "tile_n=4 " in launch
    bad = head + "\n" + launch.replace("tile_n=4 ", "tile_n=8 ") + "\n" + body
    verdicts = screen.check(A.indptr, A.indices, A.shape, "spmm", "f32", 64, ok + [bad])
    assert verdicts[:2] == [None, None]
    assert verdicts[2] is not None and verdicts[2].startswith("probe")


def test_screen_needs_a_worker():
    with pytest.raises(ValueError, match="workers=0"):
        Screen(0)


def test_screen_verdicts_are_per_matrix(screen):
    """The format-fit verdicts are remembered for one matrix at a time: a matrix of the same shape
    checked next gets its own verdicts, not the last one's."""
    band = matrices.block_diagonal(250, 4, seed=1)  # 1000 x 1000, dense 4x4 blocks: BSR 4x4 fits
    scattered = matrices.uniform_random(1000, 1000, 8, seed=4)  # BSR 4x4 would be mostly padding
    bsr = _src("bsr", "spmv", {"R": 4, "C": 4}, band)
    for _ in range(2):
        assert screen.check(band.indptr, band.indices, band.shape, "spmv", "f32", 1, [bsr]) == [None]
        (why,) = screen.check(scattered.indptr, scattered.indices, scattered.shape, "spmv", "f32", 1, [bsr])
        assert why.startswith("format: bsr:")
