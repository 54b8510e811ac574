import json

import pytest

from training.data import (MatrixRef, is_held_out, load_supervision, record_from_json, record_to_json,
                           split)

REC = {"matrix": {"source": "generated", "generator": "banded", "kwargs": {"n": 64, "half_bandwidth": 2, "seed": 0}},
       "op": "spmv", "dtype": "f32", "n": 1, "reference_us": 30.0,
       "variants": [{"family": "csr_scalar", "params": {"block": 256}, "us": 12.0},
                    {"family": "csr_vector", "params": {"threads": 4}, "us": 9.0},
                    {"family": "dia", "params": {}, "us": None}]}


def test_roundtrip_and_best(tmp_path):
    r = record_from_json(REC)
    assert r.best().family == "csr_vector" and r.best().us == 9.0
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps(record_to_json(r)) + "\n\n")
    assert load_supervision(p) == [r]
    assert r.matrix.load().shape == (64, 64)


def test_bad_line_is_named(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps(REC) + "\n" + json.dumps({"op": "spmv"}) + "\n")
    with pytest.raises(ValueError, match=r"s.jsonl:2"):
        load_supervision(p)


def test_generated_split_is_deterministic_and_about_a_fifth():
    refs = [MatrixRef("generated", "rmat", (("scale", 10), ("seed", s))) for s in range(400)]
    held = [is_held_out(r) for r in refs]
    assert held == [is_held_out(r) for r in refs]
    assert 0.12 < sum(held) / len(held) < 0.28


def test_shared_split_holds_out_per_kind(shared_matrices):
    from sparserl_compile.matrices import shared_manifest

    infos = shared_manifest(shared_matrices)
    kinds = {}
    for i in infos:
        kinds.setdefault(i.kind, []).append(i.name)
    s = split([record_from_json({**REC, "matrix": {"source": "shared", "name": i.name}}) for i in infos])
    held = {r.matrix.name for r in s.held_out}
    assert held.isdisjoint({r.matrix.name for r in s.train})
    for kind, names in kinds.items():
        assert (len(names) >= 4) == bool(held & set(names)), kind
