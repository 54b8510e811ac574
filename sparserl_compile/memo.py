"""What is derived from a values tensor, kept while that tensor lives and is unchanged.

A plan gathers a matrix's values into its format's own array, the transposed product permutes
them, a dense plan stores the matrix dense: each once per values tensor, not per call. The
memo keys on the tensor's identity (a weak reference: the memo never keeps it alive) and its
version counter, which every in-place change bumps. An inference tensor (made under
``torch.inference_mode``) has no version counter: outside inference mode it cannot change in
place, and an in-place change made inside inference mode is not seen (give new values with
``SparseRLTensor.with_values``).
"""

from __future__ import annotations

import weakref


def version_counter(t) -> int:
    """``t``'s version counter; -1 for an inference tensor, which has none."""
    try:
        return t._version
    except RuntimeError:
        return -1


class ValueMemo:
    """One tensor derived from one values tensor (``get`` it back while that tensor is alive
    and unchanged, else None)."""

    __slots__ = ("_entry",)

    def __init__(self):
        self._entry: tuple | None = None

    def get(self, val):
        e = self._entry
        if e is not None and e[0]() is val and e[1] == version_counter(val):
            return e[2]
        return None

    def put(self, val, derived):
        """Keep ``derived`` for ``val``; returns ``derived``."""
        self._entry = (weakref.ref(val), version_counter(val), derived)
        return derived
