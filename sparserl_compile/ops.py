"""The custom ops ``torch.ops.sparserl.*``: how traced graphs and autograd reach a product.

Four ops, each ``(crow_indices, col_indices, values, dense, n_rows: int, n_cols: int,
fingerprint: str) -> Tensor`` where the first three are A's int32 CSR arrays (A is
``n_rows x n_cols``):

* ``sparserl::spmv``   y = A x       x: (n_cols,)      -> (n_rows,)
* ``sparserl::spmm``   Y = A X       X: (n_cols, n)    -> (n_rows, n)
* ``sparserl::spmv_t`` y = A^T x     x: (n_rows,)      -> (n_cols,)
* ``sparserl::spmm_t`` Y = A^T X     X: (n_rows, n)    -> (n_cols, n)

They are opaque to Dynamo and Inductor (``torch.library.custom_op``): a compiled graph calls
them like any extern kernel, and the fingerprint travels as a constant string argument, so the
fake (meta) kernels below use shapes only and never read index data. The real kernels call
``plans.product`` (plan table -> generated kernel or torch.sparse reference), the one door of
every product, through the routes of their values tensor (``plans.routed_by_values``: a
compiled graph passes the same values on every call). Plain eager products with nothing to
record (no autograd, no tracing, no dispatch mode) call the runtime directly from
``tensor.py``/``dispatch.py`` and skip these ops' Python layers, with the same result; eager
products whose dense operand requires grad (nothing tracing) record
``EagerProduct``, an ``autograd.Function``, instead of these ops' autograd layers.

Autograd: the gradient w.r.t. the dense operand is the product with the transposed matrix
(spmm <-> spmm_t, spmv <-> spmv_t), so higher derivatives work too. The sparse *values* get
no gradient: asking for one (values with ``requires_grad=True`` while grad mode is on) raises
a ``RuntimeError`` at the product that says so. Index arrays are never differentiable.

Each op has a graph twin ``sparserl::<op>_graph`` (same schema, kernel and checks, fake
kernel; ``GRAPH_TWINS`` maps one to the other) registered with only a kernel: no autograd
layer, no output alias checks. The ``"sparserl"`` compile backend puts the twins into the
graphs AOTAutograd has already differentiated, where those layers are pure per-call host
cost; called directly, a twin does not differentiate (use the ops).

``backend.py`` goes one step further: Inductor lowers each twin to a direct call of its Python
function (``GRAPH_CALLS``), past the dispatcher's round trip into Python, which costs as much
host time as the product's own path.

Operands are checked (dtype, device, shape) in both the real and the fake kernel with
messages that name the operand and the fix. The dense operand must be contiguous here;
``tensor.py`` and ``dispatch.py`` make it so before calling.
"""

from __future__ import annotations

import torch

from sparserl_compile import plans
from sparserl_compile.reference import VALUE_DTYPES



def _check(name: str, crow, col, val, dense, n_rows: int, n_cols: int, transposed: bool, vector: bool):
    k = n_rows if transposed else n_cols
    torch._check(crow.dtype == torch.int32 and col.dtype == torch.int32,
                 lambda: f"sparserl::{name}: crow_indices/col_indices must be int32, got "
                         f"{crow.dtype}/{col.dtype}; build the operand with sparserl_compile.sparsify")
    torch._check(val.dtype in VALUE_DTYPES,
                 lambda: f"sparserl::{name}: values dtype {val.dtype} is not supported; use float32, "
                         "float16, bfloat16 or float64")
    torch._check(dense.dtype == val.dtype,
                 lambda: f"sparserl::{name}: the dense operand is {dense.dtype} but the sparse values "
                         f"are {val.dtype}; convert one of them (e.g. x.to({val.dtype}))")
    torch._check(dense.device == val.device and crow.device == val.device and col.device == val.device,
                 lambda: f"sparserl::{name}: operands on different devices (values on {val.device}, "
                         f"dense on {dense.device}); move them with .to(device)")
    torch._check(crow.dim() == 1 and col.dim() == 1 and val.dim() == 1,
                 lambda: f"sparserl::{name}: CSR arrays must be 1-D")
    torch._check(crow.shape[0] == n_rows + 1,
                 lambda: f"sparserl::{name}: crow_indices has {crow.shape[0]} entries, expected "
                         f"n_rows + 1 = {n_rows + 1}")
    torch._check(col.shape[0] == val.shape[0],
                 lambda: f"sparserl::{name}: {col.shape[0]} column indices but {val.shape[0]} values")
    want = 1 if vector else 2
    torch._check(dense.dim() == want,
                 lambda: f"sparserl::{name}: the dense operand must be {want}-D, got shape "
                         f"{tuple(dense.shape)}")
    torch._check(dense.shape[0] == k,
                 lambda: f"sparserl::{name}: dense operand has {dense.shape[0]} rows but the "
                         f"{'transposed ' if transposed else ''}sparse matrix has {k} columns")


def _fast_ok(crow, col, val, dense, n_rows: int, n_cols: int, transposed: bool, vector: bool) -> bool:
    """All of ``_check`` in one expression (the eager hot path); ``_check`` names a failure."""
    return (
        crow.dtype == torch.int32 and col.dtype == torch.int32 and val.dtype in VALUE_DTYPES
        and dense.dtype == val.dtype and dense.device == val.device == crow.device == col.device
        and crow.dim() == 1 and col.dim() == 1 and val.dim() == 1 and crow.shape[0] == n_rows + 1
        and col.shape[0] == val.shape[0] and dense.dim() == (1 if vector else 2)
        and dense.shape[0] == (n_rows if transposed else n_cols)
    )


def _out_shape(dense, n_rows, n_cols, transposed, vector):
    m = n_cols if transposed else n_rows
    return (m,) if vector else (m, dense.shape[1])


def _graph_call(fn, transposed: bool, vector: bool):
    """The product a compiled graph calls in place of a graph twin, without the dispatcher's
    round trip into Python (``backend.py`` lowers each twin to a call of it) and without
    operand checks: the fake kernel checked them when the graph was traced, Dynamo's guards
    hold the inputs' dtypes and devices to what it saw, the graph asserts their sizes, and the
    lowering makes ``dense`` contiguous."""
    if not transposed:
        op = "spmv" if vector else "spmm"

        def call(crow_indices, col_indices, values, dense, n_rows, n_cols, fingerprint):
            return plans.routed_by_values(op, crow_indices, col_indices, values, dense, n_rows, n_cols, fingerprint)

        return call
    return fn


def _kernel(name: str, fn, transposed: bool, vector: bool):
    """The real kernel of ``name`` (shared by the op and its graph twin): check, then run the
    product a compiled graph calls (``_graph_call``); a product of A itself goes by the routes of
    its values tensor (``plans.routed_by_values``)."""
    call = _graph_call(fn, transposed, vector)

    def kernel(crow_indices, col_indices, values, dense, n_rows, n_cols, fingerprint):
        if not _fast_ok(crow_indices, col_indices, values, dense, n_rows, n_cols, transposed, vector):
            _check(name, crow_indices, col_indices, values, dense, n_rows, n_cols, transposed, vector)
        return call(crow_indices, col_indices, values, dense.contiguous(), n_rows, n_cols, fingerprint)

    return kernel


def _fake(name: str, transposed: bool, vector: bool):
    def fake(crow_indices, col_indices, values, dense, n_rows, n_cols, fingerprint):
        _check(name, crow_indices, col_indices, values, dense, n_rows, n_cols, transposed, vector)
        return dense.new_empty(_out_shape(dense, n_rows, n_cols, transposed, vector))

    return fake


def _define(name: str, fn, transposed: bool, vector: bool):
    kernel = _kernel(name, fn, transposed, vector)

    @torch.library.custom_op(f"sparserl::{name}", mutates_args=())
    def op(crow_indices: torch.Tensor, col_indices: torch.Tensor, values: torch.Tensor,
           dense: torch.Tensor, n_rows: int, n_cols: int, fingerprint: str) -> torch.Tensor:
        return kernel(crow_indices, col_indices, values, dense, n_rows, n_cols, fingerprint)

    op.register_fake(_fake(name, transposed, vector))
    op.__doc__ = fn.__doc__
    return op


def run_eager(crow, col, val, n_rows: int, n_cols: int, fp: str, routes, x, t: bool):
    """op(A) @ x by the runtime itself, past these ops' layers (an eager product with nothing to
    record, and ``EagerProduct``'s two directions): A's CSR arrays, its fingerprint and its
    ``plans.Routes``; op(A) = A^T where ``t``; x checked and contiguous."""
    mv = x.dim() == 1
    if t:
        return (plans.spmv_t if mv else plans.spmm_t)(crow, col, val, x, n_rows, n_cols, fp)
    return plans.routed_product(routes, "spmv" if mv else "spmm", crow, col, val, x, n_rows, n_cols, fp)


class EagerProduct(torch.autograd.Function):
    """op(A) @ x differentiated w.r.t. x in plain eager autograd: ``apply(x, csr, t)`` with
    ``csr`` the tuple of ``run_eager``'s leading arguments (a tuple: autograd treats it as data). Forward the product,
    backward op(A)^T @ g, recorded again where a double backward needs it. The custom ops record
    the same through ``torch.library``'s Python layers, which cost several times the product's
    own host time; they still serve tracing, dispatch modes and functorch (``eager_grad``)."""

    @staticmethod
    def forward(ctx, x, csr, t):
        ctx.csr, ctx.t = csr, t
        return run_eager(*csr, x, t)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        if torch.is_grad_enabled() and g.requires_grad:  # create_graph: the adjoint is recorded too
            return EagerProduct.apply(g, ctx.csr, not ctx.t), None, None
        return run_eager(*ctx.csr, g, not ctx.t), None, None


_dispatch_depth = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active


def eager_grad(val, x) -> bool:
    """Whether ``EagerProduct`` may record a product: plain tensors, no dispatch mode (fake,
    proxy, functionalization), no functorch transform, and values without grad (for those the
    ops raise the error asking for their gradient deserves)."""
    return (
        type(x) is torch.Tensor and type(val) is torch.Tensor and not val.requires_grad
        and not _dispatch_depth() and not _functorch_active()
    )


#: the graph twins' library (the ``*_graph`` ops below)
_graph_lib = torch.library.Library("sparserl", "FRAGMENT")


def _define_graph_twin(name: str, fn, transposed: bool, vector: bool):
    """``sparserl::<name>_graph``: the same product as ``sparserl::<name>`` with only the
    kernel registered (no autograd layer, no output-alias checks), for graphs that
    AOTAutograd has already differentiated; ``backend.py`` puts it into compiled graphs."""
    qual = f"{name}_graph"
    _graph_lib.define(
        f"{qual}(Tensor crow_indices, Tensor col_indices, Tensor values, Tensor dense, "
        "SymInt n_rows, SymInt n_cols, str fingerprint) -> Tensor",
        tags=(torch.Tag.pt2_compliant_tag,),
    )
    _graph_lib.impl(qual, _kernel(qual, fn, transposed, vector), "CompositeExplicitAutograd")
    torch.library.register_fake(f"sparserl::{qual}", _fake(qual, transposed, vector), lib=_graph_lib)
    return getattr(torch.ops.sparserl, qual)


#: (name, runtime function, transposed, vector) of every op
_OPS = (("spmv", plans.spmv, False, True), ("spmm", plans.spmm, False, False),
        ("spmv_t", plans.spmv_t, True, True), ("spmm_t", plans.spmm_t, True, False))

spmv, spmm, spmv_t, spmm_t = (_define(name, fn, t, v) for name, fn, t, v in _OPS)

#: each op's overload -> its graph twin's (what ``backend.py`` swaps in after AOTAutograd)
GRAPH_TWINS = {
    getattr(torch.ops.sparserl, name).default: _define_graph_twin(name, fn, t, v).default
    for name, fn, t, v in _OPS
}


#: each graph twin's overload -> (the name Inductor's code calls it by, the function, transposed,
#: vector): what ``backend.py`` lowers it to
GRAPH_CALLS = {
    GRAPH_TWINS[getattr(torch.ops.sparserl, name).default]: (f"sparserl_{name}", _graph_call(fn, t, v), t, v)
    for name, fn, t, v in _OPS
}

#: each op -> the op that computes its gradient w.r.t. the dense operand
_ADJOINT = {"spmv": spmv_t, "spmm": spmm_t, "spmv_t": spmv, "spmm_t": spmm}


def _register_autograd(name: str, op) -> None:
    adjoint = _ADJOINT[name]

    def setup_context(ctx, inputs, output):
        crow, col, val, dense, n_rows, n_cols, fp = inputs
        if val.requires_grad:
            raise RuntimeError(
                f"sparserl::{name}: the sparse values require grad, but sparserl does not "
                "differentiate w.r.t. sparse values (only w.r.t. the dense operand). Detach them "
                "(SparseRLTensor.detach(), or build the tensor from values.detach()), or keep "
                "the weight dense while training it"
            )
        ctx.save_for_backward(crow, col, val)
        ctx.dims = (n_rows, n_cols, fp)

    def backward(ctx, grad):
        crow, col, val = ctx.saved_tensors
        n_rows, n_cols, fp = ctx.dims
        gd = None
        if ctx.needs_input_grad[3]:
            gd = adjoint(crow, col, val, grad.contiguous(), n_rows, n_cols, fp)
        return None, None, None, gd, None, None, None

    op.register_autograd(backward, setup_context=setup_context)


for _name, _op in (("spmv", spmv), ("spmm", spmm), ("spmv_t", spmv_t), ("spmm_t", spmm_t)):
    _register_autograd(_name, _op)

__all__ = ["spmv", "spmm", "spmv_t", "spmm_t"]
