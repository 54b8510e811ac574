import torch

from policy.encoder import StructureBatch, prepare_structure
from policy.model import PolicyHParams, build_policy, load_policy, save_policy
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


def _steps(model, past, calls, lean):
    """Run ``calls`` (kwargs of forward continuing ``past``) in order, lean or through LlamaModel."""
    import copy

    past = copy.deepcopy(past)
    model.lean_steps = lean
    outs = []
    try:
        with torch.no_grad():
            for kw in calls:
                out = model(past_key_values=past, use_cache=True, **kw)
                past = out.past_key_values
                outs.append(out)
    finally:
        del model.lean_steps  # the class default again
    return outs, past.get_seq_length()


def test_a_decoding_step_is_the_llama_forward(tiny_model):
    """``SparseRLPolicy._step`` (what a decoding step without gradients takes) gives
    ``LlamaModel.forward``'s logits and values and leaves the same cache: one token, a draft of
    several, and a batch with padding, holes in the cache and its own positions (batched
    speculative decoding), each followed by a step that reads what the first one cached."""
    ids = torch.tensor([[2, 40, 41, 3, 50], [2, 44, 3, 0, 0]])
    prompt_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    s = StructureBatch.collate([_structure_of(30), _structure_of(40)])
    with torch.no_grad():
        first = tiny_model(ids, s, attention_mask=prompt_mask, use_cache=True)
    cached = first.past_key_values.get_seq_length()
    prefix = cached - ids.shape[1]
    valid = torch.cat([torch.ones(2, prefix, dtype=torch.long), prompt_mask], dim=1)
    one_row = [{"input_ids": torch.tensor([[60]])}, {"input_ids": torch.tensor([[61, 62, 63]])},
               {"input_ids": torch.tensor([[64]])}]
    new = torch.tensor([[1, 1, 1], [1, 0, 0]])
    batched = [{"input_ids": torch.tensor([[70, 71, 72], [73, 0, 0]]), "attention_mask": new, "past_mask": valid,
                "position_ids": torch.tensor([[5, 6, 7], [3, 4, 5]]) + prefix},
               {"input_ids": torch.tensor([[74], [75]]), "attention_mask": torch.ones(2, 1, dtype=torch.long),
                "past_mask": torch.cat([valid, new], dim=1), "position_ids": torch.tensor([[8], [4]]) + prefix}]
    for past, calls in ((_first_row(tiny_model, ids[:1], s), one_row), (first.past_key_values, batched)):
        lean, n_lean = _steps(tiny_model, past, calls, True)
        slow, n_slow = _steps(tiny_model, past, calls, False)
        assert n_lean == n_slow
        for a, b in zip(lean, slow):
            torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


def test_steps_with_gradients_go_through_llama(tiny_model, monkeypatch):
    """Training's forwards (gradients on) never take the lean step."""
    s = _structure()
    first = tiny_model(torch.tensor([[2, 40]]), s, use_cache=True)
    monkeypatch.setattr(type(tiny_model), "_step", lambda *a, **k: (_ for _ in ()).throw(AssertionError("lean")))
    out = tiny_model(torch.tensor([[41]]), past_key_values=first.past_key_values, use_cache=True)
    assert out.logits.requires_grad


def _structure_of(n):
    m = banded(n, 2)
    return prepare_structure(m.indptr, m.indices, m.shape)


def _first_row(model, ids, s):
    with torch.no_grad():
        return model(ids, StructureBatch.collate([_structure_of(30)]), use_cache=True).past_key_values
