"""The README's main job (`sparserl demo`) on this machine: proposes, verifies, answers right."""

from __future__ import annotations

import pytest

from sparserl_compile import select
from sparserl_compile.commands import demo


@pytest.mark.slow
def test_demo_quick_verifies_a_kernel_per_product_and_matches_scipy(tmp_path, monkeypatch):
    rows = demo.run("search", n=8, quick=True)
    assert [(r.matrix, r.op) for r in rows] == [("stencil2d_32", "spmv"), ("stencil2d_32", "spmm8"),
                                                ("banded_2k_b3", "spmv"), ("banded_2k_b3", "spmm8")]
    for r in rows:
        assert r.proposed > 10 and r.rel_err < 1e-5
        ok, evaluated = map(int, r.verified.split("/"))
        assert ok >= 1, r
        if select.default_executor() == "cpu":
            assert r.kernel_us is None and "[" in r.chosen  # a family point, verified on the CPU
    table = demo.format_table(rows, select.default_executor())
    assert "stencil2d_32" in table and "banded_2k_b3" in table


def test_preflight_names_a_missing_cpu_compiler(monkeypatch):
    """Without a C++ compiler the CPU executor cannot verify anything: the demo says so, and
    which compiler it looked for, before it runs."""
    monkeypatch.setenv("CXX", "no-such-cxx-compiler")
    problems = demo.preflight("cpu")
    assert len(problems) == 1 and "no-such-cxx-compiler" in problems[0] and "g++" in problems[0]
    assert demo.preflight("gpu") == []  # a GPU machine verifies on the GPU: no C++ compiler needed


def test_preflight_names_missing_nvrtc(monkeypatch):
    from sparserl_compile import compiler

    def gone():
        raise RuntimeError("cuda.bindings is not installed: pip install cuda-bindings nvidia-cuda-nvrtc")

    monkeypatch.setattr(compiler, "nvrtc_version", gone)
    problems = demo.preflight("gpu")
    assert len(problems) == 1 and "NVRTC is unavailable" in problems[0] and "[gpu]" in problems[0]
