"""Run a function from many threads at once, switching between them as often as Python allows,
and collect what each raised (the thread-safety tests of the shared memos)."""

from __future__ import annotations

import sys
import threading


def errors_from_threads(work, n_threads: int) -> list[str]:
    """``work(i)`` in ``n_threads`` threads; the ``repr`` of every exception they raised."""
    errors: list[str] = []

    def run(i):
        try:
            work(i)
        except Exception as e:  # noqa: BLE001 - returned to the test
            errors.append(repr(e))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    return errors
