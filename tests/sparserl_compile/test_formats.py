"""formats.convert: every format reconstructs the matrix, read literally as contract.FORMATS says."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparserl_compile import matrices
from sparserl_compile.contract import FORMATS, signature
from sparserl_compile.formats import (
    FormatData,
    FormatNotSuitable,
    convert,
    floor_bytes,
    to_device,
    unfit,
    unfit_formats,
)

# ------------------------------------------------------------ literal reference kernels
# Each computes Y = A @ X (X: n_cols x n, float64) from FormatData as the Format.doc reads.


def _ref_csr_rows(rows, row_ptr, col_idx, vals, X, Y):
    for i in rows:
        for p in range(row_ptr[i], row_ptr[i + 1]):
            Y[i] += vals[p] * X[col_idx[p]]


def ref_product(fd: FormatData, vals: np.ndarray, X: np.ndarray) -> np.ndarray:
    s, a = fd.scalars, fd.arrays
    n_rows = s["n_rows"]
    v = fd.gather_values(vals.astype(np.float64))
    Y = np.zeros((n_rows, X.shape[1]))
    if fd.fmt == "csr":
        _ref_csr_rows(range(n_rows), a["row_ptr"], a["col_idx"], v, X, Y)
    elif fd.fmt == "csr_perm":
        assert sorted(a["perm"].tolist()) == list(range(n_rows))
        _ref_csr_rows(a["perm"], a["row_ptr"], a["col_idx"], v, X, Y)
    elif fd.fmt == "csr_part":
        pp = a["part_ptr"]
        assert pp.size == s["n_parts"] + 1 and pp[0] == 0 and pp[-1] == n_rows
        for p in range(s["n_parts"]):
            assert pp[p] < pp[p + 1]
            _ref_csr_rows(range(pp[p], pp[p + 1]), a["row_ptr"], a["col_idx"], v, X, Y)
    elif fd.fmt == "merge":
        rp, pr, items = a["row_ptr"], a["part_row"], s["items_per_part"]
        nnz = int(rp[-1])
        assert s["n_parts"] == math.ceil((n_rows + nnz) / items) and pr.size == s["n_parts"] + 1
        for p in range(s["n_parts"]):
            d0, d1 = p * items, min((p + 1) * items, n_rows + nnz)
            i, i_end = pr[p], pr[p + 1]
            j, j_end = d0 - i, d1 - i_end
            assert rp[min(i, n_rows)] <= j <= (rp[i + 1] if i < n_rows else nnz)
            while i < i_end:  # rows finished inside this piece (their tail)
                while j < rp[i + 1]:
                    Y[i] += v[j] * X[a["col_idx"][j]]
                    j += 1
                i += 1
            while j < j_end:  # the head of the row the next piece finishes
                Y[i] += v[j] * X[a["col_idx"][j]]
                j += 1
        assert pr[-1] == n_rows
    elif fd.fmt == "ell":
        w = s["width"]
        for k in range(w):
            for i in range(n_rows):
                c = a["ell_col"][k * n_rows + i]
                if c >= 0:
                    Y[i] += v[k * n_rows + i] * X[c]
                else:
                    assert v[k * n_rows + i] == 0
    elif fd.fmt == "sell":
        C, sp_ = fd.params["C"], a["slice_ptr"]
        perm = a["perm"]
        assert perm.size == s["n_slices"] * C
        assert sorted(perm[perm >= 0].tolist()) == list(range(n_rows))
        assert np.all(perm[n_rows:] == -1)
        for sl in range(s["n_slices"]):
            width = (sp_[sl + 1] - sp_[sl]) // C
            for lane in range(C):
                r = perm[sl * C + lane]
                for k in range(width):
                    q = sp_[sl] + k * C + lane
                    c = a["sell_col"][q]
                    if c >= 0:
                        assert r >= 0
                        Y[r] += v[q] * X[c]
                    else:
                        assert v[q] == 0
    elif fd.fmt == "dia":
        off = a["offsets"]
        assert off.size == s["n_diags"] and np.all(np.diff(off) > 0)
        for d in range(s["n_diags"]):
            for i in range(n_rows):
                c = i + off[d]
                if 0 <= c < s["n_cols"]:
                    Y[i] += v[d * n_rows + i] * X[c]
                else:
                    assert v[d * n_rows + i] == 0
    elif fd.fmt == "bsr":
        R, C = fd.params["R"], fd.params["C"]
        bp, bc = a["bsr_ptr"], a["bsr_col"]
        assert bp.size == s["n_brows"] + 1 == math.ceil(n_rows / R) + 1
        for b in range(s["n_brows"]):
            assert np.all(np.diff(bc[bp[b]:bp[b + 1]]) > 0)
            for k in range(bp[b], bp[b + 1]):
                for r in range(R):
                    for c in range(C):
                        row, col = b * R + r, bc[k] * C + c
                        val = v[(k * R + r) * C + c]
                        if row < n_rows and col < s["n_cols"]:
                            Y[row] += val * X[col]
                        else:
                            assert val == 0
    elif fd.fmt == "csr_split":
        _ref_split(fd, v, X, Y)
    elif fd.fmt == "tcw":
        _ref_tcw(fd, v, X, Y)
    elif fd.fmt == "bitmap":
        R = fd.params["R"]
        tw, n_bands, n_ctiles = 1024 // R, s["n_bands"], s["n_ctiles"]
        tp, words = a["tile_ptr"], a["bitmap"].view(np.uint32)
        assert n_bands == math.ceil(n_rows / R) and n_ctiles == math.ceil(s["n_cols"] / tw)
        assert tp.size == n_bands * n_ctiles + 1 and words.size == 32 * (tp.size - 1)
        assert tp[0] == 0 and np.all(tp % 8 == 0) and np.all(np.diff(tp) >= 0) and tp[-1] == v.size
        for t in range(tp.size - 1):
            k = tp[t]
            for lane in range(32):
                for b in range(32):
                    if int(words[t * 32 + lane]) >> b & 1:
                        row = (t // n_ctiles) * R + lane % R
                        col = (t % n_ctiles) * tw + (lane // R) * 32 + b
                        assert row < n_rows and col < s["n_cols"]
                        Y[row] += v[k] * X[col]
                        k += 1
            assert k <= tp[t + 1] and np.all(v[k:tp[t + 1]] == 0)  # the gap before the next tile
    else:
        raise AssertionError(fd.fmt)
    return Y


def _ref_split(fd: FormatData, v, X, Y) -> None:
    """csr_split as its Format.doc reads: hub chunks first, then pieces of stored rows."""
    s, a = fd.scalars, fd.arrays
    n_rows, n_hubs, warps = s["n_rows"], s["n_hubs"], fd.params["warps"]
    rid, sp_, pp = a["row_id"], a["srow_ptr"], a["piece_ptr"]
    n_stored = rid.size
    assert sp_.size == n_stored + 1 and set(rid.tolist()) == set(range(n_rows))
    assert sorted(rid[n_hubs:].tolist() + sorted(set(rid[:n_hubs].tolist()))) == list(range(n_rows))
    hub_rows, cuts = np.unique(rid[:n_hubs], return_counts=True)
    assert np.all(cuts <= fd.params["split"])
    lengths = np.diff(sp_)
    assert np.all(lengths[n_hubs:] < fd.params["hub"])
    n_pieces = s["n_parts"] - n_hubs * warps
    assert pp.size == n_pieces + 1 and (n_pieces == 0 or (pp[0] == n_hubs and pp[-1] == n_stored))
    stored = list(range(n_hubs))
    for p in range(n_pieces):
        rows = range(pp[p], pp[p + 1])
        assert len(rows) >= 1
        work = np.maximum(lengths[pp[p]:pp[p + 1]], 1).sum()
        assert work <= fd.params["piece"] or len(rows) == 1
        stored += list(rows)
    assert stored == list(range(n_stored))
    for k in stored:
        for q in range(sp_[k], sp_[k + 1]):
            Y[rid[k]] += v[q] * X[a["scol"][q]]


def _ref_tcw(fd: FormatData, v, X, Y) -> None:
    """tcw computed tile by tile, as the tensor-core kernel does: a dense H x 16 tile of A
    (zero-filled, nonzeros scattered by tcw_pos) times the 16 gathered rows of X."""
    s, a = fd.scalars, fd.arrays
    H, n_rows = fd.params["H"], s["n_rows"]
    rid, wp, tc, tp, pos = a["row_id"], a["win_ptr"], a["tile_col"], a["tile_ptr"], a["tcw_pos"]
    assert s["n_parts"] == math.ceil(n_rows / H) and rid.size == s["n_parts"] * H and wp.size == s["n_parts"] + 1
    assert sorted(rid[rid >= 0].tolist()) == list(range(n_rows)) and np.all(rid[n_rows:] == -1)
    for w in range(s["n_parts"]):
        cols = tc[wp[w] * 16:wp[w + 1] * 16]
        real = cols[cols >= 0]
        assert np.all(np.diff(real) > 0) and np.all(cols[real.size:] == -1)  # ascending, padding at the end
        assert cols.size - real.size < 16
        for t in range(wp[w], wp[w + 1]):
            tile = np.zeros((H, 16))
            places = pos[tp[t]:tp[t + 1]]
            assert np.unique(places).size == places.size and np.all((places >= 0) & (places < H * 16))
            tile.flat[places] = v[tp[t]:tp[t + 1]]
            xg = np.zeros((16, X.shape[1]))
            ok = tc[t * 16:t * 16 + 16] >= 0
            xg[ok] = X[tc[t * 16:t * 16 + 16][ok]]
            assert np.all(tile[:, ~ok] == 0)
            prod = tile @ xg
            for r in range(H):
                if rid[w * H + r] >= 0:
                    Y[rid[w * H + r]] += prod[r]
                else:
                    assert np.all(tile[r] == 0)


PARAMS = {
    "csr": [{}],
    "csr_perm": [{}],
    "csr_part": [{"nnz_per_part": 1}, {"nnz_per_part": 7}, {}],
    "merge": [{"items_per_part": 1}, {"items_per_part": 5}, {}],
    "ell": [{}],
    "sell": [{"C": 1, "sigma": 1}, {"C": 4, "sigma": 8}, {"C": 32, "sigma": 1}],
    "dia": [{}],
    "bsr": [{"R": 1, "C": 1}, {"R": 3, "C": 2}, {"R": 4, "C": 4}],
    "csr_split": [{"order": 1, "piece": 1, "hub": 3, "warps": 2}, {"order": 3, "piece": 5, "hub": 1000, "warps": 4},
                  {"order": 4, "piece": 2, "hub": 2, "warps": 1, "split": 3}, {"order": 2, "hub": 1, "split": 40}],
    "tcw": [{"order": 1, "H": 1}, {"order": 3, "H": 4}, {"order": 4, "H": 16}, {"order": 2, "H": 3}],
    "bitmap": [{"R": 1}, {"R": 8}, {"R": 32}],
}


def _edge_cases() -> dict[str, sp.csr_matrix]:
    rng = np.random.default_rng(3)
    long_row = sp.lil_matrix((6, 40), dtype=np.float32)
    long_row[2, :] = 1.0
    empty_rows = sp.random(13, 11, density=0.2, random_state=rng, format="lil")
    empty_rows[[0, 4, 5, 12], :] = 0
    return {
        "nnz0": sp.csr_matrix((5, 7), dtype=np.float32),
        "zero_rows": sp.csr_matrix((0, 4), dtype=np.float32),
        "one_row": sp.csr_matrix(rng.standard_normal((1, 9)).astype(np.float32)),
        "long_row": sp.csr_matrix(long_row),
        "empty_rows": sp.csr_matrix(empty_rows),
        "rect_wide": sp.random(7, 23, density=0.3, random_state=rng, format="csr"),
        "rect_tall": sp.random(29, 5, density=0.4, random_state=rng, format="csr"),
        "stencil": matrices.stencil2d(7),
        "blocks": matrices.block_random(5, 4, 3, 2, 2, seed=1),
    }


def _check(A: sp.csr_matrix, fmt: str, params: dict, max_fill: float = 1e9) -> FormatData:
    A = matrices.canonical(A)
    fd = convert(A.indptr, A.indices, A.shape, fmt, params, max_fill=max_fill)
    f = FORMATS[fmt]
    assert fd.fmt == fmt and fd.value_array == f.value_array
    assert set(fd.scalars) == set(f.scalars)
    assert set(fd.arrays) == set(f.arrays) - {f.value_array}
    assert all(a.dtype == np.int32 for a in fd.arrays.values())
    assert fd.value_map.dtype == np.int64
    # every CSR nonzero lands in exactly one slot
    used = fd.value_map[fd.value_map >= 0]
    assert np.array_equal(np.sort(used), np.arange(A.nnz))
    rng = np.random.default_rng(0)
    vals = rng.standard_normal(A.nnz)
    X = rng.standard_normal((A.shape[1], 3))
    B = sp.csr_matrix((vals, A.indices, A.indptr), shape=A.shape)
    np.testing.assert_allclose(ref_product(fd, vals, X), B @ X, rtol=1e-12, atol=1e-12)
    return fd


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_formats_table_covered(fmt):
    assert fmt in PARAMS


@pytest.mark.parametrize("case", list(_edge_cases()))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_edge_cases_reconstruct(case, fmt):
    A = _edge_cases()[case]
    for params in PARAMS[fmt]:
        _check(A, fmt, params)


@pytest.mark.parametrize("name", ["add32", "bcspwr10", "dnn_n1024_l1"])
def test_real_matrices_reconstruct(shared_matrices, name):
    A = matrices.load_npz(shared_matrices / f"{name}.npz")
    X = np.random.default_rng(1).standard_normal((A.shape[1], 2))
    B = sp.csr_matrix((A.data.astype(np.float64), A.indices, A.indptr), shape=A.shape)
    want = B @ X
    for fmt in FORMATS:
        try:
            fd = convert(A.indptr, A.indices, A.shape, fmt, {"C": 4, "sigma": 64} if fmt == "sell" else None)
        except FormatNotSuitable:
            assert fmt in ("ell", "dia", "bsr", "sell", "bitmap")
            continue
        # vectorized reconstruction (the loop reference is too slow at this size)
        v = fd.gather_values(A.data.astype(np.float64))
        rows, cols = _coords(fd)
        got = np.zeros_like(want)
        slots = fd.value_map >= 0
        assert np.all(v[~slots] == 0)
        np.add.at(got, rows, v[slots][:, None] * X[cols])
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def _coords(fd: FormatData):
    """(row, col) of every value slot whose value_map >= 0, per the format's layout."""
    m = fd.value_map
    slots = np.nonzero(m >= 0)[0]
    a, s = fd.arrays, fd.scalars
    if fd.fmt in ("csr", "csr_perm", "csr_part", "merge"):
        rows = np.repeat(np.arange(s["n_rows"]), np.diff(a["row_ptr"]))
        return rows[slots], a["col_idx"][slots]
    if fd.fmt == "ell":
        return slots % s["n_rows"], a["ell_col"][slots]
    if fd.fmt == "dia":
        i = slots % s["n_rows"]
        return i, i + a["offsets"][slots // s["n_rows"]]
    if fd.fmt == "sell":
        C = fd.params["C"]
        sl = np.searchsorted(a["slice_ptr"], slots, side="right") - 1
        lane = (slots - a["slice_ptr"][sl]) % C
        return a["perm"][sl * C + lane], a["sell_col"][slots]
    if fd.fmt == "bsr":
        R, C = fd.params["R"], fd.params["C"]
        k, rc = slots // (R * C), slots % (R * C)
        brow = np.searchsorted(a["bsr_ptr"], k, side="right") - 1
        return brow * R + rc // C, a["bsr_col"][k] * C + rc % C
    if fd.fmt == "csr_split":
        stored = np.repeat(np.arange(s["n_rows"]), np.diff(a["srow_ptr"]))
        return a["row_id"][stored[slots]], a["scol"][slots]
    if fd.fmt == "tcw":
        H = fd.params["H"]
        t = np.searchsorted(a["tile_ptr"], slots, side="right") - 1
        w = np.searchsorted(a["win_ptr"], t, side="right") - 1
        r, j = a["tcw_pos"][slots] // 16, a["tcw_pos"][slots] % 16
        return a["row_id"][w * H + r], a["tile_col"][t * 16 + j]
    if fd.fmt == "bitmap":  # words in order, each word's bits ascending: the stored slots' order
        R, n_ctiles = fd.params["R"], s["n_ctiles"]
        words = a["bitmap"].view(np.uint32)
        wk, b = np.nonzero((words[:, None] >> np.arange(32, dtype=np.uint32)) & 1)
        t, lane = wk // 32, wk % 32
        return (t // n_ctiles) * R + lane % R, (t % n_ctiles) * (1024 // R) + (lane // R) * 32 + b
    raise AssertionError(fd.fmt)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_rows=st.integers(0, 12), n_cols=st.integers(1, 12), density=st.floats(0, 1),
    seed=st.integers(0, 2**16), fmt=st.sampled_from(list(FORMATS)), k=st.integers(1, 6),
)
def test_random_small_matrices(n_rows, n_cols, density, seed, fmt, k):
    A = sp.random(n_rows, n_cols, density=density, random_state=seed, format="csr")
    params = {"csr_part": {"nnz_per_part": k}, "merge": {"items_per_part": k},
              "sell": {"C": k, "sigma": k + seed % 5}, "bsr": {"R": k, "C": 1 + seed % 4},
              "csr_split": {"order": 1 + seed % 4, "piece": k, "hub": 1 + seed % 7, "warps": 1 + seed % 3,
                            "split": 1 + seed % 5},
              "tcw": {"order": 1 + seed % 4, "H": k},
              "bitmap": {"R": 2 ** (k - 1)}}.get(fmt, {})
    _check(A, fmt, params)


def test_merge_part_row_is_the_merge_path():
    # rows of lengths 3, 0, 2 -> path items: nz0 nz1 nz2 end0 end1 nz3 nz4 end2
    A = sp.csr_matrix(np.array([[1, 1, 1, 0], [0, 0, 0, 0], [0, 1, 0, 1]], np.float32))
    fd = convert(A.indptr, A.indices, A.shape, "merge", {"items_per_part": 2})
    assert fd.scalars["n_parts"] == 4
    # diagonals 0, 2, 4, 6, 8 -> row ends consumed before each: 0, 0, 1, 2, 3
    assert fd.arrays["part_row"].tolist() == [0, 0, 1, 2, 3]


def test_csr_part_is_greedy_and_never_splits_rows():
    A = matrices.canonical(sp.csr_matrix(np.array(
        [[1] * 5, [0] * 5, [0] * 5, [1, 1, 0, 0, 0], [1] * 5], np.float32)))
    fd = convert(A.indptr, A.indices, A.shape, "csr_part", {"nnz_per_part": 3})
    # works 5 | 1+1+2 | 5
    assert fd.arrays["part_ptr"].tolist() == [0, 1, 4, 5]
    assert fd.scalars["n_parts"] == 3


def test_perm_orders_and_sell_windows():
    lens = [1, 3, 0, 3, 2, 5]
    A = sp.csr_matrix(np.array([[1] * L + [0] * (6 - L) for L in lens], np.float32))
    fd = convert(A.indptr, A.indices, A.shape, "csr_perm")
    assert fd.arrays["perm"].tolist() == [5, 1, 3, 4, 0, 2]
    fs = convert(A.indptr, A.indices, A.shape, "sell", {"C": 4, "sigma": 3})
    assert fs.arrays["perm"].tolist() == [1, 0, 2, 5, 3, 4, -1, -1]
    assert fs.arrays["slice_ptr"].tolist() == [0, 20, 32]  # widths 5 and 3, C=4


@pytest.mark.parametrize("fmt", ["ell", "dia", "bsr", "sell"])
def test_padded_formats_refused_over_budget(fmt):
    # 6000 rows: one long row + a random scatter: ELL width, DIA diagonals and BSR fill blow up
    A = matrices.uniform_random(6000, 6000, 1.0, seed=2).tolil()
    A[0, :] = 1.0
    A = matrices.canonical(A)
    params = {"sell": {"C": 32, "sigma": 1}}.get(fmt)
    if fmt == "sell":
        with pytest.raises(FormatNotSuitable, match=r"fill"):
            convert(A.indptr, A.indices, A.shape, fmt, params, max_fill=1.0)
        return
    with pytest.raises(FormatNotSuitable, match=r"fill 0\.\d+"):
        convert(A.indptr, A.indices, A.shape, fmt, params)
    fd = convert(A.indptr, A.indices, A.shape, fmt, params, max_fill=1e6)
    assert fd.fill < 1 / 3


def test_bad_inputs_say_what_is_wrong():
    A = matrices.stencil2d(3)
    with pytest.raises(ValueError, match="unknown format"):
        convert(A.indptr, A.indices, A.shape, "coo")
    with pytest.raises(ValueError, match="unknown"):
        convert(A.indptr, A.indices, A.shape, "bsr", {"B": 2})
    with pytest.raises(ValueError, match=">= 1"):
        convert(A.indptr, A.indices, A.shape, "sell", {"C": 0})
    with pytest.raises(ValueError, match=r"needs n_rows \+ 1"):
        convert(A.indptr[:-1], A.indices, A.shape, "csr")
    with pytest.raises(ValueError, match="n_cols"):
        convert(A.indptr, A.indices, (9, 2), "csr")


def test_gather_values_torch_matches_numpy_and_keeps_grad():
    A = matrices.block_random(4, 4, 2, 3, 2, seed=0)
    fd = convert(A.indptr, A.indices, A.shape, "bsr", {"R": 3, "C": 3}, max_fill=10)
    want = fd.gather_values(A.data)
    t = torch.tensor(A.data, requires_grad=True)
    got = fd.gather_values(t)
    assert got.dtype == torch.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got.detach().numpy(), want)
    got.sum().backward()
    assert torch.equal(t.grad, torch.ones_like(t))  # every value used exactly once
    with pytest.raises(ValueError, match="nnz"):
        fd.gather_values(A.data[:-1])
    empty = convert(np.zeros(3, np.int32), np.zeros(0, np.int32), (2, 2), "ell")
    assert empty.gather_values(torch.zeros(0)).numel() == 0


def test_gather_values_holds_one_int32_index_and_pads_with_zero_whatever_the_values():
    """What a plan keeps beside its format for the gather is one int32 per slot (not an int64
    map and a mask), and padding reads 0 even where every stored value is NaN."""
    A = matrices.block_random(4, 4, 2, 3, 2, seed=0)
    fd = convert(A.indptr, A.indices, A.shape, "bsr", {"R": 3, "C": 3}, max_fill=10)
    got = fd.gather_values(torch.full((fd.nnz,), float("nan"), dtype=torch.bfloat16))
    assert got.dtype == torch.bfloat16 and got.shape == (fd.padded_size,)
    assert torch.isnan(got[torch.from_numpy(fd.value_map >= 0)]).all()
    assert (got[torch.from_numpy(fd.value_map < 0)] == 0).all() and (fd.value_map < 0).any()
    (held,) = fd._device_maps.values()
    assert held.dtype == torch.int32 and held.numel() == fd.padded_size


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("op", ["spmv", "spmm"])
def test_kernel_args_follow_the_contract_order(fmt, op):
    A = matrices.stencil2d(4)
    fd = convert(A.indptr, A.indices, A.shape, fmt)
    dev = to_device(fd, "cpu")
    assert all(t.dtype == torch.int32 for t in dev.values())
    vals = fd.gather_values(torch.from_numpy(A.data))
    x, y = object(), object()
    args = fd.kernel_args(op, 8, dev, vals, x, y)
    names = [n for _, n in signature(op, fmt, "f32")]
    assert len(args) == len(names)
    for name, arg in zip(names, args):
        if name in fd.scalars:
            assert isinstance(arg, np.int32) and arg == fd.scalars[name]
        elif name == "n":
            assert isinstance(arg, np.int32) and arg == 8
        elif name == fd.value_array:
            assert arg is vals
        elif name in ("x", "y"):
            assert arg is (x if name == "x" else y)
        else:
            assert arg is dev[name]
    with pytest.raises(KeyError, match="needs array"):
        fd.kernel_args(op, 8, {}, vals, x, y)


def test_floor_bytes_matches_anchor_formula():
    n_rows, n_cols, nnz = 1000, 800, 5000
    assert floor_bytes("spmv", n_rows, n_cols, nnz) == nnz * 8 + 4 * (n_rows + 1) + 4 * n_cols + 4 * n_rows
    assert floor_bytes("spmm", n_rows, n_cols, nnz, n=32) == nnz * 8 + 4 * (n_rows + 1) + 4 * 32 * (n_cols + n_rows)
    assert floor_bytes("spmv", n_rows, n_cols, nnz, value_bytes=2) == nnz * 6 + 4 * (n_rows + 1) + 2 * (n_cols + n_rows)
    with pytest.raises(ValueError):
        floor_bytes("sddmm", 1, 1, 1)
    # a bitmap kernel reads the values and one bit per position, not CSR's indices
    assert floor_bytes("spmm", 1024, 512, 100_000, n=4, value_bytes=2, fmt="bitmap") == \
        100_000 * 2 + 1024 * 512 // 8 + 2 * 4 * (512 + 1024)
    assert floor_bytes("spmv", n_rows, n_cols, nnz, fmt="ell") == floor_bytes("spmv", n_rows, n_cols, nnz)


@pytest.mark.parametrize("make", [lambda: matrices.banded(2000, 3), lambda: matrices.uniform_random(20000, 20000, 8),
                                  lambda: matrices.rmat(12, 8), lambda: matrices.stencil2d(60)])
def test_unfit_formats_says_what_convert_refuses(make):
    """ELL and DIA are left out of the policy's grammar for a matrix exactly when ``convert``
    refuses them, with convert's reason; CSR-based and parameterised formats are never named."""
    A = make()
    reasons = unfit_formats(A.indptr, A.indices, A.shape)
    assert set(reasons) <= {"ell", "dia"}
    for fmt in ("ell", "dia"):
        if fmt in reasons:
            with pytest.raises(FormatNotSuitable) as e:
                convert(A.indptr, A.indices, A.shape, fmt)
            assert str(e.value) == reasons[fmt]
        else:
            convert(A.indptr, A.indices, A.shape, fmt)


def test_unfit_formats_on_the_matrices_that_need_it():
    road_like = matrices.uniform_random(20000, 20000, 4)  # scattered columns: thousands of diagonals
    assert "dia" in unfit_formats(road_like.indptr, road_like.indices, road_like.shape)
    assert unfit_formats(*_banded_csr()) == {}
    n = 10000  # one row of 5000 and a diagonal: ELL pads every row to 5000 (50 M slots for 15 k nonzeros),
    # and the long row alone touches 5000 diagonals
    lengths = np.ones(n, np.int64)
    lengths[0] = 5000
    ip = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ix = np.concatenate([np.arange(5000), np.arange(1, n)]).astype(np.int32)
    reasons = unfit_formats(ip, ix, (n, n))
    assert set(reasons) == {"ell", "dia"} and "width 5000" in reasons["ell"] and "5000 diagonals" in reasons["dia"]
    with pytest.raises(ValueError):
        unfit_formats(np.array([0, 2], np.int32), np.array([0], np.int32), (1, 1))  # indptr ends past indices
    with pytest.raises(ValueError, match="unknown format"):
        unfit(ip, ix, (n, n), "coo")


@pytest.mark.parametrize("fmt,params", [("sell", {"C": 32, "sigma": 1}), ("sell", {"C": 4, "sigma": 256}),
                                        ("bsr", {"R": 4, "C": 4}), ("bsr", {"R": 2, "C": 8}),
                                        ("csr", None), ("merge", {"items_per_part": 16})])
@pytest.mark.parametrize("which", ["uniform", "block_diagonal", "skewed"])
def test_unfit_answers_what_convert_does(fmt, params, which):
    """unfit's verdict for a format with header parameters is convert's, without filling arrays."""
    A = {"uniform": lambda: matrices.uniform_random(3000, 3000, 8, seed=1),
         "block_diagonal": lambda: matrices.block_diagonal(16, 8, seed=1),
         "skewed": lambda: matrices.rmat(11, 8, seed=1)}[which]()
    why = unfit(A.indptr, A.indices, A.shape, fmt, params)
    try:
        convert(A.indptr, A.indices, A.shape, fmt, params)
    except FormatNotSuitable as e:
        assert why == str(e)
    else:
        assert why is None


def _banded_csr():
    A = matrices.banded(500, 2)
    return A.indptr, A.indices, A.shape


def _pruned(n_rows: int, n_cols: int, sparsity: float, seed: int = 0) -> sp.csr_matrix:
    """A magnitude-pruned random weight: the smallest ``sparsity`` of |w| set to zero."""
    w = np.random.default_rng(seed).standard_normal((n_rows, n_cols)).astype(np.float32)
    w[np.abs(w) < np.quantile(np.abs(w), sparsity)] = 0
    return sp.csr_matrix(w)


def test_bitmap_tiles_follow_the_lane_layout():
    """R=4: tiles of 4 rows x 256 columns; word l of a tile is row l % 4, columns (l // 4)*32 ..;
    each tile's values start at a multiple of 8, in word order."""
    A = sp.csr_matrix(([1.0, 2.0, 3.0], ([0, 3, 5], [0, 255, 300])), shape=(8, 600))
    fd = convert(A.indptr, A.indices, A.shape, "bitmap", {"R": 4})
    assert fd.scalars == {"n_rows": 8, "n_cols": 600, "n_bands": 2, "n_ctiles": 3}
    words = fd.arrays["bitmap"].view(np.uint32)
    assert words.size == 6 * 32 and np.count_nonzero(words) == 3
    assert words[0] == 1  # (0, 0): tile 0, lane 0, bit 0
    assert words[31] == 1 << 31  # (3, 255): tile 0, lane 7*4 + 3, bit 31 (a negative int32)
    assert words[(1 * 3 + 1) * 32 + 5] == 1 << 12  # (5, 300): band 1, column tile 1, lane 4 + 1, bit 12
    assert fd.arrays["tile_ptr"].tolist() == [0, 8, 8, 8, 8, 16, 16]
    assert fd.value_map.tolist() == [0, 1] + [-1] * 6 + [2] + [-1] * 7


def test_bitmap_bytes_of_pruned_weights():
    """At 70 % sparsity in 16-bit values the layout is well under half the dense weight."""
    from sparserl_compile.formats import stored_bytes

    A = _pruned(512, 1024, 0.7)
    dense = 512 * 1024 * 2
    for R in (8, 32):
        fd = convert(A.indptr, A.indices, A.shape, "bitmap", {"R": R})
        assert stored_bytes(fd, 2) <= 0.40 * dense, (R, stored_bytes(fd, 2) / dense)
        # values (plus tile padding), one bit per position and a tile pointer per 1024 positions
        want = fd.padded_size * 2 + 512 * 1024 // 8 + 4 * (fd.arrays["tile_ptr"].size)
        assert stored_bytes(fd, 2) == want
    csr = convert(A.indptr, A.indices, A.shape, "csr")
    assert stored_bytes(csr, 2) == A.nnz * 6 + 4 * 513


def test_bitmap_refuses_what_it_cannot_hold():
    sparse = matrices.uniform_random(6000, 6000, 1.0, seed=2)
    with pytest.raises(FormatNotSuitable, match="bitmap words"):
        convert(sparse.indptr, sparse.indices, sparse.shape, "bitmap")
    assert unfit(sparse.indptr, sparse.indices, sparse.shape, "bitmap") is not None
    dense_enough = _pruned(64, 256, 0.9)
    assert unfit(dense_enough.indptr, dense_enough.indices, dense_enough.shape, "bitmap") is None
    dup = (np.array([0, 2], np.int32), np.array([5, 5], np.int32))
    with pytest.raises(FormatNotSuitable, match="row 0 lists column 5 twice"):
        convert(*dup, (1, 8), "bitmap")
    with pytest.raises(ValueError, match="R=3"):
        convert(dense_enough.indptr, dense_enough.indices, dense_enough.shape, "bitmap", {"R": 3})


def test_bitmap_of_unsorted_rows_matches_the_sorted_layout():
    A = matrices.canonical(_pruned(20, 300, 0.6))
    rng = np.random.default_rng(4)
    ix, order = A.indices.copy(), np.arange(A.nnz)
    for i in range(A.shape[0]):  # shuffle each row's entries
        a, b = A.indptr[i], A.indptr[i + 1]
        order[a:b] = a + rng.permutation(b - a)
    ix = A.indices[order]
    want = convert(A.indptr, A.indices, A.shape, "bitmap", {"R": 4})
    got = convert(A.indptr, ix, A.shape, "bitmap", {"R": 4})
    assert np.array_equal(got.arrays["bitmap"], want.arrays["bitmap"])
    assert np.array_equal(got.arrays["tile_ptr"], want.arrays["tile_ptr"])
    vals = rng.standard_normal(A.nnz)
    assert np.array_equal(got.gather_values(vals[order]), want.gather_values(vals))
