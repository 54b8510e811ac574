"""The language check, contract check and rewrites of ``simt.rewrite``."""

from __future__ import annotations

import re

import pytest

from sparserl_compile import contract, simt
from sparserl_compile.simt.rewrite import prepare
from simt_cases import HDR_SCALAR, SCALAR_CSR, SHARED_REDUCE, SIG_F32, VECTOR_CSR


def _with(body: str) -> str:
    return HDR_SCALAR + SIG_F32 + " {\n" + body + "\n}\n"


@pytest.mark.parametrize("body, construct", [
    ('    asm volatile("nop;");', "inline assembly"),
    ("    long long t = clock64();", "clock read"),
    ('    printf("%d", 1);', "printf"),
    ("    static int calls = 0;", "static storage"),
    ("    float v = __shfl_down(1.0f, 1);", "without _sync"),
    ("    unsigned b = __ballot_sync(0xffffffff, 1);", "warp vote"),
    ("    __threadfence();", "memory fences"),
])
def test_out_of_language_constructs_are_refused_by_name(body, construct):
    with pytest.raises(simt.SimtRefused, match=construct) as e:
        simt.compile_kernel(_with(body))
    assert e.value.line == 4


def test_includes_templates_and_globals_are_refused():
    with pytest.raises(simt.SimtRefused, match="preprocessor directive"):
        prepare(HDR_SCALAR + "#include <cstdio>\n" + SCALAR_CSR.split("\n", 2)[2])
    with pytest.raises(simt.SimtRefused, match="file-scope variable"):
        prepare(HDR_SCALAR + "__device__ float counter;\n" + SCALAR_CSR.split("\n", 2)[2])
    with pytest.raises(simt.SimtRefused, match="templates"):
        prepare(HDR_SCALAR + "template <int N> __device__ int f() { return N; }\n" + SCALAR_CSR.split("\n", 2)[2])


def test_pragma_unroll_is_accepted():
    p = prepare(_with("    #pragma unroll 4\n    for (int i = 0; i < 4; ++i) { }"))
    assert "#pragma" not in p.body


def test_tensor_core_families_build_and_run_in_fiber_mode():
    """wmma is emulated (runtime.h): the tensor-core families build, and their collective calls
    put the kernel in fiber mode (a warp's lanes must meet at them)."""
    from sparserl_compile import kernels

    wmma = [c for c in kernels.space("spmm", "f16") if c.family in ("bsr_wmma", "bitmap_wmma", "tcw_wmma")]
    assert {c.family for c in wmma} == {"bsr_wmma", "bitmap_wmma", "tcw_wmma"}
    for c in (wmma[0], next(c for c in wmma if c.family == "tcw_wmma")):
        assert prepare(c.source).uses_fibers
        assert simt.compile_kernel(c.source).uses_fibers


def test_signature_must_match_the_contract():
    bad = SCALAR_CSR.replace("const float* __restrict__ x", "const double* __restrict__ x")
    with pytest.raises(contract.ContractError, match="parameter 6"):
        prepare(bad)
    with pytest.raises(contract.ContractError):
        prepare("// no header\n" + SIG_F32 + " {}\n")


def test_compile_error_carries_log_and_numbered_source():
    with pytest.raises(simt.SimtCompileError) as e:
        simt.compile_kernel(_with("    float v = undefined_thing + 1;"))
    assert "undefined_thing" in e.value.log
    assert "kernel.cu:4" in e.value.log  # the kernel's own line numbers
    assert "4 |     float v = undefined_thing + 1;" in str(e.value)


def test_line_numbers_survive_the_rewrite():
    for src in (SCALAR_CSR, VECTOR_CSR, SHARED_REDUCE):
        for guarded in (True, False):
            p = prepare(src, guarded=guarded)
            assert p.body.count("\n") == src.count("\n")


def test_guarded_rewrite_checks_pointers_and_arrays():
    p = prepare(SHARED_REDUCE, guarded=True)
    assert re.search(r"GPtr<const float>\s+x\b", p.body) and "__restrict__" not in p.body
    assert "SArr<float> part = simt_static_shared<float>(0" in p.body
    assert "simt_tick() && (" in p.body
    assert p.uses_fibers and p.array_names[65] == "part"
    u = prepare(SHARED_REDUCE, guarded=False)
    assert "GPtr" not in u.body and "(&part)[128]" in u.body
    assert not prepare(SCALAR_CSR).uses_fibers
