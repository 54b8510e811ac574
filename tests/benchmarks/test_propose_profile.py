"""benchmarks/propose_profile.py on the CPU: the proposals timed without the profiler with lean
decoding steps and through LlamaModel write the same candidates, then the profile."""

import pytest

propose_profile = pytest.importorskip("propose_profile")
pytest.importorskip("transformers")


def test_the_report_times_both_step_paths_and_compares_their_candidates(tmp_path):
    out = tmp_path / "profile.txt"
    assert propose_profile.main(["--device", "cpu", "--records", "1", "--lines", "5", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.count("unprofiled, lean steps") == 1 and text.count("unprofiled, steps through LlamaModel") == 1
    assert "the same candidates both ways: True" in text
    assert "Ordered by: internal time" in text and "Ordered by: cumulative time" in text
