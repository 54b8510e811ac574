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
