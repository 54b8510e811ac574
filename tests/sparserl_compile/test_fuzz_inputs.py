"""A seeded fuzz of every way a matrix or an operand enters sparserl.

Each case is a well-formed input, or one with exactly one kind of damage (a pointer out of
order, an index negative or past the end or beyond int32, a length off by one, a float index
array, a bad shape, a bad value dtype), through ``sparsify`` of every input kind (dense; torch
COO, CSR, CSC; scipy CSR, CSC, COO, BSR, LIL, DIA, DOK; a cupy-like matrix), ``from_csr``,
the products (``@``, ``mm``, ``mv``, ``matmul``, ``addmm``, ``linear``, ``out=``) with odd
shapes, dtypes and layouts, the dispatch hook on native operands, ``torch.load`` of a tampered
stored tensor, and the ``.npz``/``.mtx`` loaders. The oracle here is independent of the package
(plain numpy over the raw arrays): a case must give the exact canonical pattern and values and
products within the worst-case rounding bound of a sum in the value dtype, or raise
``ValueError``/``TypeError`` whose message names one of the problems the oracle found. Never a
crash, a hang, an invalid input accepted, or a wrong number.

The cases run in a subprocess (``fuzz_worker.py``): a crash fails its case instead of killing
the test run. By default a fast subset runs (a few hundred cases); ``SPARSERL_FUZZ_FULL=1``
runs over 10^4.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuzz_worker as W
from fuzz_oracle import (
    apply_damage,
    assert_close,
    assert_names_a_problem,
    canonical,
    check_ops,
    compressed,
    entries,
    expected_of,
    expected_product,
    is_shape,
    problems_coo,
    problems_compressed,
    product_op,
    sparse_case,
    stored_tensor,
)

FULL = os.environ.get("SPARSERL_FUZZ_FULL") == "1"
#: examples per test: (fast, full); the full sum is over 10^4
EXAMPLES = {"sparsify": (120, 4800), "products": (80, 3000), "dispatch": (60, 1800), "unpickle": (40, 1000),
            "loaders": (40, 1000)}


# ---------------------------------------------------------------------- the worker


class Worker:
    """The subprocess that runs cases; restarted after a crash or a hang."""

    def __init__(self):
        self.log = tempfile.NamedTemporaryFile(prefix="fuzz-worker-", suffix=".log", delete=False)
        self.proc = None
        self.answers: dict[str, int] = {}  # cases run, by runner and answer ("ok", "raised", ...)

    def _start(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(W.__file__).parent), *sys.path]))
        self.proc = subprocess.Popen([sys.executable, W.__file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env)

    def call(self, name: str, case: dict, timeout: float = 300.0):
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        W.write_msg(self.proc.stdin, (name, case))
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"hang: no answer in {timeout:.0f} s to {name} case {_show(case)}")
        answer = W.read_msg(self.proc.stdout)
        if answer is None:
            code = self.proc.wait()
            raise AssertionError(f"crash: the worker died (exit {code}) on {name} case {_show(case)}\n{self._tail()}")
        self.answers[f"{name} {answer[0]}"] = self.answers.get(f"{name} {answer[0]}", 0) + 1
        if answer[0] == "other":
            raise AssertionError(f"{answer[1]} (neither ValueError nor TypeError) on {name} case {_show(case)}:\n"
                                 f"{answer[2]}")
        return answer

    def _tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def close(self):
        total = sum(self.answers.values())
        print(f"\nfuzz: {total} cases run in the worker: "
              + ", ".join(f"{k} {v}" for k, v in sorted(self.answers.items())), file=sys.stderr)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        os.unlink(self.log.name)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def _show(case) -> str:
    return repr({k: v for k, v in case.items() if k != "ops"})[:1500]


def fuzz_settings(name: str):
    return settings(max_examples=EXAMPLES[name][FULL], deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)


# ---------------------------------------------------------------------- the tests


def check_sparsify(worker, drawn, ops=()):
    if drawn is None:
        return
    case, found, expected = drawn
    case["ops"] = list(ops)
    answer = worker.call("sparsify", case)
    if answer[0] == "unbuildable":
        return
    what = f"sparsify {case['kind']} {case['shape']} {case['vdtype']}"
    if found:
        assert_names_a_problem(answer, found, what)
        return
    assert answer[0] == "ok", f"{what}: raised {answer[1]}({answer[2]!r}) on a valid matrix"
    got = answer[1]
    indptr, indices, values, dense = expected
    assert got["shape"] == tuple(case["shape"]) and got["dtype"] == case["vdtype"], what
    assert np.array_equal(got["crow"], indptr) and np.array_equal(got["col"], indices), f"{what}: pattern differs"
    assert_close(got["values"], values, np.abs(np.nan_to_num(values)) + 1, 8, case["vdtype"], f"{what}: values")
    check_ops(ops, got["ops"], dense, case["vdtype"], what)


@fuzz_settings("sparsify")
@given(drawn=sparse_case())
def test_fuzz_sparsify_every_input_kind(worker, drawn):
    check_sparsify(worker, drawn)


@fuzz_settings("products")
@given(data=st.data())
def test_fuzz_products_with_odd_operands(worker, data):
    drawn = data.draw(sparse_case(kinds=("from_csr", "scipy_csr", "torch_coo", "dense")))
    if drawn is None or drawn[1]:
        return
    shape, dtype = drawn[0]["shape"], drawn[0]["vdtype"]
    ops = data.draw(st.lists(product_op(shape, dtype), min_size=1, max_size=4))
    check_sparsify(worker, drawn, ops)


@fuzz_settings("dispatch")
@given(data=st.data())
def test_fuzz_the_dispatch_hook_on_native_operands(worker, data):
    drawn = data.draw(sparse_case(kinds=("torch_csr", "torch_coo", "torch_csc"), dtypes=("float32", "float64")))
    if drawn is None:
        return
    case, found, expected = drawn
    shape, dtype = case["shape"], case["vdtype"]
    if not is_shape(shape):
        return
    if case["kind"] == "torch_coo":
        case["coalesced_flag"] = data.draw(st.booleans())
    name = data.draw(st.sampled_from(["matmul", "mm", "mv", "addmm", "rmatmul"]))
    k = shape[0] if name == "rmatmul" else shape[1]
    width = data.draw(st.integers(1, 4))
    xshape = {"mv": (k,), "rmatmul": (width, k)}.get(name, (k,) if name == "matmul" and width == 1 else (k, width))
    x = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))).integers(-8, 9, xshape) / 2
    case.update(op=name, x=(x, dtype, "c"), valid=not found)
    answer = worker.call("dispatch", case)
    if answer[0] == "unbuildable":
        return
    what = f"dispatch {case['kind']} {shape} {dtype} {name}"
    assert answer[0] == "ok", f"{what}: {answer}"
    hooked, base = answer[1]["hooked"], answer[1]["base"]
    if found:
        assert_names_a_problem(hooked, found, what)
        return
    D = expected[3]
    want = expected_product((name if name != "addmm" else "addmm", (x, dtype, "c"),
                             (np.zeros((shape[0], xshape[-1])), dtype, "c") if name == "addmm" else None, 0.5, 2.0),
                            D, dtype)
    if base[0] == "torch":  # torch itself does not take this combination: the hook may say the same
        if hooked[0] == "torch":
            assert hooked[1] == base[1], f"{what}: {hooked} vs torch's {base}"
            return
    assert hooked[0] == "ok", f"{what}: raised {hooked} on a valid operand (torch: {base[0]})"
    assert_close(hooked[1], want[1], want[2], want[3], dtype, what)


@fuzz_settings("unpickle")
@given(drawn=stored_tensor())
def test_fuzz_torch_load_of_a_tampered_stored_tensor(worker, drawn):
    case, found, dense, transposed = drawn
    answer = worker.call("unpickle", case)
    what = f"torch.load {[(type(v).__name__, d) for v, d in case['args']]}"
    if found:
        assert_names_a_problem(answer, found, what)
        return
    assert answer[0] == "ok", f"{what}: raised {answer[1:]} on a valid stored tensor"
    want = dense.T if transposed else dense
    assert answer[1]["transposed"] is transposed
    assert_close(answer[1]["dense"], want, np.abs(np.nan_to_num(want)) + 1, 8, case["args"][2][1], what)


@fuzz_settings("loaders")
@given(data=st.data())
def test_fuzz_the_matrix_file_loaders(worker, data, tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    kind = data.draw(st.sampled_from(["npz_csr", "npz_coo", "npz_csc", "npz_truncated", "mtx"]))
    shape, rows, cols, vals, _ = data.draw(entries(("float64",)))
    vals = np.nan_to_num(vals, nan=1.0, posinf=2.0, neginf=-2.0)
    path = d / ("m.mtx" if kind == "mtx" else "m.npz")
    found: set[str] = set()
    if kind == "mtx":
        bad = data.draw(st.none() | st.sampled_from(["zero_index", "past_end", "count", "token"]))
        lines = [f"{r + 1} {c + 1} {float(v)!r}" for r, c, v in zip(rows, cols, vals)]
        count = len(lines)
        if bad == "zero_index" and lines:
            lines[0] = f"0 {cols[0] + 1} 1.0"
        elif bad == "past_end" and lines:
            lines[-1] = f"{shape[0] + 1} 1 1.0"
        elif bad == "count":
            count += data.draw(st.sampled_from([1, 10**10]))
        elif bad == "token" and lines:
            lines[0] = f"{rows[0] + 1} {cols[0] + 1} one"
        path.write_text(f"%%MatrixMarket matrix coordinate real general\n{shape[0]} {shape[1]} {count}\n"
                        + "".join(f"{ln}\n" for ln in lines))
        found = {"file"} if bad and (lines or bad == "count") else set()
    else:
        csc = kind == "npz_csc"
        if kind == "npz_coo":
            arrays = {"row": rows, "col": cols, "data": vals}
        else:
            ptr, idx, order = compressed(rows, cols, shape[1] if csc else shape[0], csc)
            arrays = {"indptr": ptr, "indices": idx, "data": vals[order]}
        coo = kind == "npz_coo"
        damage = data.draw(st.none() | st.sampled_from(["vals_drop"] + (["row_set", "col_set"] if coo else
                                                                        ["ptr_set", "idx_set", "ptr_swap"])))
        if damage and kind != "npz_truncated":
            renamed = {"indptr": "ptr", "indices": "idx", "data": "values"}
            a, _ = apply_damage(data.draw, damage, {renamed.get(k, k): v for k, v in arrays.items()}, shape)
            back = {v: k for k, v in renamed.items()}
            arrays = {back.get(k, k): v for k, v in a.items()}
        extra = {"format": np.array(b"csc")} if csc else {}
        np.savez(path, shape=np.array(shape), **arrays, **extra)
        if kind == "npz_coo":
            found = problems_coo(arrays["row"], arrays["col"], arrays["data"].size, shape)
        else:
            found = problems_compressed(arrays["indptr"], arrays["indices"], arrays["data"].size, shape, csc)
        if kind == "npz_truncated":
            raw = path.read_bytes()
            path.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1))])
            found = {"file"}
    answer = worker.call("load", {"path": str(path)})
    what = f"load {kind} {shape}"
    if found:
        assert_names_a_problem(answer, found, what)
        return
    assert answer[0] == "ok", f"{what}: raised {answer[1:]} on a valid file"
    final = ({"row": arrays["row"], "col": arrays["col"], "values": arrays["data"]} if kind == "npz_coo" else
             {"ptr": arrays["indptr"], "idx": arrays["indices"], "values": arrays["data"]}) if kind != "mtx" else None
    want = (canonical(rows, cols, vals, shape)[3] if final is None else
            expected_of("npz_csc" if kind == "npz_csc" else kind, final, shape, "float64")[3])
    want = want.astype(np.float32).astype(np.float64)
    assert answer[1]["dtype"] == "float32" and answer[1]["shape"] == shape
    assert np.array_equal(answer[1]["dense"], want), f"{what}: values differ"
