"""suite + report: matrix selection, a reduced end-to-end run on the CPU, the markdown report."""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from sparserl_compile.commands import bench as suite
from test_verify import needs_simt

_REPORT = Path(__file__).resolve().parents[3] / "benchmarks" / "report.py"


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", _REPORT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_suite_spans_the_scales_and_records_seeds():
    specs = suite.suite_specs("generated")
    nnz = [s.nnz_estimate for s in specs]
    assert nnz == sorted(nnz) and nnz[0] <= 1e5 and nnz[-1] >= 5e7 * 0.9
    assert {s.kind for s in specs} >= {"stencil", "banded", "block", "random", "powerlaw"}
    assert all("seed" in s.origin()["args"] for s in specs)
    quick = suite.suite_specs("generated", quick=True)
    assert 0 < len(quick) < len(specs) and all(s.nnz_estimate < 2e5 for s in quick)


def test_generated_estimates_are_close(monkeypatch):
    for s in suite.suite_specs("generated", max_nnz=200_000):
        assert abs(s.load().nnz - s.nnz_estimate) <= 0.1 * s.nnz_estimate, s.name


@pytest.mark.parametrize("which", ["grid", "grid2"])
def test_grids_hold_some_out_and_state_their_sizes(which):
    from sparserl_compile.training.data import MatrixRef, is_held_out

    grid = suite.suite_specs(which)
    names = [s.name for s in grid]
    assert len(set(names)) == len(names) and not set(names) & {s.name for s in suite.GENERATED}
    held = [s for s in grid if is_held_out(MatrixRef("generated", s.generator, tuple(sorted(s.kwargs.items()))))]
    assert 0 < len(held) < len(grid) / 2  # the split reaches the new matrices too
    for s in suite.suite_specs(which, max_nnz=200_000):
        assert abs(s.load().nnz - s.nnz_estimate) <= 0.1 * s.nnz_estimate, s.name


def test_the_grids_cover_every_generator_and_no_name_twice():
    from sparserl_compile import matrices

    grids = suite.suite_specs("grid") + suite.suite_specs("grid2")
    assert {s.generator for s in suite.GRID} | {s.generator for s in suite.GRID2} == set(matrices.GENERATORS)
    assert len({s.name for s in grids}) == len(grids)
    assert {s.name for s in suite.suite_specs("all")} >= {s.name for s in grids}


def test_cli_registers_bench():
    sub = argparse.ArgumentParser().add_subparsers()
    suite.add_cli(sub)
    args = sub.choices["bench"].parse_args(["--quick", "--ops", "spmv", "--time-budget", "5"])
    assert args.quick and args.time_budget == 5 and callable(args.func)


def _args(tmp_path, **kw):
    d = dict(suite="generated", quick=False, ops="spmv,spmm", widths="4", dtype="f32", time_budget=0,
             out=str(tmp_path), executor="cpu", max_nnz=0, matrices="stencil2d_100", max_candidates=2,
             timeout=60.0, reps=3, value_sets=1)
    d.update(kw)
    return argparse.Namespace(**d)


@needs_simt
def test_cpu_end_to_end_writes_results_and_supervision(tmp_path):
    doc = suite.run(_args(tmp_path))
    res = json.loads(Path(doc["_paths"]["results"]).read_text())
    assert [(r["op"], r["n"]) for r in res["rows"]] == [("spmv", 1), ("spmm", 4)]
    assert all(len(r["variants"]) == 2 and r["verified"] >= 1 for r in res["rows"]), res["rows"]
    with gzip.open(doc["_paths"]["supervision"], "rt") as f:
        lines = [json.loads(x) for x in f]
    assert len(lines) == 4 and lines[0]["matrix"]["generator"] == "stencil2d"
    assert lines[0]["matrix"]["seed"] == 0 and lines[0]["kernel_us"] is None


def test_time_budget_stops_adding_matrices(tmp_path):
    doc = suite.run(_args(tmp_path, time_budget=1e-9, matrices=""))
    assert doc["rows"] == [] and len(doc["skipped_for_budget"]) == len(suite.GENERATED)


def test_report_markdown_and_plots(tmp_path):
    rep = _report()
    rows = [{"matrix": "a", "kind": "stencil", "nnz": 2_000_000, "op": "spmv", "n": 1, "torch_int32_us": 40.0,
             "torch_int64_us": 42.0, "best_us": 20.0, "best_family": "dia", "frac_floor": 0.8,
             "torch_frac_floor": 0.4, "speedup": 2.0, "verified": 3, "variants": [{}] * 4},
            {"matrix": "b", "kind": "powerlaw", "nnz": 1000, "op": "spmm", "n": 32, "torch_int32_us": 10.0,
             "best_us": 20.0, "best_family": "merge", "speedup": 0.5, "verified": 1, "variants": [{}]},
            {"matrix": "c", "kind": "random", "op": "spmv", "n": 1, "error": "load failed: boom"}]
    doc = {"date": "today", "machine": {"gpu": "H200"}, "versions": {}, "executor": "gpu", "rows": rows}
    md = rep.markdown(doc)
    assert "| a | stencil | 2000000 | SpMV | 40.0 | 42.0 | 20.0 | dia | 80 | 40 | 2.00 | 3/4 |" in md
    assert "| all | 2 | 1.00 |" in md and "| nnz > 1e6 | 1 | 2.00 |" in md and "boom" in md
    pytest.importorskip("matplotlib")
    paths = rep.plots(doc, tmp_path / "r")
    assert [p.name for p in paths] == ["r_speedup.png", "r_floor.png"] and all(p.stat().st_size > 1000 for p in paths)


# ------------------------------------------------------------------ --suite graphs


def test_graph_suite_lists_graphs_smallest_first_and_names_unknown_ones():
    from sparserl_compile.commands import bench_graphs as bg

    full, quick = bg.suite(), bg.suite(quick=True)
    assert [s.nnz_estimate for s in full] == sorted(s.nnz_estimate for s in full)
    assert {s.name for s in quick} < {s.name for s in full}
    assert {s.kind for s in bg.GENERATED} == {"powerlaw", "community", "geometric"}
    assert max(s.nnz_estimate for s in full) >= 9e7  # up to about 10^8 nonzeros
    assert [s.name for s in bg.suite(names=["rmat_s18_e8"])] == ["rmat_s18_e8"]
    with pytest.raises(ValueError, match=r"unknown graph\(s\) \['nope'\]"):
        bg.suite(names=["nope"])


def test_graph_suite_takes_shared_graphs_not_features(shared_matrices):
    from sparserl_compile.commands import bench_graphs as bg

    names = {s.name for s in bg.shared_graphs()}
    if not names:
        pytest.skip(f"no shared matrices at {shared_matrices}")
    assert {"cora_adj", "astro-ph"} <= names and not {"cora_features", "bcsstk13", "add32"} & names


def test_floor_bytes_and_memory_formulas():
    from sparserl_compile.commands import bench_graphs as bg

    # CSR (4 (n+1) + nnz (4 + v)), the touched X rows and Y, at v = 2 (bfloat16)
    assert bg.floor_bytes(10, 30, 7, 8, 2) == 4 * 11 + 30 * 6 + 2 * 8 * 7 + 2 * 8 * 10
    small, wide = bg.memory_need(1000, 1000, 5000, 32, 4), bg.memory_need(1000, 1000, 5000, 256, 4)
    assert 0 < small < wide and wide > 256 * 1000 * 4 * 3  # at least X and two outputs


@pytest.mark.parametrize("generator, kw", [("rmat_graph", dict(scale=8, edge_factor=4)),
                                           ("geometric_graph", dict(n=500, avg_degree=8))])
def test_graph_suite_estimates_match_small_twins(generator, kw):
    from sparserl_compile.commands import bench_graphs as bg

    spec = bg._g("t", "x", generator, 0, **kw)
    m = spec.load()
    assert m.shape[0] == m.shape[1] and m.nnz > 0 and spec.origin()["args"]["seed"] == 0
    # the suite's estimates are within 20 % for the generated graphs small enough to build here
    for s in bg.GENERATED:
        if s.nnz_estimate <= 5e6:
            assert abs(s.load().nnz - s.nnz_estimate) <= 0.2 * s.nnz_estimate, s.name


def _graph_args(tmp_path, **kw):
    d = dict(suite="graphs", quick=False, widths="8,16", dtypes="f32,bf16", graphs="cora_adj", device="cpu",
             time_budget=0, out=str(tmp_path), max_nnz=0, provider=None, k=0, cache_dir="")
    d.update(kw)
    return argparse.Namespace(**d)


def test_graph_suite_on_cpu_writes_rows_and_a_table(tmp_path, shared_matrices, capsys):
    if not (shared_matrices / "cora_adj.npz").is_file():
        pytest.skip(f"{shared_matrices} has no cora_adj.npz")
    import sparserl_compile as sr

    before = sr.get_config()
    doc = suite.run(_graph_args(tmp_path, dtypes="f32"))  # torch's CPU CSR kernels have no bfloat16
    assert sr.get_config() == before  # the run restores the runtime's settings
    res = json.loads(Path(doc["_path"]).read_text())
    rows = res["rows"]
    assert [(r["dtype"], r["n"]) for r in rows] == [("f32", 8), ("f32", 16)]
    for r in rows:
        assert r["graph"] == "cora_adj" and r["nnz"] > 10556  # the GCN operand: self loops added
        assert r["max_rel_diff_vs_torch"] <= 1e-6, r
        assert r["torch_cold_us"] > 0 and r["sparserl_b2b_us"] > 0 and r["first_call_s"] >= 0
        assert r["plan"]["kind"] == "reference"  # CPU tensors: torch's kernels
        assert r["floor_bytes"] == suite_floor(r)
    assert res["floor_formula"] and res["skipped"] == []
    out = capsys.readouterr().out
    assert "| cora_adj | gnn_citation |" in out and "reference" in out


def suite_floor(r):
    from sparserl_compile.commands import bench_graphs as bg

    return bg.floor_bytes(r["n_rows"], r["nnz"], r["touched_cols"], r["n"], 4 if r["dtype"] == "f32" else 2)


def test_graph_suite_budget_skips_and_bad_input_says_what(tmp_path, shared_matrices):
    if not (shared_matrices / "cora_adj.npz").is_file():
        pytest.skip(f"{shared_matrices} has no cora_adj.npz")
    doc = suite.run(_graph_args(tmp_path, time_budget=1e-9, graphs="cora_adj,citeseer_adj"))
    assert doc["rows"] == [] and {s["graph"] for s in doc["skipped"]} == {"cora_adj", "citeseer_adj"}
    with pytest.raises(SystemExit, match="--dtypes 'f64'"):
        suite.run(_graph_args(tmp_path, dtypes="f64"))
    with pytest.raises(SystemExit, match="--widths '0'"):
        suite.run(_graph_args(tmp_path, widths="0"))
    with pytest.raises(SystemExit, match="unknown graph"):
        suite.run(_graph_args(tmp_path, graphs="cora"))


def test_cli_takes_the_graph_suite():
    sub = argparse.ArgumentParser().add_subparsers()
    suite.add_cli(sub)
    args = sub.choices["bench"].parse_args(["--suite", "graphs", "--quick", "--dtypes", "bf16", "--out", "x"])
    assert (args.suite, args.dtypes, args.widths, args.graphs) == ("graphs", "bf16", "", "")


@pytest.mark.gpu
def test_graph_suite_on_the_gpu(tmp_path, shared_matrices):
    """The CPU test's twin: kernels or cuSPARSE plan each product, timed cold and back to back."""
    if not (shared_matrices / "cora_adj.npz").is_file():
        pytest.skip(f"{shared_matrices} has no cora_adj.npz")
    doc = suite.run(_graph_args(tmp_path, device="cuda", widths="32", dtypes="f32,bf16", time_budget=150))
    rows = [r for r in doc["rows"] if "error" not in r]
    assert [(r["dtype"], r["n"]) for r in doc["rows"]] == [("f32", 32), ("bf16", 32)], doc["rows"]
    for r in rows:
        assert r["plan"]["kind"] in ("kernel", "reference"), r
        assert r["max_rel_diff_vs_torch"] <= (1e-5 if r["dtype"] == "f32" else 2e-2), r
        assert 0 < r["frac_floor"] and 0 < r["torch_frac_floor"] and r["sparserl_cold_us"] > 0
        assert r["first_use"].get("source") in ("search", "cache", "cache+timing"), r["first_use"]
