"""training/unlabelled.py: new structures for RL, never on the held-out side of the split."""

import pytest

from training.data import MatrixRef, is_held_out
from training.unlabelled import FIRST_SEED, unlabelled_problems


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


def test_excluded_labels_are_skipped():
    first = unlabelled_problems(1, seed=5, max_nnz=100_000)[0]
    again = unlabelled_problems(1, seed=5, max_nnz=100_000, exclude_labels={first.label})[0]
    assert again.label != first.label


def test_an_impossible_request_says_what_to_change():
    with pytest.raises(ValueError, match="raise max_nnz or ask for fewer"):
        unlabelled_problems(2, seed=0, max_nnz=1, max_draws=20)
