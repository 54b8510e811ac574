"""torch.ops.sparserl.*: opcheck, gradcheck, fake kernels, operand errors."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import sparserl_compile  # noqa: F401  (registers the ops)
from sparserl_compile.structure import fingerprint

OPS = {
    "spmv": (False, True), "spmm": (False, False), "spmv_t": (True, True), "spmm_t": (True, False),
}


def csr_args(n_rows, n_cols, density, seed=0, dtype=torch.float64):
    m = sp.random(n_rows, n_cols, density=density, format="csr", random_state=seed, dtype=np.float64)
    m.sort_indices()
    crow = torch.from_numpy(m.indptr.astype(np.int32))
    col = torch.from_numpy(m.indices.astype(np.int32))
    val = torch.from_numpy(m.data).to(dtype)
    return m, (crow, col, val), fingerprint(m.indptr, m.indices, m.shape)


def dense_for(name, n_rows, n_cols, n=3, dtype=torch.float64, requires_grad=False):
    transposed, vector = OPS[name]
    k = n_rows if transposed else n_cols
    shape = (k,) if vector else (k, n)
    return torch.randn(*shape, dtype=dtype, requires_grad=requires_grad)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize(
    "shape, density, dtype",
    [((7, 5), 0.4, torch.float64), ((7, 5), 0.4, torch.float32), ((1, 9), 1.0, torch.float64),
     ((0, 3), 0.0, torch.float64)],
)
def test_opcheck(name, shape, density, dtype):
    m, csr, fp = csr_args(*shape, density)
    op = getattr(torch.ops.sparserl, name)
    x = dense_for(name, *shape, dtype=dtype, requires_grad=dtype == torch.float64)
    torch.library.opcheck(op, (*csr[:2], csr[2].to(dtype), x, *shape, fp))


@pytest.mark.parametrize("name", list(OPS))
def test_values_match_scipy_and_gradcheck(name):
    m, csr, fp = csr_args(8, 6, 0.35, seed=3)
    op = getattr(torch.ops.sparserl, name)
    transposed, _ = OPS[name]
    x = dense_for(name, 8, 6, requires_grad=True)
    want = (m.T if transposed else m) @ x.detach().numpy()
    np.testing.assert_allclose(op(*csr, x, 8, 6, fp).detach().numpy(), want, rtol=1e-12, atol=1e-12)
    f = lambda x: op(*csr, x, 8, 6, fp)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


def test_fake_kernels_use_shapes_only():
    m, csr, fp = csr_args(5, 4, 0.5)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in csr]
        y = torch.ops.sparserl.spmm(*fake, torch.empty(4, 7, dtype=torch.float64), 5, 4, fp)
        assert y.shape == (5, 7) and y.dtype == torch.float64
        y = torch.ops.sparserl.spmv_t(*fake, torch.empty(5, dtype=torch.float64), 5, 4, fp)
        assert y.shape == (4,)


def test_operand_errors_name_the_problem():
    m, (crow, col, val), fp = csr_args(5, 4, 0.5)
    with pytest.raises(RuntimeError, match=r"dense operand is torch.float32.*values are torch.float64"):
        torch.ops.sparserl.spmm(crow, col, val, torch.ones(4, 2), 5, 4, fp)
    with pytest.raises(RuntimeError, match="must be int32"):
        torch.ops.sparserl.spmm(crow.long(), col, val, torch.ones(4, 2, dtype=torch.float64), 5, 4, fp)
    with pytest.raises(RuntimeError, match=r"dense operand has 5 rows.*has 4 columns"):
        torch.ops.sparserl.spmm(crow, col, val, torch.ones(5, 2, dtype=torch.float64), 5, 4, fp)
    with pytest.raises(RuntimeError, match="must be 1-D"):
        torch.ops.sparserl.spmv(crow, col, val, torch.ones(4, 2, dtype=torch.float64), 5, 4, fp)
    with pytest.raises(RuntimeError, match=r"crow_indices has 6 entries, expected n_rows \+ 1 = 7"):
        torch.ops.sparserl.spmv(crow, col, val, torch.ones(4, dtype=torch.float64), 6, 4, fp)
    with pytest.raises(RuntimeError, match="int64 is not supported|values dtype torch.int64"):
        torch.ops.sparserl.spmv(crow, col, val.long(), torch.ones(4, dtype=torch.int64), 5, 4, fp)


def test_values_never_get_a_gradient():
    m, (crow, col, val), fp = csr_args(5, 4, 0.5)
    with pytest.raises(RuntimeError, match="does not differentiate w.r.t. sparse values"):
        torch.ops.sparserl.spmm(crow, col, val.requires_grad_(True), torch.ones(4, 2, dtype=torch.float64), 5, 4, fp)
    with torch.no_grad():  # without grad mode nothing is asked of autograd
        torch.ops.sparserl.spmm(crow, col, val, torch.ones(4, 2, dtype=torch.float64), 5, 4, fp)


def test_every_op_has_a_graph_twin():
    from sparserl_compile.ops import GRAPH_TWINS

    assert {op.name() for op in GRAPH_TWINS} == {f"sparserl::{n}" for n in OPS}
    for op, twin in GRAPH_TWINS.items():
        assert twin.name() == op.name() + "_graph"
        assert str(twin._schema).split("(", 1)[1] == str(op._schema).split("(", 1)[1]  # same signature


@pytest.mark.parametrize("name", list(OPS))
def test_graph_twins_compute_the_same_and_pass_opcheck(name):
    m, csr, fp = csr_args(7, 5, 0.4, seed=1, dtype=torch.float32)
    op, twin = getattr(torch.ops.sparserl, name), getattr(torch.ops.sparserl, name + "_graph")
    x = dense_for(name, 7, 5, dtype=torch.float32)
    want = op(*csr, x, 7, 5, fp)
    torch.testing.assert_close(twin(*csr, x, 7, 5, fp), want, rtol=0, atol=0)
    torch.library.opcheck(twin, (*csr, x, 7, 5, fp), test_utils=("test_schema", "test_faketensor"))
    with FakeTensorMode() as mode:
        y = twin(*(mode.from_tensor(t) for t in csr), mode.from_tensor(x), 7, 5, fp)
        assert y.shape == want.shape and y.dtype == want.dtype


def test_graph_twins_check_operands_like_the_ops():
    m, (crow, col, val), fp = csr_args(5, 4, 0.5)
    with pytest.raises(RuntimeError, match=r"sparserl::spmm_graph: the dense operand is torch.float32"):
        torch.ops.sparserl.spmm_graph(crow, col, val, torch.ones(4, 2), 5, 4, fp)
    with pytest.raises(RuntimeError, match=r"dense operand has 5 rows.*has 4 columns"):
        torch.ops.sparserl.spmm_graph(crow, col, val, torch.ones(5, 2, dtype=torch.float64), 5, 4, fp)



@pytest.mark.parametrize("name", ["spmv", "spmv_graph", "spmm", "spmm_graph"])
def test_an_ops_products_see_new_values_and_keep_none_alive(name, monkeypatch):
    """The ops keep routes per values tensor (``plans.routed_by_values``): an in-place update of
    the values and other values of the same structure give the right product, and values freed
    take their entry with them (a reference plan's CSR tensor, which would hold them, is never
    kept there). The second product of the same values goes by its reference route, past the
    plan key."""
    import gc
    import weakref

    from sparserl_compile import config, plans, reference

    m, (crow, col, val), fp = csr_args(7, 5, 0.4, seed=2, dtype=torch.float32)
    op = getattr(torch.ops.sparserl, name)
    x = dense_for(name.removesuffix("_graph"), 7, 5, dtype=torch.float32)
    want = torch.from_numpy(m.toarray()).float() @ x
    for _ in range(2):  # a miss plans it, a hit stores the route
        torch.testing.assert_close(op(crow, col, val, x, 7, 5, fp), want)
    keyed, real_key = [], plans.width_bucket
    monkeypatch.setattr(plans, "width_bucket", lambda n: keyed.append(n) or real_key(n))
    plans.reset_stats()
    torch.testing.assert_close(op(crow, col, val, x, 7, 5, fp), want)
    assert keyed == [] and config.stats().reference_calls == 1  # routed: no plan key built
    monkeypatch.undo()
    assert plans._REFERENCE in plans._routes_by_values[id(val)][2].native.values()
    val.mul_(2)
    torch.testing.assert_close(op(crow, col, val, x, 7, 5, fp), 2 * want)
    other = -val
    torch.testing.assert_close(op(crow, col, other, x, 7, 5, fp), -2 * want)
    k, alive = id(other), weakref.ref(other)
    assert k in plans._routes_by_values
    del other
    reference.clear()  # the reference's own memo of its last CSR tensors (bounded) holds values too
    gc.collect()
    assert alive() is None and k not in plans._routes_by_values
