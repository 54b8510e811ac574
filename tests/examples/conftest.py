"""Fixtures for the example tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """One intra-op thread: on a busy CI machine OpenMP threads contend for the cores and a small
    matmul runs ~30x slower with 2 threads than with 1. Restored after each test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
