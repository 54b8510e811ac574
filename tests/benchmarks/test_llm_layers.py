"""benchmarks/llm_layers.py: its CPU-side logic (grid, proposals, byte accounting, tables)."""

from __future__ import annotations

import argparse

import pytest

import llm_layers as L
from sparserl_compile import matrices, verify


def _args(**kw):
    base = dict(quick=False, shapes="4096x4096,11008x4096", sparsities="0.5,0.7,0.9", batches="1,4,8,16,32")
    base.update(kw)
    return argparse.Namespace(**base)


def test_grid_and_quick():
    todo, batches = L.cases(_args())
    assert [c.label for c in todo] == ["4096x4096@50%", "4096x4096@70%", "4096x4096@90%",
                                       "11008x4096@50%", "11008x4096@70%", "11008x4096@90%"]
    assert batches == (1, 4, 8, 16, 32)
    todo, batches = L.cases(_args(quick=True, shapes="nonsense"))  # --quick overrides the lists
    assert [c.label for c in todo] == ["4096x4096@70%"] and batches == (1, 16)


@pytest.mark.parametrize("bad,match", [({"shapes": "4096by4096"}, "rows x cols"), ({"shapes": "0x5"}, ">= 1"),
                                       ({"sparsities": "1.5"}, r"\[0, 1\)"), ({"batches": "0"}, ">= 1"),
                                       ({"batches": "a,b"}, "comma-separated")])
def test_bad_arguments_say_what_is_wrong(bad, match):
    with pytest.raises(ValueError, match=match):
        L.cases(_args(**bad))


def test_bitmap_points_follow_the_width():
    pat = verify.Pattern.of(matrices.pruned_weight(256, 512, 0.7))
    one = L.bitmap_points(L.problem_for(pat, 1))
    assert len(one) == 12 and {c.family for c in one} == {"bitmap_warp"}
    assert all(dict(c.params)["v"] == 1 for c in one)
    sixteen = L.bitmap_points(L.problem_for(pat, 16))
    assert sixteen and {c.family for c in sixteen} == {"bitmap_wmma"}
    assert all(dict(c.params)["BN"] == 16 for c in sixteen)
    eight = L.bitmap_points(L.problem_for(pat, 8))
    assert {c.family for c in eight} == {"bitmap_warp", "bitmap_wmma"}
    # the same points, in the same order, as the search itself proposes first
    from sparserl_compile.search import SearchProvider

    searched = SearchProvider().candidates(L.problem_for(pat, 8), k=len(eight))
    assert [c.name for c in searched] == [c.name for c in eight]


def test_layout_bytes_of_the_kept_plan():
    m = matrices.pruned_weight(256, 1024, 0.7)
    pat = verify.Pattern.of(m)
    dense = 256 * 1024 * 2
    assert L.layout_bytes(None, pat) == m.nnz * 6 + 4 * 257  # cuSPARSE: CSR, int32 indices
    point = L.bitmap_points(L.problem_for(pat, 1))[0]
    assert L.layout_bytes(point, pat) <= 0.45 * dense


def test_speedup_and_tables():
    assert L.speedup(10.0, 5.0) == 2.0
    assert L.speedup(None, 5.0) is None and L.speedup(10.0, 0.0) is None
    row = {"weight": "4096x4096@70%", "batch": 1, "kept": "cusparse", "sparse_us": 30.0, "dense_us": 20.0,
           "cusparse_us": 30.0, "speedup_vs_dense": 0.67, "b2b_speedup_vs_dense": None, "bytes_vs_dense": 0.9,
           "rel_err": 1e-3, "first_call_s": 4.2,
           "direct": [{"name": "bitmap_warp[a]", "direct_us": 9.0, "sandbox_us": 9.5, "rel_err": 1e-3},
                      {"name": "bitmap_warp[b]", "direct_us": 7.0, "sandbox_us": None, "rel_err": 2e-3}]}
    text = L.table([row])
    assert "4096x4096@70%" in text and "cusparse" in text and "0.67" in text
    direct = L.direct_table([row]).splitlines()
    assert "dense 20.0 us" in direct[0]
    assert "bitmap_warp[b]" in direct[1] and "bitmap_warp[a]" in direct[2]  # fastest first


def test_selection_summary_reads_the_first_use_row():
    row = {"plan": "kernel", "select_s": 3.5, "verification": {
        "chosen": "bitmap_warp[x]", "rule": "fastest verified candidate beats the reference", "reference_us": 40.0,
        "candidates": [{"name": "bitmap_warp[x]", "family": "bitmap_warp", "kind": "ok", "kernel_us": 9.0},
                       {"name": "csr_vector[y]", "family": "csr_vector", "kind": "wrong", "kernel_us": None,
                        "error": "error_bound: ..."}]}}
    s = L.selection_summary(row)
    assert s["chosen"] == "bitmap_warp[x]" and s["reference_us"] == 40.0 and s["plan"] == "kernel"
    assert [c["kind"] for c in s["candidates"]] == ["ok", "wrong"]
    assert L.selection_summary(None)["candidates"] == []


def test_main_without_a_gpu_says_so(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: main would run the benchmark")
    assert L.main(["--quick", "--json", str(tmp_path / "out.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_json_path(monkeypatch, tmp_path):
    assert L.json_path(str(tmp_path / "x.json")) == tmp_path / "x.json"
    monkeypatch.setenv("OUT", str(tmp_path))
    assert L.json_path(None) == tmp_path / "llm_layers.json"
    monkeypatch.delenv("OUT")
    assert L.json_path(None).name == "llm_layers.json" and L.json_path(None).parent.name == "results"
