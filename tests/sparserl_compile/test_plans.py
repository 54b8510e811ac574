"""plans.KernelPlan: what a launch is handed (values, operand alignment, device), checked on the
CPU with a kernel object that computes the product from the launch arguments it receives."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from sparserl_compile import config, formats, plans
from sparserl_compile.kernels import space


class ArgsKernel:
    """Stands in for ``launcher.LoadedKernel`` (no ``bind``: the plain launch path): computes
    the product from the launch arguments of a ``csr`` or ``ell`` kernel, and records them."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.calls: list = []

    def launch(self, args, grid, block, smem):
        self.calls.append(args)
        x, y = args[-2], args[-1]
        if self.fmt == "csr":
            n_rows, n_cols, *rest = args
            row_ptr, col_idx, vals = rest[-5:-2]
            a = sp.csr_matrix((vals.numpy(), col_idx.numpy(), row_ptr.numpy()), shape=(int(n_rows), int(n_cols)))
        else:  # ell, column-major with padding col -1
            n_rows, n_cols, width, *rest = args
            ell_col, ell_val = rest[-4:-2]
            cols = ell_col.numpy().reshape(int(width), int(n_rows))
            vals = ell_val.numpy().reshape(int(width), int(n_rows))
            rows = np.broadcast_to(np.arange(int(n_rows)), cols.shape)
            keep = cols >= 0
            a = sp.csr_matrix((vals[keep], (rows[keep], cols[keep])), shape=(int(n_rows), int(n_cols)))
        y.copy_(torch.from_numpy(np.asarray(a @ x.numpy(), dtype=np.float32)))


def matrix(seed=0):
    return sp.random(30, 20, density=0.2, random_state=seed, format="csr", dtype=np.float32)


def plan_for(m, fmt: str, op: str = "spmv"):
    cand = next(c for c in space(op, "f32") if c.header.format == fmt)
    src, header = cand.source, cand.header
    fd = formats.convert(m.indptr, m.indices, m.shape, fmt)
    kernel = ArgsKernel(fmt)
    return plans.KernelPlan(header, kernel, fd, formats.to_device(fd, "cpu"), src), kernel


def operands(m):
    crow = torch.from_numpy(m.indptr.astype(np.int32))
    col = torch.from_numpy(m.indices.astype(np.int32))
    return crow, col, torch.from_numpy(m.data.copy())


def test_a_gathered_value_array_works_on_inference_tensors():
    """Weights loaded under ``torch.inference_mode`` (the usual LLM setup) have no version
    counter: the value gather's memo must not make every launch fail (and fall back)."""
    m = matrix()
    plan, kernel = plan_for(m, "ell")
    with torch.inference_mode():
        crow, col, val = operands(m)
        x = torch.randn(20)
        y = plan.run("spmv", crow, col, val, x, 30, 20)
        np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
        plan.run("spmv", crow, col, val, x, 30, 20)
    assert len(kernel.calls) == 2


def test_inference_mode_products_keep_their_kernel_plan(monkeypatch):
    monkeypatch.setattr(plans, "kernels_possible", lambda device: True)
    monkeypatch.setattr(plans, "device_arch", lambda device: "sm_test")
    m = matrix(1)
    plan, kernel = plan_for(m, "ell")
    key = ("fp-test", "spmv", 1, torch.float32, "sm_test")
    plans.clear()
    plans.reset_stats()
    plans._table[key] = plan
    try:
        with torch.inference_mode():
            crow, col, val = operands(m)
            x = torch.randn(20)
            for _ in range(2):
                y = plans.product("spmv", crow, col, val, x, 30, 20, "fp-test")
                np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
        st = config.stats()
        assert st.kernel_calls == 2 and st.fallbacks == 0 and plans.plans()[key] is plan
    finally:
        plans.clear()
        plans.reset_stats()


def test_a_plan_never_launches_on_another_devices_tensors():
    """The plan key names the arch, not the device: two GPUs of one kind share a plan, whose
    arrays and kernel live on one of them. A call on the other runs the reference (None)."""
    m = matrix(2)
    plan, kernel = plan_for(m, "csr")
    crow, col, val = operands(m)
    x = torch.empty(20, device="meta")
    assert plan.run("spmv", crow.to("meta"), col.to("meta"), val.to("meta"), x, 30, 20) is None
    assert kernel.calls == []
    y = plan.run("spmv", crow, col, val, torch.ones(20), 30, 20)  # its own device: launched
    np.testing.assert_allclose(y.numpy(), m @ np.ones(20, np.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["csr", "ell"])
def test_launches_get_16_byte_aligned_operands(fmt):
    """Verification places every array 16-byte aligned, so a kernel may rely on it (vector
    loads): a launch must never hand it a view at an odd offset, whatever its n_align."""
    m = matrix(3)
    plan, kernel = plan_for(m, fmt)
    crow, col, val = operands(m)
    vbig, xbig = torch.zeros(val.numel() + 1), torch.randn(21)
    vbig[1:] = val
    v, x = vbig[1:], xbig[1:]  # contiguous views 4 bytes into their storage
    assert v.data_ptr() % 16 and x.data_ptr() % 16
    for _ in range(2):
        y = plan.run("spmv", crow, col, v, x, 30, 20)
        np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    for args in kernel.calls:
        assert all(a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor))
    v.mul_(2)  # an in-place update of the values is seen
    y = plan.run("spmv", crow, col, v, x, 30, 20)
    np.testing.assert_allclose(y.numpy(), 2 * (m @ x.numpy()), rtol=1e-5, atol=1e-5)


@pytest.fixture
def capturing(monkeypatch):
    """Products as inside a CUDA graph capture (no host reads, no host-to-device copies there)."""
    monkeypatch.setattr(plans, "kernels_possible", lambda device: True)
    monkeypatch.setattr(plans, "device_arch", lambda device: "sm_test")
    monkeypatch.setattr(plans, "capturing", lambda x: True)
    plans.clear()
    plans.reset_stats()
    yield
    plans.clear()
    plans.reset_stats()


def test_a_miss_inside_a_graph_capture_runs_the_reference_and_plans_nothing(capturing, monkeypatch):
    from sparserl_compile import miss

    def no_verdict(*a, **k):
        raise AssertionError("the miss path (host reads of the pattern) ran inside a capture")

    monkeypatch.setattr(miss, "verdict", no_verdict)
    m = matrix(4)
    crow, col, val = operands(m)
    x = torch.randn(20)
    y = plans.product("spmv", crow, col, val, x, 30, 20, "fp-capture")
    np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    assert plans.plans() == {} and config.stats().fallbacks == 0


def test_an_unchecked_kernel_waits_for_a_call_outside_the_capture(capturing, monkeypatch):
    """The first-use check reads results on the host: inside a capture the reference serves and
    the plan stays, unchecked, for the next call outside it."""
    m = matrix(5)
    plan, kernel = plan_for(m, "csr")
    key = ("fp-capture", "spmv", 1, torch.float32, "sm_test")
    plans._table[key] = plan
    crow, col, val = operands(m)
    x = torch.randn(20)
    y = plans.product("spmv", crow, col, val, x, 30, 20, "fp-capture")
    np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    assert kernel.calls == [] and plans.plans()[key] is plan and not plan.checked
    assert config.stats().fallbacks == 0
    monkeypatch.setattr(plans, "capturing", lambda x: False)
    plans.product("spmv", crow, col, val, x, 30, 20, "fp-capture")
    assert len(kernel.calls) == 1 and plan.checked
    monkeypatch.setattr(plans, "capturing", lambda x: True)  # checked: it runs inside a capture too
    plans.product("spmv", crow, col, val, x, 30, 20, "fp-capture")
    assert len(kernel.calls) == 2 and config.stats().kernel_calls == 2


def test_a_finished_background_search_is_not_swapped_in_inside_a_capture(capturing):
    from concurrent.futures import Future

    m = matrix(6)
    done = Future()
    done.set_exception(AssertionError("resolved (format arrays uploaded) inside a capture"))
    pending = plans.PendingPlan(None, torch.device("cpu"), None, done)
    key = ("fp-capture", "spmv", 1, torch.float32, "sm_test")
    plans._table[key] = pending
    crow, col, val = operands(m)
    x = torch.randn(20)
    y = plans.product("spmv", crow, col, val, x, 30, 20, "fp-capture")
    np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    assert plans.plans()[key] is pending and config.stats().fallbacks == 0


@pytest.mark.gpu
def test_a_product_first_met_inside_a_cuda_graph_capture_does_not_break_it():
    """On the GPU: a product whose structure has no plan yet, captured into a CUDA graph,
    runs the reference there (the capture succeeds and its replay is right); the next call
    outside the capture plans it as usual."""
    plans.clear()
    plans.reset_stats()
    m = matrix(7)
    crow, col, val = (t.cuda() for t in operands(m))
    x = torch.randn(20, device="cuda")
    a = torch.sparse_csr_tensor(crow, col, val, size=m.shape)
    torch.mv(a, x)  # cuSPARSE's own warm-up, outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = plans.product("spmv", crow, col, val, x, 30, 20, "fp-capture-gpu")
    assert plans.plans() == {}
    g.replay()
    torch.cuda.synchronize()
    np.testing.assert_allclose(y.cpu().numpy(), m @ x.cpu().numpy(), rtol=1e-4, atol=1e-4)
    plans.product("spmv", crow, col, val, x, 30, 20, "fp-capture-gpu")
    assert len(plans.plans()) == 1
    plans.clear()
    plans.reset_stats()


def test_dense_plan_runs_in_the_operands_dtype_under_autocast():
    """A ``DensePlan`` serves a product in its operands' dtype under ``torch.autocast``, as the
    reference and a kernel do (the plan that wins must not change the result's dtype)."""
    m = sp.random(6, 5, density=0.5, format="csr", random_state=0, dtype=np.float32)
    crow, col = torch.from_numpy(m.indptr).int(), torch.from_numpy(m.indices).int()
    val, x = torch.from_numpy(m.data), torch.randn(5, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = plans.DensePlan().run("spmm", crow, col, val, x, 6, 5)
    assert y.dtype == torch.float32 and torch.allclose(y, torch.from_numpy(m.toarray()) @ x, atol=1e-5)


def test_strided_values_reach_a_kernel_contiguous():
    """A kernel reads its value array from memory: CSR-ordered values that are a strided view
    (every other float of a buffer) are copied contiguous before a launch, not handed over."""
    m = matrix(7)
    plan, kernel = plan_for(m, "csr")
    launch = kernel.launch

    def reads_memory(args, *rest):  # as a GPU kernel: the value array's memory, strides ignored
        *head, vals, x, y = args
        return launch((*head, torch.as_strided(vals, (vals.numel(),), (1,)), x, y), *rest)

    kernel.launch = reads_memory
    crow, col, val = operands(m)
    buf = torch.zeros(2 * val.numel())
    buf[::2] = val
    strided = buf[::2]
    assert not strided.is_contiguous()
    x = torch.randn(20)
    for _ in range(2):
        y = plan.run("spmv", crow, col, strided, x, 30, 20)
        np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)


class BindKernel(ArgsKernel):
    """``ArgsKernel`` with ``bind``, as ``launcher.LoadedKernel`` has: a launch prepared once
    with everything but ``x`` and ``y``; like a GPU kernel it reads the bound value array when
    it runs, so a stale binding shows as a wrong product."""

    def __init__(self, fmt: str):
        super().__init__(fmt)
        self.binds: list = []

    def bind(self, fixed, *, grid, block=None, smem=None):
        self.binds.append(fixed)
        return lambda x, y: self.launch((*fixed, x, y), grid, block, smem)


def bound_plan_for(m, fmt: str, op: str = "spmv"):
    plan, _ = plan_for(m, fmt, op)
    kernel = plan.kernel = BindKernel(fmt)
    plan._can_bind = True
    return plan, kernel


@pytest.mark.parametrize("fmt", ["csr", "ell"])
def test_a_bound_launch_follows_its_values(fmt):
    """The binding is reused while the values are: updated in place, a format that reads the
    CSR values as they are (csr) keeps its binding, one with a gathered value array (ell)
    gathers and binds again; a new values tensor binds again."""
    m = matrix(8)
    plan, kernel = bound_plan_for(m, fmt)
    crow, col, val = operands(m)
    x = torch.randn(20)
    want = m @ x.numpy()
    for _ in range(2):
        np.testing.assert_allclose(plan.run("spmv", crow, col, val, x, 30, 20).numpy(), want, rtol=1e-5, atol=1e-5)
    assert len(kernel.binds) == 1
    val.mul_(3)
    np.testing.assert_allclose(plan.run("spmv", crow, col, val, x, 30, 20).numpy(), 3 * want, rtol=1e-5, atol=1e-5)
    assert len(kernel.binds) == (1 if fmt == "csr" else 2)
    other = val * -1
    np.testing.assert_allclose(plan.run("spmv", crow, col, other, x, 30, 20).numpy(), -3 * want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(plan.run("spmv", crow, col, val, x, 30, 20).numpy(), 3 * want, rtol=1e-5, atol=1e-5)


def test_bound_widths_are_bounded_and_stay_right():
    m = matrix(9)
    plan, kernel = bound_plan_for(m, "csr", "spmm")
    crow, col, val = operands(m)
    widths = range(1, plan.BOUND_WIDTHS + 4)
    for _ in range(2):
        for n in widths:
            x = torch.randn(20, n)
            y = plan.run("spmm", crow, col, val, x, 30, 20)
            np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
            assert len(plan._bound) <= plan.BOUND_WIDTHS


def test_nothing_is_bound_for_later_inside_a_graph_capture(monkeypatch):
    """A binding keeps its value array alive; inside a CUDA graph capture that may be a graph
    tree's copy, which must not outlive the capture: the launch is prepared, used and dropped."""
    m = matrix(10)
    plan, kernel = bound_plan_for(m, "csr")
    crow, col, val = operands(m)
    x = torch.randn(20)
    monkeypatch.setattr(plans, "capturing", lambda t: True)
    for _ in range(2):
        np.testing.assert_allclose(plan.run("spmv", crow, col, val, x, 30, 20).numpy(), m @ x.numpy(),
                                   rtol=1e-5, atol=1e-5)
    assert plan._bound == {} and len(kernel.binds) == 2
    monkeypatch.setattr(plans, "capturing", lambda t: False)
    plan.run("spmv", crow, col, val, x, 30, 20)
    plan.run("spmv", crow, col, val, x, 30, 20)
    assert len(plan._bound) == 1 and len(kernel.binds) == 3
