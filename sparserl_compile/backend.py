"""The ``torch.compile`` backend ``"sparserl"``.

``torch.compile(model, backend="sparserl")`` finds this function by name through the
``torch_dynamo_backends`` entry point in ``pyproject.toml`` (no import of sparserl needed; it
is not also registered by decorator, which would be a duplicate). The graph Dynamo hands over
already contains the sparserl custom ops: Dynamo traces ``SparseRLTensor.__torch_function__``
(inputs, parameters and buffers alike) into calls of ``torch.ops.sparserl.spmv/spmm/...``,
which are opaque to Inductor. The backend passes the graph to Inductor (``compile_fx``), which
compiles everything dense around them (Triton on the GPU, C++ on the CPU) and calls the
sparserl ops as extern kernels. ``mode=`` and ``options=`` given to ``torch.compile`` are
turned into Inductor config patches exactly as the ``inductor`` backend does.

After AOTAutograd has differentiated the graph, an Inductor post-grad pass (``GraphTwinPass``,
chained after any ``post_grad_custom_post_pass`` of the user's) swaps each sparserl op for its
graph twin ``sparserl::<op>_graph`` (``ops.py``): the same kernel and operand checks, without
the ``torch.library.custom_op`` layers (a Python autograd kernel that redispatches, then output
alias checks) that cost about 45 us of host time per product per call on a 2-core CPU.
Inductor then lowers each twin to a direct call of its Python function
(``lower_graph_twins_to_calls``), past the dispatcher's round trip into a Python kernel: a
product in a compiled graph costs the host what an eager one does. The pass's uuid hashes this
file, ``ops.py`` and ``tensor.py`` (and says whether the direct calls are in place), so
Inductor's and AOTAutograd's caches never hand back a graph compiled without them, or under
another version of them.

The structure fingerprint is flatten metadata of ``SparseRLTensor``, so Dynamo guards on it:
a new structure recompiles; new values with the same structure do not. The runtime's plan
table is keyed by the same fingerprint, so a compiled graph launches its kernels with no
lookup beyond one dict hit per product.

NATIVE torch sparse tensors (``torch.sparse_csr``/``sparse_coo``) cannot be traced by Dynamo:
it graph-breaks or skips the frame (PyTorch issues 169119, 171865, 180839), and with
``fullgraph=True`` compilation fails. This backend does not change that. Convert them with
``sparserl_compile.sparsify`` (or ``sparsify_`` for a model's linear layers) before compiling,
or accelerate native tensors in eager code with ``sparserl_compile.enable()``.
"""

from __future__ import annotations

from typing import Any


def sparserl_backend(gm, example_inputs, **kwargs: Any):
    """``(GraphModule, example inputs, mode=None, options=None) -> compiled callable``."""
    import torch
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    import sparserl_compile.ops  # noqa: F401  (the graph calls torch.ops.sparserl.*)

    mode = kwargs.pop("mode", None)
    options = kwargs.pop("options", None) or {}
    dynamic = kwargs.pop("dynamic", None)
    if kwargs:
        raise TypeError(
            f"sparserl backend got unknown arguments {sorted(kwargs)}; it takes mode= and options= "
            "(as torch.compile passes them)"
        )
    if not isinstance(options, dict):
        raise TypeError(f"options must be a dict of Inductor settings, got {type(options).__name__}")
    patches = dict(list_mode_options(mode, dynamic)) if mode not in (None, "default") else {}
    patches.update(options)
    from torch._inductor import config as inductor_config

    lower_graph_twins_to_calls()
    theirs = patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
    patches["post_grad_custom_post_pass"] = GraphTwinPass(theirs)
    del torch
    return compile_fx(gm, example_inputs, config_patches=patches)


def lower_to_graph_twins(graph) -> int:
    """Replace, in place, every ``torch.ops.sparserl.{spmv,spmm,spmv_t,spmm_t}.default`` call
    of an already differentiated FX graph (or GraphModule) with its twin
    ``sparserl::<op>_graph`` (``ops.GRAPH_TWINS``): the same kernel, checks and result, without
    the custom-op layers (a Python autograd kernel that redispatches, then output alias checks)
    that cost tens of microseconds of host time per product in every compiled call. Returns the
    number of calls replaced."""
    from sparserl_compile.ops import GRAPH_TWINS

    graph = getattr(graph, "graph", graph)
    n = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target in GRAPH_TWINS:
            node.target = GRAPH_TWINS[node.target]
            n += 1
    return n


_calls: bool | None = None  # whether the twins are lowered to direct calls (None: not tried yet)


def lower_graph_twins_to_calls() -> bool:
    """Register, once, an Inductor lowering of each graph twin to a call of its Python function
    (``ops.GRAPH_CALLS``) from the graph's code, ``extern_kernels.sparserl_<op>(...)``, in place
    of ``torch.ops.sparserl.<op>_graph.default(...)``, whose trip through the dispatcher into a
    Python kernel (arguments parsed against the schema, boxed, converted back to Python objects)
    costs as much host time as the product's own path. The node is the same kind as the
    fallback kernel Inductor would make (``ExternKernelAlloc``), with a contiguous ``dense``
    and a contiguous output. Graphs compiled for Inductor's C++ wrapper (``cpp_wrapper``), which
    calls no Python function, keep the twin as a fallback kernel. Returns whether the lowering
    is in place (False where this torch's Inductor lacks what it uses: the twins serve)."""
    global _calls
    if _calls is not None:
        return _calls
    try:
        from torch._inductor import ir
        from torch._inductor.lowering import fallback_handler, register_lowering
        from torch._inductor.select_algorithm import extern_kernels
        from torch._inductor.virtualized import V
    except ImportError:  # pragma: no cover - an Inductor without these: the twins' fallback kernels
        _calls = False
        return False
    from sparserl_compile.ops import GRAPH_CALLS

    def lowering(twin, name: str, transposed: bool, vector: bool):
        fallback = fallback_handler(twin, add_to_fallback_set=False)

        def lower(crow, col, val, dense, n_rows, n_cols, fingerprint):
            if V.graph.cpp_wrapper:
                return fallback(crow, col, val, dense, n_rows, n_cols, fingerprint)
            arrays = [ir.ExternKernel.realize_input(t) for t in (crow, col, val)]
            dense = ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(dense))
            m = n_cols if transposed else n_rows
            size = [m] if vector else [m, dense.get_size()[1]]
            layout = ir.FixedLayout(dense.get_device(), dense.get_dtype(), size,
                                    ir.FlexibleLayout.contiguous_strides(size))
            return ir.TensorBox.create(ir.ExternKernelAlloc(
                layout, [*arrays, dense], constant_args=(n_rows, n_cols, fingerprint),
                python_kernel_name=f"extern_kernels.{name}"))

        return lower

    for twin, (name, fn, transposed, vector) in GRAPH_CALLS.items():
        setattr(extern_kernels, name, fn)
        register_lowering(twin, type_promotion_kind=None)(lowering(twin, name, transposed, vector))
    _calls = True
    return True


def _graph_twin_pass_base():
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass

        return CustomGraphPass
    except ImportError:  # pragma: no cover - older torch: a plain callable (no FX graph caching)
        return object


class GraphTwinPass(_graph_twin_pass_base()):
    """Inductor's post-grad custom pass (it sees the forward, backward and inference graphs
    after AOTAutograd): ``lower_to_graph_twins``, after the pass the user had configured, if
    any. Its ``uuid`` (this file's and ``ops.py``'s source hash, with the user pass's uuid) is
    part of Inductor's and AOTAutograd's cache keys, so a cached graph is never one compiled
    without the swap or by another version of it."""

    def __init__(self, inner=None):
        self.inner = inner

    def __call__(self, graph) -> None:
        if self.inner is not None:
            self.inner(graph)
        lower_to_graph_twins(graph)

    def uuid(self):
        ours = _source_hash() + ("-calls" if lower_graph_twins_to_calls() else "")
        if self.inner is None:
            return ours
        theirs = getattr(self.inner, "uuid", lambda: None)()
        return None if theirs is None else (ours, theirs)


_hash: str | None = None


def _source_hash() -> str:
    """sha256 of this file, ``ops.py`` (where the twins are defined) and ``tensor.py``, computed
    once. ``tensor.py`` is in it because a graph Dynamo records with a product's ``out=`` (and
    possibly other calls) is lowered through ``SparseRLTensor.__torch_function__`` only when
    AOTAutograd traces it, so a cached graph compiled under another version of that file has the
    same Dynamo graph and would otherwise be handed back (an ``out=`` fix did not reach a
    compiled call until the cache was cleared)."""
    global _hash
    if _hash is None:
        import hashlib
        from pathlib import Path

        h = hashlib.sha256()
        for name in ("backend.py", "ops.py", "tensor.py"):
            h.update((Path(__file__).resolve().parent / name).read_bytes())
        _hash = "sparserl-graph-twins-" + h.hexdigest()
    return _hash


__all__ = ["sparserl_backend", "lower_to_graph_twins", "GraphTwinPass"]
