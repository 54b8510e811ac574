import json

import pytest

from sparserl_compile.training.data import (MatrixRef, is_held_out, load_supervision, record_from_json, record_to_json,
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
    from sparserl_compile.training.data import SHARED_HELD_OUT, shared_held_out_by_rule
    from sparserl_compile.training.source_split import held_out_names

    for kind, names in kinds.items():
        assert (len(names) >= 4) == bool(SHARED_HELD_OUT & set(names)), kind
    assert SHARED_HELD_OUT == shared_held_out_by_rule()  # the frozen list is the rule's
    # held out: the per-kind list and the whole source collections of the frozen source split
    assert held == SHARED_HELD_OUT | held_out_names()


def test_shared_split_does_not_move_with_a_partial_manifest():
    from sparserl_compile.training.data import SHARED_HELD_OUT, shared_held_out_by_rule

    full = {"a1": "k", "a2": "k", "a3": "k", "hep-th": "k", "zz": "k"}
    assert shared_held_out_by_rule(full) == {"hep-th"}
    trimmed = {n: k for n, k in full.items() if n != "a2"}
    assert shared_held_out_by_rule(trimmed) == {"zz"}  # the rule alone would move both matrices
    assert is_held_out(MatrixRef("shared", name="hep-th")) and "hep-th" in SHARED_HELD_OUT
    assert not is_held_out(MatrixRef("shared", name="add32"))
    assert is_held_out(MatrixRef("shared", name="bcsstk13"))  # its whole collection is held out


# --- the H200 benchmark suite's per-variant lines (format 1) ---------------------------------

def _line(matrix, op, n, family, params, kind, kernel_us, torch_us=20.0):
    return {"matrix": matrix, "name": "m", "fingerprint": "f", "op": op, "n": n, "dtype": "f32",
            "arch": "sm_90", "variant": f"{family}{params}", "family": family, "params": params,
            "format": "csr", "kind": kind, "kernel_us": kernel_us, "graph_us": 1.0,
            "torch_int32_us": torch_us, "floor_us": 0.5}


GEN = {"source": "generated", "generator": "banded", "args": {"n": 64, "half_bandwidth": 2, "seed": 3}, "seed": 3}
LINES = [_line(GEN, "spmv", 1, "csr_scalar", {"block": 64}, "ok", 7.0),
         _line(GEN, "spmv", 1, "csr_vector", {"threads": 4}, "ok", 5.0),
         _line(GEN, "spmv", 1, "dia", {}, "wrong", 1.0),  # failed: fastest number, no time
         _line(GEN, "spmm", 8, "csr_scalar", {"block": 64}, "ok", 30.0, torch_us=60.0),
         _line({"source": "shared", "name": "bcsstk13"}, "spmv", 1, "csr_scalar", {"block": 128}, "ok", 4.0)]


@pytest.mark.parametrize("gz", [False, True])
def test_variant_lines_are_grouped_per_matrix_op_n(tmp_path, gz):
    import gzip

    text = "".join(json.dumps(x) + "\n" for x in LINES)
    p = tmp_path / ("s.jsonl.gz" if gz else "s.jsonl")
    if gz:
        with gzip.open(p, "wt") as f:
            f.write(text)
    else:
        p.write_text(text)
    recs = load_supervision(p)
    assert [(r.matrix.source, r.op, r.n, len(r.variants)) for r in recs] == [
        ("generated", "spmv", 1, 3), ("generated", "spmm", 8, 1), ("shared", "spmv", 1, 1)]
    spmv = recs[0]
    assert spmv.matrix.kwargs == (("half_bandwidth", 2), ("n", 64), ("seed", 3))
    assert spmv.matrix.load().shape == (64, 64)
    assert [v.us for v in spmv.variants] == [7.0, 5.0, None]
    assert spmv.best().family == "csr_vector"  # the failed dia variant never wins
    assert spmv.reference_us == 20.0 and spmv.floor_us == 0.5
    assert recs[1].reference_us == 60.0
    # grouped records round-trip through the other format
    q = tmp_path / "grouped.jsonl"
    q.write_text("".join(json.dumps(record_to_json(r)) + "\n" for r in recs))
    assert load_supervision(q) == recs


def test_variant_line_without_family_is_named(tmp_path):
    bad = dict(LINES[0])
    del bad["matrix"]
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps(LINES[0]) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"s.jsonl:2"):
        load_supervision(p)


def test_missing_file_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_supervision(tmp_path / "none.jsonl.gz")


REAL = __import__("pathlib").Path(__file__).resolve().parents[2] / "training" / "data" / "h200_supervision_2026-12-02.jsonl.gz"


@pytest.mark.skipif(not REAL.is_file(), reason="the H200 supervision file is not in this checkout")
def test_real_h200_file_loads_and_splits():
    import gzip

    with gzip.open(REAL, "rt") as f:
        raw = [json.loads(x) for x in f if x.strip()]
    groups = {(json.dumps(x["matrix"], sort_keys=True), x["op"], x["n"]) for x in raw}
    recs = load_supervision(REAL)
    assert len(recs) == len(groups)
    assert sum(len(r.variants) for r in recs) == len(raw)
    def same_matrix(m, ref):  # a raw line's matrix vs a record's MatrixRef (R-MAT scales differ only in args)
        if m["source"] == "shared":
            return ref.source == "shared" and m["name"] == ref.name
        return ref.generator == m["generator"] and dict(ref.kwargs) == m["args"]

    for r in recs:
        timed = [x["kernel_us"] for x in raw if x["kind"] == "ok" and x["op"] == r.op and x["n"] == r.n
                 and same_matrix(x["matrix"], r.matrix)]
        assert r.best() is not None and r.best().us == pytest.approx(min(timed))
        assert r.reference_us and r.reference_us > 0
    s = split(recs)
    assert s.train and s.held_out
    assert {r.matrix for r in s.train}.isdisjoint({r.matrix for r in s.held_out})


def test_default_is_the_h200_files_and_a_comma_list_concatenates(tmp_path):
    from sparserl_compile.training.data import DEFAULT_SUPERVISION

    root = REAL.parents[2]
    files = [root / p for p in DEFAULT_SUPERVISION.split(",")]
    if not all(f.is_file() for f in files):
        pytest.skip("the H200 supervision files are not in this checkout")
    each = [load_supervision(f) for f in files]
    together = load_supervision(",".join(map(str, files)))
    assert together == [r for recs in each for r in recs] == load_supervision(files)
    for i, recs in enumerate(each[1:], 1):  # each grid adds matrices, and the split reaches them
        assert {r.matrix for r in recs}.isdisjoint({r.matrix for prev in each[:i] for r in prev})
        grid = split(recs)
        assert grid.train and grid.held_out
    with pytest.raises(FileNotFoundError, match="none.jsonl"):
        load_supervision(f"{files[0]},{tmp_path / 'none.jsonl'}")


def _trimmed_folder(tmp_path, present: dict, absent: list[str]):
    """A shared folder whose MANIFEST.json lists ``present`` (name -> CSR, written) and
    ``absent`` (listed, no file): a trimmed copy, as carried to the device."""
    import numpy as np

    entries = []
    for name, m in present.items():
        np.savez(tmp_path / f"{name}.npz", indptr=m.indptr, indices=m.indices, data=m.data, shape=np.array(m.shape))
    for name in list(present) + absent:
        entries.append({"name": name, "file": f"{name}.npz", "kind": "road_planar", "n_rows": 8, "n_cols": 8,
                        "nnz": 8})
    (tmp_path / "MANIFEST.json").write_text(json.dumps(entries))
    return tmp_path


def test_a_shared_matrix_listed_but_absent_is_named_with_what_to_do(tmp_path, monkeypatch):
    import scipy.sparse as sp

    folder = _trimmed_folder(tmp_path, {"here": sp.identity(8, format="csr")}, ["uk"])
    monkeypatch.setenv("SPARSERL_SHARED_MATRICES", str(folder))
    here, gone = MatrixRef("shared", name="here"), MatrixRef("shared", name="uk")
    assert here.present() and here.load().nnz == 8
    assert not gone.present() and not MatrixRef("shared", name="nowhere").present()
    assert MatrixRef("generated", "banded", (("n", 8),)).present()
    with pytest.raises(FileNotFoundError, match=r"'uk' is in .*MANIFEST.json but its file .*uk.npz is missing: copy it"):
        gone.load()
    with pytest.raises(FileNotFoundError, match="'nowhere' not found: set SPARSERL_SHARED_MATRICES"):
        MatrixRef("shared", name="nowhere").load()
