"""Route eager products of NATIVE torch sparse tensors to sparserl: ``enable``/``accelerate``.

With ``enable()`` (or inside ``with accelerate():``) a ``TorchFunctionMode`` looks at every
``torch.mm``, ``torch.mv``, ``torch.addmm``, ``torch.matmul``, ``@`` and ``torch.sparse.mm``
call. When the left operand is a 2-D torch sparse CSR or coalesced COO matrix (any index dtype)
and the right one a dense strided 1-D/2-D tensor of the same dtype (float32, float16, bfloat16,
float64) and device, the product runs through ``torch.ops.sparserl.spmv``/``spmm`` (so the
runtime's kernels and autograd w.r.t. the dense operand apply); when there is nothing to record
(grad not needed, no dispatch mode, plain tensors) it calls the runtime directly, as
``SparseRLTensor`` products do, skipping the custom op's per-call layers. Everything else is
passed to torch unchanged, so errors and results there are torch's own:

* sparse @ sparse, dense @ sparse, batched or hybrid sparse tensors, CSC/BSR layouts,
  uncoalesced COO (call ``.coalesce()`` once to accelerate it), ``out=`` arguments;
* mismatched dtypes/devices/shapes (torch raises its usual error);
* sparse operands whose values require grad (torch differentiates them; sparserl does not);
* CSR tensors whose columns are not sorted and unique within rows.

Results follow torch's shape and dtype semantics (``addmm``: ``beta * input + alpha * A @ B``
with ``input`` broadcast, ``input`` ignored when ``beta == 0``).

Fingerprints of native tensors are memoized by (index data pointers, version counters, shape,
nnz): a repeated product reads no index data. The memo holds a reference to the index tensors
it keys on (so a freed pointer cannot be reused by a different pattern while the entry lives)
and keeps the ``MEMO_SIZE`` most recent structures; ``clear_memo()`` drops them. The int32
copies of int64 indices live in the same entry.

The mode is per thread and adds a Python call to every torch function in its scope; enable it
around sparse work, not globally in a dense-heavy program. Dynamo cannot trace native sparse
tensors at all (see ``backend.py``); under ``torch.compile`` use ``sparsify``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from sparserl_compile import plans, structure
from sparserl_compile.reference import VALUE_DTYPES
from sparserl_compile.tensor import _eager_plain, _is_canonical, check_csr_arrays

#: native structures whose fingerprint and int32 indices are kept
MEMO_SIZE = 32



@dataclass
class _Native:
    keep: tuple  # the index tensors the key's data pointers belong to
    crow: torch.Tensor | None  # int32; None: not canonical, pass through
    col: torch.Tensor | None
    fingerprint: str


@dataclass
class MemoStats:
    hits: int = 0
    misses: int = 0  # each one read the indices and computed a fingerprint


_memo: "OrderedDict[tuple, _Native]" = OrderedDict()
memo_stats = MemoStats()


def clear_memo() -> None:
    """Forget every memoized native structure (release its index tensors), zero ``memo_stats``."""
    _memo.clear()
    memo_stats.hits = memo_stats.misses = 0


def _native_csr(a: torch.Tensor):
    """(int32 crow, int32 col, values, fingerprint) of a native sparse matrix, or None."""
    if a.layout == torch.sparse_csr:
        if a.dim() != 2 or a.values().dim() != 1:
            return None
        idx = (a.crow_indices(), a.col_indices())
        vals = a.values()
    elif a.layout == torch.sparse_coo:
        if a.sparse_dim() != 2 or a.dense_dim() != 0 or not a.is_coalesced():
            return None
        idx = (a._indices(),)
        vals = a._values()
    else:
        return None
    key = (a.layout, a.device, tuple(a.shape), vals.shape[0],
           tuple(t.data_ptr() for t in idx), tuple(t._version for t in idx))
    hit = _memo.get(key)
    if hit is not None:
        memo_stats.hits += 1
        _memo.move_to_end(key)
    else:
        memo_stats.misses += 1
        hit = _build(a, idx, vals.shape[0])
        _memo[key] = hit
        while len(_memo) > MEMO_SIZE:
            _memo.popitem(last=False)
    if hit.crow is None:
        return None
    return hit.crow, hit.col, vals, hit.fingerprint


def _build(a: torch.Tensor, idx: tuple, nnz: int) -> _Native:
    n_rows, n_cols = a.shape
    if a.layout == torch.sparse_csr:
        ip = idx[0].cpu().numpy().astype(np.int64, copy=False)
        ix = idx[1].cpu().numpy().astype(np.int64, copy=False)
    else:
        ind = idx[0].cpu().numpy()
        if ind.shape[1] > 1 and bool((ind[0, 1:] < ind[0, :-1]).any()):
            # flagged coalesced (torch.sparse_coo_tensor(..., is_coalesced=True)) but not row-sorted:
            # counting rows would pair columns with the wrong rows; torch's own product is right
            return _Native(idx, None, None, "")
        ip = np.zeros(n_rows + 1, dtype=np.int64)
        np.cumsum(np.bincount(ind[0], minlength=n_rows), out=ip[1:])
        ix = ind[1].astype(np.int64, copy=False)
    check_csr_arrays(ip, ix, nnz, (n_rows, n_cols))
    if not _is_canonical(ip, ix):
        return _Native(idx, None, None, "")
    ip32, ix32 = ip.astype(np.int32), ix.astype(np.int32)
    fp = structure.fingerprint(ip32, ix32, (n_rows, n_cols))
    if a.layout == torch.sparse_csr and idx[0].dtype == torch.int32:
        crow, col = idx[0], idx[1]
    else:
        crow = torch.from_numpy(ip32).to(a.device)
        col = torch.from_numpy(ix32).to(a.device)
    return _Native(idx, crow, col, fp)


def _is_native_sparse(t) -> bool:
    return isinstance(t, torch.Tensor) and t.layout in (torch.sparse_csr, torch.sparse_coo)


def _dense_ok(s: torch.Tensor, d, ndims: tuple[int, ...]) -> bool:
    return (
        isinstance(d, torch.Tensor) and d.layout == torch.strided and type(d) is torch.Tensor
        and d.dim() in ndims and d.dtype == s.dtype and d.device == s.device
        and s.dtype in VALUE_DTYPES and s.dim() == 2 and d.shape[0] == s.shape[1]
        and not (s.requires_grad and torch.is_grad_enabled())
    )


def _run(s: torch.Tensor, d: torch.Tensor):
    """sparserl's product of a native sparse ``s`` and dense ``d``, or None to pass through."""
    got = _native_csr(s)
    if got is None:
        return None
    crow, col, vals, fp = got
    n_rows, n_cols = s.shape
    d = d.contiguous()
    vals = vals.detach()
    if _eager_plain(vals, d):  # nothing to record: call the runtime, not the custom op's layers
        fn = plans.spmv if d.dim() == 1 else plans.spmm
    else:
        fn = torch.ops.sparserl.spmv if d.dim() == 1 else torch.ops.sparserl.spmm
    return fn(crow, col, vals, d, n_rows, n_cols, fp)


def _route(func, args, kwargs):
    if "out" in kwargs:
        return None
    if func in _MM:
        if len(args) != 2 or kwargs:
            return None
        a, b = args
        nd = (1, 2) if func in _MATMUL else (1,) if func in _MV else (2,)
        if _is_native_sparse(a) and _dense_ok(a, b, nd):
            return _run(a, b)
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
    p = _run(m1, m2)
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


class SparseRLMode(TorchFunctionMode):
    """Routes eligible native sparse products to sparserl (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HANDLED:
            out = _route(func, args, kwargs)
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
