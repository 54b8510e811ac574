"""training/neighbours.py: the nearest provider's table from supervision records and its
offline best-of-k on held-out records, read off their measured times."""

from __future__ import annotations

import pytest

from sparserl_compile import nearest
from sparserl_compile.training import data, neighbours


def rec(generator, kwargs, variants, op="spmv", n=1):
    return data.SupervisionRecord(
        data.MatrixRef("generated", generator, tuple(sorted(kwargs.items()))), op, "f32", n,
        tuple(data.Variant(f, tuple(sorted(p.items())), us) for f, p, us in variants), reference_us=10.0)


def test_table_entries_rank_verified_variants_fastest_first(tmp_path):
    r = rec("stencil2d", {"n": 8}, [("b", {}, 3.0), ("a", {"x": 1}, 1.0), ("bad", {}, None)])
    (e,) = neighbours.entries_from_records([r])
    assert [f for f, _, _ in e.ranked] == ["a", "b"] and e.label == r.matrix.label
    assert neighbours.best_of_k(r, [("b", ()), ("a", (("x", 1),))], 1) == pytest.approx(1 / 3)
    assert neighbours.best_of_k(r, [("b", ()), ("a", (("x", 1),))], 2) == 1.0
    assert neighbours.best_of_k(r, [("unmeasured", ())], 1) is None
    nearest.save_table([e], tmp_path / "t.json.gz", source="test")
    assert nearest.load_table(tmp_path / "t.json.gz")[0].ranked == e.ranked


def test_offline_eval_reads_fractions_off_the_measurements():
    # train: a stencil (winner "dia") and an R-MAT graph (winner "merge"); held out: a larger
    # stencil, where "dia" is measured at 2 us against the best 1 us ("ell")
    train = [rec("stencil2d", {"n": 10}, [("dia", {}, 1.0), ("ell", {}, 2.0), ("merge", {}, 5.0)]),
             rec("rmat", {"scale": 9, "edge_factor": 8}, [("merge", {}, 1.0), ("dia", {}, 9.0), ("ell", {}, 4.0)])]
    held = [rec("stencil2d", {"n": 12}, [("dia", {}, 2.0), ("ell", {}, 1.0), ("merge", {}, 8.0)])]
    rep = neighbours.offline_eval(train, held, ks=(1, 2, 3))
    assert rep["records"] == 1 and rep["table_entries"] == 2
    near = rep["fraction_of_space_best"]["nearest"]
    # proposals: the stencil's winner (dia), the graph's (merge), then the stencil's second (ell)
    assert (near["1"], near["2"], near["3"]) == (pytest.approx(0.5), pytest.approx(0.5), pytest.approx(1.0))
    # the single best point needs 3 training records of the op to be ranked: none here
    assert set(rep["fraction_of_space_best"]) == {"nearest", "cost_model"}


def test_table_and_rl_problems_share_one_load_per_matrix(monkeypatch):
    from sparserl_compile.training.rewards import problems_from_records

    loads = []
    real = data.MatrixRef.load
    monkeypatch.setattr(data.MatrixRef, "load", lambda self: loads.append(self) or real(self))
    a = rec("stencil2d", {"n": 8}, [("a", {}, 1.0)])
    b = rec("stencil2d", {"n": 8}, [("a", {}, 2.0)], op="spmm", n=8)  # the same matrix, another op
    c = rec("banded", {"n": 32, "half_bandwidth": 1}, [("a", {}, 1.0)])
    loaded: dict = {}
    entries = neighbours.entries_from_records([a, b, c], loaded=loaded)
    probs = problems_from_records([a, b, c], loaded)
    assert len(entries) == len(probs) == 3 and len(loads) == 2  # two matrices, each loaded once
    assert probs[0].matrix is probs[1].matrix is loaded[a.matrix]
