"""The values memo: kept while the values tensor lives unchanged, inference tensors included."""

from __future__ import annotations

import gc

import torch

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
