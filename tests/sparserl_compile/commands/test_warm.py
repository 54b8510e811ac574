"""``sparserl warm``: the first run after an install compiles sparserl's numba code into numba's
disk cache; a later process only loads it."""

import json
import os
import subprocess
import sys


def _warm(tmp_path, name):
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}  # an empty cache: a fresh install
    r = subprocess.run([sys.executable, "-m", "sparserl_compile.commands.cli", "warm", "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text()), r.stdout


def test_warm_compiles_once_and_later_processes_load(tmp_path):
    first, text = _warm(tmp_path, "first")
    fns = first["functions"]
    assert len(fns) >= 10 and any(f.startswith("sparserl_compile.structure.") for f in fns)
    assert first["compiled"] == sorted(fns) and first["cached"] == sorted(fns)
    assert first["cache_dirs"] and all(d.startswith(str(tmp_path / "numba")) for d in first["cache_dirs"])
    assert f"{len(fns)} compiled now" in text
    again, text = _warm(tmp_path, "again")
    assert again["compiled"] == [] and again["cached"] == sorted(fns)
    assert f"0 compiled now, {len(fns)} loaded from the cache" in text
