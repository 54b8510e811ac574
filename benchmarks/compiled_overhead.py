"""Where the host time of a compiled sparserl forward goes (GPU): a 2-layer GCN on a small
random graph (host-bound: its GPU work is a few microseconds), timed eager and compiled, with
runtime counters, a cProfile of the compiled calls, and the call stacks of any host<->device
copies the compiled forward makes.

    python benchmarks/compiled_overhead.py [--nodes 3000] [--calls 200]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gnn_inference as g  # noqa: E402

import sparserl_compile as sr  # noqa: E402
from sparserl_compile import config, matrices, plans  # noqa: E402
from sparserl_compile.bench import wall_median_us  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    return wall_median_us(fn, "cuda", reps=calls, warmup=10)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=3000)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args(argv)
    a = g.normalized_adjacency(matrices.random_geometric(args.nodes, 5.0, seed=0), "gcn")
    x = torch.randn(args.nodes, args.hidden, device="cuda")
    m = g.GCN(g.native_csr(a, "cuda"), args.hidden, args.hidden, args.hidden).cuda().eval()
    with torch.no_grad():
        print(f"torch.sparse eager      {per_call_us(lambda: m(x), args.calls):8.1f} us")
        m.adj = sr.sparsify(a).to("cuda")
        m(x)
        print(f"sparserl eager          {per_call_us(lambda: m(x), args.calls):8.1f} us")
        c = torch.compile(m, backend="sparserl", fullgraph=True)
        c(x)
        plans.reset_stats()
        print(f"sparserl compiled       {per_call_us(lambda: c(x), args.calls):8.1f} us")
        print("runtime stats over those calls:", config.stats())
        print("plans:", {k[1:3]: repr(v) for k, v in plans.plans().items()})
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.calls):
            c(x)
        torch.cuda.synchronize()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
        print(s.getvalue())
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            for _ in range(3):
                c(x)
            torch.cuda.synchronize()
        for e in prof.events():
            if "Memcpy" in e.name or "memcpy" in e.name.lower() or "Synchronize" in e.name:
                print(e.name, f"{e.cpu_time_total:.1f}us", "\n   " + "\n   ".join(e.stack[:12]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
