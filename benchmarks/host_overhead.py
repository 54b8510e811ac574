"""Host time per eager product: where the microseconds of one ``A @ x`` go outside the kernel.

    python benchmarks/host_overhead.py            # CPU: the Python path with a no-op kernel
    python benchmarks/host_overhead.py --cuda     # GPU: search a kernel, then time eager calls

On the CPU it installs a kernel plan whose launch does nothing, so the figure is the Python
path alone (SparseRLTensor.__torch_function__ -> tensor._product -> runtime.product ->
KernelPlan.run -> bound launch), next to torch's own CSR ``mv`` for scale. On a GPU it lets the
runtime find a real kernel for a 2D stencil and reports host microseconds per call (no sync
inside the timed loop) for sparserl and for torch.sparse.
"""

from __future__ import annotations

import argparse
import time

import torch

import sparserl_compile as S
from sparserl_compile import formats, kernels, matrices, runtime


def _per_call_us(fn, n: int = 20000, warmup: int = 200) -> float:
    for _ in range(warmup):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


class _NoopKernel:
    def bind(self, fixed, grid, block=None, smem=None):
        return lambda x, y: None


def cpu(side: int) -> None:
    torch.set_num_threads(1)
    m = matrices.stencil2d(side)
    a = S.sparsify(m)
    cand = next(c for c in kernels.space("spmv", "f32") if c.header.format == "csr")
    fd = formats.convert(m.indptr, m.indices, m.shape, "csr")
    plan = runtime.KernelPlan(cand.header, _NoopKernel(), fd, formats.to_device(fd, "cpu"), cand.source)
    plan.checked = True
    runtime._table[(a.fingerprint, "spmv", 1, a.val.dtype, "cpu")] = plan
    x = torch.randn(m.shape[1])
    native = torch.sparse_csr_tensor(a.crow, a.col, a.val, m.shape)
    print(f"stencil2d({side}), {m.nnz} nonzeros, CPU, one thread")
    print(f"  SparseRLTensor @ x, no-op kernel : {_per_call_us(lambda: a @ x):7.1f} us (Python path only)")
    print(f"  torch.mv on CSR (computes)       : {_per_call_us(lambda: torch.mv(native, x)):7.1f} us")


def cuda(side: int) -> None:
    m = matrices.stencil2d(side)
    a = S.sparsify(m).cuda()
    x = torch.randn(m.shape[1], device="cuda")
    a @ x  # search, verify, cache: the first call
    torch.cuda.synchronize()
    plan = next(iter(runtime.plans().values()))
    native = torch.sparse_csr_tensor(a.crow, a.col, a.val, m.shape)
    print(f"stencil2d({side}), {m.nnz} nonzeros, {torch.cuda.get_device_name()}; plan: {plan!r}")
    for name, fn in (("SparseRLTensor @ x", lambda: a @ x), ("torch.mv on CSR", lambda: torch.mv(native, x))):
        us = _per_call_us(fn, n=5000)
        torch.cuda.synchronize()
        print(f"  {name:20s}: {us:7.1f} us host per call")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--side", type=int, default=300, help="stencil2d grid side")
    args = p.parse_args()
    (cuda if args.cuda else cpu)(args.side)


if __name__ == "__main__":
    main()
