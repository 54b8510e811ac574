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
    del torch
    return compile_fx(gm, example_inputs, config_patches=patches or None)


__all__ = ["sparserl_backend"]
