"""benchmarks/process_first_call.py on the CPU: every case runs in a fresh interpreter and
reports which provider the runtime would ask (the default unconfigured, else the one named);
products on CPU tensors use the reference, so nothing is proposed there."""

import json

import pytest

process_first_call = pytest.importorskip("process_first_call")


def test_each_case_in_its_own_process(tmp_path):
    from sparserl_compile import providers

    out = tmp_path / "first.json"
    assert process_first_call.main(["--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    # first the process after install (writes the disk caches), then the cases
    assert [(r["case"], r["prewarm"]) for r in rows] == [("default", False), *process_first_call.CASES]
    assert [r["after_install"] for r in rows] == [True] + [False] * len(process_first_call.CASES)
    default = providers.DefaultProvider().name  # the policy where the train extra is installed
    for r in rows:
        assert r["rc"] == 0 and r["provider"] == (default if r["case"] == "default" else r["case"])
        assert r["first_plan"] == r["second_plan"] == r["third_plan"] == "reference"  # CPU tensors: the reference
        assert r["first_finite"] and r["second_finite"] and r["first_s"] > 0
        assert ("startup_s" in r) == r["prewarm"]
        assert r["first_record"] is None  # no selection ran (the reference serves CPU tensors)
