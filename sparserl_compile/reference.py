"""The reference product (torch.sparse: cuSPARSE on CUDA, torch's CSR kernels on the CPU) and
the first-use check that holds a kernel's first output in a process against it.

``reference_product`` is the path of every product the runtime runs no kernel for, so it is
kept short (a few hundred nanoseconds of Python over torch's own ``mv``/``mm``). It keeps the
torch CSR tensors of the last ``CSR_MEMO_SIZE`` (crow, col, val) triples it was given (by
object identity; the CSR tensor aliases them, so in-place value updates are seen), which saves
rebuilding one per call and keeps those arrays alive until ``clear()``. Products in
float16/bfloat16 where torch has no half CSR kernel (the CPU) accumulate in float32 and round
once.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from sparserl_compile.bench import csr_tensor
from sparserl_compile.memo import capturing

_native_ok: dict[tuple, bool] = {}
#: the value dtypes a sparse operand may have: the kernels' float32, float16 and bfloat16, and
#: float64, which always runs on the reference
VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
HALF = (torch.float16, torch.bfloat16)


def reference_product(crow, col, val, x, n_rows: int, n_cols: int) -> torch.Tensor:
    """``A @ x`` by torch.sparse (cuSPARSE on CUDA), x 1-D (SpMV) or 2-D (SpMM), int32 CSR.

    The path of every product the runtime does not run a kernel for, so it is kept short (a
    few hundred nanoseconds of Python over torch's own ``mv``/``mm``): float32 and float64 go
    straight to torch; half types first learn once per device type whether torch has a
    native kernel for them (else they accumulate in float32)."""
    if n_rows == 0 or x.numel() == 0 or col.numel() == 0:
        return x.new_zeros((n_rows,) if x.dim() == 1 else (n_rows, x.shape[1]))
    if val.dtype not in HALF:
        return native_mm(csr(crow, col, val, n_rows, n_cols), x)
    key = (x.device.type, val.dtype, x.dim() == 1)
    ok = _native_ok.get(key)
    if ok is not False:
        try:
            y = native_mm(csr(crow, col, val, n_rows, n_cols), x)
        except (RuntimeError, NotImplementedError):
            _native_ok[key] = False  # no half kernel here: accumulate in float32 from now on
        else:
            if ok is None:
                _native_ok[key] = True
            return y
    y = native_mm(_new_csr(crow, col, val.float(), n_rows, n_cols), x.float())
    return y.to(val.dtype)


_mode_on = torch._C._is_torch_function_mode_enabled
_autocast_on = torch._C._is_any_autocast_enabled


def native_mm(a_csr, x):
    """``a_csr @ x`` by torch (``torch.mv``/``torch.mm``), out of reach of torch function
    modes: a product of sparserl's own must not be seen (and routed a second time) by
    ``dispatch.enable()``'s mode when the runtime is called directly from Python, as the eager
    fast paths do. Nor of ``torch.autocast``: a sparserl product runs in its operands' dtype
    whichever plan serves it (a kernel is never cast), and torch's CPU CSR product has no
    half-precision kernel for autocast to cast to."""
    if _mode_on() or _autocast_on():
        with torch._C.DisableTorchFunction(), torch._C._DisableAutocast():
            return torch.mv(a_csr, x) if x.dim() == 1 else torch.mm(a_csr, x)
    return torch.mv(a_csr, x) if x.dim() == 1 else torch.mm(a_csr, x)


#: the last torch CSR tensors built, keyed by the identity of their member tensors: a torch
#: CSR tensor aliases crow/col/val (no copy), so in-place value updates stay visible
_csr_memo: "OrderedDict[tuple, tuple]" = OrderedDict()
CSR_MEMO_SIZE = 16


def csr(crow, col, val, n_rows, n_cols):
    key = (id(crow), id(col), id(val))
    hit = _csr_memo.get(key)
    if hit is not None and hit[0]() is crow and hit[1]() is col and hit[2]() is val:
        return hit[3]
    t = _new_csr(crow, col, val, n_rows, n_cols)
    if capturing(val):  # a capture's operands may be a CUDA graph tree's copies: keep none alive
        return t
    _csr_memo[key] = (weakref.ref(crow), weakref.ref(col), weakref.ref(val), t)
    while len(_csr_memo) > CSR_MEMO_SIZE:
        _csr_memo.popitem(last=False)
    return t


def _new_csr(crow, col, val, n_rows, n_cols):
    return csr_tensor(torch, crow, col, val, (n_rows, n_cols))


def clear() -> None:
    """Drop the memoized torch CSR tensors."""
    _csr_memo.clear()


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
