"""inputs: every way a matrix enters is checked before a library reads it, and gives scipy's
canonical matrix when it is well formed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from sparserl_compile import inputs

warnings.filterwarnings("ignore", message=".*[Ss]parse.*")


def _dense(p: inputs.Pattern, values) -> np.ndarray:
    v = p.values(values)
    v = v.numpy() if isinstance(v, torch.Tensor) else v
    return sp.csr_matrix((v, p.indices, p.indptr), shape=p.shape).toarray()


def _canonical_int32(p: inputs.Pattern) -> None:
    assert p.indptr.dtype == np.int32 and p.indices.dtype == np.int32
    assert p.indptr[0] == 0 and p.indptr[-1] == p.nnz and np.all(np.diff(p.indptr) >= 0)
    assert inputs.is_canonical(p.indptr, p.indices)


def _with_duplicates(seed=0) -> sp.coo_matrix:
    rng = np.random.default_rng(seed)
    r = rng.integers(0, 7, 30)
    c = rng.integers(0, 5, 30)
    return sp.coo_matrix((rng.standard_normal(30), (r, c)), shape=(7, 5))


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "bsr", "lil", "dia", "dok"])
@pytest.mark.parametrize("kind", ["matrix", "array"])
def test_every_scipy_format_reads_as_its_canonical_matrix(fmt, kind):
    m = _with_duplicates()
    want = m.toarray()  # duplicates summed
    if fmt in ("csr", "csc"):  # duplicates and unsorted indices kept as stored (scipy's tocsr sums them)
        major, minor = (m.row, m.col) if fmt == "csr" else (m.col, m.row)
        order = np.argsort(major, kind="stable")
        ptr = np.concatenate([[0], np.cumsum(np.bincount(major, minlength=m.shape[fmt == "csc"]))])
        cls = {"csr": (sp.csr_matrix, sp.csr_array), "csc": (sp.csc_matrix, sp.csc_array)}[fmt][kind == "array"]
        a = cls((m.data[order], minor[order], ptr), shape=m.shape)
        assert a.nnz == 30 and not a.has_canonical_format
    else:
        a = (sp.coo_array(m) if kind == "array" else m).asformat(fmt)
    p, values = inputs.read_scipy(a)
    _canonical_int32(p)
    np.testing.assert_allclose(_dense(p, values), want, rtol=1e-12)


def test_torch_layouts_and_value_sums_stay_on_their_dtype():
    m = _with_duplicates(1)
    r, c = torch.from_numpy(m.row), torch.from_numpy(m.col)
    vals = torch.from_numpy(m.data).to(torch.bfloat16)
    coo = torch.sparse_coo_tensor(torch.stack([r, c]), vals, m.shape)  # uncoalesced: never coalesce()d here
    p, v = inputs.read_torch(coo)
    assert p.reorder is not None and p.values(v).dtype == torch.bfloat16
    want = coo.coalesce().to_dense().float().numpy()
    np.testing.assert_allclose(_dense(p, v.float()), want, rtol=1e-2)
    dense = torch.from_numpy(m.toarray())
    for t in (dense.to_sparse_csr(), dense.to_sparse_csc(), dense.to_sparse()):
        p, v = inputs.read_torch(t)
        _canonical_int32(p)
        assert p.reorder is None or t.layout == torch.sparse_csc
        np.testing.assert_allclose(_dense(p, v), m.toarray())


def test_torch_block_layouts_read_as_their_matrix():
    m = sp.random(12, 10, density=0.3, format="csr", dtype=np.float32, random_state=2).toarray()
    dense = torch.from_numpy(m)
    for t in (dense.to_sparse_bsr((3, 2)), dense.to_sparse_bsc((3, 2)), dense.to_sparse_bsr((1, 1))):
        p, v = inputs.read_torch(t)
        _canonical_int32(p)
        np.testing.assert_array_equal(_dense(p, v), m)
    with pytest.raises(ValueError, match="block row indices"):  # a block row past the grid, named
        b = dense.to_sparse_bsc((3, 2))
        rows = b.row_indices().clone()
        rows[0] = 4
        inputs.read_torch(torch.sparse_bsc_tensor(b.ccol_indices(), rows, b.values(), b.shape,
                                                  check_invariants=False))


def test_the_pattern_owns_its_arrays():
    crow, col = np.array([0, 1, 2], np.int32), np.array([1, 0], np.int32)
    p = inputs.csr(crow, col, (2, 2), 2)
    crow[1], col[0] = 7, -5  # the caller's arrays change after the check
    assert p.indptr.tolist() == [0, 1, 2] and p.indices.tolist() == [1, 0]


@pytest.mark.parametrize("build, match", [
    (lambda: inputs.csr([0, 2, 1, 3], [0, 1, 2], (3, 3), 3), r"crow_indices\[2\] \(1\) < crow_indices\[1\] \(2\)"),
    (lambda: inputs.csr([0, 1], [0], (2, 2), 1), r"crow_indices has 2 entries.*n_rows \+ 1 = 3"),
    (lambda: inputs.csr([0, 1, 2], [0, 1], (2, 2), 3), "2 column indices but 3 values"),
    (lambda: inputs.csr([0, 1, 2], [0.0, 1.0], (2, 2)), r"column indices are not integers \(dtype float64\)"),
    (lambda: inputs.csr([[0, 1, 2]], [0, 1], (2, 2)), r"crow_indices must be 1-D, got shape \(1, 3\)"),
    (lambda: inputs.csr([0, 1, 2], [0, 2**32 + 1], (2, 2)), r"column indices span \[0, 4294967297\]"),
    (lambda: inputs.csc([0, 1], [0], (2, 2), 1), r"ccol_indices has 2 entries.*n_cols \+ 1 = 3"),
    (lambda: inputs.csc([0, 1, 2], [0, 5], (2, 2), 2), r"row indices span \[0, 5\] but n_rows is 2"),
    (lambda: inputs.coo([0, 1], [5, -1], (2, 64), 2), r"column indices span \[-1, 5\]"),
    (lambda: inputs.coo([0, 2], [0, 0], (2, 2), 2), r"row indices span \[0, 2\] but n_rows is 2"),
    (lambda: inputs.coo([0, 1], [0], (2, 2)), "2 row indices, 1 column indices"),
    (lambda: inputs.coo([0], [0], (True, 2)), "shape must be two integers"),
    (lambda: inputs.coo([0], [0], (2**31, 2)), "does not fit int32"),
    (lambda: inputs.coo([0], [0], (-1, 2)), "negative dimension"),
    (lambda: inputs.csr(torch.tensor([0, 1], device="meta"), [0], (1, 1)), "meta device"),
    (lambda: inputs.csr(torch.tensor([0.0, 1.0]), [0], (1, 1)), r"crow_indices are not integers \(dtype torch.float32\)"),
])
def test_malformed_arrays_name_the_problem(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


def test_malformed_scipy_matrices_of_other_formats():
    b = sp.bsr_matrix(np.eye(4), blocksize=(2, 2))
    b.indices = np.array([0, 7], dtype=b.indices.dtype)
    with pytest.raises(ValueError, match=r"block column indices span \[0, 7\] but the dimension is 2"):
        inputs.read_scipy(b)
    lil = sp.lil_matrix((3, 3))
    lil[0, 1] = 1.0
    lil.rows[0].append(9)  # a column without a value, out of range
    with pytest.raises(ValueError, match="different number of columns and values"):
        inputs.read_scipy(lil)
    lil.data[0].append(2.0)
    with pytest.raises(ValueError, match=r"column indices span \[1, 9\] but n_cols is 3"):
        inputs.read_scipy(lil)
    with pytest.raises(TypeError, match="cannot read a builtins.dict"):
        inputs.read({})


class _FakeCupyCSR:
    """What sparsify sees of a cupyx.scipy.sparse matrix: its module name, format, shape and
    DLPack arrays (numpy arrays speak DLPack, so no GPU is needed here)."""

    __module__ = "cupyx.scipy.sparse._csr"
    format = "csr"

    def __init__(self, m: sp.csr_matrix):
        self.shape, self.data, self.indptr, self.indices = m.shape, m.data, m.indptr, m.indices


def test_cupy_matrices_are_read_through_dlpack_and_checked():
    import sparserl_compile as S

    m = sp.csr_matrix(_with_duplicates(2))
    m.sum_duplicates()
    f = _FakeCupyCSR(m)
    np.testing.assert_allclose(S.sparsify(f).to_dense().numpy(), m.toarray())
    f.indptr = np.array([0, 9] + [int(v) for v in m.indptr[2:]], dtype=m.indptr.dtype)
    with pytest.raises(ValueError, match="indptr is not non-decreasing"):
        S.sparsify(f)


ISSUE_CASES = {
    "scipy_csr_non_monotone_indptr": """
        m = sp.csr_matrix((np.ones(3, np.float32), np.array([0, 1, 2]), np.array([0, 9, 1, 2, 3])), shape=(4, 4))
        try:
            S.sparsify(m)
        except ValueError as e:
            assert "indptr is not non-decreasing" in str(e), e
        else:
            raise AssertionError("accepted")
    """,
    "torch_coo_negative_index": """
        t = torch.sparse_coo_tensor(torch.tensor([[0, 0, 1, 1], [5, -1, 3, 9]]), torch.ones(4), size=(2, 64))
        try:
            S.sparsify(t)
        except ValueError as e:
            assert "column indices span [-1, 9]" in str(e), e
        else:
            raise AssertionError("accepted")
        with S.accelerate():
            try:
                t @ torch.ones(64)
            except ValueError as e:
                assert "column indices span [-1, 9]" in str(e), e
            else:
                raise AssertionError("the dispatch hook passed it to torch")
    """,
}


@pytest.mark.parametrize("name", list(ISSUE_CASES))
def test_the_crashing_inputs_of_the_report_are_refused(name):
    """In a subprocess: before the checks these crashed the interpreter or corrupted its heap."""
    code = "import warnings; warnings.simplefilter('ignore')\n" \
           "import numpy as np, scipy.sparse as sp, torch, sparserl_compile as S\n" + textwrap.dedent(ISSUE_CASES[name])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stderr[-2000:]}"


@pytest.mark.gpu
def test_cuda_inputs_are_checked_on_the_host_and_built_on_the_device():
    """The CPU twin is every test above: the same arrays, on the GPU. Index arrays are copied
    to the host to be checked; duplicates are summed on the device; a malformed CUDA operand
    never reaches torch's or sparserl's kernels."""
    import sparserl_compile as S

    m = _with_duplicates(3)
    idx = torch.from_numpy(np.stack([m.row, m.col])).cuda()
    coo = torch.sparse_coo_tensor(idx, torch.from_numpy(m.data).float().cuda(), m.shape)
    A = S.sparsify(coo)
    assert A.device.type == "cuda" and A.crow.device.type == "cuda"
    np.testing.assert_allclose(A.to_dense().cpu().numpy(), m.toarray(), rtol=1e-5, atol=1e-6)
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 1], [-1, 3]], device="cuda"), torch.ones(2, device="cuda"), (2, 4))
    with pytest.raises(ValueError, match=r"column indices span \[-1, 3\]"):
        S.sparsify(bad)
    csr = torch.sparse_csr_tensor(torch.tensor([0, 2, 1], device="cuda"), torch.tensor([0, 1], device="cuda"),
                                  torch.ones(2, device="cuda"), (2, 4), check_invariants=False)
    with S.accelerate(), pytest.raises(ValueError, match="crow_indices"):
        csr @ torch.ones(4, 3, device="cuda")
    try:
        import cupyx.scipy.sparse as cps
    except ImportError:
        return
    c = cps.csr_matrix(sp.csr_matrix(m))
    np.testing.assert_allclose(S.sparsify(c).to_dense().cpu().numpy(), m.toarray(), rtol=1e-6)
