"""On a GPU: every family point computes A @ x (SpMV) and A @ X (SpMM) like scipy in float64.

Each kernel is compiled for the device's arch, fed the format arrays from ``formats.convert``
with the header's parameters, launched with the header's grid through ``cuda.core``, and its
output (poisoned with NaN first unless the header asks for zeroing) compared with scipy.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from sparserl_compile import compiler, contract, formats, kernels
from sparserl_compile.matrices import load_npz, shared_manifest

pytestmark = pytest.mark.gpu

_NP = {"f32": np.float32, "f16": np.float16}


def _edge() -> sp.csr_matrix:
    m = sp.random(301, 257, density=0.03, format="lil", random_state=np.random.default_rng(1), dtype=np.float32)
    m[5, :] = 0
    m[7, :] = np.linspace(-1, 1, 257, dtype=np.float32)  # one long row
    m[300, :] = 0
    return sp.csr_matrix(m)


def _launch(cand, m, dtype, n):
    import torch
    from cuda.core import Device, LaunchConfig, ObjectCode, launch

    h = cand.header
    try:
        fd = formats.convert(m.indptr, m.indices, m.shape, h.format, h.params)
    except formats.FormatNotSuitable:
        return None
    tdt = torch.float32 if dtype == "f32" else torch.float16
    dev = torch.device("cuda")
    vals = torch.from_numpy(fd.gather_values(m.data.astype(np.float32))).to(dev, tdt)
    rng = np.random.default_rng(0)
    xs = (n,) if h.op == "spmv" else (m.shape[1], n)
    x = torch.from_numpy(rng.standard_normal(m.shape[1] * n).astype(np.float32).reshape(xs if h.op == "spmm" else (m.shape[1],))).to(dev, tdt)
    y = torch.full((m.shape[0],) if h.op == "spmv" else (m.shape[0], n), float("nan"), device=dev, dtype=tdt)
    if h.launch.zero_output:
        y.zero_()
    arrays = formats.to_device(fd, dev)
    args = fd.kernel_args(h.op, n, arrays, vals, x, y)
    args = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    kern = ObjectCode.from_cubin(compiler.compile_cubin(cand.source).cubin).get_kernel(contract.KERNEL_NAME)
    d = Device()
    d.set_current()
    s = d.create_stream()
    launch(s, LaunchConfig(grid=h.launch.grid(fd.scalars, n), block=h.launch.block, shmem_size=h.launch.smem), kern, *args)
    s.sync()
    ref = m.astype(np.float64) @ x.double().cpu().numpy()
    return y.double().cpu().numpy(), ref


def _matrices(shared):
    tiny = sp.random(20, 17, density=0.15, format="csr", random_state=2, dtype=np.float32)
    out = [("edge", _edge()), ("tiny", tiny)]  # tiny: nnz <= 2048, so the baked family runs
    small = [i for i in shared_manifest(shared) if i.nnz < 300_000 and i.path.exists()] if shared else []
    if small:
        out.append((small[0].name, load_npz(small[0].path)))
    return out


@pytest.mark.parametrize("op,dtype,n", [("spmv", "f32", 1), ("spmm", "f32", 12), ("spmm", "f32", 3),
                                        ("spmv", "f16", 1), ("spmm", "f16", 34)])
def test_space_matches_scipy(op, dtype, n):
    from sparserl_compile.matrices import shared_matrices_dir

    bad = []
    for name, m in _matrices(shared_matrices_dir()):
        for c in kernels.space(op, dtype, n=None if op == "spmv" else n, structure=m):
            got = _launch(c, m, dtype, n)
            if got is None:
                continue
            y, ref = got
            tol = 1e-4 if dtype == "f32" else 2e-2
            scale = np.abs(ref).max() + 1
            err = np.nanmax(np.abs(y - ref)) / scale if np.isfinite(y).all() else np.inf
            if not err < tol:
                bad.append((name, c.name, float(err)))
    assert not bad, bad[:10]
