"""training/curves.py: the shipped checkpoints' training logs draw as one panel per stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparserl_compile.training import curves

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


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[16:24]
    return int.from_bytes(head[:4], "big"), int.from_bytes(head[4:], "big")


def test_many_stages_wrap_into_rows_of_columns_panels(tmp_path):
    """Ten stages (SFT and nine RL runs, as version 5's log) draw four panels a row by default:
    three rows, not one strip ten panels wide; ``--columns`` sets the width."""
    pytest.importorskip("matplotlib")
    log = {"sft": {"log": [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)]}}
    log.update({f"rl_{i}": {"log": [{"step": s, "mean_reward": 1.0 + s, "best_reward": 2.0 + s} for s in (1, 2)]}
                for i in range(9)})
    (tmp_path / "training_log.json").write_text(json.dumps(log))
    w4, h4 = _png_size(curves.plot(tmp_path, tmp_path / "c4.png"))
    assert curves.main([str(tmp_path), "--out", str(tmp_path / "c10.png"), "--columns", "10"]) == 0
    w10, h10 = _png_size(tmp_path / "c10.png")
    assert h4 > 2.5 * h10 and w10 > 2 * w4
    with pytest.raises(ValueError, match="columns=0"):
        curves.plot(tmp_path, tmp_path / "c0.png", columns=0)


def test_ppo_stages_get_an_exploration_panel(tmp_path):
    """A PPO stage's clip fraction, novel-kernel rate and entropy draw in a panel of their own
    beside its reward and KL: two panels for the stage, side by side."""
    pytest.importorskip("matplotlib")
    log = {"rl": {"log": [{"step": s, "mean_reward": 0.5 * s, "kl": 0.01 * s, "entropy": 0.3, "clip_frac": 0.1,
                           "novel_rate": 0.05 * s} for s in (1, 2, 3)]}}
    (tmp_path / "training_log.json").write_text(json.dumps(log))
    out = curves.plot(tmp_path, tmp_path / "c.png")
    one = dict(log, rl={"log": [{k: v for k, v in p.items() if k in ("step", "mean_reward", "kl")}
                                for p in log["rl"]["log"]]})
    (tmp_path / "training_log.json").write_text(json.dumps(one))
    single = curves.plot(tmp_path, tmp_path / "d.png")
    assert _png_size(out)[0] > 1.8 * _png_size(single)[0]
