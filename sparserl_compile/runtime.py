"""The path of one product: plan table, disk cache, provider, selection, launch, fallback.

Every sparserl product (``ops.py``'s custom ops call ``spmv``/``spmm``/``spmv_t``/``spmm_t``
here) looks up a ``Plan`` in an in-memory table keyed by

    (fingerprint, op, dense width bucket, value dtype, device arch)

* hit: run the plan (a ``KernelPlan`` launches its cubin; a ``ReferencePlan`` calls
  torch.sparse, i.e. cuSPARSE on CUDA and torch's CPU CSR kernels on the CPU);
* miss on CUDA: the disk cache (``cache.KernelCache.default()``; a cached "reference wins"
  verdict counts too) -> else the active provider's ``k`` candidates
  (``providers.get_provider()``) -> ``select.choose`` (compile, verify, time) -> cache ->
  plan;
* miss on the CPU, for float64 values, for empty matrices or with kernels disabled: a
  ``ReferencePlan`` (generated kernels are GPU-only).

Guarantees: a failure anywhere in the kernel path -- a missing module, a compile or
verification error, a provider exception, a launch error -- is logged once per structure
(logger ``sparserl_compile.runtime``), counted in ``stats().fallbacks``, and the product is
computed by the reference instead. Nothing here raises to the user for a kernel failure and
no unverified kernel is launched (verification is ``select``'s job; the runtime only launches
what ``select`` or the cache returns). Asynchronous device faults (an illegal address inside a
kernel) cannot be caught here; they are what ``verify``/``sandbox`` exist to rule out before
a kernel is ever cached.

Products with the transposed matrix (``*_t``, used by autograd and by ``x @ A``) run on the
transposed pattern, computed once per structure on the host (scipy) and memoized with its own
fingerprint, so A^T gets its own plan and kernel. Reference products in float16/bfloat16 on
the CPU (where torch has no half CSR kernel) accumulate in float32 and round once. The
reference keeps the torch CSR tensors of the last ``CSR_MEMO_SIZE`` (crow, col, val) triples
it was given (by object identity; the CSR tensor aliases them, so in-place value updates are
seen), which saves rebuilding one per call and keeps those arrays alive until ``clear()``.

What it does not do: validate CSR invariants (``tensor.py``/``dispatch.py`` do that once per
tensor), compute fingerprints of user tensors (callers pass them), or compile/verify kernels.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from sparserl_compile import contract, providers
from sparserl_compile.structure import fingerprint as _fingerprint

log = logging.getLogger("sparserl_compile.runtime")

#: transposed patterns kept (per structure and device); each holds 2 index arrays + a perm
TRANSPOSE_MEMO_SIZE = 32


# ------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class RuntimeConfig:
    """How misses are served. Change with ``configure(**fields)``."""

    provider: str = "reference"  # name of the active provider (set through configure/set_provider)
    k: int = 4  # candidates asked from the provider per miss
    cache: bool = True  # read and write the on-disk kernel cache
    kernels: bool = True  # False: every product uses the reference (torch.sparse / cuSPARSE)

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"RuntimeConfig.k={self.k!r}: the number of candidates must be an int >= 1")
        for name in ("cache", "kernels"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"RuntimeConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.provider, str):
            raise TypeError("RuntimeConfig.provider is the provider's name (a str)")


@dataclass(frozen=True)
class RuntimeStats:
    """Counters since the last ``reset_stats()``."""

    calls: int = 0  # products run
    hits: int = 0  # plan-table hits
    misses: int = 0  # plan-table misses (each builds a plan)
    kernel_calls: int = 0  # products run by a generated kernel
    reference_calls: int = 0  # products run by the reference
    fallbacks: int = 0  # kernel-path failures that fell back to the reference
    cache_hits: int = 0  # misses served by the disk cache
    searches: int = 0  # misses that asked the provider


_config = RuntimeConfig()
_counts: dict[str, int] = {f.name: 0 for f in fields(RuntimeStats)}
_table: dict[tuple, "Plan"] = {}
_lock = threading.RLock()
_logged: set[tuple] = set()


def configure(**kw) -> RuntimeConfig:
    """Change the runtime configuration (fields of ``RuntimeConfig``); returns the new one.

    ``provider`` may be a name or a provider object. The plan table is cleared so the next
    call of every structure is planned under the new configuration.
    """
    global _config
    valid = {f.name for f in fields(RuntimeConfig)}
    unknown = set(kw) - valid
    if unknown:
        raise TypeError(f"configure() got unknown settings {sorted(unknown)}; valid: {sorted(valid)}")
    if "provider" in kw:
        kw["provider"] = providers.set_provider(kw["provider"]).name
    new = replace(_config, **kw)
    with _lock:
        _config = new
        _table.clear()
    return new


def get_config() -> RuntimeConfig:
    return _config


def stats() -> RuntimeStats:
    """A snapshot of the counters."""
    return RuntimeStats(**_counts)


def reset_stats() -> None:
    for k in _counts:
        _counts[k] = 0


def clear() -> None:
    """Forget every plan and transposed pattern (the disk cache is untouched)."""
    with _lock:
        _table.clear()
        _transposes.clear()
        _csr_memo.clear()
        _logged.clear()


def plans() -> dict[tuple, "Plan"]:
    """A copy of the plan table (key -> plan), for inspection and tests."""
    return dict(_table)


def _log_once(kind: str, fp: str, msg: str) -> None:
    if (kind, fp) not in _logged:
        _logged.add((kind, fp))
        log.warning("%s (structure %s): %s", kind, fp[:12], msg)


# ------------------------------------------------------------------------- reference


_native_ok: dict[tuple, bool] = {}


def reference_product(crow, col, val, x, n_rows: int, n_cols: int) -> torch.Tensor:
    """``A @ x`` by torch.sparse (cuSPARSE on CUDA), x 1-D (SpMV) or 2-D (SpMM), int32 CSR."""
    mv = x.dim() == 1
    shape = (n_rows,) if mv else (n_rows, x.shape[1])
    if n_rows == 0 or col.numel() == 0 or x.numel() == 0:
        return x.new_zeros(shape)
    key = (x.device.type, val.dtype, mv)
    if _native_ok.get(key, True):
        try:
            y = _csr(crow, col, val, n_rows, n_cols) @ x
            _native_ok[key] = True
            return y
        except (RuntimeError, NotImplementedError):
            if val.dtype not in (torch.float16, torch.bfloat16):
                raise
            _native_ok[key] = False  # no half kernel here: accumulate in float32 from now on
    y = _new_csr(crow, col, val.float(), n_rows, n_cols) @ x.float()
    return y.to(val.dtype)


#: the last torch CSR tensors built, keyed by the identity of their member tensors: a torch
#: CSR tensor aliases crow/col/val (no copy), so in-place value updates stay visible
_csr_memo: "OrderedDict[tuple, tuple]" = OrderedDict()
CSR_MEMO_SIZE = 16


def _csr(crow, col, val, n_rows, n_cols):
    key = (id(crow), id(col), id(val))
    hit = _csr_memo.get(key)
    if hit is not None and hit[0]() is crow and hit[1]() is col and hit[2]() is val:
        return hit[3]
    t = _new_csr(crow, col, val, n_rows, n_cols)
    _csr_memo[key] = (weakref.ref(crow), weakref.ref(col), weakref.ref(val), t)
    while len(_csr_memo) > CSR_MEMO_SIZE:
        _csr_memo.popitem(last=False)
    return t


def _new_csr(crow, col, val, n_rows, n_cols):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
        return torch.sparse_csr_tensor(crow, col, val, (n_rows, n_cols), check_invariants=False)


# ------------------------------------------------------------------------- plans


class ReferencePlan:
    """Run the product with torch.sparse; ``reason`` says why no kernel is used."""

    kind = "reference"

    def __init__(self, reason: str):
        self.reason = reason

    def run(self, op, crow, col, val, x, n_rows, n_cols):
        return reference_product(crow, col, val, x, n_rows, n_cols)

    def __repr__(self) -> str:
        return f"ReferencePlan({self.reason!r})"


class KernelPlan:
    """A verified kernel: the loaded cubin, its header and the format arrays on the device.

    Values are gathered into the format's value array per call, memoized on the identity and
    version counter of the values tensor (so a training step's new values are re-gathered and
    an unchanged weight is not).
    """

    kind = "kernel"

    def __init__(self, header: contract.KernelHeader, kernel, fdata, arrays: dict, source: str = ""):
        self.header = header
        self.kernel = kernel
        self.fdata = fdata
        self.arrays = arrays
        self.source = source
        self._direct = contract.FORMATS[header.format].value_array == "vals"
        self._vmemo: tuple | None = None

    def _values(self, val):
        if self._direct:
            return val
        m = self._vmemo
        if m is not None and m[0]() is val and m[1] == val._version:
            return m[2]
        out = self.fdata.gather_values(val).contiguous()
        self._vmemo = (weakref.ref(val), val._version, out)
        return out

    def run(self, op, crow, col, val, x, n_rows, n_cols):
        n = 1 if x.dim() == 1 else int(x.shape[1])
        ls = self.header.launch
        if n % ls.n_align:
            return None  # this width does not suit the kernel's vector loads
        shape = (n_rows,) if x.dim() == 1 else (n_rows, n)
        y = x.new_zeros(shape) if ls.zero_output else x.new_empty(shape)
        args = self.fdata.kernel_args(op, n, self.arrays, self._values(val), x, y)
        self.kernel.launch(args, ls.grid(self.fdata.scalars, n), ls.block, ls.smem)
        return y

    def __repr__(self) -> str:
        return f"KernelPlan(format={self.header.format}, block={self.header.launch.block})"


Plan = ReferencePlan | KernelPlan


# ------------------------------------------------------------------------- one product


_arch_of: dict[tuple, str] = {}


def device_arch(device: torch.device) -> str:
    """``"cpu"`` or ``"sm_XY"`` of a CUDA device."""
    k = (device.type, device.index)
    a = _arch_of.get(k)
    if a is None:
        if device.type == "cuda":
            maj, mnr = torch.cuda.get_device_capability(device)
            a = f"sm_{maj}{mnr}"
        else:
            a = device.type
        _arch_of[k] = a
    return a


def width_bucket(n: int) -> int:
    """1 for SpMV, else the next power of two >= n (the cache's bucket)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def kernels_possible(device: torch.device) -> bool:
    """Whether generated kernels can run on ``device`` (CUDA only)."""
    return device.type == "cuda"


def product(op: str, crow, col, val, x, n_rows: int, n_cols: int, fp: str) -> torch.Tensor:
    """``A @ x`` for ``op`` in ("spmv", "spmm"), through the plan table (see module doc)."""
    _counts["calls"] += 1
    n = 1 if x.dim() == 1 else int(x.shape[1])
    key = (fp, op, width_bucket(n), val.dtype, device_arch(x.device))
    plan = _table.get(key)
    if plan is None:
        _counts["misses"] += 1
        with _lock:
            plan = _table.get(key)
            if plan is None:
                plan = _plan_for(op, crow, col, val, x, n_rows, n_cols, fp)
                _table[key] = plan
    else:
        _counts["hits"] += 1
    if plan.kind == "kernel":
        try:
            y = plan.run(op, crow, col, val, x, n_rows, n_cols)
        except Exception as e:  # a launch failure: never the user's problem
            _counts["fallbacks"] += 1
            _log_once("kernel launch failed, using the reference from now on", fp, repr(e))
            with _lock:
                _table[key] = ReferencePlan(f"launch failed: {e!r}")
            y = None
        if y is not None:
            _counts["kernel_calls"] += 1
            return y
    _counts["reference_calls"] += 1
    return reference_product(crow, col, val, x, n_rows, n_cols)


def _plan_for(op, crow, col, val, x, n_rows, n_cols, fp) -> Plan:
    if not kernels_possible(x.device):
        return ReferencePlan(f"{x.device.type} tensors use the reference (kernels are GPU-only)")
    if val.dtype == torch.float64:
        return ReferencePlan("float64 products use the reference")
    if not _config.kernels:
        return ReferencePlan("kernels disabled (configure(kernels=False))")
    if n_rows == 0 or col.numel() == 0:
        return ReferencePlan("empty matrix")
    try:
        return _search(op, crow, col, val, x, n_rows, n_cols, fp)
    except Exception as e:
        _counts["fallbacks"] += 1
        _log_once("kernel path failed, using the reference", fp, f"{type(e).__name__}: {e}")
        return ReferencePlan(f"kernel path failed: {type(e).__name__}: {e}")


def _problem(op, crow, col, val, x, n_rows, n_cols, fp) -> providers.Problem:
    dname = str(val.dtype).removeprefix("torch.")
    return providers.Problem(
        op=op, dtype=contract.TORCH_DTYPES[dname], n=1 if x.dim() == 1 else int(x.shape[1]),
        n_rows=n_rows, n_cols=n_cols, nnz=int(col.numel()),
        indptr=crow.detach().cpu().numpy().astype(np.int32, copy=False),
        indices=col.detach().cpu().numpy().astype(np.int32, copy=False),
        fingerprint=fp, arch=device_arch(x.device),
    )


def _cache_key(problem: providers.Problem, device: torch.device):
    from sparserl_compile import cache

    driver = "unknown"
    try:
        from cuda.bindings import driver as drv

        err, v = drv.cuDriverGetVersion()
        driver = str(v)
    except Exception:
        pass
    try:
        from sparserl_compile.compiler import nvrtc_version

        nv = ".".join(str(p) for p in nvrtc_version())
    except Exception:
        nv = "unknown"
    return cache.CacheKey(
        fingerprint=problem.fingerprint, op=problem.op, dtype=problem.dtype,
        width=cache.width_bucket(problem.n), arch=problem.arch,
        gpu_name=torch.cuda.get_device_name(device), driver_version=driver, nvrtc_version=nv,
    )


def _kernel_plan(problem, device, cubin: bytes, header, source: str) -> KernelPlan:
    from sparserl_compile import formats, launcher

    if isinstance(header, str):
        header = contract.parse_header(header)
    fd = formats.convert(problem.indptr, problem.indices, (problem.n_rows, problem.n_cols),
                         header.format, header.params)
    arrays = formats.to_device(fd, device)
    kernel = launcher.load(cubin, header, device=device.index)
    return KernelPlan(header, kernel, fd, arrays, source)


_pool = None


def _sandbox_pool():
    """The runtime's one sandbox worker for verification (started on the first search)."""
    global _pool
    if _pool is None:
        import atexit

        from sparserl_compile.sandbox import SandboxPool

        _pool = SandboxPool(1)
        atexit.register(_pool.close)
    return _pool


def _search(op, crow, col, val, x, n_rows, n_cols, fp) -> Plan:
    problem = _problem(op, crow, col, val, x, n_rows, n_cols, fp)
    store = key = None
    if _config.cache:
        try:
            from sparserl_compile import cache

            store, key = cache.KernelCache.default(), _cache_key(problem, x.device)
            entry = store.get(key)
        except Exception as e:
            _log_once("disk cache unusable, searching without it", fp, f"{type(e).__name__}: {e}")
            store = entry = None
        if entry is not None:
            _counts["cache_hits"] += 1
            if entry.reference_wins:
                return ReferencePlan("cached verdict: no kernel beat the reference")
            return _kernel_plan(problem, x.device, entry.cubin, entry.header or entry.source, entry.source)
    provider = providers.get_provider()
    _counts["searches"] += 1
    cands = provider.candidates(problem, _config.k)
    if not cands:
        return ReferencePlan(f"provider {provider.name!r} proposed no candidates")
    from sparserl_compile import select

    choice = select.choose(problem, cands, pool=_sandbox_pool())
    record = dict(getattr(choice, "record", None) or {})
    if choice.candidate is None:
        plan: Plan = ReferencePlan("no candidate beat the reference")
    else:
        plan = _kernel_plan(problem, x.device, choice.cubin, choice.candidate.header, choice.candidate.source)
    if store is not None:
        try:
            from sparserl_compile.cache import CacheEntry

            cand = choice.candidate
            store.put(CacheEntry(
                key=key, cubin=None if cand is None else choice.cubin,
                source="" if cand is None else cand.source,
                header="" if cand is None else cand.header.render(),
                times={"kernel_us": getattr(choice, "kernel_us", None),
                       "reference_us": getattr(choice, "reference_us", None)},
                verification=record,
            ))
        except Exception as e:
            _log_once("could not write the kernel cache", fp, f"{type(e).__name__}: {e}")
    return plan


# ------------------------------------------------------------------------- transposes


@dataclass
class TransposedPattern:
    """The CSR pattern of A^T on one device, and where A's values go in it."""

    crow: torch.Tensor  # int32, n_cols + 1
    col: torch.Tensor  # int32, nnz
    perm: torch.Tensor  # int64, nnz: A^T's k-th value is A's perm[k]-th value
    fingerprint: str
    _vmemo: tuple | None = None

    def values(self, val: torch.Tensor) -> torch.Tensor:
        m = self._vmemo
        if m is not None and m[0]() is val and m[1] == val._version:
            return m[2]
        out = val[self.perm] if self.perm.numel() else val.new_empty(0)
        self._vmemo = (weakref.ref(val), val._version, out)
        return out


_transposes: "OrderedDict[tuple, TransposedPattern]" = OrderedDict()


def transpose_pattern(crow, col, n_rows: int, n_cols: int, fp: str) -> TransposedPattern:
    """A^T's pattern (memoized per fingerprint and device; computed on the host once)."""
    key = (fp, str(crow.device))
    tp = _transposes.get(key)
    if tp is not None:
        _transposes.move_to_end(key)
        return tp
    import scipy.sparse as sp

    ip = crow.detach().cpu().numpy().astype(np.int64)
    ix = col.detach().cpu().numpy().astype(np.int64)
    nnz = ix.size
    m = sp.csr_matrix((np.arange(nnz, dtype=np.int64), ix, ip), shape=(n_rows, n_cols))
    t = m.transpose().tocsr()
    t.sort_indices()
    ipt, ixt = t.indptr.astype(np.int32), t.indices.astype(np.int32)
    dev = crow.device
    tp = TransposedPattern(
        torch.from_numpy(ipt).to(dev), torch.from_numpy(ixt).to(dev),
        torch.from_numpy(t.data.astype(np.int64)).to(dev),
        _fingerprint(ipt, ixt, (n_cols, n_rows)),
    )
    with _lock:
        _transposes[key] = tp
        while len(_transposes) > TRANSPOSE_MEMO_SIZE:
            _transposes.popitem(last=False)
    return tp


# ------------------------------------------------------------------------- entry points


def spmv(crow, col, val, x, n_rows: int, n_cols: int, fp: str) -> torch.Tensor:
    """y = A x, x of shape (n_cols,)."""
    return product("spmv", crow, col, val, x, n_rows, n_cols, fp)


def spmm(crow, col, val, x, n_rows: int, n_cols: int, fp: str) -> torch.Tensor:
    """Y = A X, X of shape (n_cols, n), row-major."""
    return product("spmm", crow, col, val, x, n_rows, n_cols, fp)


def spmv_t(crow, col, val, x, n_rows: int, n_cols: int, fp: str) -> torch.Tensor:
    """y = A^T x, x of shape (n_rows,); A is given as its own CSR (n_rows x n_cols)."""
    tp = transpose_pattern(crow, col, n_rows, n_cols, fp)
    return product("spmv", tp.crow, tp.col, tp.values(val), x, n_cols, n_rows, tp.fingerprint)


def spmm_t(crow, col, val, x, n_rows: int, n_cols: int, fp: str) -> torch.Tensor:
    """Y = A^T X, X of shape (n_rows, n)."""
    tp = transpose_pattern(crow, col, n_rows, n_cols, fp)
    return product("spmm", tp.crow, tp.col, tp.values(val), x, n_cols, n_rows, tp.fingerprint)


__all__ = [
    "RuntimeConfig", "RuntimeStats", "ReferencePlan", "KernelPlan", "TransposedPattern",
    "configure", "get_config", "stats", "reset_stats", "clear", "plans", "reference_product",
    "product", "spmv", "spmm", "spmv_t", "spmm_t", "transpose_pattern", "device_arch",
    "width_bucket", "kernels_possible",
]
