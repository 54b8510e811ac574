"""Where the policy provider's proposal spends its time: cProfile of ``PolicyProvider.candidates``.

The proposal is what the policy adds to a first call over the lookup (``propose_s`` in
``provider_e2e.py``: a median 0.15-0.21 s a product on the H100s, 0.01 s for ``nearest``). This
runs the default provider (``samples="branches"``, k = 4) on the first ``--records`` held-out
records (after one warm-up proposal) under cProfile and writes the functions by own and by
cumulative time, with the model's forward count and the total seconds. On a GPU the time the
host waits for the device shows up in the call that synchronizes (``.item()``, ``.tolist()``,
``.cpu()``).

    python benchmarks/propose_profile.py [--device cuda] [--records 20] [--out profile.txt]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time


def main(argv=None) -> int:
    import torch

    from sparserl_compile.policy.model import CountingPolicy
    from sparserl_compile.policy.provider import PolicyProvider
    from sparserl_compile.policy.retrieval import problem_for
    from sparserl_compile import matrices
    from sparserl_compile.bench import sync
    from sparserl_compile.training import data

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--records", type=int, default=20)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--lines", type=int, default=40)
    p.add_argument("--out", help="write the report here (else stdout)")
    a = p.parse_args(argv)
    prov = PolicyProvider(device=a.device)
    prov.model = counted = CountingPolicy(prov.model)
    prov.candidates(problem_for("spmv", "f32", 1, matrices.generate("banded", n=500, half_bandwidth=1, seed=1)), a.k)
    problems = []
    for r in data.split(data.load_supervision(data.DEFAULT_SUPERVISION)).held_out:
        if len(problems) == a.records:
            break
        try:
            problems.append(problem_for(r.op, "f32", r.n, r.matrix.load()))
        except FileNotFoundError:
            continue
    counted.calls = 0
    prof = cProfile.Profile()
    sync(a.device)
    t0 = time.perf_counter()
    prof.enable()
    for problem in problems:
        prov.candidates(problem, a.k)
    sync(a.device)
    prof.disable()
    total = time.perf_counter() - t0
    buf = io.StringIO()
    buf.write(f"device {a.device}, torch {torch.__version__}: {len(problems)} proposals, {total:.3f} s "
              f"({total / max(len(problems), 1):.3f} s each), {counted.calls} forwards "
              f"({1e3 * total / max(counted.calls, 1):.2f} ms a forward, all included)\n")
    for key in ("tottime", "cumulative"):
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats(key).print_stats(a.lines)
    text = buf.getvalue()
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text.splitlines()[0], flush=True)
    if not a.out:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
