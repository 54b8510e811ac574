"""The job after a failed candidate, with and without a spare sandbox worker.

A candidate that fails verification (wrong, fault, CUDA error, ...) replaces its sandbox worker,
and the replacement starts in the background. With one worker (the runtime's pool) the next
job -- the next candidate, or cuSPARSE timed again after the candidates -- waits for that
start: a fresh interpreter, torch and, on a GPU, a CUDA context. ``SandboxPool(spare=1)``
(``configure(sandbox_spare=1)``) keeps one more worker started, and the next job takes it.

For each ``spare`` in ``--spares`` a pool of one worker runs ``--reps`` times: a wrong kernel,
then a correct one, each timed from the parent (after a pause long enough for the
replacement to be up again), on a 2D stencil; rows give both wall times.

    python benchmarks/sandbox_spare.py [--executor cpu|gpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests" / "sparserl_compile"))  # the fault kernels

from faults import FAULTS, GOOD, candidate  # noqa: E402

from sparserl_compile import matrices  # noqa: E402
from sparserl_compile.fileio import write_json  # noqa: E402
from sparserl_compile.sandbox import SandboxJob, SandboxPool  # noqa: E402
from sparserl_compile.version import run_stamp  # noqa: E402


def measure(spare: int, executor: str, reps: int, pause_s: float) -> dict:
    m = matrices.stencil2d(64)
    job = lambda src: SandboxJob(candidate(src), "spmv", executor=executor)  # noqa: E731
    after, failed = [], []
    with SandboxPool(1, timeout_s=120, spare=spare) as pool:
        pool.start(wait=True)
        pool.run(job(GOOD), m)  # the pattern sent, the first build done
        for _ in range(reps):
            time.sleep(pause_s)  # the replacement (and the spare) are up again
            t = time.perf_counter()
            bad = pool.run(job(FAULTS["wrong_answer"].source), m)
            failed.append(time.perf_counter() - t)
            t = time.perf_counter()
            good = pool.run(job(GOOD), m)
            after.append(time.perf_counter() - t)
            if bad.kind != "wrong" or not good.ok:
                raise RuntimeError(f"unexpected outcomes: {bad.kind} ({bad.error}), {good.kind} ({good.error})")
        restarts = pool.restarts
    return {"spare": spare, "executor": executor, "reps": reps, "failed_job_s": failed, "next_job_s": after,
            "next_job_median_s": statistics.median(after), "failed_job_median_s": statistics.median(failed),
            "restarts": restarts}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--executor", default="cpu", help="cpu (the CPU executor) or gpu")
    p.add_argument("--spares", default="0,1", help="spare workers to compare, comma-separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--pause-s", type=float, default=8.0, help="seconds between repetitions")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    stamp = run_stamp()  # where, and when the measurement started
    rows = []
    for spare in map(int, a.spares.split(",")):
        r = measure(spare, a.executor, a.reps, a.pause_s)
        rows.append(r)
        print(f"spare={spare}: the job after a failed one {r['next_job_median_s']:.3f} s (median of {a.reps}; "
              f"{', '.join(f'{x:.3f}' for x in r['next_job_s'])}), the failed job {r['failed_job_median_s']:.3f} s")
    if a.json:
        write_json(a.json, {**stamp, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
