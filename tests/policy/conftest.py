"""Fixtures: the tiny tokenizer/policy of tests/policy_fixtures.py."""

from policy_fixtures import CSR_SCALAR, kernel_source, n_features, tiny_model, tiny_tok  # noqa: F401
from base_fixtures import base_env, tiny_base  # noqa: F401
