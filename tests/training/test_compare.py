"""training/compare.py: two variants compared record by record, with a bootstrap interval."""

import json
import math

import pytest

from sparserl_compile.training.compare import load_rows, main, paired, pooled, pooled_pairs


def _rows(values, metric="greedy_fallback_fraction"):
    return [{"label": f"m{i}", "op": "spmv", "n": 1, metric: v} for i, v in enumerate(values)]


def test_identical_variants_are_a_ratio_of_one_with_no_spread():
    r = paired(_rows([0.5, 0.9, 1.0]), _rows([0.5, 0.9, 1.0]), n_boot=200)
    assert r["ratio_geomean"] == pytest.approx(1.0) and r["ci95"] == pytest.approx([1.0, 1.0])
    assert (r["records"], r["better"], r["worse"], r["left_out"], r["changes"]) == (3, 0, 0, 0, [])


def test_one_record_that_doubles_moves_the_geomean_and_widens_the_interval():
    r = paired(_rows([0.4, 0.9, 0.9, 0.9]), _rows([0.8, 0.9, 0.9, 0.9]), n_boot=2000, seed=1)
    assert r["ratio_geomean"] == pytest.approx(2 ** 0.25)
    lo, hi = r["ci95"]
    assert lo == pytest.approx(1.0) and hi == pytest.approx(2.0, rel=0.2)  # resamples with and without it
    assert (r["better"], r["worse"]) == (1, 0)
    assert r["changes"] == [{"label": "m0", "op": "spmv", "n": 1, "base": 0.4, "other": 0.8}]


def test_records_missing_a_figure_on_either_side_are_left_out_and_counted():
    base = _rows([0.5, None, 0.8]) + [{"label": "only_base", "op": "spmm", "n": 32, "greedy_fallback_fraction": 1.0}]
    r = paired(base, _rows([0.25, 0.7, 0.8]))
    assert r["records"] == 2 and r["left_out"] == 2
    assert r["ratio_geomean"] == pytest.approx(math.sqrt(0.5)) and r["worse"] == 1
    assert paired(_rows([None]), _rows([0.5]))["ratio_geomean"] is None
    with pytest.raises(ValueError, match="metric"):
        paired(base, base, metric="speed")


def test_the_command_reads_eval_reports_and_says_what_is_missing(tmp_path, capsys):
    rep = {"variants": {"a": {}, "b": {}},
           "per_record": {"a": _rows([0.5, 1.0]), "b": _rows([1.0, 1.0])}}
    f = tmp_path / "eval.json"
    f.write_text(json.dumps(rep))
    out = tmp_path / "cmp.json"
    assert main([f"{f}:a", f"{f}:b", "--bootstrap", "100", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"{f}:b: x1.414" in text and "m0 spmv n=1: 0.500 -> 1.000" in text
    assert json.loads(out.read_text())["results"][f"{f}:b"]["records"] == 2
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"variants": {"a": {}}}))
    with pytest.raises(ValueError, match="no per_record rows"):
        load_rows(f"{old}:a")
    with pytest.raises(ValueError, match="no variant 'c'"):
        load_rows(f"{f}:c")
    assert main([f"{old}:a", f"{f}:b"]) == 2 and "evaluate again" in capsys.readouterr().err


def test_validation_results_pair_problem_by_problem(tmp_path, capsys):
    f = tmp_path / "val.json"
    f.write_text(json.dumps({"problems": ["m0 spmv", "m1 spmv"], "checkpoints": {
        "sft": {"rows": _rows([2.0, 1.0], "value")}, "rl": {"rows": _rows([4.0, 1.0], "value")}}}))
    assert load_rows(f"{f}:rl") == _rows([4.0, 1.0], "value")
    assert main([f"{f}:sft", f"{f}:rl", "--metric", "value"]) == 0
    assert f"{f}:rl: x{2 ** 0.5:.3f}" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no checkpoint 'v9'; it holds \\['rl', 'sft'\\]"):
        load_rows(f"{f}:v9")


def test_pooled_runs_average_each_records_log_ratio_over_the_runs():
    base = _rows([0.5, 0.5, 0.5])
    runs = [_rows([1.0, 0.5, 0.5]), _rows([0.25, 0.5, None])]  # the second has no figure on m2
    r = pooled(base, runs, n_boot=500)
    assert r["records"] == 2 and r["left_out"] == 1  # m2: not every run has it
    assert r["ratio_geomean"] == pytest.approx(1.0)  # m0: x2 and x0.5 average to x1; m1: x1
    assert r["changes"] == [] and (r["better"], r["worse"]) == (0, 0)
    assert pooled(base, runs[:1])["ratio_geomean"] == paired(base, runs[0])["ratio_geomean"]


def test_excluded_records_are_left_out_of_the_comparison():
    base, other = _rows([0.25, 0.5, 0.5]), _rows([1.0, 0.5, 0.5])
    assert paired(base, other)["ratio_geomean"] == pytest.approx(4 ** (1 / 3))
    r = paired(base, other, exclude=("m0",))
    assert r["ratio_geomean"] == pytest.approx(1.0) and r["records"] == 2 and r["excluded"] == ["m0"]


def test_the_command_pools_and_excludes(tmp_path, capsys):
    f = tmp_path / "eval.json"
    per = {"sft": _rows([0.5, 0.5, 0.4]), "a": _rows([1.0, 0.5, 0.4]), "b": _rows([0.25, 0.5, 0.4])}
    f.write_text(json.dumps({"per_record": per}))
    out = tmp_path / "cmp.json"
    assert main([f"{f}:sft", f"{f}:a", f"{f}:b", "--pool", "--exclude", "m2", "--bootstrap", "100",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "'m2' left out" in text and f"pooled: {f}:a + {f}:b: x1.000" in text
    res = json.loads(out.read_text())["results"]
    assert res[f"{f}:a"]["records"] == 2 and res[f"pooled: {f}:a + {f}:b"]["excluded"] == ["m2"]
    assert main([f"{f}:sft", f"{f}:a", "--pool"]) == 2 and "two or more" in capsys.readouterr().err


def test_matched_pairs_each_against_its_own_base_then_pooled():
    ctl1, run1 = _rows([0.5, 0.5]), _rows([1.0, 0.5])  # run 1 doubles m0 over its control
    ctl3, run3 = _rows([0.8, 0.4]), _rows([0.8, 0.8])  # run 3 doubles m1 over its control
    r = pooled_pairs([(ctl1, run1), (ctl3, run3)], n_boot=500)
    assert r["records"] == 2 and r["ratio_geomean"] == pytest.approx(2 ** 0.5)  # each record: (log 2 + 0) / 2
    assert r["changes"][0]["base"] == pytest.approx(math.sqrt(0.5 * 0.8))  # the bases' geometric mean
    assert pooled_pairs([(ctl1, run1)])["ratio_geomean"] == paired(ctl1, run1)["ratio_geomean"]
    # against one shared base the pooled runs are not the pooled pairs
    assert pooled(ctl1, [run1, run3])["ratio_geomean"] != pytest.approx(r["ratio_geomean"])


def test_the_command_compares_matched_pairs(tmp_path, capsys):
    f = tmp_path / "eval.json"
    per = {"c1": _rows([0.5, 0.5]), "r1": _rows([1.0, 0.5]), "c3": _rows([0.8, 0.4]), "r3": _rows([0.8, 0.8])}
    f.write_text(json.dumps({"per_record": per}))
    out = tmp_path / "cmp.json"
    assert main(["--pair", f"{f}:c1", f"{f}:r1", "--pair", f"{f}:c3", f"{f}:r3", "--bootstrap", "100",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "each against its own base" in text and f"{f}:r1 vs {f}:c1: x1.414" in text
    res = json.loads(out.read_text())
    assert res["results"][f"pooled pairs: {f}:r1 vs {f}:c1 + {f}:r3 vs {f}:c3"]["ratio_geomean"] == pytest.approx(2 ** 0.5)
    with pytest.raises(SystemExit):  # pairs and a positional base at once
        main([f"{f}:c1", f"{f}:r1", "--pair", f"{f}:c3", f"{f}:r3"])
    assert "--pair" in capsys.readouterr().err


def test_pairs_on_different_problems_are_stacked_not_averaged(tmp_path, capsys):
    """Two draws of validation problems share no record: averaging over the pairs has nothing to
    average, and the command says so and names --stack, which puts both draws' records together."""
    from sparserl_compile.training.compare import stacked_pairs

    base1, other1 = _rows([1.0, 1.0]), _rows([2.0, 1.0])  # draw 1: m0 doubles
    base2 = [dict(r, label="d2_" + r["label"]) for r in _rows([1.0, 1.0, 1.0])]  # draw 2: other records
    other2 = [dict(r, label="d2_" + r["label"]) for r in _rows([1.0, 1.0, 0.5])]  # m2 halves
    r = stacked_pairs([(base1, other1), (base2, other2)], n_boot=200)
    assert r["records"] == 5 and r["stacked"] == 2 and (r["better"], r["worse"]) == (1, 1)
    assert r["ratio_geomean"] == pytest.approx(1.0)  # (log 2 + 0 + 0 + 0 - log 2) / 5
    assert [c["label"] for c in r["changes"]] == ["m0", "d2_m2"]
    assert pooled_pairs([(base1, other1), (base2, other2)])["ratio_geomean"] is None
    f = tmp_path / "eval.json"
    f.write_text(json.dumps({"per_record": {"b1": base1, "o1": other1, "b2": base2, "o2": other2}}))
    pairs = ["--pair", f"{f}:b1", f"{f}:o1", "--pair", f"{f}:b2", f"{f}:o2", "--bootstrap", "100"]
    assert main(pairs) == 0
    assert "share no record" in capsys.readouterr().out
    assert main(pairs + ["--stack"]) == 0
    assert f"stacked pairs: {f}:o1 vs {f}:b1 + {f}:o2 vs {f}:b2: x1.000" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--stack", "--pair", f"{f}:b1", f"{f}:o1"])


def _rate_rows(compiled, samples=9):
    return [{"label": f"m{i}", "op": "spmv", "n": 1, "compiled": c, "correct": max(c - 1, 0), "samples": samples}
            for i, c in enumerate(compiled)]


def test_compile_and_correct_rates_are_paired_differences_and_zero_counts():
    base, other = _rate_rows([9, 0, 9, 8]), _rate_rows([9, 9, 9, 9])
    r = paired(base, other, metric="compile_rate", n_boot=500)
    assert r["records"] == 4 and "ratio_geomean" not in r  # a record at 0 compiled is a figure, not a gap
    assert r["difference_mean"] == pytest.approx((9 / 9 + 1 / 9) / 4)
    lo, hi = r["ci95"]
    assert 0 <= lo <= r["difference_mean"] <= hi <= 1
    assert (r["better"], r["worse"]) == (2, 0)
    assert r["changes"][0] == {"label": "m1", "op": "spmv", "n": 1, "base": 0.0, "other": 1.0}
    c = paired(base, other, metric="correct_rate", n_boot=100)
    assert c["difference_mean"] == pytest.approx((8 / 9 + 1 / 9) / 4)  # correct: 8, 0, 8, 7 -> 8 each
    same = paired(base, base, metric="compile_rate", n_boot=100)
    assert same["difference_mean"] == 0 and same["ci95"] == [0, 0] and same["changes"] == []
    assert pooled_pairs([(base, other), (other, base)], metric="compile_rate", n_boot=100)["difference_mean"] == 0


def test_rates_of_validation_rows_count_the_greedy_kernel(tmp_path, capsys):
    rows = lambda ok: [{"label": f"p{i}", "op": "spmv", "n": 1, "compiled": True, "correct": c, "value": 1.0}
                       for i, c in enumerate(ok)]
    f = tmp_path / "val.json"
    f.write_text(json.dumps({"checkpoints": {"a": {"rows": rows([True, False, True, True])},
                                             "b": {"rows": rows([True, True, True, True])}}}))
    assert main([f"{f}:a", f"{f}:b", "--metric", "correct_rate", "--bootstrap", "100"]) == 0
    out = capsys.readouterr().out
    assert "percentage points" in out and f"{f}:b: +25.0 points" in out and "p1 spmv n=1: 0.000 -> 1.000" in out
    assert main(["--stack", "--pair", f"{f}:a", f"{f}:b", "--pair", f"{f}:b", f"{f}:a",
                 "--metric", "compile_rate", "--bootstrap", "100"]) == 0
    assert "stacked pairs" in capsys.readouterr().out
