"""The ``Problem``: one product to find a kernel for, as every provider, the selection and
the cache see it (the pattern on the host, op, dtype, width, fingerprint, arch; never values).

It sits at the bottom of the package (it needs only ``contract``), so the policy, the
providers and the runtime all take it from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
