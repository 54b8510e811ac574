"""Route eager products of NATIVE torch sparse tensors to sparserl: ``enable``/``accelerate``.

With ``enable()`` (or inside ``with accelerate():``) a ``TorchFunctionMode`` looks at every
``torch.mm``, ``torch.mv``, ``torch.addmm``, ``torch.matmul``, ``@`` and ``torch.sparse.mm``
call (``torch.sparse.mm(A, B, reduce)`` with "sum" or "mean" too, on the CPU: PyG's call). Every native CSR, COO or CSC operand of such a call has its raw index arrays checked
first (``inputs.py``, once per structure): a malformed one (an index out of range or negative,
a pointer array that is not monotone, lengths that disagree) raises ``ValueError`` naming the
problem, before torch or sparserl reads it. When the left operand is a 2-D torch sparse CSR or
COO matrix stored in canonical order (rows, then columns, sorted; no duplicates; any index
dtype) and the right one a dense strided 1-D/2-D tensor of the same dtype (float32, float16,
bfloat16, float64) and device, the product runs through ``torch.ops.sparserl.spmv``/``spmm``
(so the runtime's kernels and autograd w.r.t. the dense operand apply); when there is nothing
to record (grad not needed, no dispatch mode, plain tensors) it calls the runtime directly, as
``SparseRLTensor`` products do, skipping the custom op's per-call layers. Everything else is
passed to torch unchanged, so errors and results there are torch's own:

* sparse @ sparse, dense @ sparse, batched or hybrid sparse tensors, CSC/BSR layouts,
  COO or CSR stored out of order or with duplicates (``.coalesce()`` once to accelerate a
  COO tensor), ``out=`` arguments;
* mismatched dtypes/devices/shapes (torch raises its usual error);
* sparse operands whose values require grad (torch differentiates them; sparserl does not).

Results follow torch's shape and dtype semantics (``addmm``: ``beta * input + alpha * A @ B``
with ``input`` broadcast, ``input`` ignored when ``beta == 0``).

Fingerprints of native tensors are memoized by (index data pointers, version counters, shape,
nnz): a repeated product reads no index data. An in-place change through torch bumps a
version counter, so the tensor is checked again; a write that bypasses it (through
``.numpy()`` or a raw pointer) is not seen, as torch's own sparse kernels would not see it.
The memo holds a reference to the index tensors it keys on (so a freed pointer cannot be
reused by a different pattern while the entry lives) and keeps the ``MEMO_SIZE`` most recent
structures; ``clear_memo()`` drops them. The int32 copies of int64 indices live in the same
entry, and so does one detached alias of the values: ``values()`` makes a new tensor object per
call, and what the runtime derives from values (a plan's value gather, a dense plan's copy, the
reference's CSR tensor) is memoized on the values tensor's identity and version counter. The
alias is reused while it points at the same memory (it keeps that memory alive, so no other
tensor can be there) and shares the version counter of the tensor's values, so an in-place
update is seen. A native CSR tensor met again (the same Python object, the same C++ tensor, the
same version: torch gives a sparse tensor's members one version counter, so an in-place change
of any of them, or a resize, bumps it; ``torch.utils.swap_tensors`` changes the C++ tensor) is
found by its identity, without the three accessor aliases and the key above (``_seen``).

The mode is per thread and adds a Python call to every torch function in its scope; enable it
around sparse work, not globally in a dense-heavy program. Dynamo cannot trace native sparse
tensors at all (see ``backend.py``); under ``torch.compile`` use ``sparsify``.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from sparserl_compile import inputs, plans, structure
from sparserl_compile.memo import lasting, version_counter
from sparserl_compile.ops import EagerProduct, eager_grad, run_eager
from sparserl_compile.reference import VALUE_DTYPES
from sparserl_compile.tensor import _eager_plain

#: native structures whose fingerprint and int32 indices are kept
MEMO_SIZE = 32



@dataclass
class _Native:
    keep: tuple  # the index tensors the key's data pointers belong to
    crow: torch.Tensor | None  # int32; None: not canonical, pass through
    col: torch.Tensor | None
    fingerprint: str
    #: (the detached alias of the values last seen, the Routes of this structure with them):
    #: one tuple, read once per call, so a thread never pairs its values with another's routes
    values_routes: tuple | None = None


@dataclass
class MemoStats:
    hits: int = 0
    misses: int = 0  # each one read the indices and computed a fingerprint


_memo: "OrderedDict[tuple, _Native]" = OrderedDict()
#: id(native CSR tensor) -> (the tensor, its C++ tensor, its version, what ``_native_csr``
#: gave for it): the module doc's identity memo, the ``MEMO_SIZE`` most recent tensors
_seen: dict[int, tuple] = {}
#: the memo is shared by every thread's mode: one thread's eviction must not land between
#: another's lookup and its move_to_end (an OrderedDict raises KeyError there)
_memo_lock = threading.Lock()
memo_stats = MemoStats()


def clear_memo() -> None:
    """Forget every memoized native structure (release its index tensors), zero ``memo_stats``."""
    with _memo_lock:
        _memo.clear()
        _seen.clear()
        memo_stats.hits = memo_stats.misses = 0


def _native_csr(a: torch.Tensor, count: bool = False):
    """(int32 crow, int32 col, values, fingerprint, routes) of a native sparse matrix, or None to pass it
    through to torch. A malformed one raises ``ValueError`` (checked once per structure).
    ``count``: this lookup counts in ``memo_stats`` (the operand check does, once per operand
    and call; the product's second lookup does not)."""
    if a.layout == torch.sparse_csr and not a.is_inference():  # (an inference tensor has no version counter)
        seen = _seen.get(id(a))
        if seen is not None and seen[0] is a and seen[1] == a._cdata and seen[2] == a._version:
            if count:
                with _memo_lock:
                    memo_stats.hits += 1
            return seen[3]
        got = _native_csr_keyed(a, count)
        _remember(a, got)
        return got
    return _native_csr_keyed(a, count)


def _remember(a: torch.Tensor, got) -> None:
    """Keep what ``_native_csr`` gave for the CSR tensor ``a`` by its identity (module doc). The
    entry holds ``a`` itself, not a weak reference, which ``torch.utils.swap_tensors`` would
    refuse to swap; the key memo holds its index tensors and, where routed, a values alias
    anyway, so at most ``MEMO_SIZE`` tensors are kept past their use, as before."""
    d = _seen
    d.pop(id(a), None)  # (re-inserted last: the oldest entry goes first)
    d[id(a)] = (a, a._cdata, a._version, got)
    while len(d) > MEMO_SIZE:
        try:
            d.pop(next(iter(d)))
        except (StopIteration, KeyError, RuntimeError):  # another thread changed it meanwhile
            break


def _native_csr_keyed(a: torch.Tensor, count: bool):
    """``_native_csr`` by the memo key of index pointers and versions."""
    if a.layout == torch.sparse_csr:
        vals = a.values()  # each accessor makes a new alias (most of this function's time): one call each
        if a.dim() != 2 or vals.dim() != 1:
            return None
        idx = (a.crow_indices(), a.col_indices())
    elif a.layout == torch.sparse_coo:
        if a.sparse_dim() != 2 or a.dense_dim() != 0:
            return None
        idx = (a._indices(),)
        vals = a._values()
    elif a.layout == torch.sparse_csc:
        vals = a.values()
        if a.dim() != 2 or vals.dim() != 1:
            return None
        idx = (a.ccol_indices(), a.row_indices())
    else:
        return None
    i0 = idx[0]  # (no generator expressions: this runs on every product)
    if len(idx) == 1:
        ptrs, vers = i0.data_ptr(), version_counter(i0)
    else:
        i1 = idx[1]
        ptrs, vers = (i0.data_ptr(), i1.data_ptr()), (version_counter(i0), version_counter(i1))
    key = (a.layout, a.device, tuple(a.shape), vals.shape[0], ptrs, vers)
    with _memo_lock:
        hit = _memo.get(key)
        if hit is not None:
            memo_stats.hits += count
            _memo.move_to_end(key)
    if hit is None:
        hit = _build(a, idx, vals.shape[0])
        with _memo_lock:
            memo_stats.misses += count
            _memo[key] = hit
            while len(_memo) > MEMO_SIZE:
                _memo.popitem(last=False)
    if hit.crow is None:
        return None
    vr = hit.values_routes
    # the key holds the device and nnz; one address can still be viewed as another dtype
    if vr is None or vr[0].data_ptr() != vals.data_ptr() or vr[0].dtype != vals.dtype:
        # new values: a reference route (a torch CSR tensor over the old values) must not serve them
        vr = hit.values_routes = (vals.detach(), plans.Routes())
    return hit.crow, hit.col, vr[0], hit.fingerprint, vr[1]


def _build(a: torch.Tensor, idx: tuple, nnz: int) -> _Native:
    """Check a native operand's raw index arrays (``inputs``: before torch reads them) and keep
    its canonical pattern, or mark it to pass through: CSC, uncoalesced or unsorted COO, CSR
    with unsorted or duplicate columns (torch's own product handles those, now that they are
    known to be in range)."""
    try:
        if a.layout == torch.sparse_csr:
            p = inputs.csr(idx[0], idx[1], tuple(a.shape), nnz)
        elif a.layout == torch.sparse_coo:
            p = inputs.coo(idx[0][0], idx[0][1], tuple(a.shape), nnz)
        else:
            p = inputs.csc(idx[0], idx[1], tuple(a.shape), nnz)
    except (ValueError, TypeError) as e:
        raise ValueError(f"a malformed {a.layout} operand of shape {tuple(a.shape)}: {e}") from None
    if a.layout == torch.sparse_csc or p.reorder is not None:
        return _Native(idx, None, None, "")
    fp = structure.fingerprint(p.indptr, p.indices, p.shape)
    if a.layout == torch.sparse_csr and idx[0].dtype == torch.int32 and idx[1].dtype == torch.int32:
        crow, col = idx[0], idx[1]  # already canonical int32: no copy (the key's version counters guard it)
    else:
        crow, col = lasting(a.device, lambda: [torch.from_numpy(t).to(a.device) for t in (p.indptr, p.indices)])
    return _Native(idx, crow, col, fp)


def _is_native_sparse(t) -> bool:
    return isinstance(t, torch.Tensor) and t.layout in (torch.sparse_csr, torch.sparse_coo)


def _check_operands(args) -> dict:
    """Every native CSR/COO/CSC operand of a handled call, checked (memoized) before torch or
    sparserl reads its indices; a malformed one raises ``ValueError``. Returns what
    ``_native_csr`` gave for each, by ``id``, so the product does not look it up again."""
    found = {}
    for t in args:
        if isinstance(t, torch.Tensor) and t.layout in _CHECKED:
            found[id(t)] = _native_csr(t, count=True)
    return found


def _dense_ok(s: torch.Tensor, d, ndims: tuple[int, ...]) -> bool:
    return (
        isinstance(d, torch.Tensor) and d.layout == torch.strided and type(d) is torch.Tensor
        and d.dim() in ndims and d.dtype == s.dtype and d.device == s.device
        and s.dtype in VALUE_DTYPES and s.dim() == 2 and d.shape[0] == s.shape[1]
        and not (s.requires_grad and torch.is_grad_enabled())
    )


def _run(s: torch.Tensor, d: torch.Tensor, natives: dict):
    """sparserl's product of a native sparse ``s`` and dense ``d``, or None to pass through."""
    got = natives[id(s)] if id(s) in natives else _native_csr(s)
    if got is None:
        return None
    crow, col, vals, fp, routes = got
    r = routes.get(plans.Routes.SPMV if d.dim() == 1 else d.shape[1])
    if type(r) is torch.Tensor:  # the reference serves this width: torch at once (it checks d itself)
        y = plans.reference_route(r, d, vals)
        if y is not None:
            return y
    n_rows, n_cols = s.shape
    d = d.contiguous()
    if _eager_plain(vals, d):  # nothing to record: the runtime, by this structure's routes
        return run_eager(crow, col, vals, n_rows, n_cols, fp, routes, d, False)
    if eager_grad(vals, d):  # autograd to d alone: one autograd.Function, not the custom op's layers
        return EagerProduct.apply(d, (crow, col, vals, n_rows, n_cols, fp, routes), False)
    fn = torch.ops.sparserl.spmv if d.dim() == 1 else torch.ops.sparserl.spmm
    return fn(crow, col, vals, d, n_rows, n_cols, fp)


def _route_reduce(args, kwargs, natives: dict):
    """``torch.sparse.mm(A, B, reduce)`` with reduce "sum" (the product) or "mean" (the product
    over each row's stored entries), on the CPU where torch implements it: PyG's CPU path for a
    CSR ``adj_t`` (``torch_geometric.utils.spmm``; on CUDA PyG calls the two-argument form)."""
    if len(args) + len(kwargs) != 3 or len(args) < 2:
        return None
    a, b = args[:2]
    reduce = args[2] if len(args) == 3 else kwargs.get("reduce")
    if reduce not in ("sum", "mean") or not (_is_native_sparse(a) and a.layout == torch.sparse_csr
                                            and a.device.type == "cpu" and _dense_ok(a, b, (2,))):
        return None
    p = _run(a, b, natives)
    if p is None or reduce == "sum":
        return p
    crow = a.crow_indices()
    return p / (crow[1:] - crow[:-1]).clamp(min=1).to(p.dtype).unsqueeze(1)


def _route(func, args, kwargs, natives: dict):
    if "out" in kwargs:
        return None
    if func is torch.sparse.mm and (len(args) == 3 or "reduce" in kwargs):
        return _route_reduce(args, kwargs, natives)
    if func in _MM:
        if len(args) != 2 or kwargs:
            return None
        a, b = args
        nd = (1, 2) if func in _MATMUL else (1,) if func in _MV else (2,)
        if _is_native_sparse(a) and _dense_ok(a, b, nd):
            return _run(a, b, natives)
        return None
    # addmm(input, mat1, mat2, *, beta=1, alpha=1)
    if len(args) != 3 or set(kwargs) - {"beta", "alpha"}:
        return None
    inp, m1, m2 = args
    if not (_is_native_sparse(m1) and _dense_ok(m1, m2, (2,))):
        return None
    if not (isinstance(inp, torch.Tensor) and inp.layout == torch.strided and inp.dtype == m1.dtype
            and inp.device == m1.device):
        return None
    out_shape = (m1.shape[0], m2.shape[1])
    try:
        torch.broadcast_shapes(inp.shape, out_shape)
    except RuntimeError:
        return None
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    p = _run(m1, m2, natives)
    if p is None:
        return None
    if alpha != 1:
        p = p * alpha
    if beta == 0:
        return p.expand(out_shape) if p.shape != out_shape else p
    return p + (inp if beta == 1 else inp * beta)


_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
_MV = {torch.mv, torch.Tensor.mv}
_MM = {torch.mm, torch.Tensor.mm, torch.sparse.mm} | _MATMUL | _MV
_ADDMM = {torch.addmm, torch.Tensor.addmm}
_HANDLED = _MM | _ADDMM
_CHECKED = (torch.sparse_csr, torch.sparse_coo, torch.sparse_csc)


class SparseRLMode(TorchFunctionMode):
    """Routes eligible native sparse products to sparserl (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HANDLED:
            natives = _check_operands((*args, *kwargs.values()))
            out = _route(func, args, kwargs, natives)
            if out is not None:
                return out
        return func(*args, **kwargs)


_global: SparseRLMode | None = None


def enable() -> None:
    """Route native sparse products to sparserl in this thread until ``disable()``."""
    global _global
    if _global is None:
        mode = SparseRLMode()
        mode.__enter__()
        _global = mode


def disable() -> None:
    """Undo ``enable()`` (no-op if it is not active)."""
    global _global
    if _global is None:
        return
    from torch.overrides import _get_current_function_mode_stack

    stack = _get_current_function_mode_stack()
    if not stack or stack[-1] is not _global:
        raise RuntimeError(
            "sparserl.disable(): another torch function mode was entered after enable() and is "
            "still active; exit it first (modes nest like a stack)"
        )
    _global.__exit__(None, None, None)
    _global = None


def is_enabled() -> bool:
    return _global is not None


@contextlib.contextmanager
def accelerate():
    """``with accelerate():`` routes native sparse products to sparserl inside the block."""
    with SparseRLMode():
        yield


__all__ = ["enable", "disable", "is_enabled", "accelerate", "SparseRLMode", "clear_memo", "memo_stats", "MEMO_SIZE"]
