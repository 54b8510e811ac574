"""The input fuzz's oracle and strategies (``test_fuzz_inputs.py`` runs them): what a case is,
how it is damaged, and what sparserl must answer, worked out with plain numpy over the raw
arrays, never with the package under test."""

from __future__ import annotations

import re

import numpy as np
import torch
from hypothesis import strategies as st

import fuzz_worker as W

INT32_MAX = 2**31 - 1
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}

CATEGORY = {  # the words a message names each problem with
    "shape": r"shape|int32|negative",
    "index_dtype": r"not integers",
    "index_ndim": r"must be 1-D|shape \(2, nnz\)",
    "ptr_len": r"entries but the shape",
    "nnz_len": r"values|\d+ row indices, \d+ column indices",
    "ptr0": r"\[0\] \(-?\d+\) != 0",
    "ptr_last": r"\[-1\] \(-?\d+\) != nnz",
    "monotone": r"not non-decreasing",
    "col_range": r"column indices span",
    "row_range": r"row indices span",
    "values_dtype": r"not supported|unsupported",
    "values_ndim": r"1-D|dense dimensions|batch",
    "operand_shape": r"shape mismatch|needs \d+ rows|features|needs two 2-D|needs a 1-D|needs 2-D|not defined|"
                     r"at least 1 dimension|broadcast",
    "operand_dtype": r"dtype mismatch|is torch\.\w+ on",
    "stored": r"malformed|shape must be",
    "file": r"cannot read it|claims|not a sparse matrix|not a Matrix Market",
}


# ---------------------------------------------------------------------- the oracle


def cast(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 images of ``values`` after rounding to ``dtype`` (what the matrix really holds)."""
    return torch.from_numpy(np.asarray(values, np.float64)).to(getattr(torch, dtype)).double().numpy()


def is_shape(shape) -> bool:
    return (isinstance(shape, tuple) and len(shape) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= INT32_MAX for s in shape))


def problems_compressed(ptr, idx, n_values: int, shape, csc: bool = False) -> set[str]:
    """Every broken invariant of raw CSR (or CSC) arrays, found here without the package."""
    if not is_shape(shape):
        return {"shape"}
    found = set()
    for a in (ptr, idx):
        if a.dtype.kind not in "iu":
            found.add("index_dtype")
        elif a.ndim != 1:
            found.add("index_ndim")
    if found:
        return found
    n_major, n_minor = (shape[1], shape[0]) if csc else shape
    if ptr.size != n_major + 1:
        found.add("ptr_len")
    if idx.size != n_values:
        found.add("nnz_len")
    if ptr.size:
        if int(ptr[0]) != 0:
            found.add("ptr0")
        if int(ptr[-1]) != idx.size:
            found.add("ptr_last")
        if ptr.size > 1 and bool(np.any(ptr[1:] < ptr[:-1])):
            found.add("monotone")
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n_minor):
        found.add("row_range" if csc else "col_range")
    return found


def problems_coo(row, col, n_values: int, shape) -> set[str]:
    if not is_shape(shape):
        return {"shape"}
    found = set()
    for a in (row, col):
        if a.dtype.kind not in "iu":
            found.add("index_dtype")
        elif a.ndim != 1:
            found.add("index_ndim")
    if found:
        return found
    if not row.size == col.size == n_values:
        found.add("nnz_len")
    for name, a, n in (("row_range", row, shape[0]), ("col_range", col, shape[1])):
        if a.size and (int(a.min()) < 0 or int(a.max()) >= n):
            found.add(name)
    return found


def canonical(rows, cols, values64, shape):
    """(indptr, indices, summed values, dense) of stored entries (duplicates summed in float64)."""
    sums: dict[tuple[int, int], float] = {}
    for r, c, v in zip(rows.tolist(), cols.tolist(), values64.tolist()):
        sums[(r, c)] = sums.get((r, c), 0.0) + v
    keys = sorted(sums)
    indptr = np.zeros(shape[0] + 1, np.int64)
    for r, _ in keys:
        indptr[r + 1] += 1
    dense = np.zeros(shape)
    for (r, c), v in sums.items():
        dense[r, c] = v
    return np.cumsum(indptr), np.array([c for _, c in keys], np.int64), np.array([sums[k] for k in keys]), dense


def assert_close(got: np.ndarray, want: np.ndarray, scale: np.ndarray, terms: int, dtype: str, what: str):
    """``got`` within the worst-case rounding of ``terms``-term sums in ``dtype`` of ``want``;
    non-finite entries identical."""
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_g, nan_w), f"{what}: NaN at {np.argwhere(nan_g != nan_w)[:3].tolist()}"
    inf_w = np.isinf(want)
    assert np.array_equal(got[inf_w], want[inf_w]) and not np.isinf(got[~inf_w]).any(), f"{what}: inf differs"
    fin = ~(nan_w | inf_w)
    bound = (terms + 2) * UNIT_ROUNDOFF[dtype] * np.nan_to_num(scale[fin], posinf=0.0) + 1e-300
    err = np.abs(got[fin] - want[fin])
    assert np.all(err <= bound), f"{what}: off by {float(err.max()):.3g} (bound {float(bound[np.argmax(err - bound)]):.3g})"


def assert_names_a_problem(answer, found: set[str], what: str):
    assert answer[0] == "raised", f"{what}: accepted, though {sorted(found)} ({answer[0]})"
    msg = answer[2]
    assert any(re.search(CATEGORY[f], msg) for f in found), f"{what}: {answer[1]}({msg!r}) names none of {sorted(found)}"


# ---------------------------------------------------------------------- strategies

KINDS = ["dense", "torch_coo", "torch_csr", "torch_csc", "scipy_csr", "scipy_csc", "scipy_coo", "scipy_bsr",
         "scipy_lil", "scipy_dia", "scipy_dok", "cupy_csr", "cupy_csc", "cupy_coo", "from_csr"]
INDEX_DTYPES = [np.int64, np.int32, np.int16, np.uint16, np.uint32, np.uint64, np.int8, np.uint8]
BAD_INDEX = [-1, -2, -(2**31), 2**31, 2**31 + 5, 2**32 + 1, 2**40]


@st.composite
def entries(draw, dtypes=("float32", "float64", "float16", "bfloat16")):
    """A matrix as stored entries: shape, (row, col) pairs (duplicates and any order), values.
    Hypothesis draws the sizes and kinds; the bulk of the numbers comes from a drawn seed (fast)."""
    n_rows = draw(st.integers(0, 12) | st.just(1) | st.integers(13, 40))
    n_cols = draw(st.integers(0, 12) | st.just(1) | st.integers(13, 40))
    cells = n_rows * n_cols
    nnz = draw(st.integers(0, min(60, 2 * cells))) if cells else 0
    dtype = draw(st.sampled_from(dtypes))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = rng.integers(0, max(n_rows, 1), nnz)
    cols = rng.integers(0, max(n_cols, 1), nnz)
    if nnz and draw(st.booleans()):  # sorted by row then column, as most inputs come
        order = np.lexsort((cols, rows))
        rows, cols = rows[order], cols[order]
    vals = rng.integers(-16, 17, nnz) / 4
    if dtype in ("float32", "float64") and nnz and draw(st.integers(0, 3)) == 0:
        vals[rng.integers(0, nnz, 2)] = rng.choice([0.0, np.nan, np.inf, -np.inf], 2)
    return (n_rows, n_cols), rows.astype(np.int64), cols.astype(np.int64), vals, dtype


def compressed(rows, cols, n_major, csc=False):
    """Entries grouped by row (or column) as drawn within each group: (ptr, idx, order)."""
    major, minor = (cols, rows) if csc else (rows, cols)
    order = np.argsort(major, kind="stable")
    ptr = np.concatenate([[0], np.cumsum(np.bincount(major, minlength=n_major))]).astype(np.int64)
    return ptr, minor[order], order


def damage_of(kind: str):
    base = ["vals_drop"]
    if kind in ("torch_coo", "scipy_coo", "cupy_coo"):
        base += ["row_set", "col_set", "row_drop"]
    else:
        base += ["ptr_set", "ptr_swap", "ptr_drop", "ptr_extra", "idx_set", "idx_drop", "idx_extra", "ptr_2d"]
    if not kind.startswith("torch") and kind != "scipy_coo":  # torch's constructors and scipy's COO
        base += ["col_float" if kind.endswith("coo") else "idx_float"]  # setters convert float indices
    if kind in ("from_csr", "cupy_csr", "cupy_csc", "cupy_coo"):
        base += ["shape_neg", "shape_float", "shape_bool", "shape_big", "shape_short", "shape_3"]
    if kind == "from_csr":
        base += ["vals_int", "vals_2d"]
    return base


@st.composite
def sparse_case(draw, kinds=tuple(KINDS), dtypes=("float32", "float64", "float16", "bfloat16")):
    """(runner case, found problems, expected (indptr, indices, values, dense) when valid)."""
    kind = draw(st.sampled_from(kinds))
    if kind.startswith(("scipy", "cupy")):
        dtypes = tuple(d for d in dtypes if d != "bfloat16")
    shape, rows, cols, vals, dtype = draw(entries(dtypes))
    case = {"kind": kind, "shape": shape, "vdtype": dtype}
    values = vals
    if kind == "dense":
        _, _, _, dense = canonical(rows, cols, cast(vals, dtype), shape)
        dense = cast(dense, dtype).reshape(shape)
        case["arrays"] = {"dense": dense}
        nz = np.argwhere(dense != 0)
        return case, set(), canonical(nz[:, 0], nz[:, 1], dense[dense != 0], shape)
    if kind in ("scipy_bsr", "scipy_lil", "scipy_dia", "scipy_dok"):
        if kind == "scipy_bsr":
            case["blocksize"] = (draw(st.sampled_from([d for d in (1, 2, 3) if shape[0] % d == 0] or [1])),
                                 draw(st.sampled_from([d for d in (1, 2) if shape[1] % d == 0] or [1])))
        case["arrays"] = {"row": rows, "col": cols, "values": vals}
        try:
            coo = W.build(case).tocoo()  # a valid matrix: what scipy stores is the expectation
        except W.Unbuildable:
            return None
        return case, set(), canonical(coo.row, coo.col, cast(coo.data, dtype), shape)
    csc = kind.endswith("csc")
    idt = draw(st.sampled_from(INDEX_DTYPES if kind in ("from_csr", "cupy_csr", "cupy_csc", "cupy_coo", "scipy_csr",
                                                       "scipy_csc", "scipy_coo") else [np.int64, np.int32]))
    if kind.endswith("coo"):
        arrays = {"row": rows, "col": cols}
    else:
        ptr, idx, order = compressed(rows, cols, shape[1] if csc else shape[0], csc)
        arrays = {"ptr": ptr, "idx": idx}
        values = vals[order]
    if not all(np.all(a <= np.iinfo(idt).max) for a in arrays.values()):
        idt = np.int64
    arrays = {k: v.astype(idt) for k, v in arrays.items()}
    arrays["values"] = values
    damage = draw(st.none() | st.none() | st.sampled_from(damage_of(kind)))
    if damage:
        arrays, shape = apply_damage(draw, damage, arrays, shape)
        case["shape"] = shape
    if kind == "torch_coo":
        if arrays["row"].shape != arrays["col"].shape or arrays["row"].ndim != 1:
            return None  # torch builds no COO tensor of ragged indices
        arrays["indices"] = np.stack([arrays.pop("row"), arrays.pop("col")])
    case["arrays"] = arrays
    if kind == "from_csr":
        case["torch_indices"] = draw(st.booleans()) and arrays["ptr"].dtype.kind in "iu"
    if kind.startswith("scipy_"):  # what the matrix holds: scipy's COO setters cast (and wrap) indices
        try:
            m = W.build(case)
        except W.Unbuildable:
            return None
        arrays = ({"row": m.row, "col": m.col, "values": arrays["values"]} if kind == "scipy_coo" else
                  {"ptr": m.indptr, "idx": m.indices, "values": arrays["values"]})
    found = find_problems(kind, arrays, shape, dtype if damage != "vals_int" else "int64")
    if damage == "vals_int":
        case["vdtype"] = "int64"
    return case, found, (None if found else expected_of(kind, arrays, shape, dtype))


def expected_of(kind, arrays, shape, dtype):
    """The canonical matrix of well-formed raw arrays (read as they are, after any damage that
    left them well formed)."""
    if kind == "torch_coo":
        r, c = arrays["indices"][0], arrays["indices"][1]
    elif kind.endswith("coo"):
        r, c = arrays["row"], arrays["col"]
    else:
        ptr, idx = arrays["ptr"].astype(np.int64), arrays["idx"].astype(np.int64)
        major = np.repeat(np.arange(ptr.size - 1), np.diff(ptr))
        r, c = (idx, major) if kind.endswith("csc") else (major, idx)
    return canonical(np.asarray(r, np.int64), np.asarray(c, np.int64), cast(arrays["values"], dtype), shape)


def find_problems(kind, arrays, shape, vdtype) -> set[str]:
    v = arrays["values"]
    found = set()
    if vdtype == "int64":
        found.add("values_dtype")
    if v.ndim != 1:
        found.add("values_ndim")
    n_values = v.shape[0] if v.ndim else 0
    if kind == "torch_coo":
        ind = arrays["indices"]
        return found | problems_coo(ind[0], ind[1], n_values, shape)
    if kind.endswith("coo"):
        return found | problems_coo(arrays["row"], arrays["col"], n_values, shape)
    return found | problems_compressed(arrays["ptr"], arrays["idx"], n_values, shape, csc=kind.endswith("csc"))


def apply_damage(draw, damage, arrays, shape):
    a = {k: v.copy() for k, v in arrays.items()}
    key = {"ptr": "ptr", "idx": "idx", "row": "row", "col": "col"}

    def setone(name):
        arr = a[name]
        if not arr.size:
            return
        pos = draw(st.integers(0, arr.size - 1))
        bad = draw(st.sampled_from(BAD_INDEX + [int(arr.max()) + 1, int(arr.max()) + 7]))
        if not (np.iinfo(arr.dtype).min <= bad <= np.iinfo(arr.dtype).max):
            arr = arr.astype(np.int64) if bad >= -(2**63) and bad < 2**63 else arr.astype(np.uint64)
            if arr.dtype == np.uint64 and bad < 0:
                return
        arr[pos] = bad
        a[name] = arr

    if damage in ("ptr_set", "idx_set", "row_set", "col_set"):
        setone(key[damage[:-4]])
    elif damage == "ptr_swap" and a["ptr"].size > 2:
        i, j = sorted(draw(st.lists(st.integers(0, a["ptr"].size - 1), min_size=2, max_size=2, unique=True)))
        a["ptr"][[i, j]] = a["ptr"][[j, i]]
    elif damage in ("ptr_drop", "idx_drop", "row_drop") and a[damage[:-5]].size:
        a[damage[:-5]] = a[damage[:-5]][:-1]
    elif damage in ("ptr_extra", "idx_extra"):
        name = damage[:-6]
        a[name] = np.append(a[name], a[name][-1:] if a[name].size else [0]).astype(a[name].dtype)
    elif damage in ("idx_float", "col_float"):
        name = "idx" if damage == "idx_float" else "col"
        a[name] = a[name].astype(np.float64)
    elif damage == "ptr_2d":
        a["ptr"] = a["ptr"].reshape(1, -1)
    elif damage == "vals_drop" and a["values"].size:
        a["values"] = a["values"][:-1]
    elif damage == "vals_2d":
        a["values"] = a["values"].reshape(-1, 1)
    elif damage == "vals_int":
        a["values"] = np.nan_to_num(a["values"], posinf=1.0, neginf=-1.0).astype(np.int64)
    elif damage.startswith("shape_"):
        shape = {"shape_neg": (-shape[0] - 1, shape[1]), "shape_float": (float(shape[0]), shape[1]),
                 "shape_bool": (True, shape[1]), "shape_big": (shape[0], 2**31 + shape[1]),
                 "shape_short": (max(shape[0] - 1, 0), max(shape[1] - 1, 0)), "shape_3": (*shape, 1)}[damage]
    return a, shape


# ---------------------------------------------------------------------- operands and products


@st.composite
def operand(draw, n: int, dtype: str, kind: str):
    """A dense operand for a product whose contracted dimension is ``n``: mostly well formed,
    sometimes of another length, rank, dtype or layout."""
    width = draw(st.integers(0, 5))
    batch = draw(st.integers(0, 3))
    rank = draw(st.sampled_from([1, 2, 2, 2, 3, 0]))
    k = n if draw(st.integers(0, 9)) else draw(st.integers(0, n + 3))
    shape = {"col": {0: (), 1: (k,), 2: (k, width), 3: (batch, k, width)},
             "row": {0: (), 1: (k,), 2: (width, k), 3: (batch, width, k)}}[kind][rank]
    arr = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(-8, 9, shape) / 2
    odt = dtype if draw(st.integers(0, 7)) else draw(st.sampled_from(["float32", "float64", "int64", "float16"]))
    layout = draw(st.sampled_from(["c", "c", "t", "expand"])) if arr.ndim == 2 and arr.size else "c"
    if layout == "expand":  # a stride-0 operand: every column is the first
        arr = np.repeat(arr[..., :1], arr.shape[-1], axis=-1)
    return (arr, odt, "0d" if rank == 0 else layout)


@st.composite
def product_op(draw, shape, dtype):
    n_rows, n_cols = shape
    name = draw(st.sampled_from(["matmul", "rmatmul", "t_matmul", "mm", "mv", "addmm", "linear", "out"]))
    contracted = {"matmul": n_cols, "mm": n_cols, "mv": n_cols, "addmm": n_cols, "out": n_cols,
                  "rmatmul": n_rows, "t_matmul": n_rows, "linear": n_cols}[name]
    x = draw(operand(contracted, dtype, "row" if name in ("rmatmul", "linear") else "col"))
    extra = None
    if name == "addmm":
        width = x[0].shape[-1] if x[0].ndim == 2 else 1
        eshape = draw(st.sampled_from([(n_rows, width), (width,), (1, width), (n_rows, 1), (n_rows + 1, width)]))
        extra = (np.ones(eshape) / 2, dtype if draw(st.integers(0, 7)) else "float64", "c")
        return (name, x, extra, draw(st.sampled_from([0.0, 1.0, 0.5])), draw(st.sampled_from([1.0, 2.0])))
    if name == "linear" and draw(st.booleans()):
        eshape = draw(st.sampled_from([(n_rows,), (n_rows,), (1,), (n_rows + 1,)]))
        extra = (np.full(eshape, 0.25), dtype if draw(st.integers(0, 7)) else "float64", "c")
    return (name, x, extra)


@np.errstate(invalid="ignore", over="ignore")
def expected_product(op, D: np.ndarray, dtype: str):
    """("ok", value, scale, terms) or ("error", problems) of one product on the dense ``D``."""
    name, (x, xdt, layout), extra = op[0], op[1], op[2]
    if layout == "0d":
        x = np.asarray(x.reshape(-1)[0] if x.size else 0.0)
    n_rows, n_cols = D.shape
    A = np.nan_to_num(D, nan=0, posinf=0, neginf=0)
    bad = set()
    if xdt != dtype:
        bad.add("operand_dtype")
    left = name not in ("rmatmul", "linear")
    M = D.T if name == "t_matmul" else D
    k = M.shape[1] if left else (n_rows if name == "rmatmul" else n_cols)
    if x.ndim == 0 or (name in ("mm", "addmm", "out") and x.ndim != 2) or (name == "mv" and x.ndim != 1):
        bad.add("operand_shape")
    elif (x.shape[0] if left and x.ndim == 1 else x.shape[-2] if left else x.shape[-1]) != k:
        bad.add("operand_shape")
    if bad:
        return ("error", bad)
    if name == "linear":
        val, scale = x @ D.T, np.abs(x) @ np.abs(A.T)
    elif left:
        val, scale = np.matmul(M, x), np.matmul(np.abs(A.T if name == "t_matmul" else A), np.abs(x))
    else:
        val, scale = x @ D, np.abs(x) @ np.abs(A)
    terms = max(k, 1)
    if extra is not None:
        e, edt, _ = extra
        fits = _broadcasts(e.shape, val.shape) and np.broadcast_shapes(e.shape, val.shape) == val.shape
        if edt != dtype or not fits:
            return ("error", ({"operand_dtype"} if edt != dtype else set()) | (set() if fits else {"operand_shape"}))
        if name == "addmm":
            beta, alpha = op[3], op[4]
            val = alpha * val + (beta * e if beta else 0.0)
            scale = alpha * scale + (abs(beta) * np.abs(e) if beta else 0.0)
        else:
            val, scale = val + e, scale + np.abs(e)
        terms += 2
    return ("ok", np.asarray(val, np.float64), np.asarray(scale, np.float64), terms)


def _broadcasts(a, b) -> bool:
    try:
        np.broadcast_shapes(a, b)
        return True
    except ValueError:
        return False


def check_ops(ops, answers, D, dtype, what):
    for op, ans in zip(ops, answers):
        want = expected_product(op, D, dtype)
        label = f"{what} {op[0]}(x {op[1][0].shape} {op[1][1]} {op[1][2]})"
        if want[0] == "error":
            assert_names_a_problem(ans, want[1], label)
            continue
        assert ans[0] == "ok", f"{label}: raised {ans[1]}({ans[2]!r}) on a valid product"
        assert ans[2] == dtype, f"{label}: result dtype {ans[2]}, want {dtype}"
        assert_close(ans[1], want[1], want[2], want[3], dtype, label)


@st.composite
def stored_tensor(draw):
    """The arguments a stored SparseRLTensor unpickles with, maybe tampered with."""
    shape, rows, cols, vals, dtype = draw(entries(("float32", "float64", "float16")))
    ptr, idx, order = compressed(rows, cols, shape[0])
    args = {"crow": (ptr, "int32"), "col": (idx, "int32"), "val": (vals[order], dtype), "n_rows": (shape[0], None),
            "n_cols": (shape[1], None), "transposed": (draw(st.booleans()), None)}
    damage = draw(st.none() | st.sampled_from(["crow", "col", "val", "n_rows", "n_cols", "transposed"]))
    found = set()
    if damage in ("crow", "col") and args[damage][0].size:
        a = args[damage][0].copy()
        a[draw(st.integers(0, a.size - 1))] = draw(st.sampled_from([-1, -7, 10**6, shape[1], shape[0] + 2]))
        args[damage] = (a, "int32")
    elif damage == "val":
        args["val"] = draw(st.sampled_from([("values", None), (7, None), (np.ones(2, np.int64), "int64"),
                                            (vals[order][:-1] if vals.size else np.ones(1), dtype)]))
    elif damage in ("n_rows", "n_cols"):
        args[damage] = (draw(st.sampled_from([-1, 2**31, float(args[damage][0]), "3", None, shape[0] + 1])), None)
    elif damage == "transposed":
        args["transposed"] = (draw(st.sampled_from([1, "yes", None, 0.0])), None)
    crow, col = args["crow"][0], args["col"][0]
    n_rows, n_cols, val, tr = args["n_rows"][0], args["n_cols"][0], args["val"], args["transposed"][0]
    if not isinstance(tr, bool) or not isinstance(val[0], np.ndarray):
        found.add("stored")
    elif val[1] == "int64":
        found.add("values_dtype")
    else:
        found |= problems_compressed(crow.astype(np.int32), col.astype(np.int32), val[0].size, (n_rows, n_cols))
    if not found:  # well formed (maybe after a damage that left it so): the matrix it stores
        final = {"ptr": crow.astype(np.int64), "idx": col.astype(np.int64), "values": val[0]}
        expected = expected_of("from_csr", final, (n_rows, n_cols), dtype)[3]
    else:
        expected = None
    return {"args": [args[k] for k in ("crow", "col", "val", "n_rows", "n_cols", "transposed")]}, found, expected, tr
