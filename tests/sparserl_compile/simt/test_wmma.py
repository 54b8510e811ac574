"""The CPU executor's wmma emulation: tensor-core kernels verify, and their mistakes show."""

from __future__ import annotations

import numpy as np
import pytest

from sparserl_compile import kernels, matrices, simt, verify
from simt_cases import run_candidate


def test_bsr_wmma_matches_scipy_on_a_blocked_matrix():
    m = matrices.block_random(6, 5, 16, 16, 2, seed=3)
    for dtype, warps, n in (("f16", 4, 16), ("bf16", 8, 40), ("f16", 8, 7)):
        c = kernels.render("bsr_wmma", "spmm", dtype, {"warps": warps})
        r = verify.verify(c, m, executor="cpu", n=n, value_sets=1)
        assert r.ok, (c.name, n, r.reason)


def _tcw(dtype="bf16"):
    return kernels.render("tcw_wmma", "spmm", dtype, {"H": 16, "nt": 2, "order": 1, "warps": 4})


def test_a_tile_read_before_the_warp_syncs_shows():
    """Without the __syncwarp between filling the tiles and load_matrix_sync, a lane loads a
    tile the other lanes have not finished: the executor runs lanes in turn between warp
    operations, so the product is wrong (tile writes through pointers are not race-tracked)."""
    c = _tcw()
    lines = c.source.split("\n")
    i = next(k for k, ln in enumerate(lines) if "load_matrix_sync(fa" in ln)
    assert lines[i - 1].strip() == "__syncwarp();"
    bad = type(c)("\n".join(lines[:i - 1] + lines[i:]), c.header, c.family, c.params)
    r = verify.verify(bad, matrices.rmat(8, 6, seed=1), executor="cpu", n=32, value_sets=1, static=False)
    assert not r.ok and r.failed in ("written", "error_bound"), r.reason  # NaN from unwritten shared memory


def test_a_wrong_leading_dimension_gives_wrong_products():
    c = _tcw()
    bad_src = c.source.replace("load_matrix_sync(fb, xs + 16, 32)", "load_matrix_sync(fb, xs + 16, 16)")
    assert bad_src != c.source
    bad = type(c)(bad_src, c.header, c.family, c.params)
    r = verify.verify(bad, matrices.rmat(8, 6, seed=2), executor="cpu", n=32, value_sets=1, static=False)
    assert not r.ok and r.failed in ("error_bound", "launch")


def test_fragment_elements_are_not_modelled():
    c = _tcw()
    src = c.source.replace("    float4 zero4 =", "    float peek = acc0.x[0];\n    float4 zero4 =")
    with pytest.raises(simt.SimtCompileError):
        simt.compile_kernel(src)


def test_emulated_products_are_float_sums_of_exact_products():
    # integer values: every product and partial sum is exact in float, so the result is exact
    m = matrices.rmat(8, 6, seed=4)
    o = run_candidate(_tcw("f16"), m, n=16, integer=True)
    assert np.array_equal(o.y, o.ref)
