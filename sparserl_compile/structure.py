"""Structure analysis: the exact fingerprint of a sparsity pattern (and, below, its features).

The fingerprint is a BLAKE2b-128 digest of (n_rows, n_cols, indptr as int32, indices as
int32): two patterns share a fingerprint only if they are the same pattern, whatever the
values. It keys every cache, so it is computed outside traced code, once per tensor.
"""

from __future__ import annotations

import hashlib

import numpy as np

FINGERPRINT_VERSION = 1


def _host_int32(a) -> np.ndarray:
    """A contiguous int32 numpy view of a numpy array or a torch tensor (any device)."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    if torch is not None and isinstance(a, torch.Tensor):
        a = a.detach()
        if a.dtype != torch.int32:
            a = a.to(torch.int32)
        return a.contiguous().cpu().numpy()
    return np.ascontiguousarray(a, dtype=np.int32)


def fingerprint(indptr, indices, shape) -> str:
    """Exact structure fingerprint (32 hex chars) of a CSR pattern.

    ``indptr``/``indices`` may be numpy arrays or torch tensors on any device (GPU tensors are
    copied to the host once; callers memoize the result per tensor).
    """
    n_rows, n_cols = (int(s) for s in shape)
    h = hashlib.blake2b(digest_size=16, person=b"sparserl-fp%d" % FINGERPRINT_VERSION)
    h.update(np.asarray([n_rows, n_cols], dtype=np.int64).tobytes())
    ip = _host_int32(indptr)
    ix = _host_int32(indices)
    h.update(np.asarray([ip.size, ix.size], dtype=np.int64).tobytes())
    h.update(ip.tobytes())
    h.update(ix.tobytes())
    return h.hexdigest()
