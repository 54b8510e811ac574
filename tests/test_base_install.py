"""A base install (``pip install sparserl``: torch, numpy, scipy, numba, tqdm) works as the
README says: its CPU usage runs, ``sparserl --version`` and ``sparserl demo`` say what they
need instead of failing.

The extras' modules are made unimportable in a subprocess (a meta-path finder that refuses
them), which is what a base install looks like to the package; a real ``pip install`` would
download torch again for every CI run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: top-level modules that only the extras install (gpu, nvrtc, train, onnx, plot, dev)
EXTRAS = ("cuda", "transformers", "tokenizers", "safetensors", "llguidance", "onnx", "matplotlib",
          "torch_geometric", "hypothesis", "ml_dtypes")

_BLOCK = textwrap.dedent(f"""
    import sys
    class _NoExtras:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {EXTRAS!r}:
                raise ImportError(f"{{name}} is not installed (a base install)")
            return None
    sys.meta_path.insert(0, _NoExtras())
""")


def _run(code: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK + textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_the_readme_cpu_usage_runs_on_a_base_install(tmp_path):
    r = _run(f"""
        import os
        os.environ["SPARSERL_CACHE_DIR"] = {str(tmp_path / "cache")!r}
        import torch, scipy.sparse as sp
        import sparserl_compile as sr

        m = sp.random(2000, 2000, density=0.005, format="csr", dtype="float32", random_state=0)
        A = sr.sparsify(m)
        x, X = torch.randn(2000), torch.randn(2000, 32)
        torch.testing.assert_close(A @ x, torch.from_numpy(m @ x.numpy()), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(A @ X, torch.from_numpy(m @ X.numpy()), rtol=1e-5, atol=1e-5)

        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
        with torch.no_grad():
            model[0].weight[torch.rand(512, 512) < 0.6] = 0
        want = model(torch.ones(3, 512))
        sr.sparsify_(model, min_sparsity=0.5)
        assert type(model[0].weight).__name__ == "SparseRLTensor"
        torch.testing.assert_close(model(torch.ones(3, 512)), want, rtol=1e-5, atol=1e-5)

        C = torch.from_numpy(m.toarray()).to_sparse_csr()
        with sr.accelerate():
            Z = torch.sparse.mm(C, torch.ones(2000, 8))
        torch.testing.assert_close(Z, torch.from_numpy(m @ torch.ones(2000, 8).numpy()), rtol=1e-5, atol=1e-5)
        print("provider", sr.get_provider().name)
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "provider nearest" in r.stdout  # the default provider: the lookup, no extra needed


def test_the_cli_on_a_base_install_says_what_it_needs():
    r = _run("from sparserl_compile.commands.cli import main; raise SystemExit(main(sys.argv[1:]))", "--version")
    assert r.returncode == 0 and r.stdout.strip().startswith("sparserl "), r.stderr[-2000:]
    r = _run("""
        from sparserl_compile.commands import demo
        print(demo.preflight("cpu"))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "NVRTC is unavailable" in r.stdout and "[gpu]" in r.stdout
