"""Small measures shared by the stages: the geometric mean of speed ratios (``geomean``), and
wall seconds added up by part for the logs (``timed``, ``seconds_text``)."""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager


def geomean(xs) -> float | None:
    """Geometric mean of positive numbers (None for none): how speed ratios are averaged."""
    xs = list(xs)
    return statistics.geometric_mean(xs) if xs else None


@contextmanager
def timed(seconds: dict, part: str):
    """Add the block's wall seconds to ``seconds[part]``."""
    t = time.perf_counter()
    try:
        yield
    finally:
        seconds[part] = seconds.get(part, 0.0) + time.perf_counter() - t


def seconds_text(parts: dict) -> str:
    """``{"greedy": 3.2, "sample": 9.0, "rewards": 12.1, "rewards_verify": 4.0, "rewards_time": 6.5,
    "update": 2.0}`` -> "decoding 12 (greedy 3, sample 9), rewards 12 (verify 4, time 6), update 2":
    how an RL update's seconds were spent, for the log."""
    decode = {k: v for k, v in parts.items() if k not in ("rewards", "update") and not k.startswith("rewards_")}
    rewards = {k[len("rewards_"):]: v for k, v in parts.items() if k.startswith("rewards_")}

    def some(d):
        return " (" + ", ".join(f"{k} {v:.0f}" for k, v in d.items()) + ")" if len(d) > 1 else ""

    return (f"decoding {sum(decode.values()):.0f}{some(decode)}, rewards {parts.get('rewards', 0.0):.0f}"
            f"{some(rewards)}, update {parts.get('update', 0.0):.0f}")
