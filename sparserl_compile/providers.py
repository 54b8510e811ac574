"""Where kernel candidates come from: the ``Problem`` a provider sees and the active provider.

On a miss in the runtime's plan table (and in the disk cache) the runtime describes the call
as a ``Problem`` -- op, dtype, dense width, the CSR pattern on the host, its fingerprint and
the GPU arch -- and asks the active ``Provider`` for up to ``k`` candidate kernels
(``contract.Candidate``). ``select.choose`` then compiles, verifies and times them against
the reference; the provider only proposes.

Providers, by name for ``set_provider``:

* ``"reference"`` (``ReferenceProvider``): proposes nothing, so every call uses the reference
  (torch.sparse / cuSPARSE). What a machine without the search installed gets.
* ``"search"``: ``sparserl_compile.search.SearchProvider``, the hand-written kernel families
  searched by heuristics: every pruned point (27-60) is compiled, verified and timed.
* ``"policy"``: ``policy.provider.PolicyProvider``, the trained language model.
* ``"nearest"``: ``sparserl_compile.nearest.NearestProvider``, the winners of the most alike
  matrices measured on the H200 (a few candidates instead of the whole space; the search's own
  order fills in where the table has nothing alike). The default (``DEFAULT_PROVIDER``): on the
  H200 its 4-8 candidates reach 0.99 of the whole space's best on held-out matrices, and a new
  10^6-nonzero structure's first product takes 0.2-0.45 s with 4 (docs/benchmarks.md, "Cold
  start again").

The last three are imported lazily on first use, so ``import sparserl_compile`` never imports
the policy (transformers) or the search. Any object with a ``name`` and a
``candidates(problem, k)`` method may be set as well.

This module holds no kernels and does no compiling, verifying or caching.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from sparserl_compile import contract

#: provider name -> (module, class) imported on first use
_LAZY = {
    "search": ("sparserl_compile.search", "SearchProvider"),
    "policy": ("policy.provider", "PolicyProvider"),
    "nearest": ("sparserl_compile.nearest", "NearestProvider"),
}


@dataclass(frozen=True, eq=False)
class Problem:
    """One product to find a kernel for (the pattern, not the values).

    ``eq=False``: problems hold numpy arrays and compare by identity; key them by
    ``fingerprint`` and the scalar fields.
    """

    op: str  # "spmv" | "spmm"
    dtype: str  # contract value dtype: "f32" | "f16" | "bf16"
    n: int  # dense width (1 for spmv)
    n_rows: int
    n_cols: int
    nnz: int
    indptr: np.ndarray  # int32, n_rows + 1 entries, on the host
    indices: np.ndarray  # int32, nnz entries, sorted within rows
    fingerprint: str  # structure.fingerprint(indptr, indices, (n_rows, n_cols))
    arch: str  # "sm_90", ... or "cpu"

    def __post_init__(self) -> None:
        if self.op not in contract.OPS:
            raise ValueError(f"Problem.op={self.op!r}; expected one of {contract.OPS}")
        if self.dtype not in contract.DTYPES:
            raise ValueError(
                f"Problem.dtype={self.dtype!r}; expected one of {tuple(contract.DTYPES)} "
                "(float64 products always use the reference and never reach a provider)"
            )
        if self.indptr.dtype != np.int32 or self.indices.dtype != np.int32:
            raise ValueError("Problem.indptr and Problem.indices must be int32 numpy arrays")
        if self.indptr.size != self.n_rows + 1 or self.indices.size != self.nnz:
            raise ValueError(
                f"Problem arrays do not match its shape: indptr has {self.indptr.size} entries "
                f"(n_rows + 1 = {self.n_rows + 1}), indices {self.indices.size} (nnz = {self.nnz})"
            )


@runtime_checkable
class Provider(Protocol):
    """Proposes candidate kernels for a problem; an empty list means "use the reference"."""

    name: str

    def candidates(self, problem: Problem, k: int) -> list[contract.Candidate]: ...


class ReferenceProvider:
    """Proposes no kernels: every product runs on the reference (torch.sparse / cuSPARSE)."""

    name = "reference"

    def candidates(self, problem: Problem, k: int) -> list[contract.Candidate]:
        return []


_lock = threading.Lock()
#: the default provider, resolved on first use: the nearest-neighbour proposals (measured best
#: quality for first-use time; the policy is opt-in until it beats them, docs/training.md);
#: "reference" where it cannot be imported
DEFAULT_PROVIDER = "nearest"
_active: Provider | None = None


def resolve(obj_or_name: "Provider | str") -> Provider:
    """A provider object from a name (``reference``, ``search``, ``policy``, ``nearest``) or an object."""
    if isinstance(obj_or_name, str):
        name = obj_or_name
        if name == "reference":
            return ReferenceProvider()
        if name not in _LAZY:
            raise ValueError(
                f"unknown provider {name!r}; use one of {('reference', *_LAZY)} or pass an object "
                "with .name and .candidates(problem, k)"
            )
        mod, cls = _LAZY[name]
        try:
            factory = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError) as e:
            raise ImportError(
                f"provider {name!r} needs {mod}.{cls}, which could not be imported ({e}); "
                "install the missing part (e.g. pip install 'sparserl[train]' for the policy) "
                "or use set_provider('reference')"
            ) from e
        return factory()
    if not isinstance(obj_or_name, Provider):
        raise TypeError(
            f"{type(obj_or_name).__name__} is not a provider: it needs a 'name' attribute and a "
            "'candidates(problem, k)' method returning a list of contract.Candidate"
        )
    return obj_or_name


def set_provider(obj_or_name: "Provider | str") -> Provider:
    """Make ``obj_or_name`` the active provider and return it.

    Plans already in the runtime's table stay; ``runtime.configure(provider=...)`` also clears
    them so the next call of every structure asks the new provider.
    """
    global _active
    p = resolve(obj_or_name)
    with _lock:
        _active = p
    return p


def get_provider() -> Provider:
    """The active provider (``DEFAULT_PROVIDER`` until one is set)."""
    global _active
    if _active is None:
        with _lock:
            if _active is None:
                try:
                    _active = resolve(DEFAULT_PROVIDER)
                except ImportError:
                    _active = ReferenceProvider()
    return _active
