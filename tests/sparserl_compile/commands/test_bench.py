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

_REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "report.py"


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
