"""The "nearest" provider: ranking measured neighbours, matching their winners to this
problem's kernel space, filling from the search, the table file and its errors."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from sparserl_compile import matrices, nearest, providers
from sparserl_compile.problem import make_problem
from sparserl_compile.search import SearchProvider
from sparserl_compile.structure import features, fingerprint


def problem(m, op="spmv", n=1):
    return make_problem(op, "f32", n, m.indptr, m.indices, m.shape, fingerprint(m.indptr, m.indices, m.shape), "sm_90")


def entry(label, feats, ranked, op="spmv", n=1):
    return nearest.Entry(label, op, "f32", n, np.asarray(feats, np.float64),
                         tuple((f, tuple(sorted(p.items())), us) for f, p, us in ranked))


def test_proposals_take_the_nearest_winners_first_round_robin_without_repeats():
    near = entry("near", [1.0, 1.0], [("a", {"x": 1}, 1.0), ("b", {}, 2.0)])
    far = entry("far", [9.0, 9.0], [("c", {}, 1.0), ("a", {"x": 1}, 3.0)])
    other_op = entry("spmm", [1.0, 1.0], [("z", {}, 1.0)], op="spmm", n=32)
    keys = nearest.proposals([far, other_op, near], [1.0, 1.1], "spmv", "f32", 1)
    assert keys == [("a", (("x", 1),)), ("c", ()), ("b", ())]
    # the width counts: an spmm entry at n=32 is nearer to n=32 than one at n=8
    e8 = entry("n8", [1.0], [("w8", {}, 1.0)], op="spmm", n=8)
    e32 = entry("n32", [1.0], [("w32", {}, 1.0)], op="spmm", n=32)
    assert nearest.proposals([e8, e32], [1.0], "spmm", "f32", 32)[0] == ("w32", ())


def test_provider_proposes_the_neighbours_winner_then_fills_from_the_search():
    m = matrices.stencil2d(20)
    p = problem(m)
    space = SearchProvider().candidates(p, 0)
    want = space[5]  # some point of this problem's pruned space, not the search's first
    f = features(m.indptr, m.indices, m.shape).as_vector()
    table = [entry("twin", f, [(want.family, dict(want.params), 1.0), ("no_such_family", {}, 2.0)]),
             entry("unlike", np.asarray(f) + 50, [(space[7].family, dict(space[7].params), 1.0)])]
    prov = nearest.NearestProvider(table, k=3)
    got = prov.candidates(p, 0)
    assert [c.name for c in got] == [want.name, space[7].name, space[0].name]  # winners, then the search
    assert prov.last_neighbours[0] == "twin"
    assert [c.name for c in prov.candidates(p, 1)] == [want.name]  # k from the caller wins
    # no entry of this op: the search's order
    assert [c.name for c in nearest.NearestProvider(table, k=2).candidates(problem(m, "spmm", 8), 0)] == \
        [c.name for c in SearchProvider().candidates(problem(m, "spmm", 8), 0)[:2]]


def test_table_round_trips_and_bad_files_say_how_to_rebuild(tmp_path):
    t = [entry("a", [1.0, 2.0], [("csr_scalar", {"block": 64}, 3.5)])]
    path = nearest.save_table(t, tmp_path / "t.json.gz", source="test")
    (back,) = nearest.load_table(path)
    assert back.label == "a" and back.ranked == t[0].ranked and np.array_equal(back.features, t[0].features)
    with pytest.raises(FileNotFoundError, match="python -m sparserl_compile.training.neighbours"):
        nearest.load_table(tmp_path / "absent.json.gz")
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="not a neighbour table"):
        nearest.load_table(tmp_path / "bad.json.gz")
    with gzip.open(tmp_path / "old.json.gz", "wt") as fh:
        fh.write('{"format": 0, "entries": []}')
    with pytest.raises(ValueError, match="rebuild"):
        nearest.load_table(tmp_path / "old.json.gz")


def test_the_shipped_table_serves_the_provider_by_name():
    prov = providers.resolve("nearest")
    assert prov.name == "nearest" and len(prov.entries) > 0
    assert {e.op for e in prov.entries} <= {"spmv", "spmm"}
    got = prov.candidates(problem(matrices.stencil2d(16)), 4)
    assert 1 <= len(got) <= 4 and all(c.family for c in got)
