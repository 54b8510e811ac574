"""sparserl: structure-specialized SpMV/SpMM for PyTorch, with a cuSPARSE fallback.

Importing the package registers the ``torch.ops.sparserl`` custom ops and nothing heavy: the
policy (transformers), the kernel search, NVRTC and the GPU launcher are imported only when a
product on a CUDA device first needs them.

    A = sparserl_compile.sparsify(scipy_or_torch_sparse)      # a SparseRLTensor
    y = A @ x                                                 # eager, or under torch.compile
    model = torch.compile(sparserl_compile.sparsify_(model), backend="sparserl")
    with sparserl_compile.accelerate():                       # native torch.sparse products
        y = A_csr @ x
"""

from sparserl_compile.version import version as _version
from sparserl_compile import ops  # noqa: F401  (registers torch.ops.sparserl.*)
from sparserl_compile.dispatch import accelerate, disable, enable
from sparserl_compile.config import get_config, stats
from sparserl_compile.miss import first_uses, prewarm
from sparserl_compile.plans import configure, wait_for_searches
from sparserl_compile.providers import get_provider, set_provider
from sparserl_compile.tensor import SparseRLTensor, sparsify, sparsify_

__version__ = _version()

__all__ = [
    "SparseRLTensor", "sparsify", "sparsify_", "enable", "disable", "accelerate",
    "configure", "get_config", "prewarm", "get_provider", "set_provider", "stats", "first_uses",
    "wait_for_searches", "__version__",
]
