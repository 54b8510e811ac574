"""benchmarks/graph_kernels.py without a GPU: arguments, point choice, conversion log, table."""

from __future__ import annotations

import argparse

import pytest

graph_kernels = pytest.importorskip("graph_kernels")


def test_defaults_and_quick(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    a = graph_kernels.parse_args([])
    assert a.graphs[:2] == ("rmat:20:16", "rmat:18:8") and a.widths == (32, 64, 128, 256)
    assert a.dtypes == ("f32", "bf16") and a.max_points == 2 and a.max_graph_points == 6
    assert a.json == str(tmp_path / "graph_kernels.json")
    q = graph_kernels.parse_args(["--quick", "--json", "x.json"])
    assert q.graphs == ("rmat:18:8", "wiki-Vote", "cora_adj") and q.widths == (64, 128)
    assert (q.max_points, q.max_graph_points) == (1, 4)
    assert q.json == "x.json"
    c = graph_kernels.parse_args(["--graphs", "rmat:12:4,cora_adj", "--widths", "16,512", "--dtypes", "f16"])
    assert c.graphs == ("rmat:12:4", "cora_adj") and c.widths == (16, 512) and c.dtypes == ("f16",)


@pytest.mark.parametrize("argv", [["--graphs", "rmat:40:8"], ["--graphs", "rmat:18"], ["--graphs", "a/b"],
                                  ["--dtypes", "f64"], ["--widths", "0"], ["--widths", "x"], ["--max-points", "0"],
                                  ["--max-graph-points", "0"], ["--reps", "2"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        graph_kernels.parse_args(argv)
    assert capsys.readouterr().err


def test_check_graph_messages():
    with pytest.raises(argparse.ArgumentTypeError, match="rmat:SCALE:EDGE_FACTOR"):
        graph_kernels.check_graph("rmat:x:8")
    assert graph_kernels.check_graph("wiki-Vote") == "wiki-Vote"


def test_spread_keeps_ends_and_order():
    assert graph_kernels.spread(list(range(10)), 3) == [0, 4, 9]
    assert graph_kernels.spread([1, 2], 5) == [1, 2]
    assert graph_kernels.spread(list(range(7)), 1) == [0]


class _C:
    def __init__(self, family, i):
        self.family, self.name = family, f"{family}{i}"


def test_choose_points_caps_each_family_and_rotates():
    cands = [_C("a", i) for i in range(10)] + [_C("b", i) for i in range(2)]
    got = graph_kernels.choose_points(cands, 3)
    assert [c.name for c in got if c.family == "b"] == ["b0", "b1"]
    assert len([c for c in got if c.family == "a"]) == 3
    seen = {c.name for k in range(10) for c in graph_kernels.choose_points(cands, 3, offset=k) if c.family == "a"}
    assert seen == {f"a{i}" for i in range(10)}  # successive problems sample every point
    graph = [_C("csr_split", i) for i in range(10)] + cands
    got = graph_kernels.choose_points(graph, 2, max_graph_points=5)
    assert [len([c for c in got if c.family == f]) for f in ("csr_split", "a", "b")] == [5, 2, 2]


def _problem(graph="rmat20_e16", n=128, nnz=16_000_000, torch_us=1000.0, points=()):
    return {"graph": graph, "dtype": "f32", "n": n, "nnz": nnz, "n_rows": 1 << 20, "floor_us": 400.0,
            "torch_us": torch_us, "points": list(points)}


def test_summary_names_the_winner_and_each_graph_family():
    pts = [{"name": "csr_split[v=4]", "family": "csr_split", "ok": True, "us": 500.0},
           {"name": "csr_smem[v=4]", "family": "csr_smem", "ok": True, "us": 800.0},
           {"name": "merge[x]", "family": "merge", "ok": False, "reason": "error_bound: ..."}]
    r = graph_kernels.summarize(_problem(points=pts))
    assert r["best"] == "csr_split[v=4]" and r["winner"] == "csr_split" and r["speedup"] == pytest.approx(2.0)
    assert r["best_floor"] == pytest.approx(0.8) and r["torch_floor"] == pytest.approx(0.4)
    assert r["csr_split"] == pytest.approx(2.0) and r["tcw_wmma"] is None and r["failed"] == 1
    slow = graph_kernels.summarize(_problem(points=[{"name": "x", "family": "csr_split", "ok": True, "us": 2000.0}]))
    assert slow["winner"] == "torch.sparse" and slow["speedup"] == pytest.approx(0.5)
    none = graph_kernels.summarize(_problem(points=[]))
    assert none["winner"] == "torch.sparse" and none["best"] is None


def test_table_has_a_row_per_problem_and_geomeans_by_class():
    fast = [{"name": "s", "family": "csr_split", "ok": True, "us": 500.0},
            {"name": "t", "family": "tcw_wmma", "ok": True, "us": 250.0}]
    rows = [graph_kernels.summarize(_problem(points=fast)),
            graph_kernels.summarize(_problem(graph="cora_adj", nnz=10_556, torch_us=20.0,
                                             points=[{"name": "s", "family": "csr_split", "ok": True, "us": 40.0}]))]
    text = graph_kernels.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["graph", "dt", "N"] and len(lines) == 2 + 2 + 2
    assert "tcw_wmma" in lines[2] and "4.00x" in lines[2] and "torch.sparse" in lines[3]
    assert "graphs >= 1e6 edges, N >= 64): kept plan 4.00x, csr_split 2.00x, tcw_wmma 4.00x" in text
    # the kept plan never loses (the runtime keeps torch.sparse), the families can
    assert "(all): kept plan 2.00x, csr_split 1.00x" in text
    assert graph_kernels.geomean([None, 0, 4.0, 1.0]) == pytest.approx(2.0)


def test_conversion_log_times_each_layout_once():
    from sparserl_compile import formats, matrices

    m = matrices.rmat(9, 4, seed=1)
    log = graph_kernels.ConversionLog(formats)
    log.label = "g"
    a = log(m.indptr, m.indices, m.shape, "csr_split", {"order": 3})
    b = log(m.indptr, m.indices, m.shape, "csr_split", {"order": 3})
    c = log(m.indptr, m.indices, m.shape, "tcw", {"order": 3, "H": 8})
    assert a is b and c.fmt == "tcw" and set(log.seconds["g"]) == {"csr_split[order=3]", "tcw[H=8][order=3]"}
    log.forget()
    assert log(m.indptr, m.indices, m.shape, "csr_split", {"order": 3}) is not a
    costs = graph_kernels.order_costs(m)
    assert set(costs) == {"rcm", "bfs"} and all(v >= 0 for v in costs.values())


def test_main_without_a_gpu_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: main would run the benchmark")
    assert graph_kernels.main(["--quick"]) == 2
    assert "GPU" in capsys.readouterr().err


def test_a_problem_without_a_torch_time_still_summarizes():
    r = graph_kernels.summarize(_problem(torch_us=None, points=[{"name": "s", "family": "csr_split", "ok": True,
                                                                 "us": 5.0}]))
    assert r["speedup"] is None and r["torch_floor"] is None and r["winner"].startswith("csr_split")
    assert "-" in graph_kernels.format_table([r]).splitlines()[2]
