"""Stage 1 (continued pretraining) and stage 2 (SFT) of the pretrained-base policy, in its tiny
configuration (a tiny random Llama base): the adapters and the encoder learn, the base's
weights do not move, runs resume, and the SFT policy decodes a grammar-constrained kernel."""

import json

import pytest
import torch

from policy_fixtures import CSR_SCALAR, structure_dependent_supervision
from sparserl_compile import contract
from sparserl_compile.matrices import banded
from sparserl_compile.policy.decode import generate
from sparserl_compile.policy.encoder import prepare_structure
from sparserl_compile.policy.model import load_policy
from sparserl_compile.policy.sampling import DecodeConfig
from sparserl_compile.training.pretrain import PretrainConfig, pretrain
from sparserl_compile.training.sft import SFTConfig, sft

QUIET = lambda *a: None  # noqa: E731
TEXTS = [CSR_SCALAR.replace("256", str(b)) for b in (32, 64, 128, 256, 512, 1024)] * 5


def _pretrain(tmp_path, base, steps=30):
    cfg = PretrainConfig.tiny(str(tmp_path / "pt"))
    cfg.base, cfg.steps, cfg.lr = str(base.path), steps, 1e-2  # adapters take a larger rate than a fresh model
    return cfg, pretrain(cfg, texts=TEXTS, log=QUIET)


def _base_weights(model):
    return {k: v.clone() for k, v in model.lm.state_dict().items() if "lora_" not in k}


def test_pretraining_trains_the_adapters_only_and_resumes(tmp_path, base_env):
    cfg, r = _pretrain(tmp_path, base_env)
    assert r.step == 30 and sum(r.losses[-5:]) / 5 < sum(r.losses[:5]) / 5 - 0.5
    model, _ = load_policy(tmp_path / "pt")
    from sparserl_compile.policy.basepolicy import load_base

    base_lm, _ = load_base(base_env)
    frozen = {k: v for k, v in base_lm.state_dict().items()}
    after = _base_weights(model)
    assert all(torch.equal(frozen[k.replace(".base_layer", "")], v) for k, v in after.items())
    assert any(float(v.abs().max()) > 0 for k, v in model.lm.state_dict().items() if "lora_B" in k)
    assert sorted(p.name for p in (tmp_path / "pt").iterdir()) == sorted(
        ["base_policy.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json", "pretrain_config.json"])
    cfg.steps = 34
    r2 = pretrain(cfg, texts=TEXTS, log=QUIET)
    assert (r2.start_step, r2.step, len(r2.losses)) == (30, 34, 4)


def test_sft_on_the_pretrained_base_learns_and_decodes_a_constrained_kernel(tmp_path, base_env):
    _pretrain(tmp_path, base_env, steps=4)
    data = tmp_path / "sup.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in structure_dependent_supervision()))
    cfg = SFTConfig.tiny(str(tmp_path / "pt"), str(data), str(tmp_path / "sft"))
    cfg.steps, cfg.lr = 40, 1e-2
    r = sft(cfg, render=lambda f, op, dt, params, s: CSR_SCALAR.replace("256", str(params["block"])), log=QUIET)
    assert sum(r.losses[-5:]) / 5 < sum(r.losses[:5]) / 5 * 0.6
    assert r.eval_loss is not None and r.eval_loss < r.losses[0]
    model, tok = load_policy(tmp_path / "sft")
    m = banded(64, 1)
    s = prepare_structure(m.indptr, m.indices, m.shape, max_points=model.config.max_points)
    (roll,) = generate(model, tok, s, "spmv", "f32", 1, config=DecodeConfig(greedy=True, max_new_tokens=400))
    assert roll.grammar_error is None and roll.finished
    header = contract.parse_header(roll.text)
    assert (header.op, header.dtype, header.format) == ("spmv", "f32", "csr")


@pytest.mark.gpu
def test_the_stages_run_on_the_gpu(tmp_path, base_env):
    """The CPU tests' twin on CUDA: both stages of the tiny configuration, then a constrained decode."""
    cfg = PretrainConfig.tiny(str(tmp_path / "pt"))
    cfg.base, cfg.steps, cfg.lr, cfg.device = str(base_env.path), 10, 1e-2, "cuda"
    pretrain(cfg, texts=TEXTS, log=QUIET)
    data = tmp_path / "sup.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in structure_dependent_supervision()))
    scfg = SFTConfig.tiny(str(tmp_path / "pt"), str(data), str(tmp_path / "sft"))
    scfg.steps, scfg.lr, scfg.device = 40, 1e-2, "cuda"
    r = sft(scfg, render=lambda f, op, dt, params, s: CSR_SCALAR.replace("256", str(params["block"])), log=QUIET)
    assert sum(r.losses[-5:]) / 5 < sum(r.losses[:5]) / 5 * 0.6
    model, tok = load_policy(tmp_path / "sft", device="cuda")
    m = banded(64, 1)
    s = prepare_structure(m.indptr, m.indices, m.shape, max_points=model.config.max_points)
    (roll,) = generate(model, tok, s, "spmv", "f32", 1, config=DecodeConfig(greedy=True, max_new_tokens=400))
    assert roll.grammar_error is None and roll.finished and contract.parse_header(roll.text).op == "spmv"
