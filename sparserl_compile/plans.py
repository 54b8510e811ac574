"""The plan table and the one door every product goes through: ``product``.

Every sparserl product -- ``ops.py``'s custom ops (traced graphs, autograd), the eager paths of
``tensor.py`` and ``dispatch.py`` -- ends in ``product`` (or ``routed_product``, its shortcut
for a tensor that already knows its plan is the reference). It looks up a plan in an
in-memory table keyed by

    (fingerprint, op, dense width bucket, value dtype, device arch)

* hit: run the plan: a ``KernelPlan`` launches its verified cubin on torch's current stream; a
  ``ReferencePlan`` calls torch.sparse (cuSPARSE on CUDA, torch's CPU CSR kernels on the CPU);
  a ``DensePlan`` (where the selection found the dense product fastest) multiplies by the
  matrix stored dense (``torch.mm``/``torch.mv``: cuBLAS); a ``PendingPlan`` (a background
  search still running) runs the reference;
* miss: CPU tensors, float64 values, empty matrices and ``configure(kernels=False)`` get a
  ``ReferencePlan``; a CUDA product asks the miss path (``miss.verdict``: the disk cache, then
  the provider and the sandboxed selection) and turns its verdict into a plan here.

Guarantees: a failure anywhere in the kernel path -- a missing module, a compile or
verification error, a provider exception, a launch error -- is logged once per structure
(logger ``sparserl_compile.miss``), counted in ``stats().fallbacks``, and the product is
computed by the reference instead. Nothing here raises to the user for a kernel failure and
no unverified kernel is launched (verification is ``select``'s job; this module only launches
what ``select`` or the cache returned). A kernel's first output in a process is checked against
the reference (``reference.first_use_check``); a mismatch drops it and its disk entry.
Asynchronous device faults cannot be caught here; they are what ``verify``/``sandbox`` exist
to rule out before a kernel is ever cached. Inside a CUDA graph capture nothing that reads the
device from the host or copies to it runs: a miss, a finished background search and a
kernel's first-use check wait for the next call outside it, and the reference serves meanwhile.

A ``SparseRLTensor`` goes one step further on its eager path: once its product at a width hits
a reference plan, it keeps that torch CSR tensor (``Routes``) and its next products at that
width call torch directly, without building the plan key; the plan table counts every change
(``_PlanTable.generation``) and a route is used only in the generation it was made in, so
configuring, clearing or any new plan sends every tensor back through the table once.

What it does not do: validate CSR invariants (``tensor.py``/``dispatch.py`` do that once per
tensor), compute fingerprints of user tensors (callers pass them), or compile/verify kernels.

This module is over 600 lines on purpose: the table, its plan kinds and the routes past it
are one door; every shortcut must agree with the table's path, so they are read together.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import fields, replace

import torch

from sparserl_compile import config, contract, miss, providers, reference, transpose
from sparserl_compile.cache import width_bucket  # the plan table buckets widths as the disk cache does
from sparserl_compile.config import RuntimeConfig
from sparserl_compile.memo import ValueMemo, ValueMemos, capturing, lasting
from sparserl_compile.problem import device_arch
from sparserl_compile.reference import HALF, FirstUseMismatch, first_use_check, reference_product

_lock = threading.RLock()


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
    """One sparse tensor's shortcuts past the plan table: dense width (SpMM) or ``SPMV`` ->
    what serves it, the torch CSR tensor to multiply by (a reference plan, float32/64, a
    non-empty matrix), the ``KernelPlan`` (once its first-use check passed) or the
    ``DensePlan``, valid while the plan table's ``generation`` is the one they were made in.
    ``tensor.SparseRLTensor`` keeps one (its ``_routes``); ``product(routes=)`` fills it on a hit
    and ``routed_product`` serves the next such product without building the plan key. Never
    copied (a copy would alias the original's values): ``copy``/``deepcopy`` give an empty one."""

    __slots__ = ("generation", "native")
    MAX = 8  # widths kept per tensor (a model calling one weight at many widths starts again)
    SPMV = -1  # the key of the SpMV route (an SpMM of width 1 has a plan of its own)

    def __init__(self):
        self.generation = -1
        self.native: dict[int, "torch.Tensor | KernelPlan | DensePlan"] = {}

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


_table: _PlanTable = _PlanTable()


def configure(**kw) -> RuntimeConfig:
    """Change the runtime configuration (fields of ``RuntimeConfig``, and ``provider``: a
    provider's name or object, see ``providers.set_provider``); returns the new settings.

    The plan table is cleared so the next call of every structure is planned under them.
    """
    valid = {f.name for f in fields(RuntimeConfig)} | {"provider"}
    unknown = set(kw) - valid
    if unknown:
        raise TypeError(f"configure() got unknown settings {sorted(unknown)}; valid: {sorted(valid)}")
    provider = kw.pop("provider", None)
    new = replace(config.current, **kw)  # validated before anything changes
    if provider is not None:
        providers.set_provider(provider)
    with _lock:
        config.current = new
        _table.clear()
    return new


def reset_stats() -> None:
    """Zero the counters and empty the ``first_uses()`` log."""
    config.reset_counts()
    miss.clear_first_uses()


def clear() -> None:
    """Forget every plan, transposed pattern and memoized reference tensor (the disk cache is
    untouched)."""
    with _lock:
        _table.clear()
        transpose.clear()
        reference.clear()
        miss.clear()


def plans() -> dict[tuple, "Plan"]:
    """A copy of the plan table (key -> plan), for inspection and tests."""
    return dict(_table)


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

    A call on another device than the one the plan was loaded for runs the reference: the plan
    key names the arch, not the device, so two GPUs of one kind share a plan. Every array a
    launch gets is 16-byte aligned, as verification placed them (a kernel may rely on it for
    vector loads): an operand or values view at an odd offset is copied first.
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
        #: where the format arrays live (and the kernel was loaded); None where unknown
        self.device = next((t.device for t in arrays.values() if hasattr(t, "device")), None)
        self._vmemo = ValueMemo()
        #: width -> (value tensor, launcher.BoundKernel): everything but x and y is fixed per
        #: (width, value array), bound once (a model calls one weight at a few widths)
        self._bound: dict[int, tuple] = {}
        self._can_bind = hasattr(kernel, "bind")  # a kernel object without the prepared fast path launches plainly

    BOUND_WIDTHS = 8  # widths kept bound per plan

    def _values(self, val):
        # a kernel reads memory, not strides: CSR-ordered values serve as they are only where
        # they are contiguous and 16-byte aligned (as verification placed them); else the gather copies
        if self._direct and not val.data_ptr() % 16 and val.is_contiguous():
            return val
        out = self._vmemo.get(val)
        if out is None:
            out = self._vmemo.put(val, lasting(val.device, lambda: self.fdata.gather_values(val).contiguous()))  # fresh: aligned
        return out

    def run(self, op, crow, col, val, x, n_rows, n_cols):
        """Launch on ``x`` (contiguous) into a new output; None where this width does not suit
        the kernel's vector loads or ``x`` is on another device (the caller runs the reference)."""
        vector = x.dim() == 1
        n = 1 if vector else x.shape[1]
        ls = self.header.launch
        if n % ls.n_align or (self.device is not None and x.device != self.device):
            return None
        if x.data_ptr() % 16:
            x = x.clone()  # a view at an odd offset: verification placed x 16-byte aligned
        # sizes as separate ints, not a tuple: torch parses a tuple shape more slowly (every product passes here)
        if ls.zero_output:
            y = x.new_zeros(n_rows) if vector else x.new_zeros(n_rows, n)
        else:
            y = x.new_empty(n_rows) if vector else x.new_empty(n_rows, n)
        v = self._values(val)
        if not self._can_bind:
            args = self.fdata.kernel_args(op, n, self.arrays, v, x, y)
            self.kernel.launch(args, ls.grid(self.fdata.scalars, n), ls.block, ls.smem)
            return y
        b = self._bound.get(n)
        if b is None or b[0] is not v:
            fixed = self.fdata.kernel_args(op, n, self.arrays, v, x, y)[:-2]
            b = (v, self.kernel.bind(fixed, grid=ls.grid(self.fdata.scalars, n)))
            if not capturing(v):  # (a binding keeps its values alive: none of a capture's copies)
                if len(self._bound) >= self.BOUND_WIDTHS:
                    self._bound.clear()
                self._bound[n] = b
        b[1](x, y)
        return y

    def __repr__(self) -> str:
        return f"KernelPlan(format={self.header.format}, block={self.header.launch.block})"


def kernel_plan(problem, device, cubin: bytes, header, source: str, key=None) -> KernelPlan:
    """Load a verified cubin as a plan: the format arrays converted and uploaded, the kernel loaded."""
    from sparserl_compile import formats, launcher

    if isinstance(header, str):
        header = contract.parse_header(header)
    fd = formats.convert(problem.indptr, problem.indices, (problem.n_rows, problem.n_cols),
                         header.format, header.params)
    arrays = lasting(device, lambda: formats.to_device(fd, device))
    kernel = launcher.load(cubin, header, device=device.index)
    return KernelPlan(header, kernel, fd, arrays, source, cache_key=key)


class DensePlan:
    """The dense product, where the selection found it faster than the reference and every
    candidate: ``torch.mv``/``torch.mm`` with the matrix stored dense in its value dtype.

    The dense matrix is built from the CSR values on their device on the first product and
    kept, memoized on the identity and version counter of the values tensor (as ``KernelPlan``
    memoizes its value gather): an in-place update of the values builds it again, an unchanged
    weight never. The plan key is the structure, so weights that share a pattern share the plan:
    each keeps its own dense copy, dropped when its values tensor is freed. No dense copy exists
    where this plan was not chosen. ``nbytes``: the device memory the copies take.
    """

    kind = "dense"

    def __init__(self, reason: str = ""):
        self.reason = reason
        self._dense = ValueMemos()  # the dense matrix of each values tensor

    def weight(self, crow, col, val, n_rows: int, n_cols: int) -> torch.Tensor:
        """The matrix of (crow, col, val) stored dense, built once per values tensor and version."""
        w = self._dense.get(val)
        if w is None:
            from sparserl_compile.bench import dense_matrix

            w = self._dense.put(val, lasting(val.device, lambda: dense_matrix(crow, col, (n_rows, n_cols), val)))
        return w

    @property
    def nbytes(self) -> int:
        """Bytes of the dense matrices this plan holds (0 before its first product)."""
        return sum(w.numel() * w.element_size() for w in self._dense.values())

    def run(self, op, crow, col, val, x, n_rows, n_cols):
        w = self.weight(crow, col, val, n_rows, n_cols)
        with torch._C._DisableAutocast():  # the operands' dtype, as every plan (reference.native_mm)
            return torch.mv(w, x) if x.dim() == 1 else torch.mm(w, x)

    def __repr__(self) -> str:
        return f"DensePlan(copies={len(self._dense)}, nbytes={self.nbytes})"


def entry_plan(entry, problem, device, key) -> "Plan":
    """The plan of a cache entry: its kernel, the reference or the dense product, as the entry says."""
    if entry.reference_wins:
        return ReferencePlan(entry.verification.get("why", "the reference wins"))
    if entry.dense_wins:
        return DensePlan(entry.verification.get("why", "the dense product wins"))
    return kernel_plan(problem, device, entry.cubin, entry.header or entry.source, entry.source, key)


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
            return entry_plan(self.future.result(), self.problem, self.device, self.key)
        except Exception as e:
            config.counts["fallbacks"] += 1
            miss.log_once("background search failed, using the reference", self.problem.fingerprint,
                      f"{type(e).__name__}: {e}")
            return ReferencePlan(f"background search failed: {type(e).__name__}: {e}")

    def __repr__(self) -> str:
        return f"PendingPlan(done={self.future.done()})"


Plan = "ReferencePlan | KernelPlan | DensePlan | PendingPlan"


# ------------------------------------------------------------------------- one product


def kernels_possible(device: torch.device) -> bool:
    """Whether generated kernels can run on ``device`` (CUDA only)."""
    return device.type == "cuda"


def product(op: str, crow, col, val, x, n_rows: int, n_cols: int, fp: str,
            routes: Routes | None = None) -> torch.Tensor:
    """``A @ x`` for ``op`` in ("spmv", "spmm"), through the plan table (see module doc).

    ``routes``: the sparse tensor's ``Routes``; on a reference hit the torch CSR tensor is
    stored there, so that tensor's next product at this width skips the table (``routed_product``)."""
    config.counts["calls"] += 1
    if x.numel() == 0:  # an empty dense operand (e.g. a batch of none): zeros, and no plan
        config.counts["reference_calls"] += 1  # for the width bucket it shares with real calls
        return reference_product(crow, col, val, x, n_rows, n_cols)
    n = 1 if x.dim() == 1 else int(x.shape[1])
    key = (fp, op, width_bucket(n), val.dtype, device_arch(x.device))
    generation = _table.generation  # before the lookup: a change after it voids what is stored below
    plan = _table.get(key)
    if plan is None and capturing(x):  # a miss reads the pattern on the host: not inside a capture
        config.counts["misses"] += 1
        config.counts["reference_calls"] += 1
        return reference_product(crow, col, val, x, n_rows, n_cols)
    if plan is None:
        config.counts["misses"] += 1
        with _lock:
            plan = _table.get(key)
            if plan is None:
                plan = _plan_for(op, crow, col, val, x, n_rows, n_cols, fp)
                _table[key] = plan
    else:
        config.counts["hits"] += 1
        if plan.kind == "reference":  # the hot path of a product the runtime does not run a kernel for
            config.counts["reference_calls"] += 1
            if routes is not None and val.dtype not in HALF and n_rows and col.numel():
                native = reference.csr(crow, col, val, n_rows, n_cols)
                routes.store(generation, n if op == "spmm" else Routes.SPMV, native)
                return reference.native_mm(native, x)
            return reference_product(crow, col, val, x, n_rows, n_cols)
    if plan.kind == "pending" and plan.future.done() and not capturing(x):  # (it uploads the format arrays)
        with _lock:
            cur = _table.get(key)
            if cur is plan:  # the first product after the search: swap the verdict in
                cur = _table[key] = plan.resolve()
            if cur is not None:  # (None: the table was cleared meanwhile; this call runs the reference)
                plan = cur
    if plan.kind == "dense":
        return _dense_product(plan, key, generation, routes, op, crow, col, val, x, n_rows, n_cols, fp)
    if plan.kind == "kernel" and (plan.checked or not capturing(x)):  # the check reads results on the host
        try:
            y = plan.run(op, crow, col, val, x, n_rows, n_cols)
            if y is not None and not plan.checked:
                why = first_use_check(y, crow, col, val, x, n_rows, n_cols)
                if why is not None:
                    raise FirstUseMismatch(why)
                plan.checked = True
        except Exception as e:  # a launch failure or a failed re-check: never the user's problem
            config.counts["fallbacks"] += 1
            what = "first-use check failed" if isinstance(e, FirstUseMismatch) else "launch failed"
            miss.log_once(f"kernel {what}, using the reference from now on", fp, repr(e))
            with _lock:
                _table[key] = ReferencePlan(f"{what}: {e!r}")
            if isinstance(e, FirstUseMismatch):
                miss.forget_cached(plan.cache_key)
            y = None
        if y is not None:
            config.counts["kernel_calls"] += 1
            if routes is not None and plan.checked:
                routes.store(generation, n if op == "spmm" else Routes.SPMV, plan)
            return y
    config.counts["reference_calls"] += 1
    return reference_product(crow, col, val, x, n_rows, n_cols)


def _dense_product(plan: DensePlan, key, generation, routes, op, crow, col, val, x, n_rows, n_cols, fp):
    """``product`` under a ``DensePlan``; where the dense matrix cannot be built (out of
    memory, say) the reference serves from then on, logged once, like a failed kernel."""
    try:
        y = plan.run(op, crow, col, val, x, n_rows, n_cols)
    except Exception as e:  # noqa: BLE001 - never the user's problem: the reference computes it
        config.counts["fallbacks"] += 1
        miss.log_once("dense product failed, using the reference from now on", fp, repr(e))
        with _lock:
            _table[key] = ReferencePlan(f"dense product failed: {e!r}")
        config.counts["reference_calls"] += 1
        return reference_product(crow, col, val, x, n_rows, n_cols)
    config.counts["dense_calls"] += 1
    if routes is not None:
        routes.store(generation, x.shape[1] if op == "spmm" else Routes.SPMV, plan)
    return y


def routed_product(routes: Routes, op: str, crow, col, val, x, n_rows: int, n_cols: int, fp: str) -> torch.Tensor:
    """``product`` for a sparse tensor holding ``routes``: where it has a route for this op and
    width (a plan found earlier in this generation of the table: torch's CSR tensor for the
    reference, a checked ``KernelPlan`` or a ``DensePlan``), that at once, counted as the table
    hit it stands for; else ``product``, which stores one on a hit. A routed kernel that cannot
    run this call (a launch error, a width its vector loads do not suit) or a dense plan that
    cannot build its matrix goes back through ``product``, which falls back and logs as always."""
    r = routes.get(Routes.SPMV if op == "spmv" else x.shape[1])
    if r is None:
        return product(op, crow, col, val, x, n_rows, n_cols, fp, routes)
    kind = type(r)
    if kind is KernelPlan or kind is DensePlan:
        try:
            y = r.run(op, crow, col, val, x, n_rows, n_cols)
        except Exception:  # noqa: BLE001 - product() runs it again, falls back and logs why
            y = None
        if y is None:  # a kernel plan's "not this call"
            return product(op, crow, col, val, x, n_rows, n_cols, fp, routes)
        counter = "kernel_calls" if kind is KernelPlan else "dense_calls"
    else:
        if r is _REFERENCE:  # a reference route of ``routed_by_values``: the CSR tensor from reference.csr's memo
            r = reference.csr(crow, col, val, n_rows, n_cols)
        y, counter = reference.native_mm(r, x), "reference_calls"
    counts = config.counts
    counts["calls"] += 1
    counts["hits"] += 1
    counts[counter] += 1
    return y


_dispatch_depth = torch._C._len_torch_dispatch_stack


def reference_route(native: torch.Tensor, x, val):
    """``native @ x`` for a sparse tensor whose route at the width of ``x`` is the reference's
    torch CSR tensor ``native``, before any check of sparserl's own: torch checks the operands
    itself (dtype, device, shape, layout), so the product costs what ``torch.mv``/``torch.mm``
    does. None where torch refuses them (the caller's checked path then raises the error that
    names the problem) and where the product must be seen by something (autograd, a dispatch
    mode, autocast), which the checked path handles. Counted as the table hit it stands for."""
    if x.requires_grad or val.requires_grad or _dispatch_depth() or reference._autocast_on():
        return None
    try:
        y = torch.mv(native, x) if x.dim() == 1 else torch.mm(native, x)
    except (RuntimeError, TypeError):
        return None
    counts = config.counts
    counts["calls"] += 1
    counts["hits"] += 1
    counts["reference_calls"] += 1
    return y


def kernel_route(plan: KernelPlan, op: str, crow, col, val, x, n_rows: int, n_cols: int):
    """``plan.run`` for a sparse tensor whose route at the width of ``x`` is the checked kernel
    ``plan``, counted as the table hit it stands for; the caller has checked ``x`` as the product
    does (a plain contiguous tensor of the values' dtype with ``n_cols`` rows, nothing to record).
    None where the plan cannot run this call (a launch error, a width its vector loads do not
    suit, another device): the caller's full path then runs it again, falls back and logs why."""
    try:
        y = plan.run(op, crow, col, val, x, n_rows, n_cols)
    except Exception:  # noqa: BLE001 - the full path tries again and logs
        return None
    if y is not None:
        counts = config.counts
        counts["calls"] += 1
        counts["hits"] += 1
        counts["kernel_calls"] += 1
    return y


def dense_linear(plan: DensePlan, x, bias, crow, col, val, n_rows: int, n_cols: int):
    """``F.linear(x, W, bias)`` for a sparse weight whose route at the batch of ``x`` is the
    dense ``plan``; None where its dense copy cannot be built (the caller takes the sparse route,
    which falls back and logs). One cuBLAS call on ``x`` as it is, bias fused: the layer the
    user had, without transposing ``x`` into ``W x^T`` and the result back (two copies and an
    addition, each a launch and host time, which at decoding sizes cost more than the product).
    The caller checked ``x`` and ``bias`` (dtype, device, shape) as for the sparse route."""
    try:
        w = plan.weight(crow, col, val, n_rows, n_cols)
    except Exception:  # noqa: BLE001 - the sparse route builds it again, falls back and logs why
        return None
    with torch._C._DisableAutocast():  # the operands' dtype, as every plan
        y = torch.nn.functional.linear(x, w, bias)
    counts = config.counts
    counts["calls"] += 1
    counts["hits"] += 1
    counts["dense_calls"] += 1
    return y


def _plan_for(op, crow, col, val, x, n_rows, n_cols, fp) -> Plan:
    if not kernels_possible(x.device):
        return ReferencePlan(f"{x.device.type} tensors use the reference (kernels are GPU-only)")
    if val.dtype == torch.float64:
        return ReferencePlan("float64 products use the reference")
    if not config.current.kernels:
        return ReferencePlan("kernels disabled (configure(kernels=False))")
    if n_rows == 0 or col.numel() == 0:
        return ReferencePlan("empty matrix")
    v = None
    try:
        v = miss.verdict(op, crow, col, val, x, n_rows, n_cols, fp)
        if v.reason is not None:
            plan = ReferencePlan(v.reason)
        elif v.future is not None:
            plan = PendingPlan(v.problem, x.device, v.key, v.future)
        else:
            plan = entry_plan(v.entry, v.problem, x.device, v.key)
    except Exception as e:  # noqa: BLE001 - the kernel path failed: the reference serves
        config.counts["fallbacks"] += 1
        miss.log_once("kernel path failed, using the reference", fp, f"{type(e).__name__}: {e}")
        return ReferencePlan(f"kernel path failed: {type(e).__name__}: {e}")
    finally:
        if v is not None and v.asked_provider and v.future is None:
            miss.load_provider_later()
    miss.log_first_use(v, plan.kind)
    return plan


def wait_for_searches(timeout: float | None = None) -> bool:
    """Block until every background search queued so far has finished (``on_miss="background"``);
    False if ``timeout`` seconds passed first. Finished verdicts take effect on each structure's
    next product."""
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


# ------------------------------------------------------------------------- entry points


#: what ``_PlanRoutes`` keeps for a reference route: the mark, not the torch CSR tensor
_REFERENCE = object()


class _PlanRoutes(Routes):
    """Routes of ``routed_by_values``. A reference route is kept as ``_REFERENCE``, not as the
    torch CSR tensor over the values, which would keep them alive from a table keyed by them;
    ``routed_product`` takes that tensor from ``reference.csr``'s memo (bounded)."""

    __slots__ = ()

    def store(self, generation: int, n: int, native) -> None:
        super().store(generation, n, _REFERENCE if type(native) is torch.Tensor else native)


#: id(values) -> (weak reference to them, fingerprint, their _PlanRoutes): ``routed_by_values``
_routes_by_values: dict[int, tuple] = {}


def routed_by_values(op: str, crow, col, val, x, n_rows: int, n_cols: int, fp: str) -> torch.Tensor:
    """``routed_product`` for callers that hold no ``Routes`` (the custom ops, which compiled
    graphs and autograd call with a sparse tensor's arrays): the routes of this values tensor
    and fingerprint, dropped with the values tensor. A compiled graph passes the same values
    tensor on every call, so its products skip the plan key as eager ones do."""
    k = id(val)
    e = _routes_by_values.get(k)
    if e is None or e[0]() is not val or e[1] != fp:
        d = _routes_by_values
        ref = weakref.ref(val, lambda r: d.pop(k) if k in d and d[k][0] is r else None)
        e = d[k] = (ref, fp, _PlanRoutes())
    return routed_product(e[2], op, crow, col, val, x, n_rows, n_cols, fp)


def spmv(crow, col, val, x, n_rows: int, n_cols: int, fp: str) -> torch.Tensor:
    """y = A x, x of shape (n_cols,)."""
    return product("spmv", crow, col, val, x, n_rows, n_cols, fp)


def spmm(crow, col, val, x, n_rows: int, n_cols: int, fp: str) -> torch.Tensor:
    """Y = A X, X of shape (n_cols, n), row-major."""
    return product("spmm", crow, col, val, x, n_rows, n_cols, fp)


def spmv_t(crow, col, val, x, n_rows: int, n_cols: int, fp: str) -> torch.Tensor:
    """y = A^T x, x of shape (n_rows,); A is given as its own CSR (n_rows x n_cols). By the
    routes of A^T's values (memoized per values tensor and version: a change of A's values
    makes new ones, with routes of their own)."""
    tp = transpose.transpose_pattern(crow, col, n_rows, n_cols, fp)
    return routed_by_values("spmv", tp.crow, tp.col, tp.values(val), x, n_cols, n_rows, tp.fingerprint)


def spmm_t(crow, col, val, x, n_rows: int, n_cols: int, fp: str) -> torch.Tensor:
    """Y = A^T X, X of shape (n_rows, n); by the routes of A^T's values, as ``spmv_t``."""
    tp = transpose.transpose_pattern(crow, col, n_rows, n_cols, fp)
    return routed_by_values("spmm", tp.crow, tp.col, tp.values(val), x, n_cols, n_rows, tp.fingerprint)
