"""Screen a policy's candidates on the CPU before the GPU verifies them.

A departure from the greedy kernel (``departures.branch_diverse``) changes one header token and lets
the model write the rest. Often the body does not follow the new header: a merge kernel keeps
the old ``items_per_part`` in its arithmetic, an SpMM kernel keeps the old ``tile_n``, a switch
to another format keeps a body written for SpMV, or the header names BSR blocks the matrix
does not convert to. Such departures are common (well over a third of a trained policy's
departures can fail), and on the GPU each failure costs a sandbox worker (a fresh interpreter,
torch and a CUDA context, seconds), which in RL makes the updates several times fewer.

``Screen`` answers, per candidate, whether it is worth the GPU's time, in three steps, cheapest
first:

1. the contract header parses and names the prompt's op and dtype;
2. the matrix converts to the header's format with its parameters (``formats.unfit``: the same
   budget check ``convert`` makes, host code, no array filled; answered once per format and
   parameters);
3. the kernel compiles (NVRTC) and passes every verification check on the CPU executor
   (``simt``, bounds-checked) on a *probe* of the matrix (``probe_pattern``: its first
   ``PROBE_ROWS`` rows), in a killable sandbox worker, as every untrusted kernel runs.

A candidate the screen passes is still verified on the GPU on the whole matrix; the screen only
leaves out candidates that would have failed, so it never makes a wrong kernel reach a user. It
can pass a kernel that fails on rows the probe does not hold (the GPU's verification catches
those) and, where the probe's fit differs from the matrix's, leave out one that would have run.
"""

from __future__ import annotations

import numpy as np

from sparserl_compile.verify import Pattern

#: rows of the matrix the probe keeps: several thread blocks and merge/partition pieces of every
#: family, and a multiple of every block-row height and slice size the formats use (up to 64)
PROBE_ROWS = 512
#: at most this many elements of the dense operand x (n_cols x n) in the probe: above it the
#: probe's columns are shifted to start at the first used (rounded down to 64, which keeps BSR's
#: column blocks), or, when they span too far, renumbered in order to the columns used
PROBE_X_ELEMENTS = 1 << 22


def probe_pattern(indptr, indices, shape, n: int = 1, rows: int = PROBE_ROWS,
                  max_x: int = PROBE_X_ELEMENTS) -> Pattern:
    """The first ``rows`` rows of a CSR pattern (all of a smaller matrix), with columns kept,
    shifted or renumbered so the dense operand stays under ``max_x`` elements (module
    constants). The column order within each row is kept, so a sorted pattern stays sorted."""
    ip = np.asarray(indptr).astype(np.int64, copy=False)
    ix = np.asarray(indices)
    n_rows, n_cols = int(shape[0]), int(shape[1])
    r = min(int(rows), n_rows)
    end = int(ip[r])
    sub_ip = (ip[:r + 1] - ip[0]).astype(np.int32)
    cols = ix[int(ip[0]):end].astype(np.int64)
    width = max(1, int(n))
    if n_cols * width <= max_x or cols.size == 0:
        new_cols, new_n = cols, (n_cols if n_cols * width <= max_x else 1)
    else:
        lo = (int(cols.min()) // 64) * 64
        span = int(cols.max()) + 1 - lo
        if span * width <= max_x:
            new_cols, new_n = cols - lo, span
        else:  # renumber in order: the k-th smallest column used becomes column k
            used, new_cols = np.unique(cols, return_inverse=True)
            new_n = int(used.size)
    return Pattern(sub_ip, np.ascontiguousarray(new_cols, dtype=np.int32), (r, int(new_n)))


class Screen:
    """Checks candidates for one matrix at a time on the CPU (module docstring) with a pool of
    ``workers`` sandboxed CPU workers (``spare`` kept started, so a worker that hangs or dies is
    replaced while the next job runs). ``check(...)`` returns, per source, None (worth the
    GPU's time) or why not. ``close()`` stops the workers (also at exit)."""

    def __init__(self, workers: int = 2, *, timeout_s: float = 30.0, rows: int = PROBE_ROWS, spare: int = 1):
        from sparserl_compile.sandbox import SandboxPool

        if workers < 1:
            raise ValueError(f"workers={workers}: a screen needs at least one CPU worker")
        self.rows = rows
        # warm=False: the workers never touch CUDA (the CPU executor), so none starts a context.
        # A worker is kept after a kernel that failed on it (restart_on: only after an internal
        # error; a hang or a crash always replaces it): the CPU executor's builds check the bounds
        # of every access through the kernel's pointers, and a verdict of a worker a kernel did
        # corrupt is advice the GPU's verification checks again, never a result a user gets.
        # Restarting after each of the 4 in 10 departures that fail would cost a fresh
        # interpreter each time
        self.pool = SandboxPool(workers, timeout_s=timeout_s, warm=False, spare=spare, restart_on={"internal"})
        self.pool.start(count=workers)
        self._fit: dict[tuple, str | None] = {}
        self._fit_key = None
        #: how many candidates each step left out, and how many passed, over this screen's life
        self.counts = {"header": 0, "format": 0, "probe": 0, "passed": 0}

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> "Screen":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unfit(self, indptr, indices, shape, fmt: str, params: dict) -> str | None:
        from sparserl_compile import formats

        # the arrays themselves, not their ids: holding them keeps a freed array's id from being
        # reused by another matrix's, which would hand that matrix this one's verdicts
        key = self._fit_key
        if key is None or key[0] is not indptr or key[1] is not indices or key[2] != tuple(shape):
            self._fit, self._fit_key = {}, (indptr, indices, tuple(shape))  # another matrix: forget the verdicts
        fp = (fmt, tuple(sorted(params.items())))
        if fp not in self._fit:
            self._fit[fp] = formats.unfit(indptr, indices, shape, fmt, params)
        return self._fit[fp]

    def checker(self, indptr, indices, shape, op: str, dtype: str, n: int):
        """``check`` bound to one problem: a callable from sources to verdicts, what
        ``departures.branch_diverse(screen=)`` takes."""
        return lambda sources: self.check(indptr, indices, shape, op, dtype, n, sources)

    def check(self, indptr, indices, shape, op: str, dtype: str, n: int, sources: list[str]) -> list[str | None]:
        """Per source, None when it passed every step, else the step's reason ("header: ...",
        "format: ...", "probe <kind>: ...")."""
        from sparserl_compile import contract
        from sparserl_compile.sandbox import SandboxJob

        ip, ix = np.asarray(indptr), np.asarray(indices)
        out: list[str | None] = [None] * len(sources)
        todo: list[tuple[int, contract.Candidate]] = []
        for i, src in enumerate(sources):
            try:
                h = contract.parse_header(src)
            except contract.ContractError as e:
                out[i] = f"header: {e}"
                self.counts["header"] += 1
                continue
            if h.op != op or h.dtype != dtype:
                out[i] = f"header: says {h.op}/{h.dtype}, the problem is {op}/{dtype}"
                self.counts["header"] += 1
                continue
            why = self._unfit(ip, ix, shape, h.format, dict(h.params))
            if why is not None:
                out[i] = f"format: {why}"
                self.counts["format"] += 1
                continue
            todo.append((i, contract.Candidate(source=src, header=h)))
        if todo:
            probe = probe_pattern(ip, ix, shape, n, self.rows)
            jobs = [SandboxJob(c, op, dtype, n, executor="cpu", value_sets=1) for _, c in todo]
            for (i, _), res in zip(todo, self.pool.map(jobs, probe)):
                if res.ok:
                    self.counts["passed"] += 1
                else:
                    detail = res.verify.reason if res.verify is not None else res.error
                    out[i] = f"probe {res.kind}: {' '.join(str(detail).split())[:300]}"
                    self.counts["probe"] += 1
        return out
