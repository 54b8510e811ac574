"""The end-to-end benchmark's summary (the measurement itself needs a GPU: benchmarks/provider_e2e.py)."""

import math

import pytest

provider_e2e = pytest.importorskip("provider_e2e")


def _row(provider, matrix, speedup, space=2.0, op="spmv", n=1, chosen="k", err=0.0, first=0.3, delivered=None):
    return {"provider": provider, "matrix": matrix, "op": op, "n": n, "speedup": speedup,
            "delivered_speedup": delivered,
            "space_speedup": space, "chosen": chosen, "wrong": err > 1e-3, "rel_err": err, "first_call_s": first}


def test_summary_compares_each_provider_with_the_whole_space_on_the_products_both_ran():
    rows = [_row("policy", "a", 2.0), _row("policy", "b", 1.0, chosen=None), _row("policy", "c", 3.0),
            _row("search", "a", 4.0), _row("search", "b", 1.0)]  # the search never reached "c"
    s = provider_e2e.summarize(rows)
    pol = s["policy"]
    assert pol["products"] == 3 and pol["reference_kept"] == 1 and pol["wrong"] == 0
    assert pol["speedup_geomean"] == pytest.approx(math.exp(math.log(6.0) / 3))
    assert pol["space_speedup_geomean"] == pytest.approx(2.0)
    assert pol["search_products"] == 2
    assert pol["search_speedup_geomean"] == pytest.approx(2.0)
    assert pol["ratio_to_search"] == pytest.approx(math.sqrt(2.0) / 2.0)
    assert "ratio_to_search" not in s["search"]
    assert pol["delivered_speedup_geomean"] is None and "delivered_ratio_to_search" not in pol


def test_delivered_speedups_are_compared_on_the_products_both_have():
    rows = [_row("nearest", "a", 2.0, delivered=2.0), _row("nearest", "b", 2.0, delivered=1.0),
            _row("search", "a", 2.0, delivered=4.0), _row("search", "b", 2.0, delivered=None)]
    s = provider_e2e.summarize(rows)["nearest"]
    assert s["delivered_speedup_geomean"] == pytest.approx(math.sqrt(2.0))
    assert s["search_delivered_speedup_geomean"] == pytest.approx(4.0)  # "b" has no delivered time there
    assert s["delivered_ratio_to_search"] == pytest.approx(0.5)


def test_summary_without_a_search_run_has_no_search_ratio_and_counts_wrong_results():
    s = provider_e2e.summarize([_row("nearest", "a", 2.0, err=0.5), _row("nearest", "b", 2.0)])
    assert s["nearest"]["wrong"] == 1 and s["nearest"]["max_rel_err"] == 0.5
    assert "ratio_to_search" not in s["nearest"]


def test_summary_counts_slow_first_calls_on_products_of_up_to_a_million_nonzeros():
    rows = [_row("policy", "a", 2.0, first=0.4), _row("policy", "b", 2.0, first=1.5),
            _row("policy", "c", 2.0, first=3.0), _row("policy", "d", 2.0, first=0.5)]
    for r, nnz, split in zip(rows, (10**5, 10**6, 2 * 10**6, 10**4),
                             ({"propose_s": 0.2, "select_s": 0.1}, {"propose_s": 0.9, "select_s": 0.5},
                              {"propose_s": 0.4, "select_s": 2.5}, None)):
        r["nnz"], r["first_use"] = nnz, split
    s = provider_e2e.summarize(rows)["policy"]
    assert s["first_calls_upto_1e6_nnz"] == 3  # the 2e6-nonzero product is outside the target
    assert s["first_calls_over_1s_upto_1e6_nnz"] == 1
    assert s["propose_median_s"] == pytest.approx(0.4) and s["select_median_s"] == pytest.approx(0.5)


def test_a_provider_spec_may_set_the_idle_sandbox_workers_and_bad_numbers_are_named():
    assert provider_e2e.parse_spec("default:4") == ("default", 4, None)
    assert provider_e2e.parse_spec("default:4/2") == ("default", 4, 2)
    assert provider_e2e.parse_spec("policy+branches@policy/checkpoints/default:8/0") == (
        "policy+branches@policy/checkpoints/default", 8, 0)
    with pytest.raises(SystemExit, match=r"'default:4/x'.*K\[/SPARE\]"):
        provider_e2e.parse_spec("default:4/x")
