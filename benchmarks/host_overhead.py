"""Host time per eager product: where the microseconds of one ``A @ x`` go outside the kernel.

    python benchmarks/host_overhead.py            # CPU: the Python path with a no-op kernel
    python benchmarks/host_overhead.py --cuda     # GPU: search a kernel, then time eager calls

On the CPU it installs a kernel plan whose launch does nothing, so the figure is the Python
path alone (SparseRLTensor.__matmul__ -> tensor._product -> plans.product ->
KernelPlan.run -> bound launch), next to torch's own CSR ``mv`` for scale, and times the
reference plan's path (a CPU product, which the runtime leaves to torch) on a tiny matrix
against ``torch.mv`` itself, with and without the tensor's route past the plan table
(``plans.Routes``), alternated. On a GPU it lets the
runtime find a real kernel for a 2D stencil and reports host microseconds per call (no sync
inside the timed loop) for sparserl and for torch.sparse. Both also time ``F.linear`` with a
pruned weight (1536 x 576, 90 % zeros in every row, the shape of a SmolLM2-135M MLP
projection) at one and 16 tokens: sparserl's eager shortcut against the dense ``F.linear``
(cuBLAS) and, on the GPU, torch.sparse CSR. Both time the other doors too: a native CSR
product under ``sr.accelerate()``, and what one more product adds to a compiled graph.
"""

from __future__ import annotations

import argparse
import time

import torch

import sparserl_compile as S
from sparserl_compile import formats, kernels, matrices, plans, reference
from sparserl_compile.bench import wall_median_us


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


class _NoRoute(plans.Routes):
    """Routes that never serve: every product of a tensor holding them takes the plan table's
    path (the runtime before ``plans.Routes``), for the side-by-side rows."""

    def get(self, n):
        return None

    def store(self, generation, n, native):
        pass


def _without_route(a):
    """``a``'s arrays in a second tensor whose products never take a route."""
    b = S.SparseRLTensor(a.crow, a.col, a.val, a.n_rows, a.n_cols, a.fingerprint)
    b._routes = _NoRoute()
    return b


def pruned_weight(rows: int = 1536, cols: int = 576, sparsity: float = 0.9, seed: int = 0) -> torch.Tensor:
    """A dense weight with exactly ``sparsity`` zeros in every row (per-row pruning)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    keep = torch.rand(rows, cols, generator=g).argsort(dim=1) < round(cols * (1 - sparsity))
    return w * keep


def linear_rows(device: str, noop: bool) -> None:
    import torch.nn.functional as F

    wd = pruned_weight().to(device)
    ws = S.sparsify(wd)
    native = wd.to_sparse_csr()
    for tokens in (1, 16):
        x = torch.randn(tokens, 1, wd.shape[1], device=device)
        F.linear(x, ws)  # plan it (on the GPU: search, verify, cache)
        if noop:  # CPU: every plan of this weight launches nothing (the Python path alone)
            for key in list(plans._table):
                if key[0] == ws.fingerprint:
                    plans._table[key] = _noop_plan(ws, "spmm", key[2])
        rows = [("sparserl F.linear", lambda: F.linear(x, ws)), ("dense F.linear", lambda: F.linear(x, wd))]
        if device == "cuda":
            x2 = x.reshape(tokens, -1)
            rows.append(("torch.sparse W @ x^T", lambda: (native @ x2.t()).t()))
        for name, fn in rows:
            us = _per_call_us(fn, n=5000)
            if device == "cuda":
                torch.cuda.synchronize()
            print(f"  {tokens:2d} token(s) {name:22s}: {us:7.1f} us host per call")


def entry_rows(t, tx, tn) -> None:
    """The other doors beside ``A @ x``: a native CSR product under ``sr.accelerate()`` (the
    torch.sparse dispatch hook, PyG's route), an eager SpMM whose dense operand requires grad
    (autograd records it), and one product more in a graph compiled with ``backend="sparserl"``
    (eight chained SpMVs against one, default mode), next to eager."""
    def chain(k):
        def f(v):
            for _ in range(k):
                v = t @ v
            return v
        return f

    with S.accelerate():
        print(f"  torch.mv on CSR in accelerate()  : {_per_call_us(lambda: torch.mv(tn, tx), n=5000):7.1f} us")
    xg = torch.randn(t.n_cols, 16, device=tx.device, requires_grad=True)  # eager autograd records the product
    print(f"  SparseRLTensor @ X, X needs grad : {_per_call_us(lambda: t @ xg, n=3000):7.1f} us")
    print(f"  torch.mm on CSR, X needs grad    : {_per_call_us(lambda: torch.mm(tn, xg), n=3000):7.1f} us")
    per = {}
    for mode, wrap in (("eager", lambda f: f), ("compiled", lambda f: torch.compile(f, backend="sparserl"))):
        one, eight = wrap(chain(1)), wrap(chain(8))
        t1, t8 = _per_call_us(lambda: one(tx), n=3000), _per_call_us(lambda: eight(tx), n=3000)
        per[mode] = (t8 - t1) / 7
        print(f"  one SpMV more, {mode:8s}          : {per[mode]:7.1f} us ({t1:.1f} us for a graph of one)")


def _noop_plan(a, op: str, n: int) -> plans.KernelPlan:
    """A checked CSR kernel plan for ``a`` (CPU tensors) whose launch does nothing."""
    cand = next(c for c in kernels.space(op, "f32", n=n) if c.header.format == "csr")
    fd = formats.convert(a.crow.numpy(), a.col.numpy(), (a.n_rows, a.n_cols), "csr")
    p = plans.KernelPlan(cand.header, _NoopKernel(), fd, formats.to_device(fd, "cpu"), cand.source)
    p.checked = True
    return p


def cpu(side: int) -> None:
    torch.set_num_threads(1)
    m = matrices.stencil2d(side)
    a = S.sparsify(m)
    plans._table[(a.fingerprint, "spmv", 1, a.val.dtype, "cpu")] = _noop_plan(a, "spmv", 1)
    x = torch.randn(m.shape[1])
    native = torch.sparse_csr_tensor(a.crow, a.col, a.val, m.shape)
    print(f"stencil2d({side}), {m.nnz} nonzeros, CPU, one thread")
    print(f"  SparseRLTensor @ x, no-op kernel : {_per_call_us(lambda: a @ x):7.1f} us (Python path only)")
    print(f"  torch.mv on CSR (computes)       : {_per_call_us(lambda: torch.mv(native, x)):7.1f} us")
    t = S.sparsify(matrices.stencil2d(8))  # CPU tensors: the reference plan (torch's CSR product)
    tx, tn = torch.randn(t.n_cols), torch.sparse_csr_tensor(t.crow, t.col, t.val, (t.n_rows, t.n_cols))
    tw = _without_route(t)
    print(f"stencil2d(8), {t.nnz} nonzeros: the reference plan's path over torch's own product")
    for _ in range(2):  # alternated: the route and the table's path side by side
        print(f"  SparseRLTensor @ x, reference    : {_per_call_us(lambda: t @ tx):7.1f} us")
        print(f"  ... without the tensor's route   : {_per_call_us(lambda: tw @ tx):7.1f} us")
    print(f"  torch.mv on CSR                  : {_per_call_us(lambda: torch.mv(tn, tx)):7.1f} us")
    entry_rows(t, tx, tn)
    print("pruned linear 1536 x 576, 90 % zeros per row, no-op kernel (sparserl) vs dense (computes):")
    linear_rows("cpu", noop=True)


def breakdown(a, x, plan) -> None:
    """Where a kernel plan's host time goes: its parts timed alone, then Python's profile of
    the whole call (its own overhead inflates every figure, so read it for shares)."""
    import cProfile
    import pstats

    if not isinstance(plan, plans.KernelPlan):
        print(f"no kernel plan to break down ({plan!r})")
        return
    key = next(k for k, p in plans._table.items() if p is plan)
    y = x.new_empty(a.n_rows)
    plan.run("spmv", a.crow, a.col, a.val, x, a.n_rows, a.n_cols)
    bound = plan._bound[1][1]
    parts = (("x.new_empty(n_rows)", lambda: x.new_empty(a.n_rows)),
             ("bound launch alone", lambda: bound(x, y)),
             ("KernelPlan.run", lambda: plan.run("spmv", a.crow, a.col, a.val, x, a.n_rows, a.n_cols)),
             ("plans.product", lambda: plans.product("spmv", a.crow, a.col, a.val, x, a.n_rows, a.n_cols,
                                                     a.fingerprint)),
             ("SparseRLTensor @ x", lambda: a @ x))
    print(f"where the host time of a kernel plan goes (plan key {key[:2]}):")
    for name, fn in parts:
        print(f"  {name:22s}: {_per_call_us(fn, n=5000):7.1f} us host per call")
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5000):
        a @ x
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def cuda(side: int, profile: bool = False) -> None:
    m = matrices.stencil2d(side)
    a = S.sparsify(m).cuda()
    x = torch.randn(m.shape[1], device="cuda")
    a @ x  # search, verify, cache: the first call
    torch.cuda.synchronize()
    plan = next(iter(plans.plans().values()))
    native = torch.sparse_csr_tensor(a.crow, a.col, a.val, m.shape)
    print(f"stencil2d({side}), {m.nnz} nonzeros, {torch.cuda.get_device_name()}; plan: {plan!r}")
    rows = [("SparseRLTensor @ x", lambda: a @ x), ("torch.mv on CSR", lambda: torch.mv(native, x)),
            ("CSR @ x", lambda: native @ x),
            ("reference_product", lambda: reference.reference_product(a.crow, a.col, a.val, x, *m.shape))]
    for name, fn in rows:
        us = _per_call_us(fn, n=5000)
        torch.cuda.synchronize()
        print(f"  {name:20s}: {us:7.1f} us host per call, {wall_median_us(fn, 'cuda', reps=200):7.1f} us synchronized")
    if profile:
        breakdown(a, x, plan)
    for key in list(plans._table):  # the same calls when the runtime falls back to torch.sparse
        plans._table[key] = plans.ReferencePlan("forced by host_overhead.py")
    aw = _without_route(a)
    for _ in range(2):  # alternated: the tensor's route to cuSPARSE and the table's path side by side
        for name, fn in (("... reference plan", lambda: a @ x), ("... without route", lambda: aw @ x),
                         ("torch.mv again", lambda: torch.mv(native, x))):
            print(f"  {name:20s}: {_per_call_us(fn, n=5000):7.1f} us host per call, "
                  f"{wall_median_us(fn, 'cuda', reps=200):7.1f} us synchronized")
    print("the same, through the dispatch hook and in a compiled graph (reference plan):")
    entry_rows(a, x, native)
    print("pruned linear 1536 x 576, 90 % zeros per row:")
    linear_rows("cuda", noop=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--side", type=int, default=300, help="stencil2d grid side")
    p.add_argument("--profile", action="store_true", help="--cuda: break a kernel plan's host time down")
    args = p.parse_args()
    if args.cuda:
        cuda(args.side, args.profile)
    else:
        cpu(args.side)


if __name__ == "__main__":
    main()
