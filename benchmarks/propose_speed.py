"""The policy provider's proposal, its candidates decoded one at a time or in one batch.

``PolicyProvider.candidates(problem, k)`` is the part of a first call that the policy costs
(encoding the structure, decoding k kernels; ``propose_s`` in ``benchmarks/cold_start.py``).
For each of cold start's matrices (``cold_start.MATRICES``) and widths this times it (the median of ``--repeats``) and
counts its model calls twice: as the provider decodes now, one candidate after another, and with
``DecodeConfig(batch_drafts=True)``, the first k candidates speculatively in one batch. Each is
timed with the fill budget at 0 (``first_k``: the first k hints only, the same work both ways)
and at the provider's (``with_budget``: what a first call pays; a faster proposal may decode
more fill-up hints in the time it saved). Greedy candidates are the same tokens either way; the
fill-up hints depend on the timing, so the candidate lists are compared with the budget lifted
(``same_candidates``).

    python benchmarks/propose_speed.py [--checkpoint policy/checkpoints/retrieval] [--device cpu|cuda]
                                       [--k 4] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import torch

from sparserl_compile.policy.model import CountingPolicy
from sparserl_compile.policy.provider import PolicyProvider
from sparserl_compile.policy.retrieval import problem_for
from sparserl_compile import matrices
from sparserl_compile.bench import sync
from sparserl_compile.fileio import write_json

from cold_start import MATRICES  # benchmarks/: cold start's structures


def run(checkpoint: str, device: str, k: int, repeats: int, widths=(1, 32)) -> list[dict]:
    prov = PolicyProvider(checkpoint=checkpoint, device=device)
    counted = CountingPolicy(prov.model)
    prov.model = counted
    base, budget = prov.decode, prov.fill_budget_s
    prov.candidates(problem_for("spmv", "f32", 1, matrices.generate("banded", n=500, half_bandwidth=1, seed=1)),
                    k=k)  # warm-up
    rows = []
    for label, gen, kw in MATRICES:
        m = matrices.generate(gen, **kw)
        for n in widths:
            problem = problem_for("spmv" if n == 1 else "spmm", "f32", n, m)
            row = {"matrix": label, "n": n, "samples": prov.samples}
            sources = {}
            for mode, batch in (("one_at_a_time", False), ("one_batch", True)):
                prov.decode = replace(base, batch_drafts=batch)
                row[mode] = {}
                # budget 0: the first k hints only, the same work both ways; the provider's budget:
                # a faster proposal may spend what it saved on more fill-up hints
                for key, fill in (("first_k", 0.0), ("with_budget", budget)):
                    prov.fill_budget_s = fill
                    seconds, calls = [], []
                    for _ in range(repeats):
                        counted.calls = 0
                        sync(device)
                        t0 = time.perf_counter()
                        prov.candidates(problem, k=k)
                        sync(device)
                        seconds.append(time.perf_counter() - t0)
                        calls.append(counted.calls)
                    row[mode][key] = {"median_s": sorted(seconds)[len(seconds) // 2], "seconds": seconds,
                                      "calls": calls}
                prov.fill_budget_s = float("inf")  # the candidates, whatever the timing
                sources[mode] = [c.source for c in prov.candidates(problem, k=k)]
                prov.fill_budget_s = budget
            row["same_candidates"] = sources["one_at_a_time"] == sources["one_batch"]
            rows.append(row)
            text = "  ".join(f"{key}: {row['one_at_a_time'][key]['median_s']:.3f}s ({row['one_at_a_time'][key]['calls'][0]} "
                             f"calls) -> {row['one_batch'][key]['median_s']:.3f}s ({row['one_batch'][key]['calls'][0]})"
                             for key in ("first_k", "with_budget"))
            print(f"{label:16s} n={n:<3d} {text}  same candidates {row['same_candidates']}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="policy/checkpoints/retrieval")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args(argv)
    rows = run(a.checkpoint, a.device, a.k, a.repeats)
    if a.json:
        write_json(a.json, {"rows": rows, "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(0),
                            "torch": torch.__version__, "checkpoint": a.checkpoint, "k": a.k})
    return 0 if all(r["same_candidates"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
