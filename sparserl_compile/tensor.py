"""``SparseRLTensor``: a sparse matrix torch.compile can trace, and ``sparsify``/``sparsify_``.

A ``SparseRLTensor`` is a traceable wrapper subclass (torchao style): to torch it is a
strided 2-D tensor of the matrix's shape, dtype and device; inside it holds three ordinary
dense tensors, the canonical CSR arrays (``tensor_data_names``: ``crow``, ``col``, ``val``;
int32 indices, always), and as flatten metadata (``tensor_attribute_names``) the storage
shape, the structure fingerprint and a ``transposed`` flag. Because the fingerprint is
metadata, torch.compile guards on it: a new structure recompiles, new values with the same
structure (``with_values``, an in-place update of ``val``) do not.

What it supports:

* products, routed to the ``torch.ops.sparserl`` custom ops (``ops.py``) at the
  ``__torch_function__`` level, so autograd flows to the dense operand: ``A @ x``,
  ``x @ A``, ``torch.mm``/``mv``/``matmul``/``addmm`` (either operand sparse),
  ``F.linear(x, A, b)`` with ``A`` as the weight (``x @ A^T + b``), batched dense operands
  in ``matmul`` (the batch is folded into the dense width);
* ``to_dense()``, ``.to(device/dtype)``/``.cuda()``/``.cpu()``, ``detach``, ``clone``,
  ``nnz``, ``crow_indices()``/``col_indices()`` (copies of the stored CSR indices),
  ``values()`` (a view: in-place updates reach the matrix), ``shape``, ``dtype``, ``device``;
* ``t()``/``.T``/``transpose(0, 1)``: free -- it flips the ``transposed`` flag and shares the
  arrays; products with a transposed tensor run the ``*_t`` ops, whose runtime computes the
  transposed pattern once per structure (memoized) and gives it its own kernel.

Everything else raises ``NotImplementedError`` naming the op (convert with ``to_dense()``).
Products at the aten level (reached only through decompositions) work but carry no autograd.
Sparse values never get a gradient (see ``ops.py``).

``SparseRLTensor.from_csr``, ``sparsify`` and unpickling validate once, on the host, before
any library routine reads the index arrays (``inputs.py``), with errors that say what is wrong
and how to fix it: lengths, ``crow_indices[0] == 0``, ``crow_indices[-1] == nnz``,
non-decreasing ``crow_indices``, indices in range and not negative, index values that do not
fit int32, the shape, value dtypes (float32, float16, bfloat16, float64; float64 always uses
the reference path). Unsorted or duplicate indices are canonicalized: duplicates are summed and
each row sorted (scipy's canonical CSR), so the fingerprint names the pattern, not its storage
order. NaN and inf values are allowed and propagate as in the reference (IEEE). Products never
validate again: their checks are shapes, dtypes and devices.

This module is over 600 lines on purpose: the subclass and every handler of its op table
(products, conversions, the aten ops) are one unit, read together; how a matrix enters
(``inputs.py``) and what runs a product (``plans.py``) live elsewhere.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch
import torch.nn.functional as F

from sparserl_compile import inputs
from sparserl_compile import ops as _ops
from sparserl_compile import plans as _plans
from sparserl_compile.reference import VALUE_DTYPES
from sparserl_compile.structure import fingerprint as _fingerprint

aten = torch.ops.aten


_ATEN_TABLE: dict = {}
_TORCH_FN_TABLE: dict = {}


def implements(*funcs):
    """Register the decorated handler for aten ops (OpOverload) or torch functions."""

    def deco(fn):
        for f in funcs:
            if isinstance(f, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
                _ATEN_TABLE[f] = fn
            else:
                _TORCH_FN_TABLE[f] = fn
        return fn

    return deco


class SparseRLTensor(torch.Tensor):
    """A CSR sparse matrix (int32 indices) that torch.compile traces; products go to sparserl."""

    tensor_data_names = ["crow", "col", "val"]
    tensor_attribute_names = ["n_rows", "n_cols", "fingerprint", "transposed"]

    @staticmethod
    def __new__(cls, crow, col, val, n_rows: int, n_cols: int, fingerprint: str, transposed: bool = False):
        shape = (n_cols, n_rows) if transposed else (n_rows, n_cols)
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=val.dtype, device=val.device, requires_grad=False
        )

    def __init__(self, crow, col, val, n_rows: int, n_cols: int, fingerprint: str, transposed: bool = False):
        self.crow = crow
        self.col = col
        self.val = val
        self.n_rows = n_rows
        self.n_cols = n_cols
        self.fingerprint = fingerprint
        self.transposed = transposed
        self._routes = _plans.Routes()  # eager shortcuts to the reference (plans.Routes)

    # ------------------------------------------------------------------ subclass protocol

    def __tensor_flatten__(self):
        # called on every compiled call (Dynamo's metadata guard, AOTAutograd's unwrap): spelled
        # out, not built from the name lists (tests check that the two agree)
        return ["crow", "col", "val"], (self.n_rows, self.n_cols, self.fingerprint, self.transposed)

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, ctx, outer_size, outer_stride):
        return cls(*(inner_tensors[n] for n in cls.tensor_data_names), *ctx)

    def _stable_hash_for_caching(self) -> str:
        """A deterministic key for torch's AOTAutograd cache (PyTorch's extension point for
        traceable subclasses): what a compiled graph depends on -- the structure fingerprint,
        shape, transpose flag, the inner tensors' dtypes, lengths and device type, and
        requires_grad -- never the values."""
        import hashlib

        parts = (self.fingerprint, self.n_rows, self.n_cols, self.transposed, self.crow.dtype, self.col.dtype,
                 self.val.dtype, self.crow.numel(), self.val.numel(), self.val.device.type, self.val.requires_grad)
        return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=16).hexdigest()

    def __reduce_ex__(self, protocol):
        """Pickled (``torch.save``) as its CSR arrays and rebuilt through ``from_csr``'s checks,
        so a file can never hand a kernel out-of-range indices or a stale fingerprint; the
        rebuild function is registered with ``torch.serialization.add_safe_globals`` when the
        package is imported, so ``torch.load`` (``weights_only=True``, its default) reads
        sparsified state dicts once ``sparserl_compile`` is imported (before that, torch
        refuses the unregistered global ``sparserl_compile.tensor._rebuild``)."""
        return (_rebuild, (self.crow, self.col, self.val, self.n_rows, self.n_cols, self.transposed))

    def _with(self, **changes) -> "SparseRLTensor":
        """A tensor like this one with some inner tensors or attributes replaced."""
        kw = {n: getattr(self, n) for n in self.tensor_data_names + self.tensor_attribute_names}
        kw.update(changes)
        return SparseRLTensor(**kw)

    def _view(self, **changes) -> "SparseRLTensor":
        """``_with`` for a view op (``t``, ``transpose``, ``detach`` ...). Under
        ``torch.inference_mode`` a view of a normal tensor is a normal tensor that torch gives its
        base's version counter; made there, the new wrapper would be an inference tensor, which
        has none to set, so it is made outside inference mode."""
        if torch.is_inference_mode_enabled() and not self.is_inference():
            with torch.inference_mode(False):
                return self._with(**changes)
        return self._with(**changes)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        handler = _TORCH_FN_TABLE.get(func)
        if handler is not None:
            out = kwargs.get("out")
            if out is not None:
                kwargs = {k: v for k, v in kwargs.items() if k != "out"}
            result = handler(func, types, args, kwargs)
            return result if out is None else _into(func, out, result)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = _ATEN_TABLE.get(func)
        if handler is None:
            raise NotImplementedError(
                f"SparseRLTensor does not implement {func}: convert with .to_dense() first, "
                "or use the products sparserl supports (@, mm, mv, matmul, addmm, linear, torch.sparse.mm)"
            )
        return handler(func, types, args, kwargs or {})

    def __matmul__(self, other):
        """``self @ other``: eagerly, straight to the product handler, skipping
        ``Tensor.__matmul__``'s wrapper and the ``__torch_function__`` trip (about 7 us of host
        time per call on the development CPU, a third of an eager product's Python path); at a
        width whose plan is the reference, straight to torch (``plans.reference_route``), and at
        one whose plan is a checked kernel, ``_product``'s checks inline, then the kernel
        (``plans.kernel_route``); anything else, or a kernel that cannot run this call, takes
        ``_product``, which checks, falls back and logs. Under
        ``torch.compile``, or with a torch function mode active (which must see every op), it
        takes the standard route."""
        if (not isinstance(other, torch.Tensor) or torch._C._is_torch_function_mode_enabled()
                or torch.compiler.is_compiling()):
            return super().__matmul__(other)
        if type(other) is torch.Tensor and other.layout is torch.strided:
            d = other.dim()
            if d == 1 or d == 2:  # the common case: straight to the product
                if not self.transposed:
                    r = self._routes.get(_SPMV if d == 1 else other.shape[1])
                    kind = type(r)
                    if kind is torch.Tensor:  # a width whose plan is the reference: torch at once
                        y = _plans.reference_route(r, other, self.val)
                        if y is not None:
                            return y
                    elif kind is _KernelPlan:  # a checked kernel: _product's checks inline, then it
                        val = self.val
                        if (other.dtype is val.dtype and other.shape[0] == self.n_cols and other.device == val.device
                                and other.is_contiguous() and _eager_plain(val, other)):
                            y = _plans.kernel_route(r, "spmv" if d == 1 else "spmm", self.crow, self.col, val,
                                                    other, self.n_rows, self.n_cols)
                            if y is not None:
                                return y
                return _product(self, other, False)
        return _dispatch_pair(torch.matmul, self, other)

    def __repr__(self) -> str:
        return (
            f"SparseRLTensor(shape={tuple(self.shape)}, nnz={self.nnz}, dtype={self.dtype}, "
            f"device={self.device}, fingerprint={self.fingerprint[:12]}..., "
            f"transposed={self.transposed})"
        )

    # ------------------------------------------------------------------ user API

    @classmethod
    def from_csr(cls, crow_indices, col_indices, values, shape, *, device=None) -> "SparseRLTensor":
        """Validate, canonicalize and wrap CSR arrays (torch tensors or numpy arrays)."""
        return _from_csr(crow_indices, col_indices, values, shape, device=device)

    @property
    def nnz(self) -> int:
        """Number of stored nonzeros."""
        return self.col.shape[0]

    def crow_indices(self) -> torch.Tensor:
        """A copy of the stored CSR row pointer (int32, of the untransposed matrix).

        A copy, not a view: every kernel launch and the memoized transposed pattern trust these
        arrays as they were checked when the tensor was built, and torch has no read-only
        tensors (a view's ``.numpy()`` or ``data_ptr()`` writes past any version counter). The
        cost is one allocation of ``n_rows + 1`` ints per call; build a new tensor with
        ``SparseRLTensor.from_csr`` to change the structure."""
        return self.crow.clone()

    def col_indices(self) -> torch.Tensor:
        """A copy of the stored CSR column indices (int32, sorted within rows); a copy for the
        reason ``crow_indices`` gives (``nnz`` ints per call)."""
        return self.col.clone()

    def values(self) -> torch.Tensor:
        """The stored CSR values, as a view: in place updates reach the matrix and keep its
        fingerprint (same structure, e.g. a training step's weights); a view's own ``resize_``
        or ``set_`` leaves the matrix as it is."""
        return self.val.view(self.val.shape)

    def with_values(self, values: torch.Tensor) -> "SparseRLTensor":
        """The same structure (and fingerprint) with new values, e.g. a training step's weights."""
        if not isinstance(values, torch.Tensor) or isinstance(values, SparseRLTensor) or values.layout != torch.strided:
            raise TypeError(f"with_values: values must be a dense tensor, got {type(values).__name__}")
        if values.shape != self.val.shape:
            raise ValueError(
                f"with_values: got {tuple(values.shape)} values for a pattern with nnz={self.nnz}"
            )
        if values.dtype not in VALUE_DTYPES:
            raise TypeError(f"with_values: dtype {values.dtype} unsupported; use one of {VALUE_DTYPES}")
        return self._with(val=values.to(self.val.device).contiguous())


# ------------------------------------------------------------------------ construction


def _check_values(values) -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        try:
            values = torch.as_tensor(np.asarray(values))
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"values must be a tensor or an array of floats: {e}") from None
    if values.layout != torch.strided:
        raise TypeError(f"values must be a dense tensor, got layout {values.layout}")
    values = values.detach()
    if values.dtype not in VALUE_DTYPES:
        raise TypeError(
            f"values dtype {values.dtype} is not supported: sparserl takes float32, float16, "
            "bfloat16 or float64 (float64 uses the reference path); convert with .float()"
        )
    if values.dim() != 1:
        raise ValueError(
            f"values must be 1-D (one per nonzero), got shape {tuple(values.shape)}: batched or "
            "hybrid sparse tensors are not supported"
        )
    if values.device.type == "meta":
        raise ValueError("values are on the meta device: they hold no numbers to multiply")
    return values


def _wrap(p: inputs.Pattern, values: torch.Tensor, device=None) -> SparseRLTensor:
    """A SparseRLTensor of a checked pattern and its stored values (checked, then reordered)."""
    values = p.values(_check_values(values))
    dev = torch.device(device) if device is not None else values.device
    return SparseRLTensor(
        torch.from_numpy(p.indptr).to(dev), torch.from_numpy(p.indices).to(dev),
        values.to(dev).contiguous(), p.n_rows, p.n_cols, _fingerprint(p.indptr, p.indices, p.shape),
    )


def _from_csr(crow, col, values, shape, *, device=None) -> SparseRLTensor:
    values = _check_values(values)
    return _wrap(inputs.csr(crow, col, shape, values.shape[0]), values, device)


def _rebuild(crow, col, val, n_rows: int, n_cols: int, transposed: bool) -> SparseRLTensor:
    """Unpickling (``SparseRLTensor.__reduce_ex__``): validated like any user input."""
    if not isinstance(val, torch.Tensor) or not isinstance(transposed, bool):
        raise TypeError(f"a stored SparseRLTensor is malformed: values of type {type(val).__name__}, "
                        f"transposed of type {type(transposed).__name__}")
    t = _from_csr(crow, col, val, (n_rows, n_cols), device=val.device)
    return t._with(transposed=True) if transposed else t


torch.serialization.add_safe_globals([_rebuild])


def sparsify(a, *, device=None) -> SparseRLTensor:
    """A ``SparseRLTensor`` from a dense 2-D tensor, a torch sparse CSR/CSC/COO/BSR/BSC tensor (any
    index dtype), a ``scipy.sparse`` matrix or array (any format) or a ``cupyx.scipy.sparse``
    matrix.

    Dense tensors keep their exact nonzeros (no threshold). Values are detached (sparse values
    are not trained). ``device`` moves the result (default: where ``a`` lives; CPU for scipy).
    Index arrays are checked before any library routine reads them (``inputs.py``): a
    malformed matrix raises ``ValueError`` naming the broken invariant.
    """
    if isinstance(a, SparseRLTensor):
        return a if device is None else a.to(device)
    if isinstance(a, torch.Tensor) and a.device.type == "meta":
        raise ValueError(f"sparsify: the {tuple(a.shape)} tensor is on the meta device, which holds no values to read "
                         "(a model built under torch.device('meta')): materialize it first, e.g. "
                         "model.to_empty(device='cpu') and load_state_dict(...)")
    if isinstance(a, torch.Tensor) and a.layout == torch.strided:
        if a.dim() != 2:
            raise ValueError(f"sparsify needs a 2-D matrix, got a {a.dim()}-D tensor of shape {tuple(a.shape)}")
        if a.dtype not in VALUE_DTYPES:
            raise TypeError(f"dense dtype {a.dtype} is not supported; convert with .float()")
        a = a.detach().to_sparse_csr()  # from a dense tensor: no index array to distrust
    elif type(a).__module__.startswith("scipy.sparse"):
        dtype = getattr(a, "dtype", None)
        if dtype not in (np.float16, np.float32, np.float64):
            raise TypeError(f"scipy matrix dtype {dtype} is not supported; use .astype(np.float32)")
    elif not isinstance(a, torch.Tensor) and not type(a).__module__.startswith(("cupyx", "cupy")):
        raise TypeError(
            f"sparsify cannot take a {type(a).__module__}.{type(a).__name__}: pass a dense or sparse "
            "torch tensor, a scipy.sparse matrix or a cupyx.scipy.sparse matrix"
        )
    try:
        pattern, values = inputs.read(a)
    except TypeError as e:
        raise TypeError(f"sparsify: {e}") from None
    except ValueError as e:
        raise ValueError(f"sparsify: {e}") from None
    if isinstance(values, np.ndarray):  # the tensor's own copy: never the scipy matrix's data
        values = torch.from_numpy(np.array(values, copy=True))
    elif not isinstance(a, torch.Tensor):  # cupy's data through DLPack: copied likewise
        values = values.clone()
    return _wrap(pattern, values, device)


def sparsify_(module: torch.nn.Module, min_sparsity: float = 0.5) -> torch.nn.Module:
    """Replace, in place, the weight of every ``nn.Linear`` with at least ``min_sparsity`` of
    exact zeros by a ``SparseRLTensor`` parameter (``requires_grad=False``: sparse weights are
    frozen; train biases and dense layers as usual). Returns ``module``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"sparsify_ takes an nn.Module (its nn.Linear weights are replaced), got a "
                        f"{type(module).__name__}; use sparsify() for a single matrix")
    if isinstance(min_sparsity, bool) or not isinstance(min_sparsity, numbers.Real):
        raise TypeError(f"min_sparsity={min_sparsity!r} must be a fraction in [0, 1] (of a weight's exact zeros)")
    if not (0.0 <= float(min_sparsity) <= 1.0):
        raise ValueError(f"min_sparsity={min_sparsity} must be a fraction in [0, 1]")
    for name, sub in module.named_modules():
        if not isinstance(sub, torch.nn.Linear) or isinstance(sub.weight, SparseRLTensor):
            continue
        w = sub.weight.detach()
        if w.device.type == "meta":
            raise ValueError(f"sparsify_: {name or type(sub).__name__}.weight is on the meta device, which holds no "
                             "values to count zeros in: materialize the model first, e.g. "
                             "model.to_empty(device='cpu') and load_state_dict(...)")
        if w.numel() == 0 or w.dtype not in VALUE_DTYPES:
            continue
        zeros = float((w == 0).sum()) / w.numel()
        if zeros >= min_sparsity:
            sub.weight = torch.nn.Parameter(sparsify(w), requires_grad=False)
    return module


# ------------------------------------------------------------------------ products


def _product(A: SparseRLTensor, X: torch.Tensor, transpose: bool) -> torch.Tensor:
    """op(A) @ X with op(A) = A, or A^T when ``transpose`` (on top of A's own flag); X 1/2-D.

    Every eager product passes here, so the checks are ordered and written for a plain
    tensor's fast path (identity tests of types and dtypes, the runtime called directly)."""
    if (type(X) is not torch.Tensor and (not isinstance(X, torch.Tensor) or isinstance(X, SparseRLTensor))
            or X.layout is not torch.strided):
        raise NotImplementedError(
            "sparserl multiplies a SparseRLTensor by a dense strided tensor only; "
            f"got {type(X).__name__} (layout {getattr(X, 'layout', None)}): call .to_dense() on one operand"
        )
    t = A.transposed != transpose
    val = A.val  # a plain tensor: its dtype/device reads skip the subclass's __torch_function__
    if X.dtype is not val.dtype:
        raise ValueError(
            f"dtype mismatch: the sparse matrix is {val.dtype} but the dense operand is {X.dtype}; "
            f"convert one of them (e.g. x.to({val.dtype}))"
        )
    if X.device != val.device:
        raise ValueError(
            f"device mismatch: the sparse matrix is on {val.device} but the dense operand on "
            f"{X.device}; move one with .to(device)"
        )
    k = A.n_rows if t else A.n_cols
    if X.shape[0] != k:
        m = A.n_cols if t else A.n_rows
        raise ValueError(
            f"shape mismatch: sparse ({m} x {k}) @ dense {tuple(X.shape)}: the dense operand "
            f"needs {k} rows"
        )
    if not X.is_contiguous():
        X = X.contiguous()
    if _eager_plain(val, X):  # skip the custom-op machinery (~70 us of host time per call)
        return _ops.run_eager(A.crow, A.col, val, A.n_rows, A.n_cols, A.fingerprint, A._routes, X, t)
    if _ops.eager_grad(val, X):  # autograd to X alone: one autograd.Function, not the custom op's layers
        return _ops.EagerProduct.apply(X, (A.crow, A.col, val, A.n_rows, A.n_cols, A.fingerprint, A._routes), t)
    args = (A.crow, A.col, val, X, A.n_rows, A.n_cols, A.fingerprint)
    if X.dim() == 1:
        return torch.ops.sparserl.spmv_t(*args) if t else torch.ops.sparserl.spmv(*args)
    return torch.ops.sparserl.spmm_t(*args) if t else torch.ops.sparserl.spmm(*args)


_dispatch_depth = torch._C._len_torch_dispatch_stack
_SPMV = _plans.Routes.SPMV
_KernelPlan = _plans.KernelPlan


def _eager_plain(val: torch.Tensor, X: torch.Tensor) -> bool:
    """True in plain eager execution with nothing to record: no dispatch mode (fake, proxy,
    functionalization), plain tensors, no autograd. Then the runtime is called directly; the
    result is the same as through ``torch.ops.sparserl.*``, which tracing and autograd need."""
    return (
        type(X) is torch.Tensor and type(val) is torch.Tensor
        and not _dispatch_depth()
        and not (torch.is_grad_enabled() and (X.requires_grad or val.requires_grad))
    )


def _left(A: SparseRLTensor, B: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """op(A) @ B for a dense B of any rank >= 1 (matmul semantics, batch folded into width)."""
    if B.dim() <= 2:
        return _product(A, B, transpose)
    k, n = B.shape[-2], B.shape[-1]
    batch = B.shape[:-2]
    y = _product(A, B.movedim(-2, 0).reshape(k, math.prod(batch) * n), transpose)
    return y.reshape(y.shape[0], *batch, n).movedim(0, -2)


def _right(B: torch.Tensor, A: SparseRLTensor, transpose: bool = False) -> torch.Tensor:
    """B @ op(A) for a dense B of any rank >= 1: (op(A)^T @ B^T)^T."""
    if B.dim() == 1:
        return _product(A, B, not transpose)
    x = B.reshape(math.prod(B.shape[:-1]), B.shape[-1])
    y = _product(A, x.t(), not transpose)
    return y.t().reshape(*B.shape[:-1], y.shape[0])


def _into(func, out, result: torch.Tensor) -> torch.Tensor:
    """``out=`` of a product: ``result`` written into the caller's tensor, as torch does (an
    empty ``out`` is resized to the result's shape; a non-empty one must have it already)."""
    name = getattr(func, "__name__", func)
    if not isinstance(out, torch.Tensor) or isinstance(out, SparseRLTensor) or out.layout != torch.strided:
        raise TypeError(f"{name}: out= must be a dense tensor, got {type(out).__name__}")
    if out.dtype != result.dtype or out.device != result.device:
        raise TypeError(f"{name}: out= is {out.dtype} on {out.device}, the product is {result.dtype} on "
                        f"{result.device}; pass an out tensor of the product's dtype and device")
    if out.shape != result.shape:
        if out.numel() != 0:
            raise ValueError(f"{name}: out= has shape {tuple(out.shape)}, the product has shape "
                             f"{tuple(result.shape)}; pass an out tensor of that shape (or an empty one)")
        out.resize_(result.shape)
    return out.copy_(result)


def _two(args, kwargs, names):
    vals = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    return vals


def _ndim(t) -> int:
    """``t.dim()`` without a SparseRLTensor's ``__torch_function__`` trip (about a microsecond of
    host time on every product that reads it): its matrices are 2-D."""
    return 2 if isinstance(t, SparseRLTensor) else t.dim()


@implements(torch.mm, torch.Tensor.mm)
def _mm(func, types, args, kwargs):
    a, b = _two(args, kwargs, ("input", "mat2"))
    if _ndim(a) != 2 or _ndim(b) != 2:
        raise ValueError(f"mm needs two 2-D operands, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    return _dispatch_pair(func, a, b)


@implements(torch.sparse.mm)
def _sparse_mm(func, types, args, kwargs):
    """``torch.sparse.mm(A, B)``, and its ``reduce=`` form as torch defines it for a CSR matrix:
    "sum" is the product, "mean" divides each row by its number of stored entries (a row with
    none gives 0)."""
    a, b, *rest = _two(args, kwargs, ("mat1", "mat2", "reduce"))
    reduce = rest[0] if rest else "sum"
    if reduce not in ("sum", "mean"):
        raise NotImplementedError(f"torch.sparse.mm(reduce={reduce!r}): sparserl computes 'sum' and 'mean'; "
                                  "for other reductions convert the matrix with .to_sparse_csr()")
    if _ndim(a) != 2 or _ndim(b) != 2:
        raise ValueError(f"torch.sparse.mm needs two 2-D operands, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    p = _dispatch_pair(func, a, b)
    if reduce == "sum":
        return p
    if not isinstance(a, SparseRLTensor):
        raise NotImplementedError("torch.sparse.mm(reduce='mean') takes the sparse matrix first")
    return p / _row_counts(a).clamp(min=1).to(p.dtype).unsqueeze(1)


@implements(torch.mv, torch.Tensor.mv)
def _mv(func, types, args, kwargs):
    a, v = _two(args, kwargs, ("input", "vec"))
    if not isinstance(a, SparseRLTensor):
        raise NotImplementedError(f"{func.__name__}: needs a SparseRLTensor matrix and a 1-D dense vector")
    if v.dim() != 1:
        raise ValueError(f"mv needs a 1-D vector, got {_describe(v)}")
    return _product(a, v, False)


@implements(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)
def _matmul(func, types, args, kwargs):
    a, b = _two(args, kwargs, ("input", "other"))
    return _dispatch_pair(func, a, b)


@implements(torch.Tensor.__rmatmul__)
def _rmatmul(func, types, args, kwargs):
    a, b = args  # a.__rmatmul__(b) == b @ a
    return _dispatch_pair(func, b, a)


def _dispatch_pair(func, a, b):
    sa, sb = isinstance(a, SparseRLTensor), isinstance(b, SparseRLTensor)
    if sa and sb:
        raise NotImplementedError(
            f"{getattr(func, '__name__', func)}: sparse @ sparse is not supported; convert one "
            "operand with .to_dense()"
        )
    if sa:
        if b.dim() == 0:
            raise ValueError("matmul of a matrix and a 0-D tensor is not defined")
        return _left(a, b)
    if a.dim() == 0:
        raise ValueError("matmul of a 0-D tensor and a matrix is not defined")
    return _right(a, b)


@implements(torch.addmm, torch.Tensor.addmm, torch.sparse.addmm)
def _addmm(func, types, args, kwargs):
    inp, m1, m2 = _two(args, kwargs, ("mat" if func is torch.sparse.addmm else "input", "mat1", "mat2"))
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if isinstance(inp, SparseRLTensor):
        raise NotImplementedError("addmm with a SparseRLTensor as the added input: use .to_dense()")
    if _ndim(m1) != 2 or _ndim(m2) != 2:
        raise ValueError(f"addmm needs 2-D mat1 and mat2, got {tuple(m1.shape)} and {tuple(m2.shape)}")
    p = _dispatch_pair(func, m1, m2)
    inp = _addend("addmm", "input", inp, p)
    if alpha != 1:
        p = p * alpha
    if beta == 0:
        return p
    return p + inp * beta if beta != 1 else p + inp


@implements(F.linear)
def _linear(func, types, args, kwargs):
    x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if not isinstance(w, SparseRLTensor) or isinstance(x, SparseRLTensor):
        raise NotImplementedError("F.linear: sparserl takes a SparseRLTensor weight and a dense input")
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise ValueError(f"linear: the input must be a tensor of at least 1 dimension, got {_describe(x)}")
    k = w.n_rows if w.transposed else w.n_cols  # in-features (attributes: no __torch_function__ trip)
    if x.shape[-1] != k:
        raise ValueError(
            f"linear: input has {x.shape[-1]} features but the sparse weight {tuple(w.shape)} "
            f"expects {k}"
        )
    val = w.val
    if (k and x.dim() >= 2 and not w.transposed and type(x) is torch.Tensor and x.layout == torch.strided
            and x.dtype == val.dtype and x.device == val.device and _eager_plain(val, x)):
        # the eager hot path of a sparsified model (a decoder runs hundreds of these per token):
        # y^T = W x^T straight to the runtime, the checks above being all _right/_product would do.
        # One token (batch-1 decoding): x^T is x as a column and y^T's memory is y's, so two
        # views serve instead of the four transposing ops (each about a microsecond of host);
        # sizes given as ints where the rank says them (a shape built from x's costs more)
        one = x.numel() == k
        r = w._routes.get(1 if one else x.numel() // k)
        if type(r) is _plans.DensePlan and (bias is None or (
                type(bias) is torch.Tensor and bias.dtype is val.dtype and bias.device == val.device
                and bias.shape == (w.n_rows,))):
            y = _plans.dense_linear(r, x, bias, w.crow, w.col, val, w.n_rows, k)
            if y is not None:  # selection kept the dense product at this batch: F.linear as the user had it
                return y
        d = x.dim()
        xt = (x.t() if d == 2 else x.reshape(k, 1)) if one else x.reshape(-1, k).t().contiguous()
        if one and not xt.is_contiguous():  # a strided token (x[:, ::2]): a kernel reads memory, not strides
            xt = xt.contiguous()
        y = _plans.kernel_route(r, "spmm", w.crow, w.col, val, xt, w.n_rows, k) if type(r) is _KernelPlan else None
        if y is None:
            y = _plans.routed_product(w._routes, "spmm", w.crow, w.col, val, xt, w.n_rows, k, w.fingerprint)
        if one:  # x is (1, k) or (1, 1, k) (a decoder's hidden state) or (1, ..., 1, k)
            y = y.reshape(1, w.n_rows) if d == 2 else y.reshape(1, 1, w.n_rows) if d == 3 else y.reshape(*x.shape[:-1], w.n_rows)
        else:
            y = y.t() if d == 2 else y.t().reshape(*x.shape[:-1], w.n_rows)
    else:
        y = _right(x, w, transpose=True)
    return y if bias is None else y + _addend("linear", "bias", bias, y)


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {t.dim()}-D {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
    return f"a {type(t).__name__}"


def _addend(op: str, name: str, t, out: torch.Tensor) -> torch.Tensor:
    """``t`` checked to be added to the product ``out`` as torch's dense op would take it: a
    dense tensor of the product's dtype and device that broadcasts to its shape (not promoted,
    not broadcast past it)."""
    if (type(t) is torch.Tensor and t.dtype is out.dtype and t.layout is torch.strided and out.dim()
            and t.shape == out.shape[-1:] and t.device == out.device):
        return t  # the common case, a bias of the output's width: no broadcast to work out
    if not isinstance(t, torch.Tensor) or isinstance(t, SparseRLTensor) or t.layout != torch.strided:
        raise TypeError(f"{op}: {name} must be a dense tensor, got {_describe(t)}")
    if t.dtype != out.dtype or t.device != out.device:
        raise ValueError(f"{op}: {name} is {t.dtype} on {t.device} but the product is {out.dtype} on {out.device}; "
                         f"convert it with .to({out.dtype})")
    try:
        shape = torch.broadcast_shapes(t.shape, out.shape)
    except RuntimeError:
        shape = None
    if shape != out.shape:
        raise ValueError(f"{op}: {name} of shape {tuple(t.shape)} does not broadcast to the product's shape "
                         f"{tuple(out.shape)}")
    return t


def _row_counts(A: SparseRLTensor) -> torch.Tensor:
    """The stored entries in each row of the matrix ``A`` is (a transposed view's rows are the
    stored columns)."""
    if A.transposed:
        return torch.bincount(A.col.long(), minlength=A.n_cols)
    return A.crow[1:] - A.crow[:-1]


def _row_ids(A: SparseRLTensor) -> torch.Tensor:
    """The (stored, untransposed) row of every nonzero, on the matrix's device."""
    return torch.repeat_interleave(torch.arange(A.n_rows, device=A.crow.device),
                                   (A.crow[1:] - A.crow[:-1]).long(), output_size=A.nnz)


def _dense(A: SparseRLTensor) -> torch.Tensor:
    rows = _row_ids(A)
    out = A.val.new_zeros((A.n_rows, A.n_cols))
    out = out.index_put((rows, A.col.long()), A.val)
    return out.t().contiguous() if A.transposed else out


@implements(torch.Tensor.t, torch.t, torch.Tensor.T.__get__, torch.Tensor.mT.__get__)
def _t_eager(func, types, args, kwargs):
    """``A.t()``, ``torch.t(A)``, ``A.T``, ``A.mT`` in eager code: the transposed view at once,
    without the trip down to the aten handler (``_t``; about 5 us of host time per view, as
    ``A.t() @ x`` pays on every call). Traced, and for anything else, the standard route."""
    a = args[0] if args else None
    if kwargs or len(args) != 1 or type(a) is not SparseRLTensor or torch.compiler.is_compiling():
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    return a._view(transposed=not a.transposed)


@implements(torch._sparse_sum)
def _sparse_sum(func, types, args, kwargs):
    """``torch.sparse.sum(A[, dim][, dtype=])`` (torch's would coalesce a COO tensor first): as
    ``A.sum``, a dense result."""
    a = args[0]
    if not isinstance(a, SparseRLTensor):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    rest = list(args[1:])
    dtype = kwargs.get("dtype", rest.pop() if rest and isinstance(rest[-1], torch.dtype) else None)
    dims = kwargs.get("dim", rest[0] if rest else None)
    return _sums(a, dims, False, dtype)


@implements(torch.Tensor.to_dense)
def _to_dense(func, types, args, kwargs):
    return _dense(args[0])


# a wrapper subclass has no storage of its own: torch's share_memory_/is_shared would read a
# null one (share_memory_ crashed the process), so both act on the three CSR arrays
@implements(torch.Tensor.share_memory_)
def _share_memory_(func, types, args, kwargs):
    a = args[0]
    for t in (a.crow, a.col, a.val):
        t.share_memory_()
    return a


@implements(torch.Tensor.is_shared)
def _is_shared(func, types, args, kwargs):
    a = args[0]
    return all(t.is_shared() for t in (a.crow, a.col, a.val))


# ------------------------------------------------------------------------ aten level


@implements(aten._nnz.default)
def _nnz(func, types, args, kwargs):
    return args[0].nnz


def _csr_arrays(a: SparseRLTensor):
    """(crow, col, values, shape) of the matrix ``a`` is, in copies (the transposed view's are
    A^T's CSR, sorted as sparsify sorts)."""
    if not a.transposed:
        return a.crow.clone(), a.col.clone(), a.val.clone(), (a.n_rows, a.n_cols)
    from sparserl_compile import transpose

    tp = transpose.transpose_pattern(a.crow, a.col, a.n_rows, a.n_cols, a.fingerprint)
    return tp.crow.clone(), tp.col.clone(), tp.values(a.val).clone(), (a.n_cols, a.n_rows)


# (under inference_mode the composite to_sparse* ops reach aten as themselves)
@implements(aten._to_sparse_csr.default, aten._to_sparse.default, aten.to_sparse_csr.default,
            aten.to_sparse.default, aten._to_sparse.sparse_dim, aten.to_sparse.sparse_dim)
def _to_sparse(func, types, args, kwargs):
    """``to_sparse_csr()`` and ``to_sparse()``/``to_sparse_coo()``: torch's own sparse tensor of
    the matrix, in copies (int32 CSR indices; COO takes torch's int64)."""
    a = args[0]
    if func in (aten._to_sparse_csr.default, aten.to_sparse_csr.default):
        layout = torch.sparse_csr
    elif func in (aten._to_sparse.sparse_dim, aten.to_sparse.sparse_dim):
        layout = torch.sparse_coo if args[1] == 2 else None
    else:
        layout = kwargs.get("layout") or torch.sparse_coo
    if layout not in (torch.sparse_csr, torch.sparse_coo) or kwargs.get("blocksize") is not None:
        raise NotImplementedError(f"{func}: a SparseRLTensor becomes a CSR or COO torch tensor only "
                                  f"(asked for {layout}); from CSR, torch converts further")
    crow, col, val, shape = _csr_arrays(a)
    csr = torch.sparse_csr_tensor(crow, col, val, shape)
    return csr if layout == torch.sparse_csr else csr.to_sparse_coo()


@implements(aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar)
def _scale(func, types, args, kwargs):
    """``A * s``, ``s * A`` and ``A / s`` for a real scalar ``s``, or for a column (m x 1) or row
    (1 x n, n) vector that scales rows or columns: the same structure (and its plans) with
    scaled values; as with torch's sparse tensors, the entries not stored stay zero (also where
    ``s`` is infinite or NaN). Other elementwise products (with a full matrix, another sparse
    matrix) and ``s / A`` are refused."""
    a, b = args[0], args[1]
    div = func in (aten.div.Tensor, aten.div.Scalar)
    m, other = (a, b) if isinstance(a, SparseRLTensor) else (b, a)
    s = None if kwargs or (div and m is not a) else _factor(m, other)
    if s is None:
        raise NotImplementedError(
            f"SparseRLTensor supports {'/' if div else '*'} by a real scalar, a row vector (1 x n or n) or "
            "a column vector (m x 1) only, which keep the zeros; for other elementwise operations change "
            "the values: A.with_values(f(A.values())), or use .to_dense()")
    return m._with(val=m.val / s if div else m.val * s)


def _factor(a: SparseRLTensor, v):
    """What scales the values of the matrix ``a`` for ``a * v``, or None where ``v`` is not a
    real scalar or line of factors: a Python int or float; a 0-D real tensor without grad on the
    CPU or on the values' device (as torch passes ``A * 2``: it keeps the values' dtype and is
    never read on the host); or a column (m x 1) or row (1 x n, or n) of such factors on the
    values' device, which gives the factor of each stored entry in the values' dtype (a row and
    column scaling such as D^-1/2 A D^-1/2 keeps the structure)."""
    if not isinstance(v, torch.Tensor):
        return None if isinstance(v, bool) or not isinstance(v, (int, float)) else v
    if (isinstance(v, SparseRLTensor) or v.layout != torch.strided or v.requires_grad or v.dtype.is_complex
            or v.dtype == torch.bool):
        return None
    if v.dim() == 0:
        return v if v.device.type == "cpu" or v.device == a.val.device else None
    if v.device != a.val.device:
        return None
    rows, cols = (a.n_cols, a.n_rows) if a.transposed else (a.n_rows, a.n_cols)
    if v.dim() == 2 and tuple(v.shape) == (rows, 1):
        along_rows = True
    elif (v.dim() == 2 and tuple(v.shape) == (1, cols)) or (v.dim() == 1 and v.shape[0] == cols):
        along_rows = False
    else:
        return None
    index, _ = _line_index(a, along_rows)
    return v.reshape(-1).to(a.val.dtype)[index]


@implements(aten.neg.default)
def _neg(func, types, args, kwargs):
    return args[0]._with(val=-args[0].val)


@implements(aten.abs.default)
def _abs(func, types, args, kwargs):
    return args[0]._with(val=args[0].val.abs())


@implements(aten.pow.Tensor_Scalar)
def _pow(func, types, args, kwargs):
    """``A ** p`` entrywise for a real ``p > 0`` (0 ** p is 0: the structure stays)."""
    a, p = args
    if isinstance(p, bool) or not isinstance(p, (int, float)) or p <= 0:
        raise NotImplementedError(f"SparseRLTensor ** {p!r}: only a real power > 0 keeps the zeros; "
                                  "use .to_dense() first")
    return a._with(val=a.val.pow(p))


def _line_index(a: SparseRLTensor, rows: bool) -> tuple[torch.Tensor, int]:
    """(the row, or with ``rows`` False the column, of every stored entry in the matrix ``a``
    is, how many rows or columns it has): of a transposed view, the stored columns or rows."""
    if rows != a.transposed:
        return _row_ids(a), a.n_rows
    return a.col.long(), a.n_cols


def _line_sums(a: SparseRLTensor, dim: int) -> torch.Tensor:
    """The sums along ``dim`` of the matrix ``a`` is: dim 1 gives one per row, dim 0 one per column."""
    index, n = _line_index(a, dim == 1)
    return a.val.new_zeros(n).index_add_(0, index, a.val)


def _sums(a: SparseRLTensor, dims, keepdim: bool, dtype) -> torch.Tensor:
    """Sums of the matrix ``a`` over ``dims`` (None or empty: all), a dense tensor."""
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        dims = [0, 1]
    dims = sorted({d % 2 for d in ([dims] if isinstance(dims, int) else dims)})
    if dims == [0, 1]:
        out = a.val.sum()
        if keepdim:
            out = out.reshape(1, 1)
    else:
        out = _line_sums(a, dims[0])
        if keepdim:
            out = out.unsqueeze(dims[0])
    return out if dtype is None else out.to(dtype)


@implements(aten.sum.default, aten.sum.dim_IntList)
def _sum(func, types, args, kwargs):
    """``A.sum()`` and ``A.sum(dim, keepdim=...)``: sums over the stored entries (a node's
    degree is ``A.sum(1)``)."""
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return _sums(args[0], dims, keepdim, kwargs.get("dtype"))


@implements(aten.is_pinned.default)
def _is_pinned(func, types, args, kwargs):
    a = args[0]
    return all(t.is_pinned() for t in (a.crow, a.col, a.val))


@implements(aten._pin_memory.default, aten.pin_memory.default)  # (the second: under inference_mode)
def _pin_memory(func, types, args, kwargs):
    a = args[0]
    return a._with(crow=a.crow.pin_memory(), col=a.col.pin_memory(), val=a.val.pin_memory())


@implements(aten.detach.default)
def _detach(func, types, args, kwargs):
    a = args[0]
    return a._view(crow=a.crow.detach(), col=a.col.detach(), val=a.val.detach())


@implements(aten.clone.default)
def _clone(func, types, args, kwargs):
    a = args[0]
    return a._with(crow=a.crow.clone(), col=a.col.clone(), val=a.val.clone())


@implements(aten._to_copy.default)
def _to_copy(func, types, args, kwargs):
    a = args[0]
    return _converted(a, kwargs.get("dtype") or a.dtype, kwargs.get("device") or a.device)


def _converted(a: SparseRLTensor, dtype, device) -> SparseRLTensor:
    if dtype not in VALUE_DTYPES:
        raise TypeError(f"SparseRLTensor values cannot be {dtype}; use one of {VALUE_DTYPES}")
    return a._with(crow=a.crow.to(device), col=a.col.to(device), val=a.val.to(device=device, dtype=dtype))


# .to(...), .half(), .cpu(), .cuda() and type_as reach aten as themselves under inference_mode
# or on a matrix made there (elsewhere they decompose to _to_copy first): the same conversion,
# and, as torch's own .to, the matrix itself where nothing changes and no copy is asked for
@implements(aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.to.other, aten.type_as.default)
def _to(func, types, args, kwargs):
    a = args[0]
    p = {}  # the schema's arguments by name, defaults filled in
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            p[arg.name] = args[i]
        else:
            p[arg.name] = kwargs.get(arg.name, arg.default_value if arg.has_default_value() else None)
    other = p.get("other")
    if p.get("layout") not in (None, torch.strided):
        raise NotImplementedError(f"{func}: a SparseRLTensor cannot become {p['layout']}; use .to_dense() first, "
                                  "or build a torch sparse tensor from crow_indices(), col_indices() and values()")
    dtype = other.dtype if other is not None else p.get("dtype") or a.dtype
    device = torch.device(other.device if other is not None else p.get("device") or a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype == a.dtype and device == a.device and not p.get("copy"):
        return a
    return _converted(a, dtype, device)


# .T, .mT, .mH and adjoint() reach aten as themselves under inference_mode (outside it they
# decompose to transpose first); for a real 2-D matrix each is the transpose
# nn.Module._apply (model.half(), .to(...)) asks this of a parameter and its converted copy; it
# reaches aten under inference_mode. Outside, torch answers it from the tensors' dispatch keys:
# a SparseRLTensor presents as a strided tensor, compatible with another strided one
@implements(aten._has_compatible_shallow_copy_type.default)
def _has_compatible_shallow_copy_type(func, types, args, kwargs):
    return all(t.layout == torch.strided for t in args[:2])


@implements(aten.t.default, aten.numpy_T.default, aten.mT.default, aten.mH.default, aten.adjoint.default)
def _t(func, types, args, kwargs):
    return args[0]._view(transposed=not args[0].transposed)


@implements(aten.transpose.int)
def _transpose(func, types, args, kwargs):
    a, d0, d1 = args
    if {d0 % 2, d1 % 2} == {0, 1}:
        return a._view(transposed=not a.transposed)
    if d0 % 2 == d1 % 2:
        return a._view()  # a view op must return a new tensor, not its input
    raise NotImplementedError(f"transpose({d0}, {d1}) of a 2-D SparseRLTensor")


@implements(aten.permute.default)
def _permute(func, types, args, kwargs):
    a, dims = args
    dims = [d % 2 for d in dims]
    if dims == [1, 0]:
        return a._view(transposed=not a.transposed)
    if dims == [0, 1]:
        return a._view()
    raise NotImplementedError(f"permute({dims}) of a 2-D SparseRLTensor")


@implements(aten.copy_.default)
def _copy_(func, types, args, kwargs):
    """``dst.copy_(src)``, what ``load_state_dict`` does: into a SparseRLTensor, the values of a
    SparseRLTensor of the same structure, or of a dense matrix whose nonzeros all lie in the
    pattern (a pruned model's dense checkpoint); into a dense tensor, the sparse matrix."""
    dst, src = args[0], args[1]
    if not isinstance(dst, SparseRLTensor):
        with torch._C.DisableTorchFunctionSubclass():
            return dst.copy_(_dense(src))
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"copy_: a {tuple(src.shape)} matrix into a {tuple(dst.shape)} SparseRLTensor")
    if isinstance(src, SparseRLTensor):
        if (src.fingerprint, src.transposed) != (dst.fingerprint, dst.transposed):
            raise ValueError("copy_: the source has another sparsity structure than this SparseRLTensor; "
                             "a SparseRLTensor's structure is fixed: sparsify the source instead")
        dst.val.copy_(src.val.to(dst.val.device))
        return dst
    dense = src.detach().to(device=dst.val.device)
    if dst.transposed:
        dense = dense.t()  # the stored (untransposed) matrix
    kept = dense[_row_ids(dst), dst.col.long()]
    outside = int(torch.count_nonzero(dense)) - int(torch.count_nonzero(kept))
    if outside:
        raise ValueError(f"copy_: the dense source has {outside} nonzeros outside this SparseRLTensor's pattern "
                         f"({dst.nnz} stored entries); load the weights before sparsify_ (or sparsify the "
                         "loaded matrix) to change the pattern")
    dst.val.copy_(kept)
    return dst


@implements(aten.mm.default)
def _aten_mm(func, types, args, kwargs):
    return _dispatch_pair(func, args[0], args[1])


@implements(aten.mv.default)
def _aten_mv(func, types, args, kwargs):
    return _product(args[0], args[1], False)


@implements(aten.addmm.default)
def _aten_addmm(func, types, args, kwargs):
    return _addmm(func, types, args, kwargs)


__all__ = ["SparseRLTensor", "sparsify", "sparsify_", "implements"]
