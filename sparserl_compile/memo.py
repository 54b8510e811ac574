"""What is derived from a values tensor, kept while that tensor lives and is unchanged.

A plan gathers a matrix's values into its format's own array, the transposed product permutes
them, a dense plan stores the matrix dense: each once per values tensor, not per call. The
memo keys on the tensor's identity (a weak reference: the memo never keeps it alive) and its
version counter, which every in-place change bumps. An inference tensor (made under
``torch.inference_mode``) has no version counter: outside inference mode it cannot change in
place, and an in-place change made inside inference mode is not seen (give new values with
``SparseRLTensor.with_values``).

``lasting`` makes such a kept tensor (and a plan's format arrays) outside any CUDA graph's
private memory pool. Inside a capture nothing is kept (``capturing``): a CUDA graph tree
records from copies of its inputs in its pool, and an entry would keep one alive.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor


def capturing(t) -> bool:
    """Whether work on ``t``'s device is being captured into a CUDA graph now. What is derived
    then is not kept: a CUDA graph tree records from copies of its inputs in its private pool,
    and a memo entry would keep such a copy (or what was made from it there) alive, which the
    tree refuses ("tensor(s) in the cudagraph pool not tracked as outputs")."""
    if not t.is_cuda:
        return False
    import torch

    return torch.cuda.is_current_stream_capturing()


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
        """Keep ``derived`` for ``val`` (not inside a CUDA graph capture); returns ``derived``."""
        if not capturing(val):
            self._entry = (weakref.ref(val), version_counter(val), derived)
        return derived


class ValueMemos:
    """One derived tensor per values tensor, for many values tensors at once (weights that
    share a structure share a plan, and each keeps its own); an entry goes when its values
    tensor is freed."""

    def __init__(self):
        #: id(values) -> (weak reference to them, their version, the derived tensor)
        self._entries: dict[int, tuple] = {}

    def get(self, val):
        e = self._entries.get(id(val))
        if e is not None and e[0]() is val and e[1] == version_counter(val):
            return e[2]
        return None

    def put(self, val, derived):
        """Keep ``derived`` for ``val`` (not inside a CUDA graph capture); returns ``derived``."""
        if capturing(val):
            return derived
        k, d = id(val), self._entries
        ref = weakref.ref(val, lambda r: d.pop(k) if k in d and d[k][0] is r else None)
        d[k] = (ref, version_counter(val), derived)
        return derived

    def values(self) -> list:
        """Every derived tensor kept now."""
        return [e[2] for e in list(self._entries.values())]

    def __len__(self) -> int:
        return len(self._entries)


_helper: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()
_on_helper = threading.local()


def _forget_helper() -> None:
    """In a forked child: the parent's helper thread does not exist there."""
    global _helper
    _helper = None


os.register_at_fork(after_in_child=_forget_helper)


def _helper_pool() -> ThreadPoolExecutor:
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(1, thread_name_prefix="sparserl-lasting")
        return _helper


def _needs_helper(device) -> bool:
    """On a CUDA device outside a capture (a capture records the work, whichever thread sends it)."""
    import torch

    return getattr(device, "type", None) == "cuda" and not torch.cuda.is_current_stream_capturing()


def _stream(device):
    """The caller's current stream on ``device``, as a context for another thread."""
    import torch

    return torch.cuda.stream(torch.cuda.current_stream(device))


def lasting(device, make):
    """``make()``, its tensors allocated where a memo or plan may keep them for good.

    CUDA graph trees (``torch.compile(mode="reduce-overhead")``) send every allocation of the
    thread that runs a graph's warm-up into that graph's private pool, and refuse to record a
    graph while a tensor of the pool lives on untracked ("tensor(s) in the cudagraph pool not
    tracked as outputs"). A first product in a warm-up would leave its value gather, dense copy
    or format arrays there. The pool is chosen per thread, so on a CUDA device ``make`` runs on
    a helper thread, on the caller's stream and in its grad mode, while the caller waits: the
    work keeps the caller's order. Inside a capture, and off CUDA, it runs here.
    """
    if getattr(_on_helper, "active", False) or not _needs_helper(device):
        return make()
    import torch

    grad, stream = torch.is_grad_enabled(), _stream(device)

    def run():
        _on_helper.active = True
        try:
            with stream, torch.set_grad_enabled(grad):
                return make()
        finally:
            _on_helper.active = False

    return _helper_pool().submit(run).result()
