"""The held-out split by source: frozen whole collections, checked by hash, never trained on."""

from __future__ import annotations

import json

import pytest

from sparserl_compile.training import source_split as S
from sparserl_compile.training.data import MatrixRef, is_held_out


def test_the_frozen_file_is_the_rule_applied_to_the_manifest(shared_matrices):
    manifest = json.loads((shared_matrices / "MANIFEST.json").read_text())
    assert S.dumps(S.by_sources(manifest)) == S.SOURCE_SPLIT_PATH.read_bytes()
    split = S.load()
    assert split.sources == tuple(sorted(S.HELD_OUT_SOURCES))
    # whole collections: every matrix of a held-out source, and nothing else
    for e in manifest:
        assert (e["name"] in split.matrices) == (e["source_repo"] in S.HELD_OUT_SOURCES)
        assert is_held_out(MatrixRef("shared", name=e["name"])) or e["name"] not in split.matrices


def test_no_generated_matrix_and_no_training_record_is_in_it():
    from sparserl_compile.training.data import DEFAULT_SUPERVISION, load_supervision, split

    parts = split(load_supervision(DEFAULT_SUPERVISION))
    names = S.held_out_names()
    assert not any(r.matrix.source == "shared" and r.matrix.name in names for r in parts.train)
    held = {r.matrix.name for r in parts.held_out if r.matrix.source == "shared" and r.matrix.name in names}
    assert held  # the supervision measured some of them: the evaluation has records to score
    assert all(not n.startswith(("banded", "rmat", "uniform_random")) for n in names)


def test_an_edited_split_is_refused(tmp_path):
    f = tmp_path / "heldout_sources.json"
    content = json.loads(S.SOURCE_SPLIT_PATH.read_text())
    content["matrices"].pop("cora_adj")  # moving a matrix to the training side
    f.write_bytes(S.dumps(content))
    with pytest.raises(ValueError, match="the held-out split was edited"):
        S.load(f)
    with pytest.raises(FileNotFoundError, match="ships in training/data"):
        S.load(tmp_path / "absent.json")
    assert S.load().sha256 == S.SOURCE_SPLIT_SHA256


def test_eval_split_source_keeps_only_the_collections(tmp_path):
    from sparserl_compile.training.evaluate import EvalConfig, _held_out

    _both, records, problems, _space = _held_out(EvalConfig(split="source", ops="spmv"))
    assert records and all(r.matrix.name in S.held_out_names() for r in records)
    assert len(problems) == len(records)
    with pytest.raises(ValueError, match="--split 'sources'"):
        _held_out(EvalConfig(split="sources"))
