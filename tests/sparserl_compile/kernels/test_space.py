"""The kernel space: sizes, headers, signatures, launch geometry, parameter checks."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from sparserl_compile import contract, kernels
from sparserl_compile.kernels import baked
from sparserl_compile.matrices import load_npz, shared_manifest

OPS_DTYPES = [(op, dt) for op in contract.OPS for dt in contract.DTYPES]


def _edge_structure() -> sp.csr_matrix:
    """Rectangular, with empty rows, a long row and a one-entry row."""
    rng = np.random.default_rng(0)
    m = sp.random(50, 37, density=0.08, format="lil", random_state=rng, dtype=np.float32)
    m[3, :] = 0
    m[10, :] = 1.0  # one long row
    m[49, :] = 0
    m[48, 36] = 2.0
    return sp.csr_matrix(m, dtype=np.float32)


@pytest.mark.parametrize("op,dtype", OPS_DTYPES)
def test_space_size_and_headers(op, dtype):
    cands = kernels.space(op, dtype)
    assert 35 <= len(cands) <= 150, len(cands)
    names = [c.name for c in cands]
    assert len(set(names)) == len(names), "duplicate points"
    fams = {c.family for c in cands}
    assert {"csr_scalar", "csr_part", "ell", "sell", "dia", "bsr"} <= fams
    assert ("merge" in fams) == (dtype == "f32")
    assert ("bsr_wmma" in fams) == (op == "spmm" and dtype != "f32")
    assert ("csr_vector" in fams) == (op == "spmv")
    assert "baked" not in fams  # no structure given
    for c in cands:
        h = contract.parse_header(c.source)
        assert h == c.header and (h.op, h.dtype) == (op, dtype)
        assert contract.signature_c(op, h.format, dtype) + " {" in c.source
        assert c.source.count("__global__") == 1
        # launch geometry: the kernel indexes blocks with the header's units per block ...
        assert f"blockIdx.x * {h.launch.per_block} " in c.source, c.name
        if op == "spmm" and h.launch.tile_n:
            # ... and dense-column tiles with the header's tile_n
            assert f"blockIdx.y * {h.launch.tile_n}" in c.source, c.name
        if h.launch.zero_output:
            assert "atomicAdd" in c.source
        else:
            assert "atomicAdd" not in c.source


def test_n_filters_alignment():
    all_f32 = kernels.space("spmm", "f32")
    odd = kernels.space("spmm", "f32", n=3)
    assert 0 < len(odd) < len(all_f32)
    assert all(c.header.launch.n_align == 1 for c in odd)
    assert {c.header.launch.n_align for c in kernels.space("spmm", "f32", n=8)} == {1, 2, 4}
    with pytest.raises(ValueError, match="spmm only"):
        kernels.space("spmv", "f32", n=8)


def test_baked_needs_small_structure():
    m = _edge_structure()
    with_structure = kernels.space("spmv", "f32", structure=m)
    bk = [c for c in with_structure if c.family == "baked"]
    assert len(bk) == 2
    src = bk[0].source
    # literal columns of the long row 10 appear, and row_ptr/col_idx are never read
    assert "__ldg(&x[36])" in src and "row_ptr[" not in src and "col_idx[" not in src
    big = sp.random(100, 100, density=0.3, format="csr", random_state=1)
    assert big.nnz > baked.MAX_NNZ
    assert not any(c.family == "baked" for c in kernels.space("spmv", "f32", structure=big))
    with pytest.raises(ValueError, match="at most"):
        kernels.render("baked", "spmv", "f32", {"block": 32}, structure=big)
    with pytest.raises(ValueError, match="structure"):
        kernels.render("baked", "spmv", "f32", {"block": 32})


def test_baked_on_real_matrix_refused_or_rendered(shared_matrices):
    info = min(shared_manifest(shared_matrices), key=lambda i: i.nnz)
    m = load_npz(info.path)
    cands = [c for c in kernels.space("spmm", "f16", structure=m) if c.family == "baked"]
    assert bool(cands) == (m.nnz <= baked.MAX_NNZ)


def test_render_errors_name_the_problem():
    with pytest.raises(KeyError, match="known"):
        kernels.render("nope", "spmv", "f32", {})
    with pytest.raises(ValueError, match="tpr=3"):
        kernels.render("csr_vector", "spmv", "f32", {"block": 128, "tpr": 3})
    with pytest.raises(ValueError, match="renders"):
        kernels.render("csr_vector", "spmm", "f32", {"block": 128, "tpr": 4})
    with pytest.raises(ValueError, match="f16/bf16"):
        kernels.family("bsr_wmma").render("spmm", "f32", {"warps": 4})
    with pytest.raises(ValueError, match="f32 only"):
        kernels.family("merge").render("spmv", "f16", {"block": 128, "items_per_part": 16})


def test_dtype_rendering_has_no_macros_and_converts():
    c = kernels.render("csr_rowgroup", "spmm", "bf16", {"g": 8, "v": 2, "perm": True})
    assert c.header.format == "csr_perm" and c.header.launch.n_align == 2
    assert "__bfloat1622float2" in c.source and "__floats2bfloat162_rn" in c.source
    assert "#" not in c.source
    h = kernels.render("dia", "spmv", "f16", {"block": 128}).source
    assert "__half2float" in h and "__float2half_rn" in h


def test_families_tuple_and_version():
    assert isinstance(kernels.FAMILIES, tuple)
    assert len({f.name for f in kernels.FAMILIES}) == len(kernels.FAMILIES)
    assert isinstance(kernels.KERNEL_SPACE_VERSION, str)
