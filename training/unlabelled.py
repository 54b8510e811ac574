"""Problems no supervision record covers, for stage 3 (``sparserl train rl --unlabelled N``).

SFT imitates each training record's fastest measured kernel, so RL on the same records has
little left to find (docs/training.md, "Known gaps"). What it can add is reward on structures
the supervision never measured. This module draws them: the training generators
(``sparserl_compile.matrices.GENERATORS``) at seeds from 100 up (the supervision uses 0-2) and
at sizes drawn from ranges like the supervision's. Each is SpMV or SpMM with N = 32 (the two
products the supervision mostly holds), float32.

Such a problem has no measured reference and no kernel-space best. The GPU evaluator times
cuSPARSE itself, so the speed term of the reward is ``log2(cuSPARSE / kernel)`` alone
(``training/rewards.py``). The CPU evaluators have no cuSPARSE time for these problems: there
the reward is compiling and being correct only.

A drawn matrix whose generator and arguments fall on the held-out side of the split rule
(``training.data.is_held_out``) is skipped. So are matrices above ``max_nnz`` and labels the
supervision holds. RL therefore never sees a held-out matrix.
"""

from __future__ import annotations

import numpy as np

#: generator -> a function of a numpy Generator giving its keyword arguments (seed excluded)
SAMPLERS = {
    "stencil2d": lambda r: {"n": int(r.integers(60, 800))},
    "stencil3d": lambda r: {"n": int(r.integers(10, 80))},
    "banded": lambda r: {"n": int(r.integers(5_000, 200_000)), "half_bandwidth": int(r.choice([0, 1, 2, 4, 8, 16, 32]))},
    "block_diagonal": lambda r: {"block": int(r.choice([2, 4, 8, 16, 32])), "n_blocks": int(r.integers(500, 20_000))},
    "block_random": lambda r: {"R": (b := int(r.choice([2, 4]))), "C": b, "blocks_per_row": int(r.integers(1, 6)),
                               "n_brows": (n := int(r.integers(5_000, 50_000))), "n_bcols": n},
    "uniform_random": lambda r: {"n_rows": (n := int(r.integers(2_000, 100_000))), "n_cols": n,
                                 "per_row": int(r.choice([2, 4, 8, 16, 32]))},
    "rmat": lambda r: {"scale": int(r.integers(11, 17)), "edge_factor": int(r.choice([4, 8, 16, 32]))},
    "random_geometric": lambda r: {"n": int(r.integers(5_000, 100_000)), "avg_degree": int(r.choice([4, 8, 16, 32]))},
    "circuit": lambda r: {"n": int(r.integers(5_000, 100_000)), "per_row": int(r.integers(3, 6)),
                          "dense_lines": int(r.integers(0, 20)), "dense_fill": float(r.choice([0.01, 0.05, 0.2]))},
}

#: generator -> its nonzero count from its arguments, about (to skip a draw before building it)
ESTIMATES = {
    "stencil2d": lambda a: 5 * a["n"] ** 2,
    "stencil3d": lambda a: 7 * a["n"] ** 3,
    "banded": lambda a: a["n"] * (2 * a["half_bandwidth"] + 1),
    "block_diagonal": lambda a: a["block"] ** 2 * a["n_blocks"],
    "block_random": lambda a: a["R"] * a["C"] * a["blocks_per_row"] * a["n_brows"],
    "uniform_random": lambda a: a["n_rows"] * a["per_row"],
    "rmat": lambda a: 2 ** a["scale"] * a["edge_factor"],
    "random_geometric": lambda a: a["n"] * a["avg_degree"],
    "circuit": lambda a: a["n"] * (a["per_row"] + a["dense_lines"] * a["dense_fill"]),
}

#: the first seed used; the supervision's generated matrices use 0-2
FIRST_SEED = 100


def unlabelled_problems(count: int, seed: int = 0, max_nnz: int = 0, exclude_labels=frozenset(),
                        max_draws: int | None = None) -> list:
    """``count`` ``RLProblem``s on generated matrices no supervision record names (module doc).
    Deterministic in ``seed``. Raises ValueError when ``max_draws`` (default ``50 * count``)
    draws leave fewer than ``count``."""
    from sparserl_compile import matrices
    from training.data import MatrixRef, is_held_out
    from training.rewards import RLProblem

    rng = np.random.default_rng(seed)
    names = sorted(SAMPLERS)
    out, draws = [], 0
    limit = max_draws if max_draws is not None else 50 * max(count, 1)
    while len(out) < count:
        if draws >= limit:
            raise ValueError(f"{draws} draws gave {len(out)} of {count} unlabelled problems "
                             f"(max_nnz={max_nnz}): raise max_nnz or ask for fewer")
        draws += 1
        gen = names[int(rng.integers(len(names)))]
        kwargs = {**SAMPLERS[gen](rng), "seed": FIRST_SEED + draws}
        ref = MatrixRef("generated", gen, tuple(sorted(kwargs.items())))
        if is_held_out(ref) or ref.label in exclude_labels or (max_nnz and ESTIMATES[gen](kwargs) > 1.5 * max_nnz):
            continue
        m = matrices.generate(gen, **kwargs)
        if m.nnz == 0 or (max_nnz and m.nnz > max_nnz):
            continue
        op, n = ("spmv", 1) if rng.random() < 0.5 else ("spmm", 32)
        out.append(RLProblem(m, op, "f32", n, ref.label))
    return out
