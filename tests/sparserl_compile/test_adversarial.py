"""Adversarial kernels: each compiles, is in the kernel language, and passes verification as
it was before these checks (always 0.5-1.5 operands, one width, a poisoned output every run,
guard zones only around y). Each cheats in one way a policy trained on speed could find, and
each must fail verification: on the CPU executor here, on the GPU executor in the
``gpu``-marked twin (through the sandbox, since an out-of-bounds access there ends the
worker's CUDA context).

Written against the contract (``contract.signature_c``; CSR SpMV/SpMM f32, the layout of
``kernels/csr.py``): one thread per row, ``y[row] = sum_k vals[k] * x[col_idx[k]]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from faults import FAULTS, candidate
from sparserl_compile import contract, matrices, verify
from sparserl_compile.problem import Problem
from sparserl_compile.sandbox import SandboxJob, SandboxPool
from test_verify import needs_simt

SPMV_HEAD = ("// sparserl op=spmv format=csr dtype=f32 index=i32\n"
             "// launch block=128 work=rows per_block=128 tile_n=0 smem=0 zero_output={z} n_align=1\n")
SPMM_HEAD = ("// sparserl op=spmm format=csr dtype=f32 index=i32\n"
             "// launch block=128 work=rows per_block=128 tile_n=0 smem=0 zero_output=0 n_align=1\n")
ROW = "  int row = blockIdx.x * blockDim.x + threadIdx.x;\n  if (row >= n_rows) { return; }\n"
LOOP = "  for (int k = row_ptr[row]; k < row_ptr[row + 1]; k++) {\n"


def spmv(body: str, zero_output: int = 0) -> str:
    return SPMV_HEAD.format(z=zero_output) + contract.signature_c("spmv", "csr", "f32") + " {\n" + body + "}\n"


def spmm(body: str) -> str:
    return SPMM_HEAD + contract.signature_c("spmm", "csr", "f32") + " {\n" + body + "}\n"


@dataclass(frozen=True)
class Cheat:
    source: str
    checks: frozenset  # the verify checks that may catch it
    op: str = "spmv"
    n: int = 1


CORPUS: dict[str, Cheat] = {
    # returns early when y[row] already holds a number: every poisoned run computes, and in
    # timing or production (an output buffer holding the previous answer) it skips its work
    "stale_output": Cheat(spmv(ROW + "  if (y[row] == y[row]) { return; }\n  float acc = 0.0f;\n" + LOOP +
                               "    acc += vals[k] * x[col_idx[k]];\n  }\n  y[row] = acc;\n"),
                          frozenset({"stale"})),
    # keeps its state in y across launches: averages the new answer with what y holds
    "state_in_output": Cheat(spmv(ROW + "  float acc = 0.0f;\n" + LOOP + "    acc += vals[k] * x[col_idx[k]];\n  }\n"
                                  "  float old = y[row];\n  if (old == old) { acc = 0.5f * (old + acc); }\n"
                                  "  y[row] = acc;\n"),
                             frozenset({"stale"})),
    # memoises every row far past the end of y (raw pointer) and answers from there later
    "state_past_y": Cheat(spmv(ROW + "  float* memo = &y[0] + n_rows + 100000;\n"
                               "  float m = memo[row];\n  if (m == 1.0f) { return; }\n"
                               "  float acc = 0.0f;\n" + LOOP + "    acc += vals[k] * x[col_idx[k]];\n  }\n"
                               "  y[row] = acc;\n  memo[row] = 1.0f;\n"),
                          frozenset({"bounds"})),
    # clamps x to [-2, 2]
    "clamps_x": Cheat(spmv(ROW + "  float acc = 0.0f;\n" + LOOP +
                           "    acc += vals[k] * min(max(x[col_idx[k]], -2.0f), 2.0f);\n  }\n  y[row] = acc;\n"),
                      frozenset({"error_bound"})),
    # skips values of magnitude below 0.25
    "skips_small": Cheat(spmv(ROW + "  float acc = 0.0f;\n" + LOOP + "    float v = vals[k];\n"
                              "    if (v >= 0.25f || v <= -0.25f) { acc += v * x[col_idx[k]]; }\n  }\n  y[row] = acc;\n"),
                         frozenset({"error_bound", "written"})),
    # flushes subnormal-range values to zero
    "flushes_tiny": Cheat(spmv(ROW + "  float acc = 0.0f;\n" + LOOP + "    float v = vals[k];\n"
                               "    if (fabsf(v) > 1.0e-30f) { acc += v * x[col_idx[k]]; }\n  }\n  y[row] = acc;\n"),
                          frozenset({"error_bound"})),
    # drops NaN/inf products (p - p is 0 only for finite p)
    "drops_nonfinite": Cheat(spmv(ROW + "  float acc = 0.0f;\n" + LOOP + "    float p = vals[k] * x[col_idx[k]];\n"
                                  "    if (p - p == 0.0f) { acc += p; }\n  }\n  y[row] = acc;\n"),
                             frozenset({"nonfinite"})),
    # reads x out of bounds through a raw pointer (the value is multiplied by 0)
    "reads_past_x": Cheat(spmv(ROW + "  float acc = 0.0f;\n" + LOOP + "    acc += vals[k] * x[col_idx[k]];\n  }\n"
                               "  acc += 0.0f * (&x[0])[n_cols + row];\n  y[row] = acc;\n"),
                          frozenset({"bounds", "written", "nonfinite"})),
    # a correct answer plus a write 300 elements past the end of y, through a raw pointer
    "writes_past_y": Cheat(spmv(ROW + "  float acc = 0.0f;\n" + LOOP + "    acc += vals[k] * x[col_idx[k]];\n  }\n"
                                "  y[row] = acc;\n  if (row == 0) { (&y[0])[n_rows + 300] = acc; }\n"),
                           frozenset({"bounds"})),
    # correct at widths that are multiples of 16 (n = 48), columns past the last 16 never written
    "one_width_only": Cheat(spmm(ROW + "  int m = (n / 16) * 16;\n  for (int c = 0; c < m; c++) {\n"
                                 "    float acc = 0.0f;\n  " + LOOP +
                                 "      acc += vals[k] * x[col_idx[k] * n + c];\n    }\n    y[row * n + c] = acc;\n  }\n"),
                            frozenset({"written"}), op="spmm", n=48),
    # two threads per row add their halves into y without atomics (zeroed output): lost updates
    "races_on_y": Cheat(spmv("  int t = blockIdx.x * blockDim.x + threadIdx.x;\n  int row = t / 2;\n"
                             "  if (row >= n_rows) { return; }\n  float acc = 0.0f;\n"
                             "  for (int k = row_ptr[row] + t % 2; k < row_ptr[row + 1]; k += 2) {\n"
                             "    acc += vals[k] * x[col_idx[k]];\n  }\n  y[row] += acc;\n", zero_output=1)
                        .replace("per_block=128", "per_block=64"),
                        frozenset({"race", "error_bound", "deterministic"})),
}

M = matrices.uniform_random(200, 150, 6, seed=4)


def _widths(c: Cheat) -> tuple[int, ...]:
    return verify.widths_to_verify(c.op, c.n, contract.parse_header(c.source).launch.n_align)


def test_every_cheat_is_in_the_kernel_language_and_compiles():
    from sparserl_compile import compiler, language

    for name, c in CORPUS.items():
        assert not language.check(c.source), (name, language.check(c.source))
        assert compiler.compile_cubin(c.source, arch="sm_90").cubin, name


@needs_simt
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_each_cheat_passes_the_checks_it_does_not_target(name):
    """Each cheat is a working kernel on plain operands at its own width: on the random sets
    alone it passes, or fails only by the check aimed at it (guards, races and the stale
    check need no new operands)."""
    c = CORPUS[name]
    r = verify.verify(candidate(c.source), M, executor="cpu", n=c.n, special=False, value_sets=1)
    assert r.ok or r.failed in c.checks, (name, r.reason)


@needs_simt
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_each_cheat_fails_verification_on_cpu(name):
    c = CORPUS[name]
    r = verify.verify(candidate(c.source), M, executor="cpu", n=c.n, widths=_widths(c))
    assert not r.ok, name
    assert r.failed in c.checks, (name, r.reason)
    assert r.failed in r.reason.split(":")[0], r.reason  # the message names the check


@needs_simt
def test_the_width_cheat_is_caught_by_the_selection_at_its_own_width():
    """Selected for n = 48, the kernel would serve every width of bucket 64: ``select``
    verifies them, so it is rejected although it is right at 48."""
    from sparserl_compile import structure
    from sparserl_compile.select import choose

    c = CORPUS["one_width_only"]
    assert verify.verify(candidate(c.source), M, executor="cpu", n=48).ok  # alone at 48 it passes
    prob = Problem("spmm", "f32", 48, *M.shape, M.nnz, M.indptr, M.indices,
                   structure.fingerprint(M.indptr, M.indices, M.shape), "cpu")
    choice = choose(prob, [candidate(c.source)], executor="cpu", timeout_s=120)
    rec = choice.record["candidates"][0]
    assert choice.candidate is None and rec["kind"] == "wrong" and rec["failed_check"] == "written", rec
    assert 48 in rec["widths_verified"] and len(rec["widths_verified"]) < 32


@needs_simt
def test_cheats_fail_in_the_cpu_sandbox_too():
    with SandboxPool(1, timeout_s=120) as pool:
        for name in ("stale_output", "writes_past_y", "races_on_y"):
            c = CORPUS[name]
            r = pool.run(SandboxJob(candidate(c.source), c.op, n=c.n, executor="cpu", widths=_widths(c)), M)
            assert r.kind == "wrong" and r.verify.failed in c.checks, (name, r.kind, r.error)


@pytest.mark.gpu
def test_every_cheat_and_fault_fails_on_the_gpu():
    """The same corpus (and the fault kernels) on the GPU executor, each in a sandbox worker:
    none passes, and the worker's replacement still verifies a good kernel afterwards."""
    from faults import GOOD

    jobs = {name: (c.source, c.op, c.n, True) for name, c in CORPUS.items()}
    jobs.update({f"fault:{k}": (f.source, "spmv", 1, f.static) for k, f in FAULTS.items()})
    with SandboxPool(1, timeout_s=120) as pool:
        for name, (src, op, n, static) in jobs.items():
            widths = verify.widths_to_verify(op, n, contract.parse_header(src).launch.n_align)
            r = pool.run(SandboxJob(candidate(src), op, n=n, executor="gpu", widths=widths, static=static), M,
                         timeout_s=30 if "infinite" in name else None)
            assert r.kind != "ok", (name, r.kind)
            print(f"\n{name}: {r.kind}: {r.error.splitlines()[0][:160] if r.error else ''}")
        good = pool.run(SandboxJob(candidate(GOOD), "spmv", executor="gpu"), M)
    assert good.ok, good.error


#: marks every output it finds already holding a number (a stale-output kernel that shows it)
MARKS_STALE = spmv(ROW + "  if (y[row] == y[row]) { y[row] = -12345.0f; return; }\n  float acc = 0.0f;\n" + LOOP +
                   "    acc += vals[k] * x[col_idx[k]];\n  }\n  y[row] = acc;\n")


@pytest.mark.gpu
def test_timing_re_poisons_the_output_so_a_stale_kernel_does_its_work():
    """The timing hack: timed without re-poisoning, a kernel that skips its work when ``y``
    holds numbers would find the previous answer on every call after the first. Timed as the
    sandbox times (``before=poison``), every call starts from the poison: this kernel, which
    writes -12345 where it finds a number, leaves the right answer after the timings."""
    import numpy as np
    import torch

    from sparserl_compile import bench, operands

    runners: list = []
    r = verify.verify(candidate(MARKS_STALE), M, executor="gpu", runner_out=runners, special=False)
    assert not r.ok and r.failed == "stale", r.reason
    runner = runners[0]
    try:
        call, poison, _ = verify.timing_fns(runner, "f32", 0)
        vs = operands.value_set(verify.Pattern.of(M), np.diff(M.indptr), (M.shape[1],), "f32", 0, 0)
        ref, _, bound = vs.device()
        y = runner.last[0][-1]
        for timed in (lambda: bench.time_fn(lambda: call(0), reps=5, before=poison),
                      lambda: bench.time_hot(call, 4, reps=2, before=poison)):
            timed()
            torch.cuda.synchronize()
            assert bool(((y.double() - ref).abs() <= bound).all())
        call(0)  # without the poison: the kernel shows what it found
        torch.cuda.synchronize()
        assert bool((y == -12345.0).all())
    finally:
        runner.close()
