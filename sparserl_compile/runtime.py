"""The path of one product: plan table, disk cache, provider, selection, launch, fallback.

Every sparserl product (``ops.py``'s custom ops call ``spmv``/``spmm``/``spmv_t``/``spmm_t``
here) looks up a ``Plan`` in an in-memory table keyed by

    (fingerprint, op, dense width bucket, value dtype, device arch)

* hit: run the plan (a ``KernelPlan`` launches its cubin; a ``ReferencePlan`` calls
  torch.sparse, i.e. cuSPARSE on CUDA and torch's CPU CSR kernels on the CPU);
* miss on CUDA: the disk cache (``cache.KernelCache.default()``; a cached "reference wins"
  verdict counts too) -> else, by ``RuntimeConfig.on_miss``: ``"search"`` (default) asks the
  active provider for ``k`` candidates (``providers.get_provider()``) -> ``select.choose``
  (compile, verify, time) -> cache -> plan, and the product waits for it; ``"reference"``
  plans the reference (serving from a pre-generated cache: a miss never stalls);
  ``"background"`` runs the reference now and the same search on one daemon thread, and the
  first product after it finished swaps the verdict in (``PendingPlan``;
  ``wait_for_searches()`` blocks until the queued ones are done);
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
A ``SparseRLTensor`` goes one step further on its eager path: once its product at a width hits
a reference plan, it keeps that torch CSR tensor (``Routes``) and its next products at that
width call torch directly, without building the plan key; the plan table counts every change
(``_PlanTable.generation``) and a route is used only in the generation it was made in, so
configuring, clearing or any new plan sends every tensor back through the table once.

What it does not do: validate CSR invariants (``tensor.py``/``dispatch.py`` do that once per
tensor), compute fingerprints of user tensors (callers pass them), or compile/verify kernels.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict, deque
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from sparserl_compile import contract, providers
from sparserl_compile.problem import Problem, make_problem
from sparserl_compile.bench import csr_tensor
from sparserl_compile.cache import width_bucket  # the plan table buckets widths as the disk cache does
from sparserl_compile.structure import fingerprint as _fingerprint

log = logging.getLogger("sparserl_compile.runtime")

#: transposed patterns kept (per structure and device); each holds 2 index arrays + a perm
TRANSPOSE_MEMO_SIZE = 32
#: plans built on a miss kept in the ``first_uses()`` log (the oldest are dropped)
FIRST_USE_LOG_SIZE = 256


# ------------------------------------------------------------------------- configuration

#: what a CUDA product whose structure is in neither the plan table nor the disk cache does
ON_MISS = {
    "search": "search now (provider, compile, sandboxed verify, time) and wait for the verdict",
    "reference": "run the reference and keep it (serving from a pre-generated cache, never a stall)",
    "background": "run the reference now, search on a background thread, switch when verified",
}


@dataclass(frozen=True)
class RuntimeConfig:
    """How misses are served. Change with ``configure(**fields)``."""

    provider: str = providers.DEFAULT_PROVIDER  # name of the active provider (configure/set_provider)
    k: int = 0  # candidates asked from the provider per miss (0: the provider's own default)
    cache: bool = True  # read and write the on-disk kernel cache
    kernels: bool = True  # False: every product uses the reference (torch.sparse / cuSPARSE)
    on_miss: str = "search"  # a structure the disk cache cannot serve: see ON_MISS
    #: idle sandbox workers kept started beside the one that verifies (``SandboxPool.spare``): a
    #: candidate that fails replaces its worker, and without a spare the next job (the next
    #: candidate, or cuSPARSE timed again) waits for that start, seconds on a GPU. Each spare is a
    #: process with its own CUDA context. None (default): what the active provider asks for, its
    #: ``sandbox_spare`` attribute (0 without one): 1 for a policy whose candidates often fail
    #: (departures from the greedy kernel or samples, ``PolicyProvider``), 0 for measured
    #: kernel-space points (``"nearest"``, ``"search"``) and hinted policies
    sandbox_spare: int | None = None

    def __post_init__(self) -> None:
        if self.on_miss not in ON_MISS:
            raise ValueError(f"RuntimeConfig.on_miss={self.on_miss!r}: use one of {sorted(ON_MISS)} "
                             f"({'; '.join(f'{k}: {v}' for k, v in ON_MISS.items())})")
        spare = self.sandbox_spare
        if spare is not None and (not isinstance(spare, int) or isinstance(spare, bool) or spare < 0):
            raise ValueError(f"RuntimeConfig.sandbox_spare={spare!r}: the number of idle sandbox "
                             "workers kept ready must be an int >= 0, or None for the provider's own")
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 0:
            raise ValueError(f"RuntimeConfig.k={self.k!r}: the number of candidates must be an int >= 0 "
                             "(0 = the provider's default)")
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
    background: int = 0  # searches queued on the background thread (on_miss="background")


class _PlanTable(dict):
    """The plan table: a dict whose every change (a plan set, replaced or removed, the table
    cleared) bumps ``generation``. A ``Routes`` entry is valid only in the generation it was
    made in, so no change of plans, however made, leaves a tensor on a stale shortcut."""

    def __init__(self):
        super().__init__()
        self.generation = 0

    def __setitem__(self, key, plan):
        self.generation += 1
        super().__setitem__(key, plan)

    def __delitem__(self, key):
        self.generation += 1
        super().__delitem__(key)

    def clear(self):
        self.generation += 1
        super().clear()

    def pop(self, *args):
        self.generation += 1
        return super().pop(*args)

    def popitem(self):
        self.generation += 1
        return super().popitem()

    def setdefault(self, key, default=None):
        self.generation += 1
        return super().setdefault(key, default)

    def update(self, *args, **kw):
        self.generation += 1
        super().update(*args, **kw)


class Routes:
    """One sparse tensor's shortcuts past the plan table to the reference: dense width (SpMM)
    or ``SPMV`` -> the torch CSR tensor to multiply by, for products whose plan is the reference (float32/64, a
    non-empty matrix), valid while the plan table's ``generation`` is the one they were made
    in. ``tensor.SparseRLTensor`` keeps one (its ``_routes``); ``product(routes=)`` fills it on
    a reference hit and ``routed_product`` serves the next such product without building the plan
    key. Never copied (a copy would alias the original's values): ``copy``/``deepcopy`` give
    an empty one."""

    __slots__ = ("generation", "native")
    MAX = 8  # widths kept per tensor (a model calling one weight at many widths starts again)
    SPMV = -1  # the key of the SpMV route (an SpMM of width 1 has a plan of its own)

    def __init__(self):
        self.generation = -1
        self.native: dict[int, torch.Tensor] = {}

    def get(self, n: int):
        return self.native.get(n) if self.generation == _table.generation else None

    def store(self, generation: int, n: int, native) -> None:
        if self.generation != generation or len(self.native) >= self.MAX:
            self.native = {}
            self.generation = generation
        self.native[n] = native

    def __copy__(self):
        return Routes()

    def __deepcopy__(self, memo):
        return Routes()

    def __reduce__(self):
        return (Routes, ())


_config = RuntimeConfig()
_counts: dict[str, int] = {f.name: 0 for f in fields(RuntimeStats)}
_table: _PlanTable = _PlanTable()
_lock = threading.RLock()
_logged: set[tuple] = set()
_first_uses: deque = deque(maxlen=FIRST_USE_LOG_SIZE)


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
    """Zero the counters and empty the ``first_uses()`` log."""
    for k in _counts:
        _counts[k] = 0
    _first_uses.clear()


def first_uses() -> list[dict]:
    """Where the time of each plan built on a miss went, oldest first (the last
    ``FIRST_USE_LOG_SIZE``): what a slow first product on a new structure paid for. Each dict:

    * ``fingerprint``, ``op``, ``n``, ``dtype``, ``nnz``; ``source``: ``"search"`` (the provider
      was asked), ``"cache"`` (served by the disk cache) or ``"cache+timing"`` (a pre-generated
      entry never timed on this GPU, or one timed before the hot-L2 rule, ``timed_before_hot_rule``,
      timed now);
    * seconds: ``problem_s`` (the pattern copied to the host), ``cache_s`` (disk-cache lookup),
      ``propose_s`` (the provider's ``candidates``), ``select_s`` (compile, sandboxed
      verification and timing, ``select.choose``, and the disk-cache write), ``plan_s``
      (format conversion, upload and loading the winner), ``total_s``;
    * ``plan``: ``"kernel"`` or ``"reference"``; ``verification``: the selection record
      (per-candidate worker phases, the reference's time, why the reference won), when one ran.

    Background searches (``on_miss="background"``) and products served straight from the
    plan table are not in it."""
    with _lock:
        return [dict(r) for r in _first_uses]


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
_HALF = (torch.float16, torch.bfloat16)


def reference_product(crow, col, val, x, n_rows: int, n_cols: int) -> torch.Tensor:
    """``A @ x`` by torch.sparse (cuSPARSE on CUDA), x 1-D (SpMV) or 2-D (SpMM), int32 CSR.

    The path of every product the runtime does not run a kernel for, so it is kept short (a
    few hundred nanoseconds of Python over torch's own ``mv``/``mm``): float32 and float64 go
    straight to torch; half types first learn once per device type whether torch has a
    native kernel for them (else they accumulate in float32)."""
    if n_rows == 0 or x.numel() == 0 or col.numel() == 0:
        return x.new_zeros((n_rows,) if x.dim() == 1 else (n_rows, x.shape[1]))
    if val.dtype not in _HALF:
        return _native_mm(_csr(crow, col, val, n_rows, n_cols), x)
    key = (x.device.type, val.dtype, x.dim() == 1)
    ok = _native_ok.get(key)
    if ok is not False:
        try:
            y = _native_mm(_csr(crow, col, val, n_rows, n_cols), x)
        except (RuntimeError, NotImplementedError):
            _native_ok[key] = False  # no half kernel here: accumulate in float32 from now on
        else:
            if ok is None:
                _native_ok[key] = True
            return y
    y = _native_mm(_new_csr(crow, col, val.float(), n_rows, n_cols), x.float())
    return y.to(val.dtype)


_mode_on = torch._C._is_torch_function_mode_enabled


def _native_mm(a_csr, x):
    """``a_csr @ x`` by torch (``torch.mv``/``torch.mm``), out of reach of torch function
    modes: a product of sparserl's own must not be seen (and routed a second time) by
    ``dispatch.enable()``'s mode when the runtime is called directly from Python, as the eager
    fast paths do."""
    if _mode_on():
        with torch._C.DisableTorchFunction():
            return torch.mv(a_csr, x) if x.dim() == 1 else torch.mm(a_csr, x)
    return torch.mv(a_csr, x) if x.dim() == 1 else torch.mm(a_csr, x)


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
    return csr_tensor(torch, crow, col, val, (n_rows, n_cols))


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

    def __init__(self, header: contract.KernelHeader, kernel, fdata, arrays: dict, source: str = "",
                 cache_key=None):
        self.checked = False  # set after the first-use re-check in this process passed
        self.cache_key = cache_key  # the disk-cache key it came from (dropped if the re-check fails)
        self.header = header
        self.kernel = kernel
        self.fdata = fdata
        self.arrays = arrays
        self.source = source
        self._direct = contract.FORMATS[header.format].value_array == "vals"
        self._vmemo: tuple | None = None
        self._bound: tuple | None = None  # (n, value tensor, launcher.BoundKernel)

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
        if ls.n_align > 1 and x.data_ptr() % 16:
            x = x.clone()  # a view at an odd offset: vector loads need 16-byte-aligned rows
        shape = (n_rows,) if x.dim() == 1 else (n_rows, n)
        y = x.new_zeros(shape) if ls.zero_output else x.new_empty(shape)
        v = self._values(val)
        if not hasattr(self.kernel, "bind"):  # a kernel object without the prepared fast path
            args = self.fdata.kernel_args(op, n, self.arrays, v, x, y)
            self.kernel.launch(args, ls.grid(self.fdata.scalars, n), ls.block, ls.smem)
            return y
        b = self._bound
        if b is None or b[0] != n or b[1] is not v:
            # everything but x and y is fixed per (width, value array): bind once, launch cheaply
            fixed = self.fdata.kernel_args(op, n, self.arrays, v, x, y)[:-2]
            b = self._bound = (n, v, self.kernel.bind(fixed, grid=ls.grid(self.fdata.scalars, n)))
        b[2](x, y)
        return y

    def __repr__(self) -> str:
        return f"KernelPlan(format={self.header.format}, block={self.header.launch.block})"


Plan = "ReferencePlan | KernelPlan | PendingPlan"


# ------------------------------------------------------------------------- one product


_arch_of: dict[torch.device, str] = {}


def device_arch(device: torch.device) -> str:
    """``"cpu"`` or ``"sm_XY"`` of a CUDA device (memoized on the device: it is part of every
    product's plan key, so a hit costs one dict lookup)."""
    a = _arch_of.get(device)
    if a is None:
        if device.type == "cuda":
            maj, mnr = torch.cuda.get_device_capability(device)
            a = f"sm_{maj}{mnr}"
        else:
            a = device.type
        _arch_of[device] = a
    return a


def kernels_possible(device: torch.device) -> bool:
    """Whether generated kernels can run on ``device`` (CUDA only)."""
    return device.type == "cuda"


def product(op: str, crow, col, val, x, n_rows: int, n_cols: int, fp: str,
            routes: Routes | None = None) -> torch.Tensor:
    """``A @ x`` for ``op`` in ("spmv", "spmm"), through the plan table (see module doc).

    ``routes``: the sparse tensor's ``Routes``; on a reference hit the torch CSR tensor is
    stored there, so that tensor's next product at this width skips the table (``routed_product``)."""
    _counts["calls"] += 1
    if x.numel() == 0:  # an empty dense operand (e.g. a batch of none): zeros, and no plan
        _counts["reference_calls"] += 1  # for the width bucket it shares with real calls
        return reference_product(crow, col, val, x, n_rows, n_cols)
    n = 1 if x.dim() == 1 else int(x.shape[1])
    key = (fp, op, width_bucket(n), val.dtype, device_arch(x.device))
    generation = _table.generation  # before the lookup: a change after it voids what is stored below
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
        if plan.kind == "reference":  # the hot path of a product the runtime does not run a kernel for
            _counts["reference_calls"] += 1
            if routes is not None and val.dtype not in _HALF and n_rows and col.numel():
                native = _csr(crow, col, val, n_rows, n_cols)
                routes.store(generation, n if op == "spmm" else Routes.SPMV, native)
                return _native_mm(native, x)
            return reference_product(crow, col, val, x, n_rows, n_cols)
    if plan.kind == "pending" and plan.future.done():
        with _lock:
            cur = _table.get(key)
            if cur is plan:  # the first product after the search: swap the verdict in
                cur = _table[key] = plan.resolve()
            if cur is not None:  # (None: the table was cleared meanwhile; this call runs the reference)
                plan = cur
    if plan.kind == "kernel":
        try:
            y = plan.run(op, crow, col, val, x, n_rows, n_cols)
            if y is not None and not plan.checked:
                why = first_use_check(y, crow, col, val, x, n_rows, n_cols)
                if why is not None:
                    raise FirstUseMismatch(why)
                plan.checked = True
        except Exception as e:  # a launch failure or a failed re-check: never the user's problem
            _counts["fallbacks"] += 1
            what = "first-use check failed" if isinstance(e, FirstUseMismatch) else "launch failed"
            _log_once(f"kernel {what}, using the reference from now on", fp, repr(e))
            with _lock:
                _table[key] = ReferencePlan(f"{what}: {e!r}")
            if isinstance(e, FirstUseMismatch):
                _forget_cached(plan)
            y = None
        if y is not None:
            _counts["kernel_calls"] += 1
            return y
    _counts["reference_calls"] += 1
    return reference_product(crow, col, val, x, n_rows, n_cols)


def routed_product(routes: Routes, op: str, crow, col, val, x, n_rows: int, n_cols: int, fp: str) -> torch.Tensor:
    """``product`` for a sparse tensor holding ``routes``: where it has a route for this op and
    width (a reference plan found earlier in this generation of the table), torch's product at
    once, counted as the table hit it stands for; else ``product``, which stores one on a
    reference hit."""
    native = routes.get(Routes.SPMV if op == "spmv" else x.shape[1])
    if native is None:
        return product(op, crow, col, val, x, n_rows, n_cols, fp, routes)
    _counts["calls"] += 1
    _counts["hits"] += 1
    _counts["reference_calls"] += 1
    return _native_mm(native, x)


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


def _problem(op, crow, col, val, x, n_rows, n_cols, fp) -> Problem:
    dname = str(val.dtype).removeprefix("torch.")
    return make_problem(op, contract.TORCH_DTYPES[dname], 1 if x.dim() == 1 else int(x.shape[1]),
                        crow, col, (n_rows, n_cols), fp, device_arch(x.device))


@dataclass(frozen=True)
class Target:
    """The GPU a kernel is generated for: the machine-dependent fields of the cache key."""

    arch: str  # "sm_90"
    gpu_name: str  # "NVIDIA H200"
    driver_version: str  # cuDriverGetVersion, e.g. "13000"
    nvrtc_version: str  # "13.0"


def local_target(device: torch.device | None = None) -> Target:
    """The ``Target`` of this machine's current (or given) CUDA device."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here: name the target GPU (sparserl pregen --target-gpu ...)")
    device = device or torch.device("cuda", torch.cuda.current_device())
    driver = "unknown"
    try:
        from cuda.bindings import driver as drv

        _, v = drv.cuDriverGetVersion()
        driver = str(v)
    except Exception:
        pass
    try:
        from sparserl_compile.compiler import nvrtc_version

        nv = ".".join(str(p) for p in nvrtc_version())
    except Exception:
        nv = "unknown"
    return Target(device_arch(device), torch.cuda.get_device_name(device), driver, nv)


def policy_hash(provider) -> str:
    """The cache key's ``policy_hash`` for entries ``provider`` proposes: its checkpoint's
    sha256 (the policy), or ``"none"`` (search, nearest: the hand-written families only)."""
    return str(getattr(provider, "checkpoint_hash", None) or "none")


def cache_key(problem: Problem, target: Target):
    """The disk-cache key of ``problem`` on ``target`` under the active provider."""
    from sparserl_compile import cache
    from sparserl_compile.kernels import KERNEL_SPACE_VERSION

    return cache.CacheKey(
        fingerprint=problem.fingerprint, op=problem.op, dtype=problem.dtype,
        width=cache.width_bucket(problem.n), arch=target.arch, gpu_name=target.gpu_name,
        driver_version=target.driver_version, nvrtc_version=target.nvrtc_version,
        kernel_space_version=KERNEL_SPACE_VERSION,
        policy_hash=policy_hash(providers.get_provider()),
    )


def lookup(store, key):
    """``store``'s entry for ``key``, else the same problem and target's entry built by
    another provider whose kernels every process takes: the families-only entry
    (``policy_hash="none"``: built with the search or nearest provider), then the shipped default
    policy's (``providers.shipped_policy_hash``: a cache pre-generated with the default provider).
    A kernel verified and timed on this GPU kind is as valid whoever proposed it, so a cache
    built with the search serves a process running the policy, and one built with the default
    policy serves a process without the ``train`` extra (its default is then the lookup). Entries
    built by any other checkpoint are keyed to it and only a process running it finds them: a new
    policy is asked again instead of being served an old one's verdicts."""
    from dataclasses import replace

    for h in dict.fromkeys((key.policy_hash, "none", providers.shipped_policy_hash())):  # in order, once each
        entry = None if h is None else store.get(key if h == key.policy_hash else replace(key, policy_hash=h))
        if entry is not None:
            return entry
    return None


_targets: dict[tuple, Target] = {}


def _local_target_memo(device: torch.device) -> Target:
    k = (device.type, device.index)
    if k not in _targets:
        _targets[k] = local_target(device)
    return _targets[k]


def search_entry(problem: Problem, key, *, candidates=None, executor: str | None = None):
    """Ask the active provider (or take ``candidates``), select, and return the cache entry.

    The entry holds the winning kernel (cubin, source, header, times) or, with ``cubin=None``,
    the verdict that the reference wins. ``select.choose`` does all compiling, sandboxed
    verification and timing; nothing is launched in this process.
    """
    from sparserl_compile import select
    from sparserl_compile.cache import CacheEntry

    t0 = time.perf_counter()
    if candidates is None:
        provider = providers.get_provider()
        if not isinstance(provider, providers.ReferenceProvider):
            # a process's first search: the sandbox worker (seconds on a GPU) starts while the
            # provider proposes (and, the first time, loads its model) instead of after it
            try:
                _sandbox_pool(provider).start()
            except Exception:  # noqa: BLE001 - best effort: the selection starts one and reports why not
                pass
        propose = getattr(provider, "propose", None)
        if callable(propose):  # the DefaultProvider: never waits for the policy's model to load
            candidates, proposer = propose(problem, _config.k)
        else:
            candidates, proposer = provider.candidates(problem, _config.k), getattr(provider, "name", "?")
    else:
        provider, proposer = None, "given"
    _counts["searches"] += 1
    record: dict = {"provider": proposer, "candidates": len(candidates),
                    "propose_s": time.perf_counter() - t0}
    if not candidates:
        record["why"] = f"provider {record['provider']!r} proposed no candidates"
        return CacheEntry(key=key, cubin=None, times={}, verification=record)
    choice = select.choose(problem, candidates, executor=executor, pool=_sandbox_pool(provider))
    record.update(dict(choice.record or {}))
    cand = choice.candidate
    times = {k: v for k, v in (("kernel_us", choice.kernel_us), ("reference_us", choice.reference_us))
             if v is not None}
    if cand is None:
        record.setdefault("why", record.get("rule") or "no verified candidate beat the reference")
        return CacheEntry(key=key, cubin=None, times=times, verification=record)
    record["winner_family"] = cand.name
    return CacheEntry(key=key, cubin=choice.cubin, source=cand.source, header=cand.header.render(),
                      times=times, verification=record)


_pool = None
_pool_lock = threading.Lock()


def sandbox_spare(provider=None) -> int:
    """The idle sandbox workers the runtime keeps for ``provider``: ``RuntimeConfig.sandbox_spare``
    when set, else the provider's own ``sandbox_spare`` (0 without one, and for no provider)."""
    if _config.sandbox_spare is not None:
        return _config.sandbox_spare
    wish = getattr(provider, "sandbox_spare", 0)
    return wish if isinstance(wish, int) and not isinstance(wish, bool) and wish > 0 else 0


def _sandbox_pool(provider=None):
    """The runtime's one sandbox worker for verification (started on the first search, or by
    ``prewarm``), and ``sandbox_spare(provider)`` idle ones."""
    global _pool
    with _pool_lock:
        if _pool is None:
            import atexit

            from sparserl_compile.sandbox import SandboxPool

            _pool = SandboxPool(1)
            atexit.register(_pool.close)
        _pool.spare = sandbox_spare(provider)  # configure() or the provider may change between products
    return _pool


def prewarm(*, provider: bool = True) -> threading.Thread:
    """Pay this process's one-time costs now, in the background, instead of in the first
    product on a new structure: start the sandbox worker (a fresh interpreter with torch and,
    on a GPU, a CUDA context, which then loads the format converters), load the converters
    and structure statistics here (numba, from its disk cache), and build the active provider
    (``provider=True``; for the policy, the default, that is loading the model and its
    ``warm_up``: one small SpMV and one SpMM proposal, its first decoding costs; without it the
    lookup proposes for the first new structures while the model loads in the background). For
    serving processes: call it at start-up. Returns the thread (``join()`` it to wait); errors
    are left for the first product to report.

    The sandbox workers are fresh interpreters that import only ``sparserl_compile``, never the
    main script, so a script needs no ``if __name__ == "__main__":`` guard for them."""

    def go():
        try:
            from sparserl_compile import formats

            pool = _sandbox_pool()
            pool.start()
            formats.warm()
            if provider:
                prov = providers.get_provider()
                warm = getattr(prov, "warm_up", None)
                if callable(warm):  # the policy (default or set): load it and pay its first decoding
                    warm()
                _sandbox_pool(prov)  # and the spare workers it asks for
            pool.start(wait=True)
        except Exception:  # noqa: BLE001 - best effort; the first product reports real errors
            pass

    t = threading.Thread(target=go, daemon=True, name="sparserl-prewarm")
    t.start()
    return t


def _kernel_plan(problem, device, cubin: bytes, header, source: str, key=None) -> KernelPlan:
    from sparserl_compile import formats, launcher

    if isinstance(header, str):
        header = contract.parse_header(header)
    fd = formats.convert(problem.indptr, problem.indices, (problem.n_rows, problem.n_cols),
                         header.format, header.params)
    arrays = formats.to_device(fd, device)
    kernel = launcher.load(cubin, header, device=device.index)
    return KernelPlan(header, kernel, fd, arrays, source, cache_key=key)


def _search(op, crow, col, val, x, n_rows, n_cols, fp) -> Plan:
    t0 = time.perf_counter()
    problem = _problem(op, crow, col, val, x, n_rows, n_cols, fp)
    t_problem = time.perf_counter()
    store = _store()
    key = entry = candidates = None
    if store is not None:
        try:
            key = _cache_key(problem, x.device)
            entry = lookup(store, key)
        except Exception as e:
            _log_once("disk cache unusable, searching without it", fp, f"{type(e).__name__}: {e}")
            store = None
    t_cache = time.perf_counter()
    source = "search"
    if entry is not None:
        _counts["cache_hits"] += 1
        if entry.reference_wins:
            return ReferencePlan("cached verdict: " + entry.verification.get("why", "the reference wins"))
        if "kernel_us" in entry.times and not timed_before_hot_rule(entry):
            plan = _entry_plan(entry, problem, x.device, entry.key)  # its own key: dropped if the re-check fails
            _log_first_use(problem, "cache", plan, None, t0, t_problem, t_cache, t_cache)
            return plan
        # pre-generated without a GPU (verified on the CPU, never timed on this GPU), or timed
        # before the selection compared short products with a hot L2: the kernel is timed
        # against cuSPARSE in the sandbox (one candidate) before it is trusted
        candidates = [contract.Candidate(entry.source, contract.parse_header(entry.header or entry.source))]
        source = "cache+timing"
    elif _config.on_miss == "reference":
        return ReferencePlan("not in the kernel cache (on_miss='reference')")
    if _config.on_miss == "background":
        return PendingPlan(problem, x.device, key, _background_search(problem, key, store, fp, candidates, x.device))
    try:
        entry = search_entry(problem, key, candidates=candidates)
        _put(store, entry, fp)
        t_selected = time.perf_counter()
        plan = _entry_plan(entry, problem, x.device, key)
    finally:
        if candidates is None:  # the provider was asked (not a cached kernel's re-timing)
            _load_provider_later()
    _log_first_use(problem, source, plan, entry.verification, t0, t_problem, t_cache, t_selected)
    return plan


def _load_provider_later() -> None:
    """After a search that asked the provider, and its plan: the ``DefaultProvider`` starts
    loading the policy in the background (``load_in_background``; nothing once it is loaded,
    nor for other providers). Not sooner: until the process's first plan is built, the sandbox
    worker's start, the timing and the plan's conversion and upload have the process and the GPU
    to themselves (on an H100, with the load started after the selection, 1.2 s of a fresh
    process's first product lay outside its proposal and selection, against 0.36 s with the
    lookup named; transformers' import holds the interpreter; started here, 0.47-0.75 s
    against 0.37-0.47 s in three processes)."""
    later = getattr(providers.get_provider(), "load_in_background", None)
    if callable(later):
        later()


def timed_before_hot_rule(entry) -> bool:
    """Whether a cached kernel verdict for a short product (under ``sandbox.GRAPH_BELOW_US``
    flushed) was chosen before ``select.decide`` also compared short products with a hot L2:
    its record has no ``reference_graph_us``. Such an entry is timed again, once, under the
    current rule; longer products are decided alike by both rules."""
    from sparserl_compile.sandbox import GRAPH_BELOW_US

    us = entry.times.get("kernel_us")
    return us is not None and us < GRAPH_BELOW_US and "reference_graph_us" not in entry.verification


def _log_first_use(problem, source: str, plan, record, t0, t_problem, t_cache, t_selected) -> None:
    """Append one plan's time split to the ``first_uses()`` log (times from ``_search``)."""
    now = time.perf_counter()
    record = dict(record or {})
    propose = record.get("propose_s", 0.0)
    row = {"fingerprint": problem.fingerprint, "op": problem.op, "n": problem.n, "dtype": problem.dtype,
           "nnz": problem.nnz, "source": source, "problem_s": t_problem - t0, "cache_s": t_cache - t_problem,
           "propose_s": propose, "select_s": max(t_selected - t_cache - propose, 0.0),
           "plan_s": now - t_selected, "total_s": now - t0, "plan": plan.kind,
           "verification": record or None}
    with _lock:
        _first_uses.append(row)


def _entry_plan(entry, problem, device, key) -> Plan:
    if entry.reference_wins:
        return ReferencePlan(entry.verification.get("why", "the reference wins"))
    return _kernel_plan(problem, device, entry.cubin, entry.header or entry.source, entry.source, key)


class PendingPlan:
    """A structure whose search runs on the background thread (``on_miss="background"``):
    products run the reference until the search is done; the next product after that swaps
    in the verdict (``resolve``), which then goes through the first-use check like any plan."""

    kind = "pending"

    def __init__(self, problem, device, key, future):
        self.problem, self.device, self.key, self.future = problem, device, key, future

    def run(self, op, crow, col, val, x, n_rows, n_cols):
        return reference_product(crow, col, val, x, n_rows, n_cols)

    def resolve(self) -> Plan:
        """The plan of the finished search (a failed search: the reference, logged once)."""
        try:
            return _entry_plan(self.future.result(), self.problem, self.device, self.key)
        except Exception as e:
            _counts["fallbacks"] += 1
            _log_once("background search failed, using the reference", self.problem.fingerprint,
                      f"{type(e).__name__}: {e}")
            return ReferencePlan(f"background search failed: {type(e).__name__}: {e}")

    def __repr__(self) -> str:
        return f"PendingPlan(done={self.future.done()})"


_bg_queue = None


def _background_search(problem, key, store, fp, candidates=None, device=None):
    """Queue ``search_entry`` for ``problem`` on the one background thread; returns a Future.
    The thread is a daemon: a search still running when the process exits is abandoned (its
    sandbox worker is closed at exit) and nothing half-done is cached. The search runs with
    ``device`` current (a thread starts on CUDA device 0), so its sandbox follows the product's GPU."""
    global _bg_queue
    from concurrent.futures import Future

    with _lock:
        if _bg_queue is None:
            import queue

            _bg_queue = queue.Queue()
            threading.Thread(target=_background_worker, args=(_bg_queue,), name="sparserl-search",
                             daemon=True).start()
    fut: Future = Future()
    _counts["background"] += 1
    _bg_queue.put((fut, problem, key, store, fp, candidates, device))
    return fut


def _background_worker(q) -> None:
    while True:
        fut, problem, key, store, fp, candidates, device = q.get()
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            with torch.cuda.device(device) if device is not None and device.type == "cuda" else nullcontext():
                entry = search_entry(problem, key, candidates=candidates)
                _put(store, entry, fp)
        except BaseException as e:  # noqa: BLE001 - handed to the product that resolves it
            fut.set_exception(e)
        else:
            fut.set_result(entry)
        finally:
            if candidates is None:
                _load_provider_later()


def wait_for_searches(timeout: float | None = None) -> bool:
    """Block until every background search queued so far has finished (``on_miss="background"``);
    False if ``timeout`` seconds passed first. Finished verdicts take effect on each structure's
    next product."""
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    with _lock:
        pending = [p.future for p in _table.values() if p.kind == "pending"]
    for f in pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            f.exception(timeout=left)
        except TimeoutError:
            return False
    return True


def _cache_key(problem, device):
    return cache_key(problem, _local_target_memo(device))


def _store():
    if not _config.cache:
        return None
    try:
        from sparserl_compile import cache

        return cache.KernelCache.default()
    except Exception as e:
        _log_once("disk cache unusable, searching without it", "-", f"{type(e).__name__}: {e}")
        return None


def _put(store, entry, fp: str) -> None:
    if store is None or entry.key is None:
        return
    try:
        store.put(entry)
    except Exception as e:
        _log_once("could not write the kernel cache", fp, f"{type(e).__name__}: {e}")


def _forget_cached(plan: "KernelPlan") -> None:
    """Drop the disk entry of a kernel that failed its first-use re-check."""
    store = _store()
    if store is not None and plan.cache_key is not None:
        try:
            store.remove(plan.cache_key)
        except Exception:
            pass


class FirstUseMismatch(RuntimeError):
    """A cached/selected kernel disagreed with the reference on its first call in this process."""


#: first-use tolerance relative to (|A| |x|) row-wise, per value dtype
_FIRST_USE_TOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def first_use_check(y, crow, col, val, x, n_rows, n_cols) -> str | None:
    """Compare a kernel's first output in this process with the reference; None = agrees.

    The bound is row-wise: |y - ref| <= tol * (|A| |x|) + tiny, with tol well above float
    rounding and far below any real error. Non-finite outputs must match the reference's.
    """
    ref = reference_product(crow, col, val, x, n_rows, n_cols).float()
    mag = reference_product(crow, col, val.abs(), x.abs(), n_rows, n_cols).float()
    yf = y.float()
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(yf), fin):
        return "non-finite entries differ from the reference"
    tol = _FIRST_USE_TOL.get(val.dtype, 2e-3)
    bad = (yf - ref).abs()[fin] > (tol * mag[fin] + 1e-30)
    if bool(bad.any()):
        return f"{int(bad.sum())} entries outside the error bound"
    return None


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
    "product", "routed_product", "Routes", "spmv", "spmm", "spmv_t", "spmm_t", "transpose_pattern", "device_arch",
    "width_bucket", "kernels_possible", "PendingPlan", "wait_for_searches", "ON_MISS",
]
