"""benchmarks/sandbox_memory.py on the CPU: idle sandbox workers are started and each one's
resident memory read (no GPU here, so no device memory)."""

import json
import os

import pytest

sandbox_memory = pytest.importorskip("sandbox_memory")


def test_reports_each_idle_workers_memory(tmp_path):
    out = tmp_path / "mem.json"
    assert sandbox_memory.main(["--workers", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["workers"] == 2 and len(r["rss_mib"]) == 2
    assert all(m is not None and m > 10 for m in r["rss_mib"])  # an interpreter with torch: tens of MiB at least
    if r["device"] == "cpu":
        assert r["device_mib_per_worker"] is None


def test_rss_of_this_process_and_of_no_process():
    assert sandbox_memory.rss_mib(os.getpid()) > 1
    assert sandbox_memory.rss_mib(2**31 - 1) is None


def test_at_least_one_worker():
    with pytest.raises(SystemExit):
        sandbox_memory.main(["--workers", "0"])
