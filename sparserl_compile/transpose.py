"""A^T's CSR pattern, for products with the transposed matrix (``*_t``: autograd and ``x @ A``).

Computed once per structure and device on the host (scipy), memoized with its own fingerprint
(the last ``TRANSPOSE_MEMO_SIZE``), so A^T gets its own plan and kernel; ``values`` gathers
A's values into A^T's order, memoized on the values tensor's identity and version.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from sparserl_compile.memo import ValueMemo, lasting
from sparserl_compile.structure import fingerprint as _fingerprint

#: transposed patterns kept (per structure and device); each holds 2 index arrays + a perm
TRANSPOSE_MEMO_SIZE = 32
_lock = threading.Lock()


@dataclass
class TransposedPattern:
    """The CSR pattern of A^T on one device, and where A's values go in it."""

    crow: torch.Tensor  # int32, n_cols + 1
    col: torch.Tensor  # int32, nnz
    perm: torch.Tensor  # int64, nnz: A^T's k-th value is A's perm[k]-th value
    fingerprint: str
    _vmemo: ValueMemo = field(default_factory=ValueMemo, repr=False, compare=False)

    def values(self, val: torch.Tensor) -> torch.Tensor:
        out = self._vmemo.get(val)
        if out is None:
            out = self._vmemo.put(val, lasting(val.device, lambda: val[self.perm] if self.perm.numel() else val.new_empty(0)))
        return out


_transposes: "OrderedDict[tuple, TransposedPattern]" = OrderedDict()


def transpose_pattern(crow, col, n_rows: int, n_cols: int, fp: str) -> TransposedPattern:
    """A^T's pattern (memoized per fingerprint and device; computed on the host once)."""
    key = (fp, str(crow.device))
    with _lock:  # (another thread's eviction must not land between the lookup and move_to_end)
        tp = _transposes.get(key)
        if tp is not None:
            _transposes.move_to_end(key)
            return tp
    import scipy.sparse as sp

    ip = crow.detach().cpu().numpy().astype(np.int64)
    ix = col.detach().cpu().numpy().astype(np.int64)
    nnz = ix.size
    m = sp.csr_matrix((np.arange(nnz, dtype=np.int64), ix, ip), shape=(n_rows, n_cols))
    t = m.transpose().tocsr()
    t.sort_indices()
    ipt, ixt = t.indptr.astype(np.int32), t.indices.astype(np.int32)
    dev = crow.device
    tp = TransposedPattern(
        *lasting(dev, lambda: [torch.from_numpy(a).to(dev) for a in (ipt, ixt, t.data.astype(np.int64))]),
        _fingerprint(ipt, ixt, (n_cols, n_rows)),
    )
    with _lock:
        _transposes[key] = tp
        while len(_transposes) > TRANSPOSE_MEMO_SIZE:
            _transposes.popitem(last=False)
    return tp


def clear() -> None:
    """Forget every memoized transposed pattern."""
    with _lock:
        _transposes.clear()
