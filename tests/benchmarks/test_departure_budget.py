"""benchmarks/departure_budget.py on the first two held-out records (generated matrices): both
ways propose the same candidates there, and the JSON holds each way's forwards and seconds."""

import json
from pathlib import Path

import pytest

departure_budget = pytest.importorskip("departure_budget")

DEFAULT = Path(__file__).resolve().parents[2] / "policy" / "checkpoints" / "default"


@pytest.mark.skipif(not (DEFAULT / "model.safetensors").is_file(), reason="no default checkpoint in this checkout")
def test_two_records(tmp_path):
    out = tmp_path / "budget.json"
    assert departure_budget.main(["--checkpoint", str(DEFAULT), "--records", "2", "--device", "cpu",
                                  "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["ways"]["before"] == {"departure_steps": None, "departure_rounds": None} and d["ways"]["now"] == {}
    assert len(d["rows"]) == 2 and d["summary"]["records"] == 2
    for r in d["rows"]:
        assert r["same_candidates"] is True  # no departure there is cut or drawn in a third round
        for way in ("before", "now"):
            assert r[way]["forwards"] >= 2 and r[way]["seconds"] > 0 and r[way]["candidates"] == 4
    assert d["summary"]["same_candidates"] == 2 and d["summary"]["speedup_geomean"] > 0
