"""The miss path's disk writes: what ``miss._put`` stores and what it leaves to the next process."""

from __future__ import annotations

import dataclasses

from sparserl_compile import miss
from sparserl_compile.cache import CacheEntry, CacheKey, KernelCache


def _entry(fp: str, **verification) -> CacheEntry:
    key = CacheKey(fingerprint=fp, op="spmv", dtype="f32", width=1, arch="sm_90", gpu_name="NVIDIA H200",
                   driver_version="13000", nvrtc_version="13.0")
    return CacheEntry(key, None, times={"kernel_us": 7.0}, verification={"why": "reference kept", **verification})


def test_a_verdict_from_a_failure_that_may_not_recur_is_not_written(tmp_path):
    """A reference kept because its own timing failed (``transient``) is decided again by the
    next process, not served from the disk forever; every other verdict is written."""
    store = KernelCache(tmp_path)
    transient, kept = _entry("ab" * 16, transient=True), _entry("cd" * 16)
    miss._put(store, transient, "fp")
    miss._put(store, kept, "fp")
    fresh = KernelCache(tmp_path)
    assert fresh.get(transient.key) is None and fresh.get(kept.key) == kept
    miss._put(store, dataclasses.replace(kept, key=None), "fp")  # no key: nothing to write, no error
