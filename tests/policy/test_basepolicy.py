"""The policy on a pretrained base, in its tiny configuration (a tiny random Llama as the base):
what a checkpoint ships, the base's hash check, and grammar-constrained decoding through the
policy's decode path."""

import json

import pytest
import torch

from base_fixtures import tiny_base_policy
from policy_fixtures import banded_structure
from sparserl_compile.policy.base import BaseUnavailable
from sparserl_compile.policy.basepolicy import CONFIG_FILE, BaseMismatch, write_tiny_base
from sparserl_compile.policy.decode import generate
from sparserl_compile.policy.encoder import StructureBatch
from sparserl_compile.policy.masks import make_matcher
from sparserl_compile.policy.model import load_policy, save_policy
from sparserl_compile.policy.sampling import DecodeConfig
from sparserl_compile.policy.tokenizer import prompt_text


def test_only_adapters_and_the_encoder_train_and_the_prefix_reaches_the_logits(tiny_base, n_features):
    model, tok = tiny_base_policy(tiny_base, n_features)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n or not n.startswith("lm.") for n in trained)
    assert any(n.startswith("encoder.") for n in trained) and "proj.weight" in trained
    ids = torch.tensor([tok.encode(prompt_text("spmv", "f32", 1))])
    sb = StructureBatch.collate([banded_structure()])
    out = model(ids, sb)
    assert out.logits.shape == (1, ids.shape[1], model.config.vocab_size) and out.values.shape == (1, ids.shape[1])
    with torch.no_grad():
        model.proj.weight.mul_(3.0)
    assert not torch.allclose(model(ids, sb).logits, out.logits)  # the structure prefix is read


def test_a_checkpoint_ships_no_base_weight_and_reloads_on_its_base(tmp_path, base_env, n_features):
    model, tok = tiny_base_policy(base_env, n_features, seed=3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # adapters that change the output, as after training
    save_policy(model, tok, tmp_path / "ck")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata()["base_sha256"] == base_env.sha256
    assert keys == set(model.trained_state()) and not any(k.startswith("lm.") and "lora_" not in k for k in keys)
    assert json.loads((tmp_path / "ck" / CONFIG_FILE).read_text())["base_sha256"] == base_env.sha256
    loaded, tok2 = load_policy(tmp_path / "ck")  # the base from $SPARSERL_BASE
    ids = torch.tensor([tok.encode(prompt_text("spmv", "f32", 1))])
    sb = StructureBatch.collate([banded_structure()])
    model.eval()
    assert torch.allclose(loaded(ids, sb).logits, model(ids, sb).logits, atol=1e-5)
    assert tok2.encode("op=spmv") == tok.encode("op=spmv")


def test_loading_refuses_another_base_and_says_why_without_one(tmp_path, tiny_base, tiny_tok, n_features,
                                                               monkeypatch):
    model, tok = tiny_base_policy(tiny_base, n_features)
    save_policy(model, tok, tmp_path / "ck")
    other = write_tiny_base(tmp_path / "other", tiny_tok, seed=1)
    with pytest.raises(BaseMismatch, match=f"trained on the base .*{tiny_base.sha256}.*{other.sha256}"):
        load_policy(tmp_path / "ck", base=other.path)
    monkeypatch.delenv("SPARSERL_BASE", raising=False)
    with pytest.raises(BaseUnavailable, match="no base model .*fetch"):
        load_policy(tmp_path / "ck")


def test_the_provider_falls_back_when_the_base_is_missing(tmp_path, tiny_base, n_features, monkeypatch):
    from sparserl_compile.policy.provider import PolicyProvider

    model, tok = tiny_base_policy(tiny_base, n_features)
    save_policy(model, tok, tmp_path / "ck")
    monkeypatch.delenv("SPARSERL_BASE", raising=False)
    with pytest.raises(BaseUnavailable) as e:  # the runtime's provider chain logs this and uses the lookup
        PolicyProvider(checkpoint=tmp_path / "ck", device="cpu")
    assert "fetch" in str(e.value)


def test_grammar_constrained_decoding_writes_only_kernel_text(tiny_base, n_features):
    model, tok = tiny_base_policy(tiny_base, n_features)
    model.eval()
    (r,) = generate(model, tok, banded_structure(), "spmv", "f32", 1, k=1,
                    config=DecodeConfig(temperature=1.0, max_new_tokens=48, seed=0))
    assert r.grammar_error is None and r.masks is not None and len(r.tokens) == r.masks.shape[0]
    m = make_matcher(tok, model.config.vocab_size, None, "spmv", "f32")
    assert m.validate_tokens(r.tokens) == len(r.tokens)  # every token was one the grammar allowed
    assert r.text.startswith("// sparserl op=spmv format=")
