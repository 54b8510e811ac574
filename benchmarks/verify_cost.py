"""What verification and timing cost per candidate (GPU): the first product's selection on a
new structure, as the runtime runs it (one sandbox worker, ``select.evaluate``), with every
check and then with the cheaper configuration of before the adversarial checks (random
value sets only, the call's width only), side by side.

Per matrix and op: the selection's wall time, the reference's, and per candidate the worker's
phases (prepare, values, runs at n, widths, cusparse, time = flushed timing, graph = hot
timing), the widths verified, the out-of-bounds mode, the flushed and hot times and the
verdict; the decision (``select.decide``) with both reference figures.

    python benchmarks/verify_cost.py [--json out.json] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from sparserl_compile import kernels, matrices, structure
from sparserl_compile.problem import Problem
from sparserl_compile.sandbox import SandboxJob, SandboxPool
from sparserl_compile.select import decide, evaluate


def _problem(m, op: str, n: int) -> Problem:
    return Problem(op, "f32", n, m.shape[0], m.shape[1], m.nnz, m.indptr, m.indices,
                   structure.fingerprint(m.indptr, m.indices, m.shape), "gpu")


class _Reduced:
    """A pool whose candidate jobs leave out the special sets and the other widths."""

    def __init__(self, pool):
        self.pool, self.workers = pool, pool.workers

    def run(self, job: SandboxJob, pattern, **kw):
        if job.candidate is not None:
            job = replace(job, widths=(), special=False)
        return self.pool.run(job, pattern, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--k", type=int, default=4, help="candidates per product (the runtime's default k)")
    args = ap.parse_args()
    cases = [("stencil2d_450", matrices.stencil2d(450)), ("rmat_16", matrices.rmat(16, 16, seed=1))]
    rows = []
    with SandboxPool(1, timeout_s=300) as pool:
        pool.start(wait=True)
        warm = matrices.stencil2d(30)  # the worker's first CUDA work, off the measurements
        evaluate(_problem(warm, "spmv", 1), kernels.space("spmv", "f32")[:1], pool=pool, executor="gpu")
        for name, m in cases:
            for op, n in (("spmv", 1), ("spmm", 64)):
                cands = [c for c in kernels.space(op, "f32", n=n) if c.family.startswith("csr")][:args.k]
                prob = _problem(m, op, n)
                for config, p in (("every check", pool), ("random sets, n only", _Reduced(pool))):
                    t0 = time.perf_counter()
                    ev = evaluate(prob, cands, pool=p, executor="gpu")
                    wall = time.perf_counter() - t0
                    rec = decide(cands, ev).record
                    row = {"matrix": name, "nnz": int(m.nnz), "op": op, "n": n, "config": config,
                           "select_s": round(wall, 3), "parts": rec["parts"], "chosen": rec.get("chosen"),
                           "rule": rec.get("rule"), "reference_us": rec["reference_us"],
                           "reference_hot_us": rec["reference_hot_us"],
                           "candidates": [{k: c.get(k) for k in ("name", "kind", "failed_check", "kernel_us", "hot_us",
                                                                  "hot_method", "widths_verified", "oob", "phases",
                                                                  "wall_s")} for c in rec["candidates"]]}
                    rows.append(row)
                    print(f"{name} {op} n={n} [{config}]: {wall:.2f} s, chosen {row['chosen']}, "
                          f"reference {row['reference_us']} us flushed / {row['reference_hot_us']} us hot", flush=True)
                    for c in row["candidates"]:
                        print(f"   {c['name']}: {c['kind']} {c['kernel_us']} / {c['hot_us']} us, "
                              f"{len(c['widths_verified'] or [])} widths, phases {c['phases']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
