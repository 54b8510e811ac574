"""Wall-clock timing shared by the benchmark scripts: the median of synchronized calls."""

from __future__ import annotations

import time

import numpy as np
import torch


def wall_median_us(fn, device: torch.device | str = "cuda", reps: int = 30, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in microseconds, each call followed by a synchronize of
    ``device`` (none on the CPU): what a caller that waits for every result pays, host
    overhead included (not a kernel time)."""
    dev = torch.device(device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(ts))
