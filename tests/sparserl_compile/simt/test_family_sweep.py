"""Every kernel family and parameter point of the kernel space, run on the CPU executor
against scipy in float64: all points on one small matrix, one point per family on the edge
cases, a sample on real matrices. Tensor-core (wmma) points run on the executor's emulation.

Compiling is the cost (about 0.5 s of g++ per distinct source); the in-process table of
``simt.compile_kernel`` builds each source once for the whole test run.
"""

from __future__ import annotations

import pytest

from sparserl_compile import formats, kernels, simt
from sparserl_compile.matrices import banded, load_npz, shared_manifest, uniform_random
from simt_cases import edge_matrices, run_candidate

SMALL = uniform_random(150, 110, 4, seed=11)
OPS = [(op, dt) for op in ("spmv", "spmm") for dt in ("f32", "f16", "bf16")]


def _space(op, dtype, m=SMALL):
    return kernels.space(op, dtype, structure=m)


@pytest.mark.parametrize("op, dtype", OPS)
def test_every_point_on_a_small_matrix(op, dtype):
    cands = _space(op, dtype)
    assert len(cands) >= 20
    built = simt.compile_many([c.source for c in cands])
    failures = []
    for c, k in zip(cands, built):
        if isinstance(k, Exception):
            failures.append(f"{c.name}: {type(k).__name__}: {str(k)[:300]}")
            continue
        o = run_candidate(c, SMALL, n=8)
        if not o.ok:
            failures.append(f"{c.name}: error exceeds the bound by {o.worst():.3g}")
    assert not failures, "\n".join(failures)


def _one_per_family(op, dtype, m):
    seen, out = set(), []
    for c in _space(op, dtype, m):
        if c.family not in seen and c.family != "baked":
            seen.add(c.family)
            out.append(c)
    return out


@pytest.mark.parametrize("op", ["spmv", "spmm"])
@pytest.mark.parametrize("case", sorted(edge_matrices()))
def test_every_family_on_edge_cases(op, case):
    m = edge_matrices()[case]
    ran = 0
    for c in _one_per_family(op, "f32", SMALL):
        try:
            o = run_candidate(c, m, n=4)
        except formats.FormatNotSuitable:
            continue
        assert o.ok, f"{c.name} on {case}: error exceeds the bound by {o.worst():.3g}"
        ran += 1
    assert ran >= 5


def test_banded_matrix_runs_dia_and_bsr_at_default_fill():
    m = banded(300, 3, seed=2)
    for op in ("spmv", "spmm"):
        for c in _one_per_family(op, "f32", m):
            if c.family in ("dia", "bsr"):
                o = run_candidate(c, m, n=4, max_fill=formats.DEFAULT_MAX_FILL)
                assert o.ok, c.name


def test_structure_baked_kernels_on_a_tiny_matrix():
    m = uniform_random(40, 30, 3, seed=5)
    baked = [c for op, dt in (("spmv", "f32"), ("spmm", "f32")) for c in kernels.space(op, dt, structure=m)
             if c.family == "baked"]
    for c in baked[:2]:
        assert run_candidate(c, m, n=4).ok, c.name


def test_sample_on_real_matrices(shared_matrices):
    infos = sorted((i for i in shared_manifest(shared_matrices) if i.nnz <= 120_000), key=lambda i: i.nnz)
    for info in infos[::max(1, len(infos) // 3)][:3]:
        m = load_npz(info.path)
        for op in ("spmv", "spmm"):
            for c in _one_per_family(op, "f32", SMALL):
                try:
                    o = run_candidate(c, m, n=4, max_fill=formats.DEFAULT_MAX_FILL)
                except formats.FormatNotSuitable:
                    continue
                assert o.ok, f"{c.name} on {info.name}: error exceeds the bound by {o.worst():.3g}"
                assert o.stats.wall_s < 2.0, (c.name, info.name, o.stats)


@pytest.mark.parametrize("op, dtype", [("spmv", "f32"), ("spmm", "f32"), ("spmm", "bf16")])
def test_one_point_per_family_passes_verification_with_every_check(op, dtype):
    """``verify`` as the selection runs it (zeros, large, small, subnormal and non-finite
    operands, every width of the bucket, both placements, the stale check) accepts the
    hand-written families, DIA and BSR multiplying their padding included."""
    from sparserl_compile import verify

    m = banded(120, 2, fill=0.8, seed=1)  # holes in the band: DIA and BSR carry padding
    n = 1 if op == "spmv" else 8
    ran = []
    for c in _one_per_family(op, dtype, m):
        align = c.header.launch.n_align
        if n % align:
            continue
        r = verify.verify(c, m, executor="cpu", n=n, widths=verify.widths_to_verify(op, n, align))
        if r.failed == "format":
            continue
        assert r.ok, f"{c.name}: {r.reason}"
        ran.append(c.family)
    assert {"csr_scalar", "dia", "bsr"} <= set(ran), ran
