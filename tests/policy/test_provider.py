import numpy as np
import pytest

from policy.decode import DecodeConfig
from policy.provider import PolicyProvider
from sparserl_compile import contract
from sparserl_compile.matrices import banded


class _Problem:  # the fields of sparserl_compile.providers.Problem the provider reads
    def __init__(self, m):
        self.op, self.dtype, self.n = "spmv", "f32", 1
        self.n_rows, self.n_cols, self.nnz = m.shape[0], m.shape[1], m.nnz
        self.indptr, self.indices = m.indptr, m.indices
        self.fingerprint, self.arch = "x", "cpu"


def test_candidates_have_parsed_headers_and_drops_are_counted(tiny_model, tiny_tok):
    prov = PolicyProvider(model=tiny_model, tokenizer=tiny_tok, decode=DecodeConfig(max_new_tokens=40, seed=0))
    cands = prov.candidates(_Problem(banded(32, 1)), k=3)
    # 40 tokens are too few for an untrained model to finish a kernel: all are cut off
    assert prov.stats.sampled == 3 and prov.stats.returned == len(cands)
    assert prov.stats.unfinished + prov.stats.unparseable + len(cands) == 3
    for c in cands:
        assert isinstance(c, contract.Candidate) and c.family is None


def test_missing_checkpoint_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="sparserl train"):
        PolicyProvider(checkpoint=tmp_path)


_ = np


def test_checkpoint_hash_is_the_weights_sha256(tmp_path, tiny_model, tiny_tok):
    import hashlib

    from policy.model import save_policy

    save_policy(tiny_model, tiny_tok, tmp_path)
    prov = PolicyProvider(checkpoint=tmp_path, device="cpu")
    assert prov.checkpoint_hash == hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    assert PolicyProvider(model=tiny_model, tokenizer=tiny_tok).checkpoint_hash is None


def test_a_kernel_written_twice_is_proposed_once(tiny_model, tiny_tok, kernel_source, monkeypatch):
    """Two samples (e.g. two hints) that give the same kernel are one candidate: selection
    would compile, verify and time it twice for nothing."""
    from policy import provider as prov_mod
    from policy.decode import Rollout

    other = kernel_source.rstrip() + "\n// another kernel"
    rolls = [Rollout([], [1], text, [0.0], True) for text in (kernel_source, kernel_source, other)]
    monkeypatch.setattr(prov_mod, "generate", lambda *a, **kw: rolls)
    prov = PolicyProvider(model=tiny_model, tokenizer=tiny_tok, speculative=False)
    cands = prov.candidates(_Problem(banded(32, 1)), k=3)
    assert [c.source for c in cands] == [kernel_source, other]
    assert prov.stats.duplicates == 1 and prov.stats.returned == 2 and prov.stats.sampled == 3
