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


def test_nothing_derived_is_kept_while_a_cuda_graph_is_being_captured(monkeypatch):
    """A CUDA graph tree records from copies of its inputs in its private pool and refuses to
    finish while anything keeps such a copy alive: inside a capture the memos and the
    reference's CSR memo hand back what they made without keeping it."""
    from sparserl_compile import memo, reference

    assert not memo.capturing(torch.ones(1))  # never on the CPU
    v, d = torch.ones(2), torch.zeros(2)
    one, many = memo.ValueMemo(), memo.ValueMemos()
    crow, col = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    reference.clear()
    monkeypatch.setattr(memo, "capturing", lambda t: True)
    monkeypatch.setattr(reference, "capturing", lambda t: True)
    assert one.put(v, d) is d and one.get(v) is None
    assert many.put(v, d) is d and many.get(v) is None and len(many) == 0
    t = reference.csr(crow, col, v, 2, 2)
    torch.testing.assert_close(t.to_dense(), torch.eye(2))
    assert len(reference._csr_memo) == 0
    monkeypatch.undo()
    assert one.put(v, d) is d and one.get(v) is d
    assert many.put(v, d) is d and many.get(v) is d
    assert reference.csr(crow, col, v, 2, 2) is reference.csr(crow, col, v, 2, 2)
