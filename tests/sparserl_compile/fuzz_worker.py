"""The input fuzz's subprocess: it runs the cases, so a case that crashes the interpreter is a
failed case and not a dead test run (``test_fuzz_inputs.py`` is the parent and the oracle).

Protocol: the parent writes ``pickle((runner name, case))`` messages, each after its 8-byte
length, to stdin; the worker answers each in the same framing on a private copy of its stdout
(what anything prints goes to stderr). Cases are plain data (numpy arrays, numbers, strings):
the worker builds the torch, scipy or cupy-like object itself, runs sparserl on it and answers
``("ok", result)``, ``("raised", exception type, message)`` for a ValueError/TypeError, or
``("other", exception type, message and traceback)`` for anything else.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import traceback
import warnings


def read_msg(stream):
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    data = stream.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


def write_msg(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


class Unbuildable(Exception):
    """The input object itself cannot be built (its own library refused it): not sparserl's case."""


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _tensor(a, dtype: str | None = None):
    import numpy as np
    import torch

    t = torch.from_numpy(np.array(a, order="C"))  # a copy; 0-D stays 0-D (ascontiguousarray makes it 1-D)
    return t if dtype is None else t.to(_torch_dtype(dtype))


class FakeCupy:
    """What sparserl sees of a cupyx.scipy.sparse matrix (recognised by module name; its arrays
    speak DLPack, as numpy arrays do)."""

    def __init__(self, fmt, shape, **arrays):
        self.format, self.shape = fmt, shape
        for k, v in arrays.items():
            setattr(self, k, v)


FakeCupy.__module__ = "cupyx.scipy.sparse._fake"


def build(case):
    """The input object a case describes (raw arrays as given, never checked here)."""
    import numpy as np
    import scipy.sparse as sp
    import torch

    kind, a, shape, vdtype = case["kind"], case["arrays"], case["shape"], case["vdtype"]
    try:
        if kind == "dense":
            return _tensor(a["dense"], vdtype)
        if kind.startswith("torch_"):
            vals = _tensor(a["values"], vdtype)
            if kind == "torch_coo":
                return torch.sparse_coo_tensor(_tensor(a["indices"]), vals, shape,
                                               is_coalesced=case.get("coalesced_flag", False))
            ctor = torch.sparse_csr_tensor if kind == "torch_csr" else torch.sparse_csc_tensor
            return ctor(_tensor(a["ptr"]), _tensor(a["idx"]), vals, shape, check_invariants=False)
        if kind.startswith("scipy_"):
            fmt = kind[6:]
            vals = np.asarray(a["values"], dtype=vdtype)
            if fmt in ("csr", "csc"):
                cls = sp.csr_matrix if fmt == "csr" else sp.csc_matrix
                m = cls(shape, dtype=vdtype)
                m.indptr, m.indices, m.data = a["ptr"], a["idx"], vals  # assigned raw, past scipy's checks
                return m
            if fmt == "coo":
                m = sp.coo_matrix(shape, dtype=vdtype)
                m.row, m.col, m.data = a["row"], a["col"], vals
                return m
            dense = sp.coo_matrix((vals, (a["row"], a["col"])), shape=shape)  # a valid matrix only
            return dense.asformat(fmt) if fmt != "bsr" else dense.tobsr(blocksize=case["blocksize"])
        if kind.startswith("cupy_"):
            fmt = kind[5:]
            vals = np.asarray(a["values"], dtype=vdtype)
            if fmt == "coo":
                return FakeCupy("coo", shape, row=a["row"], col=a["col"], data=vals)
            return FakeCupy(fmt, shape, indptr=a["ptr"], indices=a["idx"], data=vals)
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise Unbuildable(f"{type(e).__name__}: {e}") from None
    raise KeyError(kind)


def _operand(spec):
    """A dense operand: (array, dtype name, layout) -> a torch tensor of that layout."""
    import numpy as np

    arr, dtype, layout = spec
    if layout == "t":  # non-contiguous: the transpose of a contiguous array
        return _tensor(np.ascontiguousarray(arr.T), dtype).t()
    if layout == "expand":  # stride 0 along the last dimension
        return _tensor(arr[..., :1], dtype).expand(*arr.shape)
    if layout == "0d":
        return _tensor(np.asarray(arr.reshape(-1)[0] if arr.size else 0.0), dtype)
    return _tensor(arr, dtype)


def run_op(A, op):
    """One product on the SparseRLTensor ``A``; answers (outcome, float64 numpy result)."""
    import torch
    import torch.nn.functional as F

    name, args = op[0], [None if s is None else _operand(s) for s in op[1:3]]
    x, extra = args
    if name == "matmul":
        y = A @ x
    elif name == "rmatmul":
        y = x @ A
    elif name == "t_matmul":
        y = A.t() @ x
    elif name == "mm":
        y = torch.mm(A, x)
    elif name == "mv":
        y = torch.mv(A, x)
    elif name == "addmm":
        y = torch.addmm(extra, A, x, beta=op[3], alpha=op[4])
    elif name == "linear":
        y = F.linear(x, A, extra)
    elif name == "out":
        o = torch.empty(0, dtype=A.dtype)
        y = torch.mm(A, x, out=o)
        assert y is o
    else:
        raise KeyError(name)
    return y.detach().double().numpy(), str(y.dtype).replace("torch.", "")


def _ops(A, ops):
    out = []
    for op in ops:
        try:
            out.append(("ok",) + run_op(A, op))
        except (ValueError, TypeError) as e:
            out.append(("raised", type(e).__name__, str(e)))
    return out


def run_sparsify(case):
    import numpy as np

    import sparserl_compile as S

    if case["kind"] == "from_csr":
        a = case["arrays"]
        idx = (lambda v: _tensor(v)) if case.get("torch_indices") else (lambda v: v)
        A = S.SparseRLTensor.from_csr(idx(a["ptr"]), idx(a["idx"]), _tensor(a["values"], case["vdtype"]), case["shape"])
    else:
        A = S.sparsify(build(case))
    res = {"crow": A.crow_indices().numpy().astype(np.int64), "col": A.col_indices().numpy().astype(np.int64),
           "values": A.values().double().numpy(), "shape": tuple(A.shape), "dtype": str(A.dtype).replace("torch.", "")}
    res["ops"] = _ops(A, case.get("ops", ()))
    return res


def run_dispatch(case):
    """A native operand through the dispatch hook; when the case is valid, torch's own outcome
    without the hook too (never for an invalid one: torch would read it out of bounds)."""
    import torch

    import sparserl_compile as S

    A = build(case)
    x = _operand(case["x"])

    def call():
        if case["op"] == "matmul":
            return A @ x
        if case["op"] == "mm":
            return torch.mm(A, x)
        if case["op"] == "mv":
            return torch.mv(A, x)
        if case["op"] == "addmm":
            return torch.addmm(torch.zeros(A.shape[0], x.shape[1], dtype=x.dtype), A, x, beta=0.5, alpha=2.0)
        if case["op"] == "rmatmul":
            return x @ A
        raise KeyError(case["op"])

    def outcome(fn):
        try:
            y = fn()
            return ("ok", (y.to_dense() if y.layout != torch.strided else y).double().numpy())
        except (ValueError, TypeError) as e:
            return ("raised", type(e).__name__, str(e))
        except (RuntimeError, NotImplementedError) as e:
            return ("torch", type(e).__name__, str(e))

    base = outcome(call) if case["valid"] else None
    with S.accelerate():
        hooked = outcome(call)
    return {"hooked": hooked, "base": base}


def run_unpickle(case):
    import torch

    from sparserl_compile.tensor import _rebuild

    class Stored:
        def __reduce_ex__(self, protocol):
            return (_rebuild, tuple(_tensor(v, d) if isinstance(d, str) else v for v, d in case["args"]))

    buf = io.BytesIO()
    torch.save(Stored(), buf)
    buf.seek(0)
    A = torch.load(buf)
    return {"dense": A.to_dense().double().numpy(), "transposed": A.transposed}


def run_load(case):
    from sparserl_compile import matrices

    m = matrices.load_matrix(case["path"])
    return {"dense": m.toarray().astype("float64"), "dtype": str(m.dtype), "shape": m.shape}


RUNNERS = {"sparsify": run_sparsify, "dispatch": run_dispatch, "unpickle": run_unpickle, "load": run_load}


def main() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints go to stderr, never into the answers
    warnings.simplefilter("ignore")
    import sparserl_compile  # noqa: F401  (imported once, before the first case)

    while True:
        msg = read_msg(sys.stdin.buffer)
        if msg is None:
            return
        name, case = msg
        try:
            answer = ("ok", RUNNERS[name](case))
        except Unbuildable as e:
            answer = ("unbuildable", str(e))
        except (ValueError, TypeError) as e:
            answer = ("raised", type(e).__name__, str(e))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the case
            answer = ("other", type(e).__name__, f"{e}\n{traceback.format_exc()}")
        write_msg(out, answer)


if __name__ == "__main__":
    main()
