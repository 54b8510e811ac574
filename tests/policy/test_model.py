import torch

from sparserl_compile.policy.encoder import StructureBatch, prepare_structure
from sparserl_compile.policy.model import PolicyHParams, build_policy, load_policy, save_policy
from sparserl_compile.matrices import banded


def _structure():
    m = banded(30, 2)
    return StructureBatch.collate([prepare_structure(m.indptr, m.indices, m.shape)])


def test_default_size_fits_the_checkpoint_budget(n_features):
    hp = PolicyHParams(n_features=n_features)
    n = build_policy(hp).n_params()
    assert 2e6 < n and n * 4 < 16 * 2**20  # a few million parameters, fp32 file < 16 MiB


def test_prefix_changes_the_output_and_cache_matches(tiny_model):
    ids = torch.tensor([[2, 40, 41, 3, 50]])
    s = _structure()
    full = tiny_model(ids, s)
    assert full.logits.shape == (1, 5, tiny_model.config.vocab_size) and full.values.shape == (1, 5)
    assert not torch.allclose(full.logits, tiny_model(ids).logits)
    first = tiny_model(ids[:, :3], s, use_cache=True)
    rest = tiny_model(ids[:, 3:], past_key_values=first.past_key_values, use_cache=True)
    torch.testing.assert_close(rest.logits, full.logits[:, 3:], atol=1e-4, rtol=1e-4)


def test_save_load_roundtrip_is_safetensors_only(tiny_model, tiny_tok, tmp_path):
    save_policy(tiny_model, tiny_tok, tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors" in files and "tokenizer.json" in files
    assert not any(f.endswith((".bin", ".pt", ".pkl")) for f in files)
    m2, t2 = load_policy(tmp_path)
    ids = torch.tensor([[2, 40, 41]])
    torch.testing.assert_close(m2(ids, _structure()).logits, tiny_model(ids, _structure()).logits)
    assert t2.encode("y[row] = acc;") == tiny_tok.encode("y[row] = acc;")
