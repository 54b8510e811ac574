"""The kernel-language grammar (through llguidance) and the post-parse checks."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from sparserl_compile import contract, kernels, language


def _all_points():
    m = sp.random(30, 20, density=0.1, format="csr", random_state=5, dtype=np.float32)
    return [c for op in contract.OPS for dt in contract.DTYPES for c in kernels.space(op, dt, structure=m)]


def test_every_space_point_is_in_the_language():
    pts = _all_points()
    assert {c.family for c in pts} == {f.name for f in kernels.FAMILIES}
    for c in pts:
        v = language.accepts(c.source)
        assert v.accepted, (c.name, v.error)
        assert language.check(c.source) == [], c.name


@pytest.mark.parametrize("fmt", sorted(contract.FORMATS))
@pytest.mark.parametrize("dtype", sorted(contract.DTYPES))
def test_grammar_header_covers_every_format(fmt, dtype):
    f = contract.FORMATS[fmt]
    launch = contract.LaunchSpec(block=128, work=f.work[0], per_block=4)
    h = contract.KernelHeader("spmv", fmt, dtype, "i32", tuple((k, 8) for k in f.params), launch)
    src = h.render() + contract.signature_c("spmv", fmt, dtype) + " {\n    return;\n}\n"
    assert language.accepts(src).accepted
    assert language.check(src) == []


BASE = kernels.render("csr_scalar", "spmv", "f32", {"block": 128}).source
HEAD, SIG_AND_BODY = BASE.split("extern", 1)
BODY_AT = "    float acc = 0.0f;\n"

# (name, source, rejected by the grammar?)
BAD = [
    ("include", "#include <stdio.h>\n" + BASE, True),
    ("define", HEAD + "#define N 4\nextern" + SIG_AND_BODY, True),
    ("asm", BASE.replace(BODY_AT, BODY_AT + '    asm("nop;");\n'), True),
    ("printf", BASE.replace(BODY_AT, BODY_AT + '    printf("%d", row);\n'), True),
    ("clock", BASE.replace(BODY_AT, BODY_AT + "    long long t0 = clock64();\n"), False),
    ("device_global", HEAD + "__device__ float g_state[4];\nextern" + SIG_AND_BODY, True),
    ("static", BASE.replace(BODY_AT, "    static float acc = 0.0f;\n"), True),
    ("template", HEAD + "template <int N> __device__ __forceinline__ int f() { return N; }\nextern" + SIG_AND_BODY, True),
    ("host_api", BASE.replace(BODY_AT, BODY_AT + "    cudaDeviceSynchronize();\n"), False),
    ("malloc", BASE.replace(BODY_AT, BODY_AT + "    float* p = (float*)malloc(4);\n"), False),
    ("comment", BASE.replace(BODY_AT, BODY_AT + "    // hello\n"), True),
    ("wrong_signature", BASE.replace("const float* __restrict__ x", "const float* x"), False),
    ("two_kernels", BASE + 'extern "C" __global__ void sparserl_kernel(int a) { }\n', True),
]


@pytest.mark.parametrize("name,src,by_grammar", BAD, ids=[b[0] for b in BAD])
def test_forbidden_snippets_are_rejected(name, src, by_grammar):
    verdict = language.accepts(src)
    problems = language.check(src)
    assert problems, f"{name}: check() found nothing"
    if by_grammar:
        assert not verdict.accepted, f"{name}: the grammar accepted it"
    else:
        assert verdict.accepted, (name, verdict.error)  # only the post-parse check catches it


def test_signature_mismatch_message_names_the_contract():
    src = BASE.replace("int n_cols, ", "")
    (msg,) = [p for p in language.check(src) if "signature" in p]
    assert "format=csr" in msg and contract.signature_c("spmv", "csr", "f32") in msg


def test_helpers_may_be_called_and_unknown_calls_are_not():
    helper = "__device__ __forceinline__ float twice(float v) {\n    return v + v;\n}\n"
    src = HEAD + helper + "extern" + SIG_AND_BODY.replace("y[row] = acc;", "y[row] = twice(acc);")
    assert language.accepts(src).accepted
    assert language.check(src) == []
    src2 = src.replace("twice(acc)", "thrice(acc)")
    assert any("thrice" in p for p in language.check(src2))


def test_bad_header_is_reported():
    src = BASE.replace("format=csr", "format=coo")
    assert not language.accepts(src).accepted
    assert any(p.startswith("header:") for p in language.check(src))


def test_inputs_are_read_only_in_the_language():
    """A kernel that writes an input through a cast is rejected before it runs anywhere (the CPU
    executor's guarded pointers cannot see a write through a cast that strips const)."""
    from sparserl_compile import contract

    sig = contract.signature_c("spmv", "csr", "f32")
    head = "// sparserl op=spmv format=csr dtype=f32 index=i32\n// launch block=128 work=rows per_block=128\n"

    def src(stmt):
        return head + sig + " {\n  int row = blockIdx.x * blockDim.x + threadIdx.x;\n  " + stmt + "\n}\n"

    assert any("C-style pointer casts" in v for v in language.check(src("((float*)vals)[0] = 1.0f;")))
    assert any("const_cast" in v for v in language.check(src("const_cast<float*>(x)[0] = 1.0f;")))
    assert any("input 'x'" in v for v in language.check(src("reinterpret_cast<float4*>(x)[0] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);")))
    assert not any("cast" in v for v in language.check(src("if (row < n_rows) { y[row] = reinterpret_cast<const float2*>(x)[0].x; }")))
