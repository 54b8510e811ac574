"""Providers the proposer tests build inside a worker process (importable there: the worker
gets the test process's ``sys.path``)."""

from __future__ import annotations

import os

from sparserl_compile import kernels


class EchoProvider:
    """Proposes the first ``k`` CSR points of the kernel space and says which process it is."""

    name = "echo"
    checkpoint_hash = "feedface"
    sandbox_spare = 1

    def __init__(self):
        self.warmed = False

    def warm_up(self):
        self.warmed = True

    def candidates(self, problem, k):
        if problem.n_rows == 13:
            raise ValueError("thirteen rows are unlucky")
        if problem.n_rows == 7:
            os._exit(9)  # dies mid-request
        space = kernels.space(problem.op, problem.dtype)
        return space[: k or 2]


class BrokenProvider:
    name = "broken"

    def __init__(self):
        raise OSError("the model file is unreadable")


class SlowProvider:
    """Takes ten minutes to warm up (a model that loads slowly)."""

    name = "slow"

    def warm_up(self):
        import time

        time.sleep(600)

    def candidates(self, problem, k):
        return []
