"""Load the scripts in ``examples/`` as modules (they are scripts, not a package).

Tests in this folder import it by name (pytest puts the folder on ``sys.path``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str):
    """Import ``examples/<name>.py`` once per test run, registered as ``sparserl_example_<name>``."""
    mod_name = f"sparserl_example_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    path = EXAMPLES / f"{name}.py"
    if not path.is_file():
        pytest.fail(f"{path} is missing")
    spec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[mod_name]
        raise
    return mod
