"""Shared fixtures: the real matrices in ../shared, GPU skipping, an isolated kernel cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sparserl_compile.matrices import shared_matrices_dir


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing entirely
        return False


HAS_CUDA = _has_cuda()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run on the device (benchmarks/device_run.sh)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def shared_matrices() -> Path:
    """The folder of real matrices (../shared/matrices); skips the test where it is absent."""
    d = shared_matrices_dir()
    if d is None:
        pytest.skip("../shared/matrices is absent (set SPARSERL_SHARED_MATRICES to its path)")
    return d


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test gets its own kernel cache directory, never the user's ~/.cache/sparserl."""
    d = tmp_path_factory.mktemp("sparserl_cache")
    os.chmod(d, 0o700)
    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(d))
    yield d


@pytest.fixture(scope="session", autouse=True)
def _session_runtime_settings():
    """The runtime's settings as the test run starts, before any fixture or test changes them:
    the default configuration and one ``DefaultProvider`` (made without loading anything; on a
    GPU the policy it loads stays loaded for later tests)."""
    from sparserl_compile import config, providers

    return config.get_config(), providers.get_provider()


@pytest.fixture(autouse=True)
def _runtime_settings_restored(_session_runtime_settings):
    """Whatever a test sets (``configure``, ``set_provider``), the next test starts from the
    test run's first settings, not from what an earlier module left behind."""
    from sparserl_compile import config, plans, providers

    settings, active = _session_runtime_settings
    yield
    if config.get_config() is not settings or providers.get_provider() is not active:
        config.current, providers._active = settings, active  # as they were: no provider is built
        plans.clear()
