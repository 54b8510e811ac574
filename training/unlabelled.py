"""Problems no supervision record covers, for stage 3 (``sparserl train rl --unlabelled N``).

SFT imitates each training record's fastest measured kernel, so RL on the same records has
little left to find. What it can add is reward on structures
the supervision never measured. This module draws them: the training generators
(``sparserl_compile.matrices.GENERATORS``) at seeds from 100 up (the supervision uses 0-2) and
at sizes drawn from ranges like the supervision's. Each is SpMV or SpMM with N = 32 (the two
products the supervision mostly holds), float32. ``spmm_widths`` (``--unlabelled-spmm-n``) gives
the SpMM problems other widths, drawn equally: the held-out split holds SpMM with N = 8 and 128
too.

Such a problem has no measured reference and no kernel-space best. The GPU evaluator times
cuSPARSE itself, so the speed term of the reward is ``log2(cuSPARSE / kernel)`` alone
(``training/rewards.py``). The CPU evaluators have no cuSPARSE time for these problems: there
the reward is compiling and being correct only.

A drawn matrix whose generator and arguments fall on the held-out side of the split rule
(``training.data.is_held_out``) is skipped. So are matrices above ``max_nnz`` and labels the
supervision holds. RL therefore never sees a held-out matrix.

The generators have no social graph, GNN feature matrix or FEM model. A second source,
``shared``, covers those kinds: a new structure derived from a training-side matrix of
``../shared/matrices`` (``derive_shared``): the rows (for a square matrix also the columns) of a
random subset of 30-90 % of its indices, in their order or, half the time, randomly relabelled.
A held-out matrix is never a source. ``mix`` weights the sources (``parse_mix``: e.g.
``shared:social_powerlaw=3,rmat=1``); without it the generators are drawn equally, as before.

``uniform_random_shapes`` (a mix source only, never drawn without a mix) is the uniform random
generator at the shapes ``uniform_random``'s sampler never draws and the supervision grids
hold: tall (4-40 times more rows than columns), wide (4-20 times more columns), and 1 or
64-256 nonzeros per row, where the held-out uniform random records have room for RL to gain.
Its matrices are labelled, split and skipped as ``uniform_random``'s.
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


def _uniform_random_shapes(r) -> dict:
    shape = r.choice(["tall", "wide", "square"])
    if shape == "tall":
        cols = int(r.integers(1_000, 20_000))
        return {"n_rows": cols * int(r.integers(4, 41)), "n_cols": cols, "per_row": int(r.choice([1, 2, 4, 8]))}
    if shape == "wide":
        rows = int(r.integers(1_000, 20_000))
        return {"n_rows": rows, "n_cols": rows * int(r.integers(4, 21)), "per_row": int(r.choice([16, 64, 256]))}
    n = int(r.integers(2_000, 100_000))
    return {"n_rows": n, "n_cols": n, "per_row": int(r.choice([1, 64, 128, 256]))}


#: mix-only source -> (the generator it draws, its sampler); never drawn without a mix, so the
#: default draw (``sorted(SAMPLERS)``) is what it always was
EXTRA_SOURCES = {"uniform_random_shapes": ("uniform_random", _uniform_random_shapes)}

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


def parse_spmm_widths(widths) -> tuple[int, ...]:
    """The SpMM widths N of ``unlabelled_problems``: a sequence of ints, or their comma-separated
    text (``--unlabelled-spmm-n 8,32,128``). Raises ValueError unless one or more integers >= 2."""
    try:
        out = tuple(int(w) for w in (widths.split(",") if isinstance(widths, str) else widths)
                    if not isinstance(w, str) or w.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 2:
        raise ValueError(f"SpMM widths {widths!r}: give one or more SpMM widths N >= 2, e.g. 8,32,128")
    return out


def parse_mix(text: str) -> dict[str, float]:
    """``'shared:social_powerlaw=3,rmat=1,shared=0.5'`` -> source -> weight. A source is a
    generator of ``SAMPLERS``, ``shared`` (any kind of the shared folder's training side) or
    ``shared:<kind>``. Raises ValueError naming the bad entry and the valid sources."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, w = part.partition("=")
        name = name.strip()
        try:
            weight = float(w) if eq else 1.0
        except ValueError:
            weight = -1.0
        if not (name in SAMPLERS or name in EXTRA_SOURCES or name == "shared" or name.startswith("shared:")) \
                or weight < 0:
            raise ValueError(f"unlabelled mix entry {part!r}: write SOURCE=WEIGHT (weight >= 0) with SOURCE one of "
                             f"{sorted(SAMPLERS) + sorted(EXTRA_SOURCES)}, 'shared' or 'shared:<kind>'")
        out[name] = weight
    if not out or sum(out.values()) <= 0:
        raise ValueError(f"unlabelled mix {text!r} gives no source a positive weight")
    return out


def shared_sources(kind: str | None = None) -> list:
    """The shared folder's training-side matrices (``MatrixInfo``) whose file is present, of
    ``kind`` when given; [] without the folder."""
    from sparserl_compile import matrices
    from sparserl_compile.training.data import MatrixRef, is_held_out

    return [i for i in matrices.shared_manifest() if i.path.is_file() and (kind is None or i.kind == kind)
            and not is_held_out(MatrixRef("shared", name=i.name))]


def derive_shared(m, rng: np.random.Generator):
    """A new structure from CSR ``m`` (module doc) -> (matrix, description for the label).
    Deterministic in ``rng``'s seed, which the label names."""
    import scipy.sparse as sp

    frac = float(np.round(rng.uniform(0.3, 0.9), 2))
    relabel = bool(rng.random() < 0.5)
    rows = np.sort(rng.choice(m.shape[0], max(1, int(frac * m.shape[0])), replace=False))
    if relabel:
        rows = rng.permutation(rows)
    sub = m[rows]
    if m.shape[0] == m.shape[1]:
        sub = sub[:, rows]
    sub = sp.csr_matrix(sub)
    sub.sort_indices()
    return sub, f"frac={frac}, relabel={int(relabel)}"


def unlabelled_problems(count: int, seed: int = 0, max_nnz: int = 0, exclude_labels=frozenset(),
                        max_draws: int | None = None, mix: dict[str, float] | None = None,
                        first_seed: int = FIRST_SEED, spmm_widths=(32,)) -> list:
    """``count`` ``RLProblem``s on matrices no supervision record names (module doc): generated,
    and with ``mix`` naming ``shared`` sources, derived from the shared folder's training side.
    Half are SpMV, half SpMM with an N of ``spmm_widths``, drawn equally.
    Deterministic in ``seed`` (and the shared folder). The generators' and derivations' seeds
    count from ``first_seed`` (stage 3's validation problems use their own range,
    ``training/validation.py``). Raises ValueError when ``max_draws``
    (default ``50 * count``) draws leave fewer than ``count``, or when a ``shared`` source has no
    matrix."""
    from sparserl_compile import matrices
    from sparserl_compile.training.data import MatrixRef, is_held_out
    from sparserl_compile.training.rewards import RLProblem

    widths = parse_spmm_widths(spmm_widths)
    rng = np.random.default_rng(seed)
    names = sorted(SAMPLERS) if mix is None else sorted(k for k, w in mix.items() if w > 0)
    weights = None if mix is None else np.array([mix[k] for k in names]) / sum(mix[k] for k in names)
    pools = {}
    for name in names:
        if name.startswith("shared"):
            pools[name] = shared_sources(name.partition(":")[2] or None)
            if not pools[name]:
                raise ValueError(f"unlabelled source {name!r} has no training-side matrix: "
                                 + ("set SPARSERL_SHARED_MATRICES to the folder holding MANIFEST.json"
                                    if matrices.shared_matrices_dir() is None else "check the kind's name in MANIFEST.json"))
    out, draws = [], 0
    limit = max_draws if max_draws is not None else 50 * max(count, 1)
    while len(out) < count:
        if draws >= limit:
            raise ValueError(f"{draws} draws gave {len(out)} of {count} unlabelled problems "
                             f"(max_nnz={max_nnz}): raise max_nnz or ask for fewer")
        draws += 1
        gen = names[int(rng.integers(len(names)))] if weights is None else names[int(rng.choice(len(names), p=weights))]
        if gen in pools:
            info = pools[gen][int(rng.integers(len(pools[gen])))]
            if max_nnz and 0.3 * info.nnz > max_nnz:
                continue
            m, how = derive_shared(matrices.load_npz(info.path), np.random.default_rng(first_seed + draws))
            label = f"shared:{info.name}({how}, seed={first_seed + draws})"
        else:
            gen, sampler = EXTRA_SOURCES.get(gen, (gen, SAMPLERS.get(gen)))
            kwargs = {**sampler(rng), "seed": first_seed + draws}
            ref = MatrixRef("generated", gen, tuple(sorted(kwargs.items())))
            if is_held_out(ref) or ref.label in exclude_labels or (max_nnz and ESTIMATES[gen](kwargs) > 1.5 * max_nnz):
                continue
            m, label = matrices.generate(gen, **kwargs), ref.label
        if m.nnz == 0 or (max_nnz and m.nnz > max_nnz) or label in exclude_labels:
            continue
        op, n = ("spmv", 1) if rng.random() < 0.5 else ("spmm", widths[0])
        if op == "spmm" and len(widths) > 1:  # one more draw only then: the default draws stay as before
            n = widths[int(rng.integers(len(widths)))]
        out.append(RLProblem(m, op, "f32", n, label))
    return out
