"""The transforms that change what a kernel does on the machine (``split_acc``, ``shfl_xor``,
``prefetch``):
the exact rewrite on small hand-written kernels, where they do not apply, and on kernel-space
points: inside the kernel language, compiled by NVRTC, correct on the CPU executor through
``verified_variants``, and new kernels (``novelty.is_novel``)."""

from __future__ import annotations

import pytest

from sparserl_compile import compiler, kernels
from sparserl_compile.training import transforms as T
from sparserl_compile.training import variants as V
from sparserl_compile.training.data import MatrixRef, SupervisionRecord, Variant
from sparserl_compile.training.novelty import is_novel

#: row lengths 1..3 and ragged rows, so the remainder loop and short rows run
BANDED = MatrixRef("generated", "banded", (("half_bandwidth", 2), ("n", 64), ("seed", 0)))
POWER_LAW = MatrixRef("generated", "rmat", (("edge_factor", 8), ("scale", 7), ("seed", 1)))


def _norm(s: str) -> str:
    return " ".join(s.split())


# ------------------------------------------------------------------ exact rewrites


def test_split_acc_unrolls_into_two_partial_sums_and_adds_them_after_the_remainder():
    src = ("float acc = 0.0f; float other = 1.0f;\n"
           "for (int k = lo; k < hi; ++k) { acc += v[k] * x[c[k]]; }\n"
           "y[r] = acc + other;")
    assert _norm(T.split_acc(src)) == _norm(
        "float acc = 0.0f; float other = 1.0f;\n"
        "{ int k = lo; float acc_1 = 0.0f;\n"
        "for (; k + 1 < hi; k += 2) { { acc += v[k] * x[c[k]]; } { acc_1 += v[(k + 1)] * x[c[(k + 1)]]; } }\n"
        "for (; k < hi; k += 1) { acc += v[k] * x[c[k]]; }\n"
        "acc += acc_1; }\n"
        "y[r] = acc + other;")


def test_split_acc_splits_every_fmaf_accumulator_and_keeps_the_stride():
    src = ("double s = 0.0; float t = 0.0f; float acc_1 = 0.0f;\n"
           "for (int k = a + lane; k < b; k += 8) { float w = v[k]; s = fmaf(w, x[k], s); t = fmaf(w, w, t); }")
    assert _norm(T.split_acc(src)) == _norm(
        "double s = 0.0; float t = 0.0f; float acc_1 = 0.0f;\n"
        "{ int k = a + lane; double s_1 = 0.0; float t_1 = 0.0f;\n"
        "for (; k + 8 < b; k += 16) { { float w = v[k]; s = fmaf(w, x[k], s); t = fmaf(w, w, t); }"
        " { float w = v[(k + 8)]; s_1 = fmaf(w, x[(k + 8)], s_1); t_1 = fmaf(w, w, t_1); } }\n"
        "for (; k < b; k += 8) { float w = v[k]; s = fmaf(w, x[k], s); t = fmaf(w, w, t); }\n"
        "s += s_1; t += t_1; }")


@pytest.mark.parametrize("src", [
    # the accumulator is read in the loop besides its accumulation
    "float acc = 0.0f; for (int k = 0; k < n; ++k) { acc += v[k]; if (acc > 1.0f) y[k] = 1.0f; }",
    # an integer counter is not a floating-point sum
    "int cnt = 0; for (int k = 0; k < n; ++k) { cnt += v[k]; }",
    # the accumulated value reads the accumulator
    "float acc = 0.0f; for (int k = 0; k < n; ++k) { acc += acc * v[k]; }",
    # a warp shuffle in the body: the copies would shuffle a different number of times
    "float acc = 0.0f; for (int k = 0; k < n; ++k) { acc += __shfl_down_sync(0xffffffff, v[k], 1); }",
    # no accumulation at all
    "for (int k = 0; k < n; ++k) { y[k] = v[k]; }",
])
def test_split_acc_does_not_apply(src):
    assert T.split_acc(src) is None


def test_shfl_xor_rewrites_an_unrolled_reduction():
    src = ("acc += __shfl_down_sync(0xffffffff, acc, 4);\n"
           "acc += __shfl_down_sync(0xffffffff, acc, 2);\n"
           "acc += __shfl_down_sync(0xffffffff, acc, 1);\n"
           "if (lane == 0) y[row] = acc;")
    assert T.shfl_xor(src) == src.replace("__shfl_down_sync", "__shfl_xor_sync")


def test_shfl_xor_rewrites_interleaved_reductions_and_halving_loops():
    src = ("a0 += __shfl_down_sync(0xffffffff, a0, 16); a1 += __shfl_down_sync(0xffffffff, a1, 16);\n"
           "a0 += __shfl_down_sync(0xffffffff, a0, 8); a1 += __shfl_down_sync(0xffffffff, a1, 8);\n"
           "for (int off = 16; off > 0; off /= 2) s += __shfl_down_sync(0xffffffff, s, off);\n"
           "for (int o = 8; o >= 1; o >>= 1) { p += __shfl_down_sync(m, p, o); q += __shfl_down_sync(m, q, o); }")
    assert T.shfl_xor(src) == src.replace("__shfl_down_sync", "__shfl_xor_sync")


@pytest.mark.parametrize("src", [
    # an offset repeated: a lane would add a partner's sum that already holds its own
    "acc += __shfl_down_sync(0xffffffff, acc, 1);\nacc += __shfl_down_sync(0xffffffff, acc, 1);",
    # not a power of two
    "acc += __shfl_down_sync(0xffffffff, acc, 3);",
    # a different value shuffled than the one accumulated
    "acc += __shfl_down_sync(0xffffffff, other, 1);",
    # a loop that does not halve from a power of two
    "for (int o = 12; o > 0; o /= 2) acc += __shfl_down_sync(0xffffffff, acc, o);",
    # a halving loop that does more than reduce
    "for (int o = 16; o > 0; o /= 2) { acc += __shfl_down_sync(0xffffffff, acc, o); n += 1; }",
    # a scan, not a reduction
    "k += __shfl_up_sync(0xffffffff, k, 1);",
])
def test_shfl_xor_does_not_apply(src):
    assert T.shfl_xor(src) is None


def test_shfl_xor_leaves_a_run_with_a_repeated_offset_and_rewrites_the_others():
    bad = "a += __shfl_down_sync(0xffffffff, a, 2);\na += __shfl_down_sync(0xffffffff, a, 2);\n"
    good = "y[0] = a;\nb += __shfl_down_sync(0xffffffff, b, 2);\nb += __shfl_down_sync(0xffffffff, b, 1);\n"
    assert T.shfl_xor(bad + good) == bad + good.replace("__shfl_down_sync", "__shfl_xor_sync")


def test_prefetch_loads_the_next_elements_before_the_current_work():
    src = ("__global__ void k(const int* __restrict__ col, const __half* val, float* y) {\n"
           "for (int k = lo; k < hi; k += 4) { int c = __ldg(&col[k]); acc = fmaf(__half2float(val[k]), x[c], acc); }"
           " }")
    assert _norm(T.prefetch(src)) == _norm(
        "__global__ void k(const int* __restrict__ col, const __half* val, float* y) {\n"
        "{ int k = lo; if (k < hi) {\n"
        "int col_next_1 = __ldg(&col[k]); __half val_next_1 = __ldg(&val[k]);\n"
        "for (; k < hi; k += 4) { int col_here_1 = col_next_1; __half val_here_1 = val_next_1;\n"
        "if (k + 4 < hi) { col_next_1 = __ldg(&col[k + 4]); val_next_1 = __ldg(&val[k + 4]); }\n"
        "int c = col_here_1; acc = fmaf(__half2float(val_here_1), x[c], acc); } } } }")


@pytest.mark.parametrize("src", [
    # the loop reads no read-only parameter at its variable (y is written, w is no parameter)
    "void f(const float* v, float* y) { for (int k = 0; k < n; ++k) { y[k] = w[k] + v[k + 1]; } }",
    # an element's address is taken: the register copy would not stand for it
    "void f(const float* v, float* y) { for (int k = 0; k < n; ++k) { g(&v[k]); y[k] = v[k]; } }",
    # the loop variable changes inside the body
    "void f(const float* v, float* y) { for (int k = 0; k < n; ++k) { y[0] += v[k]; k += 1; } }",
])
def test_prefetch_does_not_apply(src):
    assert T.prefetch(src) is None


# ------------------------------------------------------------------ on kernel-space points


@pytest.fixture(scope="module")
def cpu_evaluator():
    from sparserl_compile.training.rewards import SandboxEvaluator

    ev = SandboxEvaluator("cpu", workers=2)
    yield ev
    ev.close()


def _record(ref: MatrixRef, op: str, n: int, family: str, params: dict) -> SupervisionRecord:
    return SupervisionRecord(ref, op, "f32", n, (Variant(family, tuple(sorted(params.items())), 2.0),))


@pytest.mark.parametrize("ref,op,n,family,params,name,combined", [
    (BANDED, "spmv", 1, "csr_vector", {"block": 128, "tpr": 8}, "shfl_xor", "unroll2+shfl_xor"),
    (POWER_LAW, "spmv", 1, "csr_vector", {"block": 128, "tpr": 32}, "shfl_xor", "split_acc+shfl_xor"),
    (POWER_LAW, "spmv", 1, "csr_vector", {"block": 128, "tpr": 4}, "split_acc", "split_acc+fma_expand"),
    (POWER_LAW, "spmv", 1, "csr_scalar", {"block": 128}, "split_acc", "split_acc+plain_loads"),
    (BANDED, "spmm", 8, "csr_scalar", {"block": 128, "tile_n": 4}, "split_acc", "split_acc+fma_expand"),
    (POWER_LAW, "spmm", 8, "csr_rowgroup", {"g": 8, "v": 2, "perm": False}, "split_acc", "split_acc+plain_loads"),
    (POWER_LAW, "spmv", 1, "csr_scalar", {"block": 128}, "prefetch", "prefetch+fma_expand"),
    (BANDED, "spmv", 1, "csr_vector", {"block": 128, "tpr": 8}, "prefetch", "prefetch+shfl_xor"),
    (POWER_LAW, "spmm", 8, "csr_rowgroup", {"g": 8, "v": 2, "perm": False}, "prefetch", "prefetch+plain_loads"),
])
def test_the_transform_makes_a_new_kernel_that_compiles_and_verifies(cpu_evaluator, ref, op, n, family, params,
                                                                      name, combined):
    m = ref.load()
    assert params in kernels.family(family).space(op, "f32")
    source = kernels.render(family, op, "f32", params).source
    rec = _record(ref, op, n, family, params)
    cands = {dict(v.params)[V.TRANSFORM_KEY]: (v, text) for v, text in V.record_candidates(rec, m, top=1)}
    assert name in cands and combined in cands
    for t in (name, combined):
        variant, text = cands[t]
        assert text == T.apply(source, t) and text != source
        assert V.grammar_problems(text) == []
        compiler.compile_cubin(text, "sm_90")  # raises CompileError when NVRTC rejects it
        assert is_novel(text, op, "f32", m)
    verified = {dict(v.params)[V.TRANSFORM_KEY] for v in V.verified_variants(rec, m, cpu_evaluator, top=1)}
    assert {name, combined} <= verified
    assert verified == set(cands)  # every candidate is a correct kernel


def test_a_split_that_drops_a_partial_sum_is_not_a_target(cpu_evaluator, monkeypatch):
    m = POWER_LAW.load()
    rec = _record(POWER_LAW, "spmv", 1, "csr_scalar", {"block": 128})
    real = T.split_acc
    monkeypatch.setitem(T._APPLY, "split_acc", lambda s: real(s).replace("acc += acc_1;", ""))
    verified = {dict(v.params)[V.TRANSFORM_KEY] for v in V.verified_variants(rec, m, cpu_evaluator, top=1,
                                                                                 combine=False)}
    assert "split_acc" not in verified and "unroll2" in verified


def test_a_halving_loop_reduction_verifies_as_a_butterfly(cpu_evaluator):
    from sparserl_compile.training.rewards import RLProblem

    m = POWER_LAW.load()
    base = kernels.render("csr_vector", "spmv", "f32", {"block": 128, "tpr": 32}).source
    head, body = base.split("    acc += __shfl_down_sync(0xffffffff, acc, 16);\n", 1)
    body = body.split("    if (row < n_rows", 1)[1]
    looped = (head + "    for (int off = 16; off > 0; off /= 2) {\n"
              "        acc += __shfl_down_sync(0xffffffff, acc, off);\n    }\n    if (row < n_rows" + body)
    butterfly = T.apply(looped, "shfl_xor")
    assert butterfly == looped.replace("__shfl_down_sync", "__shfl_xor_sync")
    assert V.grammar_problems(butterfly) == []
    # a butterfly whose lane 0 reads a lane of another row is wrong, and the evaluator says so
    wrong = butterfly.replace("int off = 16;", "int off = 32;")
    pb = RLProblem(m, "spmv", "f32", 1, POWER_LAW.label)
    assert [o.correct for o in cpu_evaluator(pb, [looped, butterfly, wrong])] == [True, True, False]


def test_new_transforms_combine_render_and_keep_the_old_names():
    source = kernels.render("csr_vector", "spmv", "f32", {"block": 128, "tpr": 8}).source
    names = T.transform_names(source)
    assert names[:5] == ["unroll2", "unroll4", "while", "fma_expand", "plain_loads"]
    assert {"split_acc", "shfl_xor", "prefetch", "unroll2+shfl_xor", "split_acc+shfl_xor",
            "prefetch+plain_loads"} <= set(names)
    params = {"block": 128, "tpr": 8, V.TRANSFORM_KEY: "split_acc+shfl_xor"}
    text = T.render("csr_vector", "spmv", "f32", params)
    assert "acc_1" in text and "__shfl_xor_sync" in text and "__shfl_down_sync" not in text
    with pytest.raises(ValueError, match="does not apply"):
        T.apply(kernels.render("csr_scalar", "spmv", "f32", {"block": 128}).source, "shfl_xor")
