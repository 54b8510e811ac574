"""The pretrained-base policy's tiny configuration for tests/policy and tests/training: a tiny
random Llama saved as a base folder with the tiny BPE tokenizer (no download)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory, tiny_tok):
    """``BaseInfo`` of a tiny random Llama base folder (2 blocks, width 64) over ``tiny_tok``."""
    from sparserl_compile.policy.basepolicy import write_tiny_base

    return write_tiny_base(tmp_path_factory.mktemp("tiny_base"), tiny_tok)


@pytest.fixture()
def base_env(tiny_base, monkeypatch):
    """``$SPARSERL_BASE`` pointing at the tiny base: what loading a checkpoint finds."""
    from sparserl_compile.policy.base import ENV_BASE

    monkeypatch.setenv(ENV_BASE, str(tiny_base.path))
    return tiny_base


def tiny_base_policy(base, n_features: int, seed: int = 0):
    """A new tiny pretrained-base policy on ``base`` and the base's tokenizer."""
    from sparserl_compile.policy.basepolicy import BasePolicyConfig, build_base_policy

    return build_base_policy(base.path, BasePolicyConfig.tiny(n_features), seed=seed)
