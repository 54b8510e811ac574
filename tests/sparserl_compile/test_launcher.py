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


_FAKE_LIBCUDA = r"""
#include <stdint.h>
#include <string.h>
/* cuLaunchKernel's signature; records what it was handed (the first 8 bytes each parameter slot points at) */
void *rec_f, *rec_stream, **rec_extra;
unsigned rec_dims[7];
uint64_t rec_params[16];
int rec_nparams = 0, rec_calls = 0, rec_rc = 0;
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned smem, void *stream, void **params, void **extra) {
    unsigned d[7] = {gx, gy, gz, bx, by, bz, smem};
    rec_f = f; rec_stream = stream; rec_extra = extra; memcpy(rec_dims, d, sizeof d);
    for (int i = 0; i < rec_nparams && i < 16; i++) memcpy(&rec_params[i], params[i], 8);
    rec_calls++;
    return rec_rc;
}
"""


@pytest.fixture
def fake_libcuda(tmp_path, monkeypatch):
    """A shared library standing in for libcuda: its cuLaunchKernel records its arguments."""
    import ctypes
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")
    if cc is None:
        pytest.skip("needs a C compiler (cc, gcc or g++) to build the stand-in libcuda")
    src, lib = tmp_path / "fake.c", tmp_path / "libfakecuda.so"
    src.write_text(_FAKE_LIBCUDA)
    subprocess.run([cc, "-x", "c", "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    fake = ctypes.CDLL(str(lib))
    monkeypatch.setattr(launcher, "_libcuda", [fake])
    return fake


class _KernelStub:
    """What ``_DirectLaunch.build`` reads of a ``LoadedKernel``: a driver-API function handle,
    the device, and torch's current raw stream."""

    backend = "driver"
    device = 0

    def __init__(self, handle: int, stream: int):
        self._kernel = handle
        self._raw_stream = lambda device: stream


def test_the_direct_launch_hands_cuLaunchKernel_exactly_its_arguments(fake_libcuda):
    """The bound launch's ctypes marshalling, checked against a stand-in libcuda on the CPU:
    the function, grid, block, shared memory and stream as given, the parameter slots holding
    the fixed arguments (pointers and int32 / float scalars) and the operand pointers of each
    call, no extra options; a nonzero CUresult raises."""
    import ctypes

    fixed = (0x7F00_0000_1000, np.int32(300), np.int32(-7), np.float32(0.5), 0x7F00_0000_2000)
    d = launcher._DirectLaunch.build(_KernelStub(0x5EED, 0xABC0), fixed, ((12, 3), 256, 4096))
    assert d is not None
    lib = fake_libcuda
    ctypes.c_int.in_dll(lib, "rec_nparams").value = len(fixed) + 2
    for xp, yp in ((0x7F00_0000_3000, 0x7F00_0000_4000), (0x7F00_0000_5000, 0x7F00_0000_6000)):
        d(xp, yp)
        assert ctypes.c_void_p.in_dll(lib, "rec_f").value == 0x5EED
        assert ctypes.c_void_p.in_dll(lib, "rec_stream").value == 0xABC0
        assert ctypes.c_void_p.in_dll(lib, "rec_extra").value is None
        assert list((ctypes.c_uint * 7).in_dll(lib, "rec_dims")) == [12, 3, 1, 256, 1, 1, 4096]
        p = list((ctypes.c_uint64 * 16).in_dll(lib, "rec_params"))
        assert p[0] == 0x7F00_0000_1000 and p[4] == 0x7F00_0000_2000
        assert ctypes.c_int32(p[1] & 0xFFFFFFFF).value == 300 and ctypes.c_int32(p[2] & 0xFFFFFFFF).value == -7
        assert ctypes.c_float.from_buffer(ctypes.c_uint32(p[3] & 0xFFFFFFFF)).value == 0.5
        assert (p[5], p[6]) == (xp, yp)
    assert ctypes.c_int.in_dll(lib, "rec_calls").value == 2
    ctypes.c_int.in_dll(lib, "rec_rc").value = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(launcher.LaunchError, match="CUresult 700"):
        d(1, 2)
