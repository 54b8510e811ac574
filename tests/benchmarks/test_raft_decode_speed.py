"""RAFT's candidate decoding benchmark (benchmarks/raft_decode_speed.py): drafted format
candidates are the same kernels as plain ones (and as those of the batched-samples mode), and
the JSON says where the seconds went."""

import json

import pytest

raft_decode_speed = pytest.importorskip("raft_decode_speed")


def test_drafted_format_candidates_are_the_plain_ones(tmp_path):
    out = tmp_path / "raft_decode.json"
    rc = raft_decode_speed.main(["--count", "1", "--mix", "banded=1", "--max-new-tokens", "60",
                                 "--max-nnz", "300000", "--batched-samples", "--traced-samples", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0 and doc["same_candidates"] and len(doc["rows"]) == 1
    row = doc["rows"][0]
    assert {"greedy", "format", "sample"} <= set(row["plain"]) and set(row["plain"]) == set(row["drafted"])
    assert set(row["batched"]) == set(row["traced"]) == set(row["drafted"])
    assert set(doc["totals_s"]) == {"plain", "drafted", "batched", "traced"}
    assert len(row["formats"]) > 1 and len(set(row["formats"])) > 1  # format candidates of other formats
