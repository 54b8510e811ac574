"""training/curves.py: the shipped checkpoints' training logs draw as one panel per stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training import curves

ROOT = Path(__file__).resolve().parents[2]


def test_stages_are_found_in_file_order_and_history_only_when_asked():
    log = {"version": "5", "base": {"checkpoint": "x"},
           "sft": {"config": {}, "log": [{"step": 5, "ms_per_step": 3.0}, {"step": 100, "loss": 0.5}]},
           "rl": {"log": [{"step": 1, "mean_reward": 2.0, "kl": 0.0}]},
           "previous_version_4": {"sft": {"log": [{"step": 10, "loss": 1.0}]}}}
    assert [n for n, _ in curves.stages(log)] == ["sft", "rl"]
    assert [n for n, _ in curves.stages(log, history=True)] == ["sft", "rl", "previous_version_4/sft"]


@pytest.mark.parametrize("name", ["default", "retrieval"])
def test_the_shipped_checkpoints_curves_draw(name, tmp_path):
    pytest.importorskip("matplotlib")
    out = curves.plot(ROOT / "policy" / "checkpoints" / name, tmp_path / "c.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_a_folder_without_a_log_or_stages_is_a_clear_error(tmp_path, capsys):
    assert curves.main([str(tmp_path), "--out", str(tmp_path / "c.png")]) == 2
    assert "no training log" in capsys.readouterr().err
    (tmp_path / "training_log.json").write_text(json.dumps({"notes": "nothing logged"}))
    with pytest.raises(ValueError, match="no stage with logged loss or reward"):
        curves.plot(tmp_path, tmp_path / "c.png")
