"""benchmarks/format_drafts.py on the first two held-out records: the greedy kernels and the
departures are the same with either drafts, and a draft of every format saves forwards on the
SpMM record, whose departures leave the nearest entries' formats."""

import json
from pathlib import Path

import pytest

format_drafts = pytest.importorskip("format_drafts")

DEFAULT = Path(__file__).resolve().parents[2] / "policy" / "checkpoints" / "default"


@pytest.mark.skipif(not (DEFAULT / "model.safetensors").is_file(), reason="no default checkpoint in this checkout")
def test_two_records(tmp_path):
    out = tmp_path / "drafts.json"
    assert format_drafts.main(["--checkpoint", str(DEFAULT), "--records", "2", "--k", "4", "--device", "cpu",
                               "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["records"] == 2 and d["k"] == 4 and len(d["rows"]) == 2
    for r in d["rows"]:
        assert r["greedy"]["same"] is True and r["departures"]["same"] is True and len(r["formats"]) == 4
        assert r["drafts"]["every_format"] > r["drafts"]["nearest"]
        for part in format_drafts.PARTS:
            assert r[part]["every_format"]["calls"] >= 1 and r[part]["nearest"]["calls"] >= 1
    spmm = d["rows"][1]
    assert spmm["op"] == "spmm" and spmm["departures"]["every_format"]["calls"] * 3 < spmm["departures"]["nearest"]["calls"]
    s = d["summary"]
    assert s["departures"]["every_format"]["calls"] < s["departures"]["nearest"]["calls"]
    assert s["greedy"]["same"] == 2 and s["departures"]["same"] == 2
