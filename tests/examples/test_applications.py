"""examples/applications.py (the applications part of ``make demo``) at CI scale."""

from __future__ import annotations

import json

import pytest

from example_loader import load_example

apps = load_example("applications")


def test_the_three_applications_run_and_agree_with_their_comparisons(tmp_path, capsys):
    out = tmp_path / "apps.json"
    assert apps.main(["--quick", "--device", "cpu", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "== the applications, short" in text and "FAILED" not in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["application"] for r in rows] == ["GNN", "GNN", "pruned LLM", "pre-generation"]
    assert all(r["ok"] for r in rows)
    assert "same tokens 100%" in rows[2]["check"]
    assert rows[3]["sparserl"] == "6/6 served from cache"  # two matrices and one ONNX weight, SpMV and SpMM


def test_a_failed_check_is_shown_as_failed():
    row = apps.Row("GNN", "w", "1 ms", "2 ms", "max rel err 1", ok=False)
    table = apps.format_rows([row, apps.Row("GNN", "w", "1 ms", "2 ms", "max rel err 0", ok=True)])
    lines = table.splitlines()
    assert lines[2].endswith("FAILED") and lines[3].endswith("ok")


@pytest.mark.gpu
def test_the_applications_on_a_gpu_agree_with_their_comparisons(tmp_path):
    out = tmp_path / "apps.json"
    assert apps.main(["--quick", "--device", "cuda", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(r["ok"] for r in rows), rows
    assert "for this GPU" in rows[3]["what"]  # built and timed here, then served from the cache
