"""benchmarks/screen_cost.py on one held-out record: the three ways draw, the two screens keep
the same candidates, and the JSON holds each way's seconds, counts and restarts."""

import json
from pathlib import Path

import pytest

screen_cost = pytest.importorskip("screen_cost")

DEFAULT = Path(__file__).resolve().parents[2] / "policy" / "checkpoints" / "default"


@pytest.mark.skipif(not (DEFAULT / "model.safetensors").is_file(), reason="no default checkpoint in this checkout")
def test_one_record(tmp_path):
    out = tmp_path / "cost.json"
    assert screen_cost.main(["--checkpoint", str(DEFAULT), "--records", "1", "--k", "2", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["records"] == 1 and d["k"] == 2 and d["same_verdicts"] is True
    assert set(d["ways"]) == {"none", "keep", "restart"}
    assert d["ways"]["none"]["screen_s"] == 0 and d["ways"]["none"]["counts"] == {}
    for way in ("keep", "restart"):
        w = d["ways"][way]
        assert w["counts"]["header"] + w["counts"]["format"] + w["counts"]["probe"] + w["counts"]["passed"] >= 1
        assert len(w["rows"]) == 1 and w["rows"][0]["screen_s"] > 0 and 1 <= w["candidates"] <= 2
    assert d["ways"]["keep"]["restarts"] == 0
