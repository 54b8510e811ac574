"""The novelty function: a kernel-space point is not novel up to whitespace, comments and names;
a changed program is."""

from __future__ import annotations

import pytest

from sparserl_compile import kernels
from sparserl_compile.matrices import banded
from sparserl_compile.training.novelty import is_novel, normal_form, novel_rate


def test_points_renamed_or_reformatted_are_not_novel():
    src = kernels.render("csr_vector", "spmv", "f16", kernels.family("csr_vector").space("spmv", "f16")[2]).source
    assert not is_novel(src, "spmv", "f16")
    renamed = src.replace("acc", "total").replace("row", "r0w").replace("    ", "\t")
    commented = renamed.replace("{\n", "{ /* the row's sum */\n", 1) + "// end\n"
    assert normal_form(commented) == normal_form(src)
    assert not is_novel(commented, "spmv", "f16")


def test_changed_programs_are_novel():
    src = kernels.render("csr_scalar", "spmv", "f32", {"block": 128}).source
    assert is_novel(src.replace("fmaf(", "fmaxf("), "spmv", "f32")
    assert is_novel(src.replace("128", "160"), "spmv", "f32")  # a block size the family does not declare
    # a point of another (op, dtype) is no point of this one
    assert is_novel(src, "spmv", "bf16")
    assert novel_rate([src, src.replace("fmaf(", "fmaxf(")], "spmv", "f32") == 0.5
    assert novel_rate([], "spmv", "f32") is None


def test_structure_dependent_points_need_the_matrix():
    m = banded(32, 1)
    baked = [c for c in kernels.space("spmv", "f32", structure=m) if c.source not in
             {p.source for p in kernels.space("spmv", "f32")}]
    assert baked  # the baked kernels of this small matrix
    assert is_novel(baked[0].source, "spmv", "f32")  # without the matrix: not in the cached space
    assert not is_novel(baked[0].source, "spmv", "f32", m)


def test_bad_problem_is_a_clear_error():
    with pytest.raises(ValueError, match="dtype='f64'"):
        is_novel("", "spmv", "f64")
