"""Wall-clock timing shared by the benchmark scripts: the median of synchronized calls."""

from __future__ import annotations

import time

import numpy as np
import torch


def sync(device: torch.device | str) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def wall_median_us(fn, device: torch.device | str = "cuda", reps: int = 30, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in microseconds, each call followed by a synchronize of
    ``device`` (none on the CPU): what a caller that waits for every result pays, host
    overhead included (not a kernel time)."""
    for _ in range(warmup):
        fn()
    sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(ts))


def stream_us(fn, device: torch.device | str = "cuda", calls: int = 200, warmup: int = 20) -> float:
    """Microseconds per call of ``calls`` back-to-back calls with one synchronize at the end:
    the rate of a caller that does not wait for each result. Host-bound products show their
    host cost here (launches, dispatch), device-bound ones their GPU time with a warm L2."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / calls * 1e6
