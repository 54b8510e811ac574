"""``sparserl demo``: the main job, end to end, on generated matrices, on any machine.

For a handful of generated matrices (a 2D stencil, a band, block-diagonal, uniform random,
an R-MAT power-law graph) and both products (SpMV, SpMM), it does what the runtime does on a
miss and shows every step in one table:

1. the provider proposes candidate kernels (the runtime's default: the nearest-neighbour
   lookup over measured winners; ``--provider policy`` asks the bundled language-model policy,
   which needs the ``train`` extra; ``--provider search`` times the whole kernel space);
2. ``select.choose`` compiles each with NVRTC and verifies it in a killable sandbox worker --
   on a GPU against cuSPARSE and float64 and timed side by side with cuSPARSE; without a GPU
   with the CPU executor (``simt``) against float64, untimed;
3. the product then runs through a ``SparseRLTensor`` and is compared with scipy in float64.

Nothing is written to the user's kernel cache: the demo uses a temporary one.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np
from sparserl_compile.problem import make_problem

DEMO_MATRICES = (
    ("stencil2d_32", "stencil2d", {"n": 32}),
    ("banded_2k_b3", "banded", {"n": 2000, "half_bandwidth": 3}),
    ("blockdiag_64x8", "block_diagonal", {"n_blocks": 64, "block": 8}),
    ("uniform_2k_d6", "uniform_random", {"n_rows": 2000, "n_cols": 2000, "per_row": 6}),
    ("rmat_s11_e6", "rmat", {"scale": 11, "edge_factor": 6}),
)


@dataclass
class DemoRow:
    matrix: str
    nnz: int
    op: str
    provider: str
    proposed: int
    verified: str  # "verified/evaluated"
    chosen: str
    kernel_us: float | None
    reference_us: float | None
    rel_err: float
    seconds: float


def _provider(name: str | None):
    """The named provider, else the runtime's default (``providers.DefaultProvider``: the lookup).

    ``--provider policy`` uses the policy provider's default checkpoint
    (``policy/checkpoints/default``; its held-out figures are in docs/policy.md, "Evaluation").
    """
    from sparserl_compile import providers

    return providers.resolve(name) if name else providers.get_provider()


def run(provider_name: str | None = None, n: int = 16, k: int = 4, quick: bool = False) -> list[DemoRow]:
    import torch

    import sparserl_compile as sr
    from sparserl_compile import problem, select
    from sparserl_compile.sandbox import SandboxPool

    prov = _provider(provider_name)
    sr.set_provider(prov)
    executor = select.default_executor()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    arch = problem.device_arch(torch.device(device))
    rows: list[DemoRow] = []
    with SandboxPool(1) as pool:  # one worker for every candidate: no process start per product
        for name, gen, kw in DEMO_MATRICES[:2] if quick else DEMO_MATRICES:
            for op, width in (("spmv", 1), ("spmm", n)):
                rows.append(_one_product(name, gen, kw, op, width, prov, pool, executor, device, arch, k))
    return rows


def _one_product(name, gen, kw, op, width, prov, pool, executor, device, arch, k) -> DemoRow:
    """Propose, select, then run the product through a SparseRLTensor against scipy."""
    import torch

    import sparserl_compile as sr
    from sparserl_compile import matrices, select, structure

    t0 = time.perf_counter()
    m = matrices.generate(gen, seed=0, **kw)
    fp = structure.fingerprint(m.indptr, m.indices, m.shape)
    problem = make_problem(op, "f32", width, m.indptr, m.indices, m.shape, fp, arch)
    cands = prov.candidates(problem, k if prov.name == "policy" else 0)
    choice = select.choose(problem, cands, executor=executor, pool=pool) if cands else None
    recs = choice.record.get("candidates", []) if choice else []
    ok = sum(r["kind"] == "ok" for r in recs)
    x = np.random.default_rng(1).standard_normal(m.shape[1] if op == "spmv" else (m.shape[1], width))
    x = x.astype(np.float32)
    y = (sr.sparsify(m).to(device) @ torch.from_numpy(x).to(device)).cpu().numpy()
    ref = m.astype(np.float64) @ x.astype(np.float64)
    err = float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))
    if choice is None:
        chosen = "no candidates: reference"
    elif choice.dense:
        chosen = "the dense product (faster than cuSPARSE and every candidate)"
    elif choice.candidate is None:
        chosen = "reference" if ok else "none verified: reference"
    else:
        chosen = choice.candidate.name
    label = op if op == "spmv" else f"spmm{width}"
    print(f"  {name} {label}: {chosen} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    return DemoRow(name, m.nnz, label, prov.name, len(cands), f"{ok}/{len(recs)}", chosen,
                   None if choice is None else choice.kernel_us,
                   None if choice is None else choice.reference_us, err, time.perf_counter() - t0)


def format_table(rows: list[DemoRow], executor: str) -> str:
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    head = (f"{'matrix':16s} {'nnz':>7s} {'op':7s} {'provider':8s} {'cands':>5s} {'verified':>8s} "
            f"{'kernel_us':>9s} {'cusparse_us':>11s} {'speedup':>7s} {'rel_err':>8s} {'s':>5s}  chosen")
    out = [head, "-" * len(head)]
    speedups = []
    for r in rows:
        sp = None if r.kernel_us is None or r.reference_us is None else r.reference_us / r.kernel_us
        if sp:
            speedups.append(sp)
        out.append(f"{r.matrix:16s} {r.nnz:>7d} {r.op:7s} {r.provider:8s} {r.proposed:>5d} {r.verified:>8s} "
                   f"{f(r.kernel_us):>9s} {f(r.reference_us):>11s} {f(sp, '.2f'):>7s} {r.rel_err:>8.1e} "
                   f"{r.seconds:>5.1f}  {r.chosen[:48]}")
    if executor == "cpu":
        out.append("no GPU here: candidates were compiled with NVRTC (sm_90) and verified with the CPU "
                   "executor; nothing was timed. On a GPU the same command times them against cuSPARSE.")
    elif speedups:
        g = math.exp(sum(map(math.log, speedups)) / len(speedups))
        out.append(f"geometric-mean speedup of the chosen kernels over cuSPARSE: {g:.2f}x ({len(speedups)} products)")
    return "\n".join(out)


def preflight(executor: str) -> list[str]:
    """What this machine lacks to compile and verify kernels, each as a sentence that names the
    fix (empty: nothing). Without it every candidate fails and the demo shows only the reference."""
    problems = []
    try:
        from sparserl_compile import compiler

        compiler.nvrtc_version()
    except Exception as e:  # noqa: BLE001 - any failure to reach NVRTC is reported the same way
        problems.append(f"NVRTC is unavailable ({str(e).splitlines()[0][:160]}): install the gpu extra, "
                        "pip install -e '.[gpu]' (or '.[dev]')")
    if executor == "cpu":
        from sparserl_compile.simt import build

        try:
            build.compiler()
        except Exception as e:  # noqa: BLE001 - SimtUnavailable names the compiler it looked for
            problems.append(str(e))
    return problems


def _cmd(args) -> int:
    from sparserl_compile import select

    missing = preflight(select.default_executor())
    for why in missing:
        print(f"sparserl demo: {why}", file=sys.stderr)
    if missing:
        print("sparserl demo: every product will run the reference until that is fixed", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="sparserl-demo-") as d:
        os.chmod(d, 0o700)
        os.environ["SPARSERL_CACHE_DIR"] = d
        rows = run(args.provider, n=args.n, k=args.k, quick=args.quick)
    print(format_table(rows, select.default_executor()))
    bad = [r for r in rows if not r.rel_err < 1e-4]
    if bad:
        print(f"WRONG RESULTS: {[(r.matrix, r.op) for r in bad]}", file=sys.stderr)
        return 1
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("demo", help="the main job on generated matrices (works without a GPU)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--provider", default=None, help="search | nearest | policy (default: the runtime's, i.e. the nearest lookup)")
    p.add_argument("--n", type=int, default=16, help="SpMM dense width")
    p.add_argument("--k", type=int, default=4, help="policy samples per product")
    p.add_argument("--quick", action="store_true", help="two matrices only")
    p.set_defaults(func=_cmd)
