"""What a kernel provider is asked and what it may do: the ``Problem`` and ``Provider``.

A ``Problem`` is one product to find a kernel for, as every provider, the selection and the
cache see it (the pattern on the host, op, dtype, width, fingerprint, arch; never values).
``Provider`` is the base class of every provider: it declares everything the runtime may ask
of one, with defaults, so the runtime calls methods instead of probing attributes.

It sits at the bottom of the package (it needs only ``contract``), so the policy, the
providers and the runtime all take it from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sparserl_compile import contract


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



def make_problem(op: str, dtype: str, n: int, indptr, indices, shape, fp: str, arch: str) -> Problem:
    """The ``Problem`` for one product, from a host (numpy) or torch CSR pattern."""
    def host(a):
        if isinstance(a, torch.Tensor):
            a = a.detach().cpu().numpy()
        return np.ascontiguousarray(a, dtype=np.int32)

    ip, ix = host(indptr), host(indices)
    return Problem(op=op, dtype=dtype, n=int(n), n_rows=int(shape[0]), n_cols=int(shape[1]),
                   nnz=int(ix.size), indptr=ip, indices=ix, fingerprint=fp, arch=arch)


_arch_of: dict = {}


def device_arch(device) -> str:
    """``"cpu"`` or ``"sm_XY"`` of a torch device (memoized on the device: it is part of every
    product's plan key, so a hit costs one dict lookup)."""
    a = _arch_of.get(device)
    if a is None:
        if device.type == "cuda":
            maj, mnr = torch.cuda.get_device_capability(device)
            a = f"sm_{maj}{mnr}"
        else:
            a = device.type
        _arch_of[device] = a
    return a


class Provider:
    """Proposes candidate kernels for a problem. Subclasses implement ``candidates``; the rest
    has defaults that suit a provider with no model to load.

    An empty candidate list means "use the reference". ``providers.resolve`` also takes any
    object with a ``name`` and a ``candidates(problem, k)`` method and gives it these defaults.
    """

    #: what the provider is called in logs, selection records and ``set_provider``
    name: str = "provider"
    #: the cache key's policy hash for entries it proposes: its checkpoint's sha256, or None
    #: (the hand-written families only: every process may take its entries)
    checkpoint_hash: str | None = None
    #: idle sandbox workers it wants kept ready: 1 where its candidates often fail verification
    #: (a failed candidate replaces its worker), 0 for measured kernel-space points
    sandbox_spare: int = 0

    def candidates(self, problem: Problem, k: int) -> list[contract.Candidate]:
        """Up to ``k`` candidates (``k == 0``: the provider's own default number)."""
        raise NotImplementedError(f"{type(self).__name__}.candidates")

    def propose(self, problem: Problem, k: int) -> tuple[list[contract.Candidate], str]:
        """What the runtime calls: ``(candidates, name of who proposed them)``. A provider whose
        model is still loading may let another propose meanwhile (``DefaultProvider``)."""
        return self.candidates(problem, k), self.name

    def warm_up(self) -> None:
        """Pay one-time costs now (load a model, its first decoding); ``prewarm`` calls it."""

    def load_in_background(self) -> None:
        """Start ``warm_up`` off the caller's thread, if there is anything to load."""
