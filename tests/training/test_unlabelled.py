"""training/unlabelled.py: new structures for RL, never on the held-out side of the split."""

import numpy as np
import pytest

from sparserl_compile.training.data import MatrixRef, is_held_out
from sparserl_compile.training.unlabelled import FIRST_SEED, derive_shared, parse_mix, parse_spmm_widths, unlabelled_problems


def _ref(label_problem):
    gen, args = label_problem.label.split("(", 1)
    kwargs = dict(kv.split("=") for kv in args.rstrip(")").split(", "))
    return gen, kwargs


def test_problems_are_deterministic_new_and_never_held_out():
    a = unlabelled_problems(5, seed=3, max_nnz=100_000)
    b = unlabelled_problems(5, seed=3, max_nnz=100_000)
    assert [p.label for p in a] == [p.label for p in b] and len(a) == 5
    assert [p.label for p in unlabelled_problems(5, seed=4, max_nnz=100_000)] != [p.label for p in a]
    for p in a:
        gen, kwargs = _ref(p)
        assert int(kwargs["seed"]) > FIRST_SEED  # the supervision's generated matrices use seeds 0-2
        assert 0 < p.matrix.nnz <= 100_000
        assert (p.op, p.n, p.dtype) in {("spmv", 1, "f32"), ("spmm", 32, "f32")}
        assert p.reference_us is None and p.best_space_us is None  # nothing measured: the evaluator times it
        typed = {k: (float(v) if "." in v else int(v)) for k, v in kwargs.items()}
        assert not is_held_out(MatrixRef("generated", gen, tuple(sorted(typed.items()))))


def test_spmm_widths_are_drawn_equally_and_the_default_draws_stay_as_before():
    base = unlabelled_problems(12, seed=3, max_nnz=100_000)
    assert [(p.label, p.op, p.n) for p in unlabelled_problems(12, seed=3, max_nnz=100_000, spmm_widths=(32,))] == \
        [(p.label, p.op, p.n) for p in base]  # one width: no extra draw, the problems of earlier runs
    wide = unlabelled_problems(40, seed=3, max_nnz=100_000, spmm_widths=(8, 32, 128))
    assert {p.n for p in wide if p.op == "spmm"} == {8, 32, 128}
    assert all(p.n == 1 for p in wide if p.op == "spmv")
    only = unlabelled_problems(6, seed=3, max_nnz=100_000, spmm_widths=(128,))
    assert {p.n for p in only if p.op == "spmm"} == {128}
    for bad in ((), (1,), (32, 0)):
        with pytest.raises(ValueError, match="SpMM widths"):
            unlabelled_problems(2, seed=3, spmm_widths=bad)
    assert parse_spmm_widths("8, 32,128,") == (8, 32, 128) == parse_spmm_widths([8, 32, 128])
    for bad in ("", "32,x", "1"):
        with pytest.raises(ValueError, match="SpMM widths"):
            parse_spmm_widths(bad)


def test_excluded_labels_are_skipped():
    first = unlabelled_problems(1, seed=5, max_nnz=100_000)[0]
    again = unlabelled_problems(1, seed=5, max_nnz=100_000, exclude_labels={first.label})[0]
    assert again.label != first.label


def test_an_impossible_request_says_what_to_change():
    with pytest.raises(ValueError, match="raise max_nnz or ask for fewer"):
        unlabelled_problems(2, seed=0, max_nnz=1, max_draws=20)


def test_the_mix_names_valid_sources_and_rejects_the_rest():
    assert parse_mix("shared:social_powerlaw=3, rmat=1,shared") == {"shared:social_powerlaw": 3.0, "rmat": 1.0,
                                                                   "shared": 1.0}
    for bad in ("nosuch=1", "rmat=-1", "rmat=x", "rmat=0", ""):
        with pytest.raises(ValueError, match="unlabelled mix"):
            parse_mix(bad)


def test_a_mix_draws_only_its_sources():
    mix = parse_mix("banded=1,block_diagonal=1")
    ps = unlabelled_problems(6, seed=2, max_nnz=200_000, mix=mix)
    assert {_ref(p)[0] for p in ps} <= {"banded", "block_diagonal"} and len(ps) == 6


def test_shared_structures_come_from_the_training_side_only(shared_matrices):
    from sparserl_compile import matrices
    from sparserl_compile.training.data import SHARED_HELD_OUT
    from sparserl_compile.training.source_split import held_out_names

    mix = parse_mix("shared:social_powerlaw=1,shared:road_planar=1")
    ps = unlabelled_problems(8, seed=7, max_nnz=300_000, mix=mix)
    again = unlabelled_problems(8, seed=7, max_nnz=300_000, mix=mix)
    assert [p.label for p in ps] == [p.label for p in again]
    assert all((p.matrix != q.matrix).nnz == 0 for p, q in zip(ps, again))
    kinds = {i.name: i for i in matrices.shared_manifest(shared_matrices)}
    for p in ps:
        name, _, rest = p.label.removeprefix("shared:").partition("(")
        assert name not in SHARED_HELD_OUT | held_out_names()  # hep-th, uk, rgg_n_2_15_s0 are never a source
        assert kinds[name].kind in {"social_powerlaw", "road_planar"}
        src = kinds[name]
        # a subset of 30-90 % of the rows (square: of the rows and columns), the columns of a rectangular one kept
        assert 0.29 * src.n_rows <= p.matrix.shape[0] <= 0.9 * src.n_rows
        assert p.matrix.shape[1] == (p.matrix.shape[0] if src.n_rows == src.n_cols else src.n_cols)
        assert 0 < p.matrix.nnz < src.nnz and p.matrix.has_sorted_indices
        # the label reproduces the matrix
        args = dict(kv.split("=") for kv in rest.rstrip(")").split(", "))
        m, how = derive_shared(matrices.load_npz(src.path), np.random.default_rng(int(args["seed"])))
        assert how == f"frac={args['frac']}, relabel={args['relabel']}" and (m != p.matrix).nnz == 0


def test_a_shared_kind_without_matrices_says_so(shared_matrices):
    with pytest.raises(ValueError, match="no training-side matrix"):
        unlabelled_problems(1, seed=0, mix=parse_mix("shared:no_such_kind=1"))


def test_a_shared_source_without_the_folder_says_where_to_point(monkeypatch):
    from sparserl_compile import matrices

    monkeypatch.setattr(matrices, "shared_matrices_dir", lambda: None)
    with pytest.raises(ValueError, match="set SPARSERL_SHARED_MATRICES"):
        unlabelled_problems(1, seed=0, mix=parse_mix("shared=1,rmat=1"))
    assert len(unlabelled_problems(2, seed=0, max_nnz=100_000, mix=parse_mix("rmat=1"))) == 2  # generators need no folder


def test_uniform_random_shapes_draws_the_shapes_the_square_sampler_never_does():
    """A mix-only source: tall, wide and very sparse or dense-row uniform random matrices,
    labelled and split as ``uniform_random``'s; the default draw does not include it."""
    ps = unlabelled_problems(12, seed=1, max_nnz=1_000_000, mix=parse_mix("uniform_random_shapes=1"))
    shapes = set()
    for p in ps:
        gen, kwargs = _ref(p)
        assert gen == "uniform_random" and p.label.startswith("uniform_random(")
        rows, cols, per_row = int(kwargs["n_rows"]), int(kwargs["n_cols"]), int(kwargs["per_row"])
        assert p.matrix.shape == (rows, cols)
        assert rows != cols or per_row in (1, 64, 128, 256)  # never the square sampler's 2-32 per row
        shapes.add("tall" if rows > cols else "wide" if cols > rows else "square")
        typed = {k: int(v) for k, v in kwargs.items()}
        assert not is_held_out(MatrixRef("generated", gen, tuple(sorted(typed.items()))))
    assert shapes == {"tall", "wide", "square"}
    # the default draw is what it was before the source existed (pinned from that code)
    assert [p.label for p in unlabelled_problems(4, seed=1, max_nnz=200_000)] == [
        "uniform_random(n_cols=5415, n_rows=5415, per_row=2, seed=102)", "rmat(edge_factor=4, scale=14, seed=105)",
        "block_diagonal(block=4, n_blocks=8360, seed=110)", "random_geometric(avg_degree=4, n=29919, seed=111)"]
    with pytest.raises(ValueError, match="uniform_random_shapes"):  # named among the valid sources
        parse_mix("uniform_random_wide=1")
