"""SparseRLTensor and sparsify: construction, validation, canonicalization, products vs scipy."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import sparserl_compile as S
from sparserl_compile.matrices import load_npz, stencil2d
from sparserl_compile.structure import fingerprint
from sparserl_compile.tensor import SparseRLTensor

warnings.filterwarnings("ignore", message=".*[Ss]parse.*")

TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}


def rand_csr(n_rows, n_cols, density=0.3, seed=0, long_row=None, dtype=np.float64):
    rng = np.random.default_rng(seed)
    m = sp.random(n_rows, n_cols, density=density, format="lil", random_state=rng, dtype=np.float64)
    if long_row is not None and n_rows:
        m[long_row, :] = rng.standard_normal(n_cols)
    m = sp.csr_matrix(m)
    m.sort_indices()
    return m.astype(dtype)


def check_close(got: torch.Tensor, want: np.ndarray, dtype):
    tol = TOL[dtype]
    scale = max(1.0, float(np.abs(want).max()) if want.size else 1.0)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=tol, atol=tol * scale)


# ---------------------------------------------------------------- construction


def test_sparsify_inputs_agree_and_use_int32():
    m = rand_csr(9, 7, seed=1)
    dense = torch.from_numpy(m.toarray())
    csr64 = dense.to_sparse_csr()
    csr32 = torch.sparse_csr_tensor(csr64.crow_indices().int(), csr64.col_indices().int(), csr64.values(), m.shape)
    coo = dense.to_sparse()
    blocks = (dense.to_sparse_bsr((1, 1)), dense.to_sparse_bsc((1, 1)))  # 1x1 blocks store only the nonzeros
    tensors = [S.sparsify(a) for a in (dense, csr64, csr32, coo, m, m.tocoo(), m.tocsc(), *blocks)]
    fps = {t.fingerprint for t in tensors}
    assert fps == {fingerprint(m.indptr, m.indices, m.shape)}
    for t in tensors:
        assert isinstance(t, SparseRLTensor)
        assert t.crow.dtype == torch.int32 and t.col.dtype == torch.int32
        assert t.shape == m.shape and t.dtype == torch.float64 and t.nnz == m.nnz
        torch.testing.assert_close(t.to_dense(), dense)


def test_sparsify_is_idempotent_and_keeps_values_frozen():
    w = torch.randn(4, 5, requires_grad=True)
    a = S.sparsify(w)
    assert not a.val.requires_grad and not a.requires_grad
    assert S.sparsify(a) is a


def test_unsorted_and_duplicate_indices_are_canonicalized():
    crow = torch.tensor([0, 3, 3, 5])
    col = torch.tensor([2, 0, 2, 1, 1])  # row 0 unsorted with a duplicate; row 2 duplicate
    val = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    a = SparseRLTensor.from_csr(crow, col, val, (3, 3))
    want = sp.csr_matrix((val.numpy(), col.numpy(), crow.numpy()), shape=(3, 3))
    want.sum_duplicates()
    assert a.col.tolist() == want.indices.tolist() and a.crow.tolist() == want.indptr.tolist()
    torch.testing.assert_close(a.to_dense(), torch.from_numpy(want.toarray()).float())
    assert a.fingerprint == fingerprint(want.indptr, want.indices, (3, 3))


@pytest.mark.parametrize(
    "crow, col, shape, match",
    [
        ([0, 1, 3], [0, 1], (2, 3), r"crow_indices\[-1\] \(3\) != nnz \(2\).*check_invariants=True"),
        ([0, 2, 1, 2], [0, 1], (3, 3), r"crow_indices\[2\] \(1\) < crow_indices\[1\] \(2\)"),
        ([0, 1, 2], [0, 3], (2, 3), r"column indices span \[0, 3\] but n_cols is 3"),
        ([0, 1, 2], [0, -1], (2, 3), r"column indices span \[-1, 0\]"),
        ([0, 1], [0, 1], (2, 3), r"crow_indices has 2 entries.*n_rows \+ 1 = 3"),
        ([1, 1, 2], [0, 1], (2, 3), r"crow_indices\[0\] \(1\) != 0"),
        ([0, 1, 2], [0, 0], (2**31, 3), r"does not fit int32"),
    ],
)
def test_malformed_csr_errors_say_what_is_wrong(crow, col, shape, match):
    with pytest.raises(ValueError, match=match):
        SparseRLTensor.from_csr(torch.tensor(crow), torch.tensor(col), torch.ones(len(col)), shape)


def test_value_dtype_errors():
    with pytest.raises(TypeError, match=r"int64 is not supported.*float\(\)"):
        SparseRLTensor.from_csr(torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([3]), (1, 1))
    with pytest.raises(TypeError, match="float"):
        S.sparsify(torch.eye(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="cannot take a builtins.list"):
        S.sparsify([[1.0]])


def test_dense_operand_mismatches():
    a = S.sparsify(rand_csr(4, 3, dtype=np.float32))
    with pytest.raises(ValueError, match=r"dtype mismatch.*float32.*float64"):
        a @ torch.ones(3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"shape mismatch.*needs 3 rows"):
        a @ torch.ones(4, 2)
    with pytest.raises(ValueError, match="device mismatch"):
        a @ torch.ones(3, 2, device="meta")
    with pytest.raises(NotImplementedError, match="sparse @ sparse"):
        a @ a.t()


@pytest.mark.parametrize("made_in_inference_mode", [False, True])
def test_views_and_products_under_inference_mode(made_in_inference_mode):
    """``torch.inference_mode`` is how models are served: every transpose spelling, detach and
    the products work there, on a matrix made inside it or outside it."""
    d = torch.eye(4) + torch.diag(torch.ones(3), 1)
    x = torch.arange(8.0).reshape(4, 2)
    with torch.inference_mode(made_in_inference_mode):
        A = S.sparsify(d)
    with torch.inference_mode():
        for view in (A.t(), A.T, A.mT, A.mH, A.adjoint(), A.transpose(0, 1), A.permute(1, 0)):
            assert torch.equal(view @ x, d.t() @ x)
        assert torch.equal(A.detach() @ x, d @ x) and torch.equal(x.t() @ A, x.t() @ d)
        assert torch.equal(A @ x[:, 0], d @ x[:, 0]) and torch.equal(F.linear(x.t(), A), x.t() @ d.t())


@pytest.mark.parametrize("where", ["made in inference mode", "converted in inference mode"])
def test_dtype_and_device_conversions_under_inference_mode(where):
    """``model.half()``, ``.to(dtype)``, ``.cpu()`` and ``type_as`` reach the subclass as
    ``aten.to.*`` under ``torch.inference_mode`` or on a matrix made there (outside, they
    decompose to ``_to_copy``): they convert as they do elsewhere, and return the matrix itself
    where nothing changes."""
    d = torch.eye(4) + torch.diag(torch.ones(3), 1)
    with torch.inference_mode(where == "made in inference mode"):
        A = S.sparsify(d)
    with torch.inference_mode(where == "converted in inference mode"):
        for conv, dtype in ((lambda a: a.half(), torch.float16), (lambda a: a.bfloat16(), torch.bfloat16),
                            (lambda a: a.double(), torch.float64), (lambda a: a.to(torch.float16), torch.float16),
                            (lambda a: a.to("cpu", torch.float16), torch.float16),
                            (lambda a: a.to(dtype=torch.bfloat16, device="cpu"), torch.bfloat16),
                            (lambda a: a.to(torch.zeros(1, dtype=torch.float64)), torch.float64),
                            (lambda a: a.type_as(torch.zeros(1, dtype=torch.float16)), torch.float16)):
            B = conv(A)
            assert isinstance(B, SparseRLTensor) and B.dtype == dtype and B.fingerprint == A.fingerprint
            assert torch.equal((B @ torch.ones(4, dtype=dtype)).double(), d.double() @ torch.ones(4, dtype=torch.float64))
        assert A.cpu() is A and A.to(torch.float32) is A and A.float() is A and A.to("cpu") is A
        assert A.to(torch.float32, copy=True) is not A
        assert torch.equal(A.T.half().to_dense(), d.t().half())
        with pytest.raises(TypeError, match="int32"):
            A.to(torch.int32)
        model = torch.nn.Linear(4, 4)
        model.weight = torch.nn.Parameter(A, requires_grad=False)
        model.half()
        assert isinstance(model.weight, SparseRLTensor) and model.weight.dtype == torch.float16


def test_unimplemented_op_names_the_op():
    a = S.sparsify(rand_csr(3, 3))
    with pytest.raises(NotImplementedError, match="aten.sin"):
        torch.sin(a)
    with pytest.raises(NotImplementedError, match="aten.add"):
        a + 1


def test_tensor_protocol_and_basic_ops():
    m = rand_csr(5, 4, seed=3, dtype=np.float32)
    a = S.sparsify(m)
    names, ctx = a.__tensor_flatten__()
    b = SparseRLTensor.__tensor_unflatten__({n: getattr(a, n) for n in names}, ctx, a.shape, a.stride())
    assert b.fingerprint == a.fingerprint and b.shape == a.shape
    for t in (a, a.t()):  # the spelled-out flatten agrees with the declared names
        names, ctx = t.__tensor_flatten__()
        assert names == SparseRLTensor.tensor_data_names
        assert ctx == tuple(getattr(t, n) for n in SparseRLTensor.tensor_attribute_names)
    for c in (a.detach(), a.clone(), a.to("cpu"), a.cpu()):
        assert isinstance(c, SparseRLTensor) and c.fingerprint == a.fingerprint
        torch.testing.assert_close(c.to_dense(), a.to_dense())
    d = a.to(torch.float64)
    assert d.dtype == torch.float64 and d.val.dtype == torch.float64 and d.crow.dtype == torch.int32
    c = a.clone()
    assert c.val.data_ptr() != a.val.data_ptr()
    assert "nnz=" in repr(a) and a.fingerprint[:12] in repr(a)
    assert a.t().shape == (4, 5) and a.T.shape == (4, 5) and a.transpose(0, 1).shape == (4, 5)
    assert a.t().t().transposed is False
    torch.testing.assert_close(a.t().to_dense(), torch.from_numpy(m.toarray().T))
    v = a.with_values(a.values() * 2)
    assert v.fingerprint == a.fingerprint
    torch.testing.assert_close(v.to_dense(), 2 * a.to_dense())


# ---------------------------------------------------------------- products


@st.composite
def matrices(draw):
    n_rows = draw(st.integers(0, 12))
    n_cols = draw(st.integers(1, 12))
    density = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    long_row = draw(st.one_of(st.none(), st.integers(0, max(n_rows - 1, 0)))) if n_rows else None
    return rand_csr(n_rows, n_cols, density, draw(st.integers(0, 2**16)), long_row)


@settings(max_examples=25, deadline=None)
@given(m=matrices(), n=st.integers(1, 5), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_products_match_scipy_float64(m, n, dtype):
    a = S.sparsify(m).to(dtype)
    dense = m.toarray()
    rng = np.random.default_rng(0)
    X = rng.standard_normal((m.shape[1], n))
    Xr = rng.standard_normal((n, m.shape[0]))
    v = rng.standard_normal(m.shape[1])
    t = lambda z: torch.from_numpy(z).to(dtype)  # noqa: E731
    check_close(a @ t(X), dense @ X, dtype)
    check_close(torch.mm(a, t(X)), dense @ X, dtype)
    check_close(a @ t(v), dense @ v, dtype)
    check_close(torch.mv(a, t(v)), dense @ v, dtype)
    check_close(t(Xr) @ a, Xr @ dense, dtype)
    check_close(a.t() @ t(Xr.T.copy()), dense.T @ Xr.T, dtype)
    check_close(torch.matmul(t(X.T.copy()), a.t()), X.T @ dense.T, dtype)
    bias = rng.standard_normal(m.shape[0])
    check_close(F.linear(t(X.T.copy()), a, t(bias)), X.T @ dense.T + bias, dtype)
    check_close(torch.addmm(t(bias[:, None]), a, t(X), beta=0.5, alpha=2.0), 0.5 * bias[:, None] + 2 * dense @ X, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_products(dtype):
    m = rand_csr(20, 15, 0.3, seed=5)
    a = S.sparsify(m).to(dtype)
    X = torch.randn(15, 3).to(dtype)
    y = a @ X
    assert y.dtype == dtype and y.shape == (20, 3)
    check_close(y, m.toarray() @ X.double().numpy(), dtype)


def test_batched_matmul_and_noncontiguous_operands():
    m = rand_csr(6, 5, seed=7)
    a = S.sparsify(m)
    B = torch.randn(3, 5, 4, dtype=torch.float64)
    want = np.einsum("ik,bkn->bin", m.toarray(), B.numpy())
    check_close(a @ B, want, torch.float64)
    Xt = torch.randn(4, 5, dtype=torch.float64).t()  # transposed, non-contiguous
    assert not Xt.is_contiguous()
    check_close(a @ Xt, m.toarray() @ Xt.numpy(), torch.float64)
    x3 = torch.randn(2, 3, 6, dtype=torch.float64)
    check_close(x3 @ a, x3.numpy() @ m.toarray(), torch.float64)
    x3w = torch.randn(2, 3, 5, dtype=torch.float64)
    check_close(F.linear(x3w, a), x3w.numpy() @ m.toarray().T, torch.float64)


def test_empty_and_degenerate_shapes_return_zeros():
    for shape in [(0, 4), (4, 3), (1, 1)]:
        a = SparseRLTensor.from_csr(torch.zeros(shape[0] + 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                    torch.zeros(0), shape)
        y = a @ torch.randn(shape[1], 2)
        assert y.shape == (shape[0], 2) and not y.any()
        assert (a @ torch.randn(shape[1])).shape == (shape[0],)
        assert (torch.randn(2, shape[0]) @ a).shape == (2, shape[1])


def test_nan_values_follow_ieee_like_the_reference():
    m = rand_csr(6, 6, 0.5, seed=2)
    m.data[0] = np.nan
    a = S.sparsify(m)
    X = np.random.default_rng(0).standard_normal((6, 3))
    y = (a @ torch.from_numpy(X)).numpy()
    want = m.toarray() @ X
    assert np.array_equal(np.isnan(y), np.isnan(want))
    np.testing.assert_allclose(y[~np.isnan(y)], want[~np.isnan(want)], rtol=1e-10)


def test_sparse_values_requiring_grad_raise_a_clear_error():
    a = S.sparsify(rand_csr(3, 3))
    b = a.with_values(a.values().clone().requires_grad_(True))
    with pytest.raises(RuntimeError, match="does not differentiate w.r.t. sparse values"):
        b @ torch.randn(3, 2, dtype=torch.float64)


@pytest.mark.parametrize("name", ["cora_adj", "rajat01", "ISPD98_ibm01"])
def test_real_matrices_match_scipy(shared_matrices, name):
    m = load_npz(shared_matrices / f"{name}.npz")
    a = S.sparsify(m)
    X = np.random.default_rng(1).standard_normal((m.shape[1], 4)).astype(np.float32)
    want = m.astype(np.float64) @ X.astype(np.float64)
    check_close(a @ torch.from_numpy(X), want, torch.float32)
    x = X[:, 0].copy()
    check_close(a @ torch.from_numpy(x), want[:, 0], torch.float32)
    r = np.random.default_rng(2).standard_normal(m.shape[0]).astype(np.float32)
    check_close(torch.from_numpy(r) @ a, r.astype(np.float64) @ m.astype(np.float64).toarray(), torch.float32)


# ---------------------------------------------------------------- modules


def test_sparsify_swaps_only_sparse_linears():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    with torch.no_grad():
        model[0].weight.mul_((torch.rand_like(model[0].weight) > 0.7).float())
    x = torch.randn(5, 8)
    want = model(x)
    assert S.sparsify_(model, min_sparsity=0.5) is model
    assert isinstance(model[0].weight, SparseRLTensor) and isinstance(model[0].weight, torch.nn.Parameter)
    assert not model[0].weight.requires_grad
    assert not isinstance(model[2].weight, SparseRLTensor)
    torch.testing.assert_close(model(x), want)
    with pytest.raises(ValueError, match="min_sparsity"):
        S.sparsify_(model, min_sparsity=1.5)


def gcn_step_losses(adj: SparseRLTensor, feats, labels, steps=8, forward=None):
    torch.manual_seed(0)
    w1 = torch.nn.Parameter(torch.randn(feats.shape[1], 16) * 0.1)
    w2 = torch.nn.Parameter(torch.randn(16, int(labels.max()) + 1) * 0.1)
    opt = torch.optim.Adam([w1, w2], lr=0.05)

    def fwd(adj, feats, w1, w2):
        h = torch.relu(adj @ (feats @ w1))
        return adj @ (h @ w2)

    fwd = forward(fwd) if forward else fwd
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(fwd(adj, feats, w1, w2), labels)
        loss.backward()
        assert torch.isfinite(w1.grad).all() and torch.isfinite(w2.grad).all()
        assert w1.grad.abs().sum() > 0
        opt.step()
        losses.append(float(loss))
    return losses


def normalized_adjacency(n=60, seed=0):
    m = rand_csr(n, n, 0.08, seed=seed) + sp.eye(n)
    m.data[:] = 1.0
    d = np.asarray(m.sum(1)).ravel() ** -0.5
    return sp.diags(d) @ m @ sp.diags(d)


def test_gcn_training_step_loss_falls():
    adj = S.sparsify(sp.csr_matrix(normalized_adjacency()).astype(np.float32))
    feats = torch.randn(60, 10)
    labels = torch.randint(0, 3, (60,))
    losses = gcn_step_losses(adj, feats, labels)
    assert losses[-1] < losses[0] * 0.9


@pytest.mark.gpu
def test_products_on_cuda_match_scipy():
    m = rand_csr(300, 200, 0.05, seed=4, long_row=7)
    a = S.sparsify(m, device="cuda").float()
    assert a.device.type == "cuda" and a.crow.device.type == "cuda"
    X = np.random.default_rng(0).standard_normal((200, 8))
    check_close((a @ torch.from_numpy(X).float().cuda()).cpu(), m @ X, torch.float32)
    check_close((a @ torch.from_numpy(X[:, 0].copy()).float().cuda()).cpu(), m @ X[:, 0], torch.float32)
    Xh = torch.from_numpy(X).half().cuda()
    check_close((a.half() @ Xh).cpu(), m @ Xh.double().cpu().numpy(), torch.float16)
    torch.testing.assert_close(a.cpu().to_dense(), torch.from_numpy(m.toarray()).float())


def test_linear_fast_path_matches_the_general_path_for_every_input_shape():
    """F.linear's eager shortcut (plain weight, plain input) and the general path (transposed
    weight, autograd) give the dense result for 1-D, 2-D, 3-D inputs, views, with and without bias."""
    m = rand_csr(6, 5, seed=3)
    a = S.sparsify(m)
    at = S.sparsify(m.T.tocsr()).t()  # the same matrix, held as the transpose of its transpose
    bias = torch.randn(6, dtype=torch.float64)
    inputs = [torch.randn(5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64),
              torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(1, 1, 5, dtype=torch.float64),
              torch.randn(5, 7, dtype=torch.float64).t(),  # a non-contiguous view
              torch.randn(1, 5, dtype=torch.float64), torch.randn(1, 10, dtype=torch.float64)[:, ::2]]  # one token
    for x in inputs:
        want = x.numpy() @ m.toarray().T
        for w in (a, at):
            check_close(F.linear(x, w), want, torch.float64)
            out = F.linear(x, w, bias)
            check_close(out, want + bias.numpy(), torch.float64)
            assert out.shape == (*x.shape[:-1], 6)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    F.linear(x, a).sum().backward()  # the general path (autograd) with the same result
    np.testing.assert_allclose(x.grad.numpy(), np.ones((4, 6)) @ m.toarray(), rtol=1e-12)
    with pytest.raises(ValueError, match="input has 4 features"):
        F.linear(torch.randn(3, 4, dtype=torch.float64), a)


def test_stable_cache_hash_names_the_structure_not_the_values():
    m = rand_csr(6, 5, seed=4)
    a, b = S.sparsify(m), S.sparsify(m * 2.0)  # same structure, other values
    assert a._stable_hash_for_caching() == b._stable_hash_for_caching()
    assert a._stable_hash_for_caching() != S.sparsify(rand_csr(6, 5, seed=5))._stable_hash_for_caching()
    assert a._stable_hash_for_caching() != a.t()._stable_hash_for_caching()
    assert a._stable_hash_for_caching() != a.float()._stable_hash_for_caching()  # a is float64


def test_matmul_operator_fast_path_keeps_torch_semantics():
    """``A @ x`` skips the torch-function trip when nothing else must see it: same result and
    autograd as ``torch.matmul``, the same TypeError for a non-tensor, and an active torch
    function mode still sees the op."""
    from torch.overrides import TorchFunctionMode

    m = stencil2d(6)
    a = S.sparsify(m)
    x = torch.randn(m.shape[1], 3, requires_grad=True)
    y = a @ x
    torch.testing.assert_close(y, torch.matmul(a, x))
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.from_numpy(np.asarray(m.T.sum(axis=1))).float().expand(-1, 3))
    with pytest.raises(TypeError, match="unsupported operand"):
        a @ 3

    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Spy():
        torch.testing.assert_close(a @ x.detach(), y.detach())
    assert any("matmul" in name for name in seen)


def test_out_argument_is_written_like_torch_writes_it():
    """``torch.mm(A, x, out=o)`` and the other products fill ``o`` and return it (an earlier
    version returned a fresh tensor and left ``o`` untouched: a silent wrong result)."""
    m = rand_csr(6, 5, density=0.5, seed=3, dtype=np.float32)
    A, D = S.sparsify(m), torch.from_numpy(m.toarray())
    x, v, inp, y = torch.randn(5, 3), torch.randn(5), torch.randn(6, 3), torch.randn(4, 6)
    cases = [
        (lambda o: torch.mm(A, x, out=o), D @ x, (6, 3)),
        (lambda o: torch.matmul(A, x, out=o), D @ x, (6, 3)),
        (lambda o: torch.mv(A, v, out=o), D @ v, (6,)),
        (lambda o: torch.addmm(inp, A, x, beta=2.0, alpha=0.5, out=o), 2 * inp + 0.5 * (D @ x), (6, 3)),
        (lambda o: torch.matmul(y, A, out=o), y @ D, (4, 5)),
    ]
    for call, want, shape in cases:
        for o in (torch.full(shape, 12345.0), torch.empty(0)):  # the right shape, or empty (resized)
            got = call(o)
            assert got is o
            torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"out= has shape \(2, 2\), the product has shape \(6, 3\)"):
        torch.mm(A, x, out=torch.empty(2, 2))
    with pytest.raises(TypeError, match="out= is torch.float64 .* pass an out tensor of the product's dtype"):
        torch.mm(A, x, out=torch.empty(6, 3, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(3.7, 3.2), None, (3,), "ab"])
def test_a_shape_that_is_not_two_integers_is_refused(shape):
    with pytest.raises(ValueError, match="shape must be"):
        SparseRLTensor.from_csr(np.array([0, 1, 1, 2]), np.array([0, 2]), np.ones(2, np.float32), shape)


def test_an_unsigned_index_beyond_int64_is_named():
    with pytest.raises(ValueError, match=r"column indices span \[0, 9223372036854775813\] but n_cols is 3"):
        SparseRLTensor.from_csr(np.array([0, 1, 1, 2], np.uint64), np.array([0, 2**63 + 5], np.uint64),
                                np.ones(2, np.float32), (3, 3))


def test_identity_transposes_return_a_new_tensor():
    A = S.sparsify(torch.eye(3))
    for B in (A.transpose(0, 0), A.permute(0, 1)):
        assert B is not A and not B.transposed
        torch.testing.assert_close(B.to_dense(), torch.eye(3))


def _pruned_mlp(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4))
    with torch.no_grad():
        for lin in (m[0], m[2]):
            lin.weight.mul_(torch.rand_like(lin.weight) < 0.3)
    return m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_products_under_autocast_run_in_the_operands_dtype(dtype):
    """``torch.autocast`` (mixed-precision CPU inference) leaves sparserl's products alone, as it
    leaves any op it has no rule for: the product runs in the operands' dtype (torch's CPU CSR
    product, which autocast would otherwise hand half-precision operands it has no kernel for),
    and the dense layers around it are cast as usual."""
    m = rand_csr(6, 5, seed=3)
    d = torch.from_numpy(m.toarray())
    for vdtype in (torch.float32, torch.bfloat16):
        A = S.sparsify(d.to(vdtype))
        x = torch.randn(5, 3).to(vdtype)
        with torch.autocast("cpu", dtype=dtype):
            for y, want in ((A @ x, d @ x.double()), (A @ x[:, 0], d @ x[:, 0].double()),
                            (x.t() @ A.t(), x.t().double() @ d.t()), (A.t() @ torch.ones(6, 2, dtype=vdtype), d.t() @ torch.ones(6, 2).double()),
                            (F.linear(x.t(), A, torch.ones(6, dtype=vdtype)), x.t().double() @ d.t() + 1)):
                assert y.dtype == vdtype
                check_close(y, want.numpy(), vdtype)
    layer = torch.nn.Linear(5, 6)
    layer.weight = torch.nn.Parameter(S.sparsify(d.float()), requires_grad=False)
    model = torch.nn.Sequential(layer, torch.nn.Linear(6, 2))
    with torch.autocast("cpu", dtype=dtype), torch.inference_mode():
        out = model(torch.randn(4, 5))
    assert out.dtype == dtype  # the dense layer after it runs under autocast


def test_sparsify_inplace_names_a_bad_argument():
    with pytest.raises(TypeError, match="min_sparsity='half'.*fraction"):
        S.sparsify_(torch.nn.Linear(2, 2), "half")
    with pytest.raises(TypeError, match="sparsify_ takes an nn.Module.*Tensor.*sparsify"):
        S.sparsify_(torch.zeros(2, 2))


def test_share_memory_shares_the_csr_arrays_for_worker_processes():
    """``model.share_memory()`` (before handing a served model to worker processes) moves a
    SparseRLTensor's three CSR arrays to shared memory, as it does a dense weight's storage."""
    d = torch.eye(4) + torch.diag(torch.ones(3), 1)
    model = torch.nn.Linear(4, 4)
    model.weight = torch.nn.Parameter(S.sparsify(d), requires_grad=False)
    A = model.weight
    assert not A.is_shared()
    assert model.share_memory() is model and model.weight is A
    assert A.is_shared() and all(t.is_shared() for t in (A.crow, A.col, A.val))
    assert A.share_memory_() is A and torch.equal(A @ torch.ones(4), d @ torch.ones(4))


def test_pinning_reaches_the_csr_arrays():
    """``is_pinned``/``pin_memory`` answer for the three CSR arrays (pinning needs a GPU: on a
    CPU-only machine torch's own error, as for a dense tensor)."""
    A = S.sparsify(torch.eye(3))
    assert A.is_pinned() is False
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError) as dense:  # what this build says (a CPU build, or CUDA without a driver)
            torch.eye(3).pin_memory()
        for inference in (False, True):
            with torch.inference_mode(inference), pytest.raises(RuntimeError) as sparse:
                A.pin_memory()
            assert str(sparse.value) == str(dense.value)
        return
    P = A.pin_memory()
    assert isinstance(P, SparseRLTensor) and P.is_pinned() and all(t.is_pinned() for t in (P.crow, P.col, P.val))


def test_state_dicts_load_between_dense_and_sparsified_models():
    """load_state_dict copies (aten.copy_) into a sparsified model from its own kind of state
    dict or from the dense model it was pruned from, and a dense model loads a sparsified one."""
    import copy

    ref = _pruned_mlp()
    dense_sd = copy.deepcopy(ref.state_dict())
    sparse = S.sparsify_(copy.deepcopy(ref), min_sparsity=0.5)
    assert isinstance(sparse[0].weight, SparseRLTensor)
    sparse_sd = sparse.state_dict()
    x = torch.randn(5, 8)
    want = ref(x)

    other = copy.deepcopy(sparse)
    with torch.no_grad():
        other[0].weight.values().zero_()
        other[2].weight.values().zero_()
    other.load_state_dict(sparse_sd)
    torch.testing.assert_close(other(x), want)
    with torch.no_grad():
        other[0].weight.values().zero_()
    other.load_state_dict(dense_sd)  # the dense checkpoint of the same pruned model
    torch.testing.assert_close(other(x), want)
    dense = _pruned_mlp(seed=1)
    dense.load_state_dict(sparse_sd)
    torch.testing.assert_close(dense(x), want)

    with pytest.raises(RuntimeError, match="nonzeros outside this SparseRLTensor's pattern"):
        other.load_state_dict(_pruned_mlp(seed=2).state_dict())  # another pruning mask
    with pytest.raises(RuntimeError, match="another sparsity structure"):
        other.load_state_dict(S.sparsify_(_pruned_mlp(seed=2), min_sparsity=0.5).state_dict())


def test_a_meta_tensor_is_refused_with_what_to_do():
    for a in (torch.empty(5, 4, device="meta"), torch.eye(3).to_sparse_csr().to("meta")):
        with pytest.raises(ValueError, match=r"meta device.*holds no values.*to_empty"):
            S.sparsify(a)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="meta device"):
        S.sparsify_(model, min_sparsity=0.0)


def test_torch_save_and_weights_only_load_round_trip_and_validate(tmp_path):
    """torch.load's default (weights_only=True) reads a sparsified state dict; a file whose
    indices were tampered with is refused by from_csr's checks, never handed to a kernel."""
    sparse = S.sparsify_(_pruned_mlp(), min_sparsity=0.5)
    torch.save(sparse.state_dict(), tmp_path / "sd.pt")
    sd = torch.load(tmp_path / "sd.pt")
    w = sd["0.weight"]
    assert isinstance(w, SparseRLTensor) and w.fingerprint == sparse[0].weight.fingerprint
    torch.testing.assert_close(w.to_dense(), sparse[0].weight.to_dense())
    T = S.sparsify(torch.eye(3)).t()
    torch.save(T, tmp_path / "t.pt")
    assert torch.load(tmp_path / "t.pt").transposed
    bad = S.sparsify(torch.eye(2))
    bad.col[1] = 7
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(Exception, match=r"column indices span \[0, 7\] but n_cols is 2"):
        torch.load(tmp_path / "bad.pt")


# ---------------------------------------------------------------- the stored structure cannot be changed


def test_a_fresh_process_loads_a_saved_matrix_weights_only_with_a_map_location(tmp_path):
    """The import registers the rebuild with torch's weights-only unpickler (before it, torch
    refuses the global ``sparserl_compile.tensor._rebuild``, as it does any unregistered one)."""
    import subprocess
    import sys

    A = S.sparsify(rand_csr(30, 20, seed=4, dtype=np.float32))
    torch.save({"w": A, "t": A.t()}, tmp_path / "m.pt")
    code = f"""
import torch
try:
    torch.load({str(tmp_path / "m.pt")!r}, weights_only=True)
except Exception as e:
    assert "sparserl_compile.tensor._rebuild" in str(e), e
else:
    raise SystemExit("loaded without the import")
import sparserl_compile
for where in ("cpu", torch.device("cpu"), {{"cpu": "cpu"}}, lambda storage, loc: storage):
    d = torch.load({str(tmp_path / "m.pt")!r}, weights_only=True, map_location=where)
    print(type(d["w"]).__name__, d["t"].transposed, float((d["w"] @ torch.ones(20)).sum()))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    want = f"SparseRLTensor True {float((A @ torch.ones(20)).sum())}"
    assert r.stdout.splitlines() == [want] * 4


def test_index_accessors_return_copies_an_edit_cannot_reach_the_matrix():
    """An in-place edit of what crow_indices()/col_indices() return used to reach the live
    arrays: out of range, ``A @ x`` read past the end; moved, the memoized transpose went stale
    (``A.t() @ v`` wrong by 0.39)."""
    m = rand_csr(6, 5, 0.5, seed=11)
    A = S.sparsify(m)
    x, v = torch.randn(5, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    check_close(A.t() @ v, m.toarray().T @ v.numpy(), torch.float64)  # the transpose is memoized
    col, crow = A.col_indices(), A.crow_indices()
    assert col.dtype == torch.int32 and col.data_ptr() != A.col.data_ptr()
    col.fill_(10**6)  # out of range
    col.numpy()[:] = 0  # a write past torch's version counter
    crow.zero_()
    check_close(A @ x, m.toarray() @ x.numpy(), torch.float64)
    check_close(A.t() @ v, m.toarray().T @ v.numpy(), torch.float64)
    assert A.col_indices().tolist() == m.indices.tolist() and A.crow_indices().tolist() == m.indptr.tolist()


def test_values_stay_writable_but_cannot_change_their_count():
    m = rand_csr(5, 4, 0.5, seed=12)
    before = m.data.copy()
    A = S.sparsify(m)
    A.values().mul_(2)  # a training step's in-place update
    check_close(A.to_dense(), 2 * m.toarray(), torch.float64)
    assert np.array_equal(m.data, before)  # the tensor holds its own copy of a scipy matrix's values
    v = A.values()
    v.resize_(0)  # the view changes, the matrix keeps its nnz values
    assert A.val.shape == (m.nnz,)
    check_close(A @ torch.ones(4, dtype=torch.float64), 2 * m.toarray().sum(1), torch.float64)
    with pytest.raises(TypeError, match="dense tensor"):
        A.with_values(torch.ones(m.nnz, dtype=torch.float64).to_sparse())
    strided = torch.arange(2 * m.nnz, dtype=torch.float64)[::2]
    assert A.with_values(strided).val.is_contiguous()  # kernels read values contiguously


# ---------------------------------------------------------------- degenerate shapes behave as torch


@pytest.mark.parametrize("shape", [(0, 0), (0, 4), (4, 0), (3, 4)])
@pytest.mark.parametrize("batch", [0, 1, 3])
def test_degenerate_products_match_torch(shape, batch):
    """0 rows, 0 columns, nnz 0, an empty batch: every product gives torch's result for the
    dense matrix, F.linear with no in-features included (zeros plus the bias)."""
    n_rows, n_cols = shape
    W = torch.zeros(shape)
    if n_rows and n_cols:
        W[1, 2] = 1.5
    A = S.sparsify(W)
    x = torch.randn(batch, n_cols)
    b = torch.randn(n_rows)
    for got, want in [(F.linear(x, A), F.linear(x, W)), (F.linear(x, A, b), F.linear(x, W, b)),
                      (A @ x.t(), W @ x.t()), (torch.randn(batch, n_rows) @ A, None),
                      (A @ torch.ones(n_cols), W @ torch.ones(n_cols)),
                      (torch.addmm(torch.ones(n_rows, batch), A, x.t()), torch.addmm(torch.ones(n_rows, batch), W, x.t())),
                      (A @ torch.randn(2, n_cols, batch), None)]:
        if want is None:
            continue
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
    y = torch.randn(batch, n_rows)
    torch.testing.assert_close(y @ A, y @ W)
    B = torch.randn(2, n_cols, batch)
    torch.testing.assert_close(A @ B, W @ B)


def test_added_operands_are_checked_like_torch_checks_them():
    A = S.sparsify(rand_csr(4, 3, 0.5, seed=13, dtype=np.float32))
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"bias of shape \(5,\) does not broadcast to the product's shape \(2, 4\)"):
        F.linear(x, A, torch.ones(5))
    with pytest.raises(ValueError, match="bias is torch.float64 on cpu but the product is torch.float32"):
        F.linear(x, A, torch.ones(4, dtype=torch.float64))  # never promoted silently
    with pytest.raises(ValueError, match=r"input of shape \(3, 3\) does not broadcast"):
        torch.addmm(torch.ones(3, 3), A, torch.randn(3, 3))
    with pytest.raises(ValueError, match="at least 1 dimension"):
        F.linear(torch.tensor(1.0), A)


def test_a_tampered_pickle_is_refused_with_the_field_named(tmp_path):
    from sparserl_compile.tensor import _rebuild

    A = S.sparsify(torch.eye(3))
    with pytest.raises(TypeError, match="transposed of type int"):
        _rebuild(A.crow, A.col, A.val, 3, 3, 1)
    with pytest.raises(ValueError, match="shape must be two integers"):
        _rebuild(A.crow, A.col, A.val, 3.0, 3, False)
    with pytest.raises(TypeError, match="column indices are not integers"):
        _rebuild(A.crow, A.col.float(), A.val, 3, 3, False)


def test_torch_sparse_mm_sums_and_averages_like_torch():
    """``torch.sparse.mm``, the GNN idiom, on a SparseRLTensor: as torch computes it on a CSR
    tensor, with reduce "sum" and "mean" (a row without entries gives 0), on a transposed view
    and with the dense operand first; other reductions say what to do."""
    m = sp.random(12, 9, density=0.3, format="csr", random_state=3, dtype=np.float32)
    m[4] = 0
    m.eliminate_zeros()
    a, d = S.sparsify(m), torch.from_numpy(m.toarray())
    x, y, z = torch.randn(9, 4), torch.randn(12, 3), torch.randn(5, 12)
    for reduce in ("sum", "mean"):
        torch.testing.assert_close(torch.sparse.mm(a, x, reduce), torch.sparse.mm(d.to_sparse_csr(), x, reduce))
        torch.testing.assert_close(torch.sparse.mm(a.t(), y, reduce=reduce),
                                   torch.sparse.mm(d.t().contiguous().to_sparse_csr(), y, reduce=reduce))
    torch.testing.assert_close(torch.sparse.mm(a, x), d @ x)
    torch.testing.assert_close(torch.sparse.mm(z, a), z @ d)
    with pytest.raises(NotImplementedError, match="'sum' and 'mean'.*to_sparse_csr"):
        torch.sparse.mm(a, x, "amax")
    with pytest.raises(ValueError, match="2-D operands"):
        torch.sparse.mm(a, torch.randn(9))


def test_scaling_by_a_scalar_keeps_the_structure_and_other_elementwise_ops_are_refused():
    m = sp.random(12, 9, density=0.3, format="csr", random_state=4, dtype=np.float32)
    a, d, x = S.sparsify(m), torch.from_numpy(m.toarray()), torch.randn(9, 4)
    for scaled, want in ((a * 2, 2 * d), (2.5 * a, 2.5 * d), (a / 4, d / 4), (-a, -d), (a * torch.tensor(3.0), 3 * d)):
        assert isinstance(scaled, SparseRLTensor) and scaled.fingerprint == a.fingerprint and scaled.dtype == a.dtype
        torch.testing.assert_close(scaled @ x, want @ x)
    torch.testing.assert_close((a.t() * 3) @ torch.ones(12), 3 * d.t() @ torch.ones(12))
    assert (a.to(torch.bfloat16) * torch.tensor(2.0, dtype=torch.float64)).dtype == torch.bfloat16
    assert a._nnz() == m.nnz
    r, c = torch.rand(12, 1) + 0.5, torch.rand(9) + 0.5  # row and column scalings keep the structure
    for scaled, want in ((a * r, d * r), (c * a, c * d), (a / c[None], d / c[None]), (a * r * c, d * r * c),
                         (a.t() * r.reshape(-1), d.t() * r.reshape(-1)), (a.t() * c[:, None], d.t() * c[:, None])):
        assert isinstance(scaled, SparseRLTensor) and scaled.fingerprint == a.fingerprint
        torch.testing.assert_close(scaled.to_dense(), want)
    assert (a.to(torch.bfloat16) * r).dtype == torch.bfloat16
    for bad in (lambda: a * torch.randn(12, 9), lambda: a * a, lambda: a * True, lambda: a * (1 + 2j),
                lambda: a * torch.tensor(2.0, requires_grad=True), lambda: a * torch.rand(9, 1), lambda: c / a):
        with pytest.raises(NotImplementedError, match="by a real scalar, a row vector.*with_values"):
            bad()


def test_torch_sparse_addmm_is_addmm():
    m = sp.random(12, 9, density=0.3, format="csr", random_state=5, dtype=np.float32)
    a, d, x, inp = S.sparsify(m), torch.from_numpy(m.toarray()), torch.randn(9, 4), torch.randn(12, 4)
    torch.testing.assert_close(torch.sparse.addmm(inp, a, x, beta=0.5, alpha=2.0), 0.5 * inp + 2 * d @ x)
    torch.testing.assert_close(torch.sparse.addmm(inp, a, x), inp + d @ x)


def test_to_sparse_gives_torchs_own_tensor_in_copies():
    m = sp.random(12, 9, density=0.3, format="csr", random_state=6, dtype=np.float32)
    a, d = S.sparsify(m), torch.from_numpy(m.toarray())
    for got, want, layout in ((a.to_sparse_csr(), d, torch.sparse_csr), (a.t().to_sparse_csr(), d.t(), torch.sparse_csr),
                              (a.to_sparse(), d, torch.sparse_coo), (a.t().to_sparse_coo(), d.t(), torch.sparse_coo)):
        assert got.layout == layout and not isinstance(got, SparseRLTensor)
        torch.testing.assert_close(got.to_dense(), want)
    a.to_sparse_csr().values().zero_()  # a copy: the matrix is untouched
    torch.testing.assert_close(a.to_dense(), d)
    torch.testing.assert_close(S.sparsify(a.t().to_sparse_csr()).to_dense(), d.t())  # and back


@pytest.mark.parametrize("case", ["A @ X", "A @ x", "A.t() @ Y", "x @ A", "linear"])
def test_eager_autograd_to_the_dense_operand_is_one_function_and_twice_differentiable(case):
    """Plain eager autograd (the dense operand requires grad) records one autograd.Function,
    not the custom op's layers (a tenth of the host time); gradients and second derivatives are
    those of the dense matrix."""
    m = sp.random(12, 9, density=0.3, format="csr", random_state=7, dtype=np.float64)
    a = S.sparsify(m)
    f, shape = {"A @ X": (lambda v: a @ v, (9, 3)), "A @ x": (lambda v: a @ v, (9,)),
                "A.t() @ Y": (lambda v: a.t() @ v, (12, 3)), "x @ A": (lambda v: v @ a, (4, 12)),
                "linear": (lambda v: F.linear(v, a.t()), (5, 12))}[case]
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    out = f(x)  # kept: on torch 2.11 a node whose output is gone refuses next_functions
    chain, fn = [], out.grad_fn
    while fn is not None:  # the recorded graph holds the Function, never the custom op's backward
        chain.append(type(fn).__name__)
        fn = fn.next_functions[0][0] if fn.next_functions else None
    assert "EagerProductBackward" in chain and not any("sparserl" in c.lower() for c in chain), chain
    assert torch.autograd.gradcheck(f, (x,)) and torch.autograd.gradgradcheck(f, (x,))


def test_eager_transposes_are_made_at_once_and_traced_ones_the_standard_way(monkeypatch):
    from sparserl_compile import tensor as T

    m = sp.random(12, 9, density=0.3, format="csr", random_state=8, dtype=np.float32)
    a, d = S.sparsify(m), torch.from_numpy(m.toarray())
    f = torch.compile(lambda A, v: A.T @ v + A.mT @ v + A.t() @ v, backend="sparserl", fullgraph=True)
    y = torch.randn(12, 2)
    torch.testing.assert_close(f(a, y), 3 * d.t() @ y)
    monkeypatch.setitem(T._ATEN_TABLE, torch.ops.aten.t.default, lambda *args: pytest.fail("aten.t reached"))
    for view in (a.t(), a.T, a.mT, torch.t(a), a.t().t()):
        assert isinstance(view, SparseRLTensor) and view is not a and view.fingerprint == a.fingerprint
    torch.testing.assert_close(a.T @ y, d.t() @ y)
    torch.testing.assert_close(a.t().t().to_dense(), d)


def test_sums_and_zero_keeping_entrywise_ops_match_the_dense_matrix():
    """A node's degree (``A.sum(1)``), ``torch.sparse.sum`` and entrywise ops that keep the
    zeros (abs, a positive power) on a matrix and its transposed view, eager and compiled."""
    m = sp.random(12, 9, density=0.3, format="csr", random_state=9, dtype=np.float32)
    a, d = S.sparsify(m), torch.from_numpy(m.toarray())
    for mat, dense in ((a, d), (a.t(), d.t())):
        for got, want in ((mat.sum(), dense.sum()), (mat.sum(1), dense.sum(1)), (mat.sum(0), dense.sum(0)),
                          (mat.sum(-1, keepdim=True), dense.sum(-1, keepdim=True)), (mat.sum((0, 1)), dense.sum()),
                          (mat.sum(1, dtype=torch.float64), dense.sum(1, dtype=torch.float64)),
                          (torch.sparse.sum(mat), dense.sum()), (torch.sparse.sum(mat, dim=1), dense.sum(1)),
                          (mat.abs().to_dense(), dense.abs()), ((mat.abs() ** 0.5).to_dense(), dense.abs() ** 0.5)):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want)
    with pytest.raises(NotImplementedError, match="power > 0"):
        a ** 0
    f = torch.compile(lambda A, x: (A @ x) / A.sum(1, keepdim=True), backend="sparserl", fullgraph=True)
    x = torch.randn(9, 3)
    torch.testing.assert_close(f(a, x), (d @ x) / d.sum(1, keepdim=True))


@pytest.mark.parametrize("made_in_inference_mode", [False, True])
def test_the_entrywise_ops_sums_and_conversions_under_inference_mode(made_in_inference_mode):
    """Under inference_mode composite ops reach the subclass as themselves (to_sparse_csr, ...)."""
    m = sp.random(12, 9, density=0.3, format="csr", random_state=10, dtype=np.float32)
    with torch.inference_mode(made_in_inference_mode):
        a = S.sparsify(m)
    d, x, r = torch.from_numpy(m.toarray()), torch.randn(9, 3), torch.rand(12, 1)
    with torch.inference_mode():
        for got, want in (((a * 2) @ x, 2 * d @ x), (a.sum(1), d.sum(1)), (a.T @ torch.ones(12), d.t() @ torch.ones(12)),
                          (torch.sparse.mm(a, x, "mean"), torch.sparse.mm(d.to_sparse_csr(), x, "mean")),
                          (a.to_sparse_csr().to_dense(), d), (a.to_sparse().to_dense(), d), ((a * r).to_dense(), d * r),
                          ((-a).abs().to_dense(), d.abs())):
            torch.testing.assert_close(got, want)


# ------------------------------------------------------------------ the eager route to a kernel


@pytest.fixture
def kernel_routed(monkeypatch):
    """A 30 x 20 float32 SparseRLTensor whose SpMV and SpMM (width 4) plans are checked CSR
    kernel plans on the CPU (``test_plans.ArgsKernel`` computes the product from its launch
    arguments): ``(A, m, {op: kernel})``."""
    from test_plans import plan_for

    from sparserl_compile import plans

    monkeypatch.setattr(plans, "kernels_possible", lambda device: True)
    monkeypatch.setattr(plans, "device_arch", lambda device: "sm_test")
    plans.clear()
    plans.reset_stats()
    m = sp.random(30, 20, density=0.2, random_state=7, format="csr", dtype=np.float32)
    m.sort_indices()
    A = S.sparsify(m)
    kernels = {}
    for op, n in (("spmv", 1), ("spmm", 4)):
        plan, kernels[op] = plan_for(m, "csr", op)
        plan.checked = True
        plans._table[(A.fingerprint, op, n, torch.float32, "sm_test")] = plan
    yield A, m, kernels
    plans.clear()
    plans.reset_stats()


def test_a_checked_kernel_serves_products_and_counts_each_once(kernel_routed, monkeypatch):
    from sparserl_compile import plans

    A, m, kernels = kernel_routed
    routed = []
    route = plans.kernel_route
    monkeypatch.setattr(plans, "kernel_route", lambda *a: routed.append(a[1]) or route(*a))
    x, X = torch.randn(20), torch.randn(20, 4)
    for _ in range(3):  # the first call finds the plan in the table, the next ones by the tensor's route
        np.testing.assert_allclose((A @ x).numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose((A @ X).numpy(), m @ X.numpy(), rtol=1e-5, atol=1e-5)
    st = S.stats()
    assert len(kernels["spmv"].calls) == 3 and len(kernels["spmm"].calls) == 3
    assert st.calls == st.hits == st.kernel_calls == 6 and st.fallbacks == st.reference_calls == 0
    assert routed == ["spmv", "spmm"] * 2  # after the first calls, straight from A @ x to the kernel


def test_operands_a_kernel_route_must_not_take_get_the_products_checks(kernel_routed):
    """What the route checks inline is what ``_product`` checks: a wrong dtype, row count or
    device never reaches the kernel; a strided operand is made contiguous first."""
    A, m, kernels = kernel_routed
    x = torch.randn(20)
    A @ x  # the route is in place
    with pytest.raises(ValueError, match="dtype mismatch"):
        A @ x.double()
    with pytest.raises(ValueError, match="shape mismatch"):
        A @ torch.randn(21)
    with pytest.raises(ValueError, match="device mismatch"):
        A @ torch.randn(20, device="meta")
    assert len(kernels["spmv"].calls) == 1
    X = torch.randn(4, 20).t()  # 20 x 4, not contiguous
    np.testing.assert_allclose((A @ X).numpy(), m @ X.numpy(), rtol=1e-5, atol=1e-5)
    assert len(kernels["spmm"].calls) == 1


def test_a_kernel_route_leaves_autograd_to_the_recorded_path(kernel_routed):
    A, m, kernels = kernel_routed
    A @ torch.randn(20)
    x = torch.randn(20, requires_grad=True)
    (A @ x).sum().backward()  # d/dx sum(A x) = A^T 1
    np.testing.assert_allclose(x.grad.numpy(), m.T @ np.ones(30, np.float32), rtol=1e-5, atol=1e-5)


def test_a_kernel_that_cannot_run_a_call_falls_back_through_the_full_path(kernel_routed, monkeypatch):
    """A routed kernel that fails (a launch error) or declines a call (None: a width its vector
    loads do not suit, another device) is tried again by the table's path, which falls back to
    the reference and logs; the answer is right either way."""
    from sparserl_compile import plans

    A, m, kernels = kernel_routed
    x = torch.randn(20)
    A @ x
    monkeypatch.setattr(plans.KernelPlan, "run", lambda self, *a: None)
    np.testing.assert_allclose((A @ x).numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)

    def broken(self, *a):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(plans.KernelPlan, "run", broken)
    np.testing.assert_allclose((A @ x).numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    assert S.stats().fallbacks >= 1


def _reads_memory(kernel) -> None:
    """Make a test kernel read ``x`` from its data pointer, row-major, as a GPU kernel does
    (strides ignored)."""
    launch = kernel.launch

    def raw(args, *rest):
        x = args[-2]
        return launch((*args[:-2], torch.as_strided(x, (x.numel(),), (1,)).reshape(x.shape), args[-1]), *rest)

    kernel.launch = raw


def test_strided_operands_reach_a_kernel_contiguous(kernel_routed):
    """Every door hands a kernel a contiguous ``x``: a strided view that reached one would be
    read as the wrong numbers, since a kernel reads memory, not strides."""
    from test_plans import plan_for

    from sparserl_compile import plans

    A, m, kernels = kernel_routed
    plan, k1 = plan_for(m, "csr", "spmm")  # F.linear at one token: an SpMM of width 1
    plan.checked = True
    plans._table[(A.fingerprint, "spmm", 1, torch.float32, "sm_test")] = plan
    for k in (*kernels.values(), k1):
        _reads_memory(k)
    x1 = torch.randn(1, 40)[:, ::2]  # one token of 20 features, every other float of its storage
    Xs = torch.randn(40, 4)[::2]  # 20 x 4, every other row
    for _ in range(2):  # the table's path, then the tensor's route
        np.testing.assert_allclose(F.linear(x1, A).numpy(), x1.numpy() @ m.T.toarray(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose((A @ Xs).numpy(), m @ Xs.numpy(), rtol=1e-5, atol=1e-5)
    assert len(k1.calls) == 2 and len(kernels["spmm"].calls) == 2


@pytest.mark.parametrize("shape", [(1, 20), (3, 20), (1, 1, 20), (2, 3, 20)])
def test_sparse_linear_through_a_kernel_has_the_dense_layers_values_and_shape(kernel_routed, shape):
    """``F.linear(x, W)`` whose route at the batch is a kernel: one token or several, 2-D or
    3-D inputs, with and without bias, as the dense layer gives them (the kernel reads memory)."""
    from test_plans import plan_for

    from sparserl_compile import plans

    A, m, _ = kernel_routed
    batch = int(np.prod(shape[:-1]))
    plan, kernel = plan_for(m, "csr", "spmm")
    plan.checked = True
    plans._table[(A.fingerprint, "spmm", plans.width_bucket(batch), torch.float32, "sm_test")] = plan
    _reads_memory(kernel)
    dense = torch.from_numpy(m.toarray())
    bias = torch.randn(30)
    x = torch.randn(*shape)
    for _ in range(2):  # the table's path, then the weight's route
        for b in (None, bias):
            got, want = F.linear(x, A, b), F.linear(x, dense, b)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(kernel.calls) == 4
