"""The values memo: kept while the values tensor lives unchanged, inference tensors included;
``lasting``: what it keeps made outside a CUDA graph's memory pool."""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest
import torch

from sparserl_compile import memo
from sparserl_compile.memo import ValueMemo, version_counter


def test_the_memo_follows_identity_and_in_place_changes():
    val, memo = torch.ones(5), ValueMemo()
    assert memo.get(val) is None
    derived = memo.put(val, val * 2)
    assert memo.get(val) is derived and memo.get(torch.ones(5)) is None  # another tensor: a miss
    val.mul_(3)  # in place: the version counter moves
    assert memo.get(val) is None


def test_inference_tensors_have_no_counter_and_still_memoize():
    with torch.inference_mode():
        val = torch.ones(5)
        assert version_counter(val) == -1
        memo = ValueMemo()
        derived = memo.put(val, val + 1)
        assert memo.get(val) is derived


def test_the_memo_does_not_keep_the_values_alive():
    val, memo = torch.ones(5), ValueMemo()
    memo.put(val, torch.zeros(5))
    ref = memo._entry[0]
    del val
    gc.collect()
    assert ref() is None


@pytest.fixture
def on_helper(monkeypatch):
    """``lasting`` as on a CUDA device outside a capture, with a stand-in for the caller's stream."""
    monkeypatch.setattr(memo, "_needs_helper", lambda device: True)
    monkeypatch.setattr(memo, "_stream", lambda device: contextlib.nullcontext())


def test_lasting_runs_here_off_cuda():
    assert memo.lasting(torch.device("cpu"), threading.current_thread) is threading.current_thread()


def test_lasting_makes_on_another_thread_in_the_callers_grad_mode(on_helper):
    """CUDA graph trees pick the warm-up's memory pool by thread: what a memo keeps is made on
    another one, in the caller's grad mode."""
    here = threading.current_thread()
    seen = memo.lasting("cuda", lambda: (threading.current_thread(), torch.is_grad_enabled()))
    assert seen == (seen[0], True) and seen[0] is not here
    with torch.no_grad():
        assert memo.lasting("cuda", torch.is_grad_enabled) is False


def test_lasting_raises_the_makers_error_and_nests(on_helper):
    def fail():
        raise ValueError("bad values")

    with pytest.raises(ValueError, match="bad values"):
        memo.lasting("cuda", fail)
    # a maker that itself keeps something runs it on its own thread (one helper: no deadlock)
    inner = memo.lasting("cuda", lambda: memo.lasting("cuda", threading.current_thread))
    assert inner is not threading.current_thread()


def test_memos_keep_one_entry_per_live_values_tensor():
    """A plan shared by weights of one structure keeps what it derived from each, until that
    weight is freed or changed in place."""
    memos, a, b = memo.ValueMemos(), torch.ones(3), torch.ones(3)
    da, db = memos.put(a, a * 2), memos.put(b, b * 3)
    assert memos.get(a) is da and memos.get(b) is db and len(memos) == 2
    b.add_(1)
    assert memos.get(b) is None and memos.get(a) is da
    del a
    gc.collect()
    assert len(memos) == 1 and memos.values() == [db]


def test_lasting_starts_a_helper_of_its_own_in_a_forked_child(on_helper):
    import os
    import signal

    assert memo.lasting("cuda", lambda: 1) == 1  # the parent's helper thread exists now
    pid = os.fork()
    if pid == 0:  # the child: the parent's helper thread is not there; a wait for it would hang
        signal.alarm(20)
        os._exit(0 if memo.lasting("cuda", lambda: 7) == 7 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
