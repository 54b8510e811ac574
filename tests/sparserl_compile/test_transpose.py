"""transpose: the memoized transposed pattern behind products with a transposed matrix."""

from __future__ import annotations

import torch

import sparserl_compile as S
from sparserl_compile import transpose
from thread_stress import errors_from_threads


def test_threads_multiplying_more_transposes_than_the_memo_keeps(monkeypatch):
    """Several threads serving more transposed structures than the memo keeps: one thread's
    eviction never breaks another's product."""
    monkeypatch.setattr(transpose, "TRANSPOSE_MEMO_SIZE", 2)
    mats = [S.sparsify(torch.eye(6 + i) + torch.diag(torch.ones(5 + i), 1)) for i in range(6)]
    want = [m.to_dense().t() @ torch.ones(m.shape[0]) for m in mats]

    def work(i):
        for r in range(1000):
            k = (i + r) % len(mats)
            assert torch.equal(mats[k].t() @ torch.ones(mats[k].shape[0]), want[k])

    try:
        assert errors_from_threads(work, 8) == []
    finally:
        transpose.clear()
