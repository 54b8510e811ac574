"""examples/distributed_gcn.py in one process (world size 1, gloo): it trains and passes its own
float64 check of the first forward. The multi-process runs are tested in
tests/sparserl_compile/test_distributed.py."""

from __future__ import annotations

import pytest
from example_loader import load_example


def test_one_process_rmat_run_passes_its_float64_check(monkeypatch, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():
        monkeypatch.setenv(k, v)
    ex = load_example("distributed_gcn")
    rc = ex.main(["--graph", "rmat:9:4", "--epochs", "3", "--hidden", "16", "--features", "16"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "epoch" in out or "acc" in out


@pytest.mark.parametrize("spec", ["rmat:x:4", "rmat:8", "rgg:100"])
def test_a_malformed_generated_graph_is_named_with_the_expected_form(spec):
    ex = load_example("distributed_gcn")
    with pytest.raises(SystemExit, match=rf"--graph {spec!r}.*rmat:SCALE:EF or rgg:N:DEGREE"):
        ex.load_graph(spec, 8, 2)
