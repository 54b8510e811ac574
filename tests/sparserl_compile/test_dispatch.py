"""enable()/accelerate(): native torch.sparse CSR/COO products routed to sparserl, or passed through."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import sparserl_compile as S
from thread_stress import errors_from_threads
from sparserl_compile import config, dispatch, plans

warnings.filterwarnings("ignore", message=".*[Ss]parse.*")


@pytest.fixture(autouse=True)
def clean():
    dispatch.clear_memo()
    plans.reset_stats()
    yield
    S.disable()


def native(n_rows=12, n_cols=9, layout="csr", index=torch.int64, dtype=torch.float32, seed=0, density=0.3):
    m = sp.random(n_rows, n_cols, density=density, format="csr", random_state=seed, dtype=np.float64)
    m.sort_indices()
    vals = torch.from_numpy(m.data).to(dtype)
    if layout == "csr":
        return torch.sparse_csr_tensor(torch.from_numpy(m.indptr).to(index), torch.from_numpy(m.indices).to(index),
                                       vals, m.shape, check_invariants=True)
    coo = m.tocoo()
    idx = torch.from_numpy(np.vstack([coo.row, coo.col])).long()
    return torch.sparse_coo_tensor(idx, vals, m.shape).coalesce()


def calls():
    return config.stats().calls


@pytest.mark.parametrize("layout, index", [("csr", torch.int64), ("csr", torch.int32), ("coo", torch.int64)])
def test_routed_products_match_torch(layout, index):
    A = native(layout=layout, index=index)
    X = torch.randn(9, 4)
    v = torch.randn(9)
    inp = torch.randn(4)
    cases = [
        lambda: A @ X, lambda: A @ v, lambda: torch.mm(A, X), lambda: torch.mv(A, v),
        lambda: torch.matmul(A, X), lambda: torch.sparse.mm(A, X), lambda: A.matmul(v),
        lambda: torch.addmm(inp, A, X, beta=0.5, alpha=2.0), lambda: torch.addmm(torch.randn(12, 4), A, X),
        lambda: torch.addmm(torch.full((12, 4), float("nan")), A, X, beta=0),
    ]
    for case in cases:
        torch.manual_seed(0)
        want = case()
        before = calls()
        with S.accelerate():
            torch.manual_seed(0)
            got = case()
        assert calls() == before + 1, "not routed"
        assert got.shape == want.shape and got.dtype == want.dtype and got.layout == torch.strided
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_native_tensors_made_under_inference_mode_are_routed():
    """An inference tensor has no version counter; the fingerprint memo still works for it."""
    with torch.inference_mode():
        a = (torch.eye(5) + torch.diag(torch.ones(4), -1)).to_sparse_csr()
        x = torch.arange(10.0).reshape(5, 2)
        with S.accelerate():
            y = a @ x
            assert torch.equal(a @ x, y)
        assert torch.equal(y, a.to_dense() @ x)


def test_routed_products_under_autocast_run_in_the_operands_dtype():
    """Under ``torch.autocast`` a routed native product runs in its operands' dtype; torch's own
    CPU CSR product, handed the half-precision operands autocast would cast to, has no kernel."""
    a = native()
    x = torch.randn(9, 4)
    want = a.to_dense() @ x
    with torch.autocast("cpu", dtype=torch.bfloat16), S.accelerate():
        y = a @ x
    assert y.dtype == torch.float32 and torch.allclose(y, want, atol=1e-5)


def test_enable_disable():
    A, X = native(), torch.randn(9, 2)
    assert not dispatch.is_enabled()
    S.enable()
    S.enable()  # idempotent
    assert dispatch.is_enabled()
    A @ X
    assert calls() == 1
    with S.accelerate():  # nests
        A @ X
    assert calls() == 2
    S.disable()
    S.disable()  # no-op
    A @ X
    assert calls() == 2 and not dispatch.is_enabled()


def test_threads_routing_more_structures_than_the_memo_keeps(monkeypatch):
    """A server whose threads each multiply many structures (a new sampled subgraph per batch)
    shares one memo of native structures: evictions in one thread never break a product in
    another."""
    monkeypatch.setattr(dispatch, "MEMO_SIZE", 2)
    mats = [native(6 + i, 5, seed=i) for i in range(6)]
    want = [m.to_dense() @ torch.ones(5) for m in mats]

    def work(i):
        with S.accelerate():
            for r in range(400):
                k = (i + r) % len(mats)
                assert torch.allclose(mats[k] @ torch.ones(5), want[k], atol=1e-6)

    assert errors_from_threads(work, 6) == []


def test_threads_multiplying_one_structure_with_different_values_each_get_their_own():
    """Two tensors of one structure (one memo entry) with different values, used from many
    threads at once: each product pairs its own values with their routes."""
    A = native()
    mats = [A, torch.sparse_csr_tensor(A.crow_indices(), A.col_indices(), -3 * A.values(), A.shape)]
    x = torch.randn(9)
    want = [m.to_dense() @ x for m in mats]

    def work(i):
        with S.accelerate():
            for r in range(200):
                k = (i + r) % 2
                assert torch.allclose(mats[k] @ x, want[k], atol=1e-6)

    assert errors_from_threads(work, 6) == []


def test_fingerprint_is_memoized_per_structure(monkeypatch):
    counter = {"n": 0}
    real = dispatch.structure.fingerprint

    def counting(*a, **k):
        counter["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(dispatch.structure, "fingerprint", counting)
    A, X = native(), torch.randn(9, 3)
    with S.accelerate():
        for _ in range(5):
            A @ X
        assert counter["n"] == 1 and dispatch.memo_stats.hits == 4
        # torch gives a sparse tensor's members one shared version counter, so an in-place
        # update of the values re-reads the indices once (and only once)
        A.values().mul_(2)
        A @ X
        y = A @ X
        assert counter["n"] == 2
        A.col_indices().add_(0)  # an in-place write to the indices bumps the version too
        A @ X
        assert counter["n"] == 3
        B = native(seed=1)  # another structure
        B @ X
        assert counter["n"] == 4
    torch.testing.assert_close(y, (A.to_dense() @ X))


def test_autograd_flows_to_the_dense_operand():
    A = native(dtype=torch.float64)
    X = torch.randn(9, 3, dtype=torch.float64, requires_grad=True)
    (A @ X).pow(2).sum().backward()
    want = X.grad.clone()
    X.grad = None
    with S.accelerate():
        y = A @ X
        y.pow(2).sum().backward()
    assert calls() >= 2  # forward and the transposed product in backward
    torch.testing.assert_close(X.grad, want)


def test_plain_eager_products_call_the_runtime_directly(monkeypatch):
    """Nothing to record (no autograd, no dispatch mode): the routed product skips the custom
    op's layers and calls the runtime; with a dense operand that requires grad it records one
    autograd.Function, not the op. Nested modes (enable() + accelerate()) still run one product."""
    from sparserl_compile import ops

    routed, by_op = [], []  # every routed product; the custom op kernels' calls (they check first)
    real, real_check = plans.routed_product, ops._fast_ok
    monkeypatch.setattr(plans, "routed_product", lambda *a: routed.append(1) or real(*a))
    monkeypatch.setattr(ops, "_fast_ok", lambda *a: by_op.append(1) or real_check(*a))
    A, X = native(dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    S.enable()
    with S.accelerate():
        y = A @ X
    assert routed == [1] and by_op == [] and calls() == 1
    torch.testing.assert_close(y, A.to_dense() @ X)
    Xg = X.clone().requires_grad_(True)
    with S.accelerate():
        (A @ Xg).sum().backward()
    # eager autograd: one autograd.Function (its forward by the structure's routes, its adjoint by
    # the routes of the transposed values), not the op
    assert len(routed) == 3 and by_op == [] and calls() == 3
    assert "EagerProduct" in type((A @ Xg).grad_fn).__name__
    torch.testing.assert_close(Xg.grad, A.to_dense().t() @ torch.ones(12, 3, dtype=torch.float64))


def test_a_reference_route_under_accelerate_goes_to_torch_at_once(monkeypatch):
    """Once a native structure's product at a width has hit the reference, the next one calls
    torch on its int32 CSR with nothing of the runtime between (counted as the hit it is); an
    update of the values in place is seen (torch bumps the version counter the indices share, so
    the structure is looked up again), and autograd still records its product."""
    A, X, v = native(), torch.randn(9, 4), torch.randn(9)
    with S.accelerate():
        for _ in range(2):
            A @ X, A @ v  # a miss plans each, a hit stores each route
        monkeypatch.setattr(plans, "routed_product", lambda *a: pytest.fail("the runtime was called"))
        config.reset_counts()
        torch.testing.assert_close(A @ X, A.to_dense() @ X)
        torch.testing.assert_close(torch.mv(A, v), A.to_dense() @ v)
        assert (config.stats().calls, config.stats().reference_calls) == (2, 2)
        monkeypatch.undo()
        A.values().mul_(2)
        for _ in range(2):
            torch.testing.assert_close(A @ X, A.to_dense() @ X)
        Xg = X.clone().requires_grad_(True)
        (A @ Xg).sum().backward()
    torch.testing.assert_close(Xg.grad, A.to_dense().t() @ torch.ones(12, 4))


def test_a_native_tensors_repeated_products_derive_from_its_values_once(monkeypatch):
    """``values()`` is a new tensor object per call; what the runtime derives from values (here
    the reference's torch CSR tensor) is still built once, and new or updated values are used."""
    from sparserl_compile import reference

    built = []
    real = reference._new_csr
    monkeypatch.setattr(reference, "_new_csr", lambda *a: built.append(1) or real(*a))
    A, x = native(), torch.randn(9)
    dense = A.to_dense()
    with S.accelerate():
        for _ in range(5):
            torch.testing.assert_close(A @ x, dense @ x)
        assert len(built) == 1
        B = torch.sparse_csr_tensor(A.crow_indices(), A.col_indices(), 2 * A.values(), A.shape)  # one structure
        torch.testing.assert_close(B @ x, 2 * dense @ x)
        torch.testing.assert_close(A @ x, dense @ x)
        A.values().mul_(3)  # in place: the version counter the alias shares
        torch.testing.assert_close(A @ x, 3 * dense @ x)
    assert calls() == 8


def test_unsupported_combinations_pass_through_unchanged():
    A = native()
    X = torch.randn(9, 4)
    uncoalesced = torch.sparse_coo_tensor(torch.tensor([[0, 0], [1, 1]]), torch.tensor([1.0, 2.0]), (12, 9))
    A_grad = native()
    A_grad.requires_grad_(True)
    with S.accelerate():
        torch.testing.assert_close((A @ A.t().to_sparse_csr()).to_dense(), A.to_dense() @ A.to_dense().t())
        torch.testing.assert_close(uncoalesced @ X, uncoalesced.to_dense() @ X)
        D = torch.randn(2, 12)
        torch.testing.assert_close(D @ A, D @ A.to_dense())  # dense @ sparse: torch's own product
        (A_grad @ X).sum().backward()  # torch differentiates the sparse values; sparserl does not
        assert A_grad.grad is not None
        out = torch.empty(12, 4)
        torch.mm(A, X, out=out)
        with pytest.raises(RuntimeError):
            A @ torch.randn(9, 4, dtype=torch.float64)  # torch's own dtype error
        with pytest.raises(RuntimeError):
            A @ torch.randn(8, 4)  # torch's own shape error
    assert calls() == 0
    torch.testing.assert_close(out, A.to_dense() @ X)


def test_empty_matrix_returns_zeros():
    A = torch.sparse_csr_tensor(torch.zeros(6, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                torch.zeros(0), (5, 3))
    with S.accelerate():
        y = A @ torch.randn(3, 2)
    assert calls() == 1 and y.shape == (5, 2) and not y.any()


def test_malformed_native_tensor_is_reported():
    A = torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([0, 7]), torch.ones(2), (2, 3),
                                check_invariants=False)
    with S.accelerate(), pytest.raises(ValueError, match=r"column indices span \[0, 7\] but n_cols is 3"):
        A @ torch.randn(3, 2)


@pytest.mark.gpu
def test_routed_on_cuda():
    A = native(300, 200, index=torch.int32, density=0.05).cuda()
    X = torch.randn(200, 8, device="cuda")
    with S.accelerate():
        y = A @ X
    assert calls() == 1
    torch.testing.assert_close(y, A.to_dense() @ X, rtol=1e-4, atol=1e-4)


def test_coo_flagged_coalesced_but_not_row_sorted_gives_torchs_result():
    """``sparse_coo_tensor(..., is_coalesced=True)`` over indices that are not row-sorted breaks
    torch's contract, but torch's own product is still right; sparserl must not pair the columns
    with the wrong rows (it passes the product to torch), and ``sparsify`` sorts the rows."""
    lying = torch.sparse_coo_tensor(torch.tensor([[1, 0, 1], [0, 1, 1]]), torch.tensor([1.0, 2.0, 3.0]), (2, 2),
                                    is_coalesced=True)
    want = torch.tensor([[0.0, 2.0], [1.0, 3.0]])
    x = torch.tensor([[1.0], [10.0]])
    with S.accelerate():
        torch.testing.assert_close(lying @ x, want @ x)
    torch.testing.assert_close(S.sparsify(lying).to_dense(), want)
    torch.testing.assert_close(S.sparsify(lying) @ x, want @ x)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_sparse_mm_with_reduce_routed_on_cpu(reduce):
    """``torch.sparse.mm(A, B, reduce)``: PyG's CPU call for a CSR adjacency; "mean" averages over
    each row's stored entries (an empty row gives zeros), as torch does."""
    A = native(40, 30, index=torch.int64, density=0.1)
    X = torch.randn(30, 5)
    want = torch.sparse.mm(A, X, reduce)
    with S.accelerate():
        got = torch.sparse.mm(A, X, reduce)
        got_kw = torch.sparse.mm(A, X, reduce=reduce)
    assert calls() == 2
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_kw, want)
    with S.accelerate():  # "amax" and COO operands are torch's own
        torch.sparse.mm(A, X, "amax")
    assert calls() == 2


def _bad(kind: str):
    """Native operands whose raw indices torch would read out of bounds (check_invariants off)."""
    if kind == "coo_negative":
        return torch.sparse_coo_tensor(torch.tensor([[0, 0, 1, 1], [5, -1, 3, 8]]), torch.ones(4), (2, 9))
    if kind == "coo_row_past_end":
        return torch.sparse_coo_tensor(torch.tensor([[0, 7], [0, 1]]), torch.ones(2), (2, 9), is_coalesced=True)
    if kind == "csr_not_monotone":
        return torch.sparse_csr_tensor(torch.tensor([0, 3, 2]), torch.tensor([0, 1]), torch.ones(2), (2, 9),
                                       check_invariants=False)
    if kind == "csc_row_past_end":
        return torch.sparse_csc_tensor(torch.tensor([0, 1] + [2] * 8), torch.tensor([0, 5]), torch.ones(2), (2, 9),
                                       check_invariants=False)
    raise KeyError(kind)


BAD = {"coo_negative": r"column indices span \[-1, 8\]", "coo_row_past_end": r"row indices span \[0, 7\]",
       "csr_not_monotone": "crow_indices is not non-decreasing", "csc_row_past_end": r"row indices span \[0, 5\]"}


@pytest.mark.parametrize("kind", list(BAD))
def test_malformed_operands_are_refused_before_torch_reads_them(kind):
    """Wherever a malformed native operand appears in a handled call (left, right, addmm's
    input), the hook raises a ValueError naming the problem instead of handing it to torch."""
    A = _bad(kind)
    calls_ = [lambda: A @ torch.randn(9, 2), lambda: torch.mm(A, torch.randn(9, 2)),
              lambda: torch.randn(3, 2) @ A, lambda: torch.addmm(torch.zeros(2, 2), A, torch.randn(9, 2)),
              lambda: torch.mv(A, torch.randn(9))]
    with S.accelerate():
        for call in calls_:
            with pytest.raises(ValueError, match=BAD[kind]):
                call()
    assert calls() == 0


def test_uncoalesced_coo_in_canonical_order_is_routed():
    A = native(layout="coo")
    raw = torch.sparse_coo_tensor(A._indices(), A._values(), A.shape)  # the same entries, not flagged coalesced
    assert not raw.is_coalesced()
    X = torch.randn(9, 3)
    with S.accelerate():
        y = raw @ X
    assert calls() == 1
    torch.testing.assert_close(y, A.to_dense() @ X)


def test_native_products_differentiate_to_the_dense_operand_twice():
    A = native(dtype=torch.float64)
    for x in (torch.randn(9, 3, dtype=torch.float64, requires_grad=True),
              torch.randn(9, dtype=torch.float64, requires_grad=True)):
        with S.accelerate():
            assert "EagerProduct" in type((A @ x).grad_fn).__name__
            assert torch.autograd.gradcheck(lambda v: A @ v, (x,))
            assert torch.autograd.gradgradcheck(lambda v: torch.mm(A, v) if v.dim() == 2 else torch.mv(A, v), (x,))


def test_a_csr_tensor_met_again_is_found_by_identity(monkeypatch):
    """A CSR tensor multiplied again is found by identity, without its accessor aliases; any
    in-place change (values, indices, a resize) or a swap of its C++ tensor is seen."""
    A, X = native(), torch.randn(9, 3)
    accessed = {"n": 0}
    real = dispatch._native_csr_keyed

    def keyed(*a, **k):
        accessed["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(dispatch, "_native_csr_keyed", keyed)
    with S.accelerate():
        for _ in range(4):
            torch.testing.assert_close(A @ X, A.to_dense() @ X)
        assert accessed["n"] == 1 and dispatch.memo_stats.hits == 3
        A.values().mul_(-2)  # new numbers: seen
        torch.testing.assert_close(A @ X, A.to_dense() @ X)
        assert accessed["n"] == 2
        A.col_indices()[0] = 99  # a structure change, out of range: checked again and refused
        with pytest.raises(ValueError, match="malformed"):
            A @ X
        B, C = native(seed=2), native(seed=3)
        B @ X
        torch.utils.swap_tensors(B, C)  # B is now the other matrix, with the same version
        torch.testing.assert_close(B @ X, B.to_dense() @ X)
        D = native(seed=4)
        D @ X
        D.data = native(seed=5)  # whatever torch makes of it, the product is D's as it stands
        torch.testing.assert_close(D @ X, D.to_dense() @ X)


def test_the_identity_memo_is_bounded_and_cleared():
    X = torch.randn(9, 3)
    with S.accelerate():
        for seed in range(dispatch.MEMO_SIZE + 5):
            native(seed=seed) @ X
        assert len(dispatch._seen) == dispatch.MEMO_SIZE
    dispatch.clear_memo()
    assert len(dispatch._seen) == 0
