"""launcher: argument rules on the CPU; load/launch, bind, no host sync, graph capture on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

from faults import GOOD, SPMM_GOOD, candidate
from sparserl_compile import launcher, matrices


def test_argument_conversion_rules():
    assert launcher._ptr(np.int32(5)) == 5 and isinstance(launcher._ptr(np.int32(5)), np.int32)
    assert launcher._ptr(123456) == 123456  # a Python int is a pointer
    with pytest.raises(launcher.LaunchError, match="np.int32"):
        launcher._ptr(1.5)
    assert launcher._dim3(7) == (7, 1, 1) and launcher._dim3((2, 3)) == (2, 3, 1)


def test_no_gpu_is_a_clear_error(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(launcher.LaunchError, match="executor='cpu'"):
        launcher.load(b"\x00", candidate(GOOD).header)


def _setup(src, m, n=1):
    import torch

    from sparserl_compile import compiler, formats

    cand = candidate(src)
    major, minor = torch.cuda.get_device_capability()
    cubin = compiler.compile_cubin(src, arch=f"sm_{major}{minor}").cubin
    fd = formats.convert(m.indptr, m.indices, m.shape, "csr")
    arrays = formats.to_device(fd, "cuda")
    vals = torch.from_numpy(m.data).cuda()
    xs = (m.shape[1],) if n == 1 and cand.header.op == "spmv" else (m.shape[1], n)
    x = torch.randn(*xs, device="cuda")
    y = torch.full((m.shape[0],) + xs[1:], float("nan"), device="cuda")
    args = fd.kernel_args(cand.header.op, n, arrays, vals, x, y)
    grid = cand.header.launch.grid(fd.scalars, n)
    a = torch.sparse_csr_tensor(torch.from_numpy(m.indptr).cuda(), torch.from_numpy(m.indices).cuda(), vals,
                                size=m.shape)
    return cand, cubin, args, grid, x, y, a


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda.core", "driver"])
def test_launch_matches_torch_sparse(backend):
    m = matrices.stencil2d(50)
    cand, cubin, args, grid, x, y, a = _setup(GOOD, m)
    k = launcher.load(cubin, cand.header, backend=backend)
    k.launch(args, grid)
    import torch

    torch.testing.assert_close(y, torch.mv(a, x), rtol=1e-5, atol=1e-5)
    y2 = torch.full_like(y, float("nan"))
    k.bind(args[:-2], grid=grid)(x, y2)
    torch.testing.assert_close(y2, y, rtol=0, atol=0)
    cand, cubin, args, grid, x, y, a = _setup(SPMM_GOOD, m, n=8)
    launcher.load(cubin, cand.header, backend=backend).launch(args, grid)
    torch.testing.assert_close(y, torch.mm(a, x), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_bound_launch_no_host_sync_graph_capture_and_overhead():
    import torch

    m = matrices.stencil2d(100)
    cand, cubin, args, grid, x, y, a = _setup(GOOD, m)
    bound = launcher.load(cubin, cand.header).bind(args[:-2], grid=grid)
    bound(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            bound(x, y)  # a host sync here would raise
    finally:
        torch.cuda.set_sync_debug_mode("default")
    g = torch.cuda.CUDAGraph()
    y_g = torch.full_like(y, float("nan"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        bound(x, y_g)
    torch.cuda.current_stream().wait_stream(s)
    y_g.fill_(float("nan"))
    with torch.cuda.graph(g):
        bound(x, y_g)
    assert torch.isnan(y_g).all()  # captured, not run
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y_g, torch.mv(a, x), rtol=1e-5, atol=1e-5)
    assert bound._direct is not None  # libcuda's cuLaunchKernel, not cuda.core's launch


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda.core", "driver"])
def test_the_direct_launch_and_the_back_ends_own_agree_bit_for_bit(backend, monkeypatch):
    import torch

    m = matrices.stencil2d(60)
    cand, cubin, args, grid, x, y, a = _setup(SPMM_GOOD, m, n=8)
    k = launcher.load(cubin, cand.header, backend=backend)
    direct = k.bind(args[:-2], grid=grid)
    monkeypatch.setattr(launcher, "DIRECT_LAUNCH", False)
    own = k.bind(args[:-2], grid=grid)
    assert direct._direct is not None and own._direct is None
    y1, y2 = torch.full_like(y, float("nan")), torch.full_like(y, float("nan"))
    for _ in range(3):  # the same slots, rewritten per call
        direct(x, y1)
        own(x, y2)
    x2 = torch.randn_like(x)
    direct(x2, y1)
    own(x2, y2)
    torch.cuda.synchronize()
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    torch.testing.assert_close(y1, torch.mm(a, x2), rtol=1e-5, atol=1e-5)
