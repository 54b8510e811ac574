"""Padded row formats: ELLPACK and SELL-C-sigma.

* ``ell``: every row padded to ``width`` entries, stored column-major (entry ``k`` of row ``i``
  at ``k*n_rows + i``), so consecutive threads read consecutive addresses. One thread per row
  for SpMV; ``g`` lanes per row across ``v``-wide dense columns for SpMM.
* ``sell`` (SELL-C-sigma): rows sorted by length inside windows of ``sigma`` rows and cut into
  slices of ``C`` rows, each slice padded only to its own longest row. SpMV: one thread per
  slice row (``C`` threads per slice). SpMM: ``g`` lanes per slice row across dense columns.

Padding entries have column -1: the kernels skip them (``if (col >= 0)``), never multiply them,
so padding cannot turn an inf/NaN in ``x`` into a NaN in ``y``. Rows are guarded against
``n_rows`` (ELL) or a ``perm`` entry of -1 (SELL's last slice).
"""

from __future__ import annotations

from sparserl_compile.contract import LaunchSpec
from sparserl_compile.kernels import template as t


def _vecs(dtype: str) -> tuple[int, ...]:
    return (1, t.max_vec(dtype))


# ----------------------------------------------------------------------------- ell


def ell_space(op: str, dtype: str) -> list[dict]:
    if op == "spmv":
        return [{"block": b} for b in (128, 256)]
    return [{"g": g, "v": v} for g in (8, 32) for v in _vecs(dtype)]


def ell_render(op: str, dtype: str, params: dict, structure=None):
    if op == "spmv":
        t.check_params("ell", params, {"block": (64, 128, 256)})
        b = params["block"]
        body = [
            f"int row = blockIdx.x * {b} + threadIdx.x;",
            "if (row >= n_rows) return;",
            "float acc = 0.0f;",
            "for (int k = 0; k < width; ++k) {",
            "    long long e = (long long)k * n_rows + row;",
            "    int col = __ldg(&ell_col[e]);",
            "    if (col >= 0) {",
            f"        acc = fmaf({t.ldg(dtype, 'ell_val', 'e')}, {t.ldg(dtype, 'x', 'col')}, acc);",
            "    }",
            "}",
            f"y[row] = {t.from_float(dtype, 'acc')};",
        ]
        launch = LaunchSpec(block=b, work="rows", per_block=b)
    else:
        t.check_params("ell", params, {"g": (4, 8, 16, 32), "v": _vecs(dtype)})
        g, v = params["g"], params["v"]
        b = 256
        body = [f"int row = blockIdx.x * {b // g} + threadIdx.x / {g};", "if (row >= n_rows) return;"]
        body += t.spmm_columns(dtype, g, v) + ["if (!col_ok) return;", t.zero_acc(v)]
        body += [
            "for (int k = 0; k < width; ++k) {",
            "    long long e = (long long)k * n_rows + row;",
            "    int col = __ldg(&ell_col[e]);",
            "    if (col >= 0) {",
            f"        float v = {t.ldg(dtype, 'ell_val', 'e')};",
        ]
        body += t.indent(t.accumulate_x(dtype, v, "col", "v"), 2) + ["    }", "}"]
        body += t.store_y(dtype, v, "row")
        launch = LaunchSpec(block=b, work="rows", per_block=b // g, tile_n=g * v, n_align=v)
    return t.assemble(op, "ell", dtype, launch, body, family="ell", params=params)


# ----------------------------------------------------------------------------- sell

_SIGMAS = (1, 256, 4096)


def sell_space(op: str, dtype: str) -> list[dict]:
    if op == "spmv":
        return [{"C": c, "sigma": s} for c in (8, 32) for s in _SIGMAS]
    return [{"C": c, "sigma": 256, "g": 32, "v": v} for c in (4, 8) for v in _vecs(dtype)]


def sell_render(op: str, dtype: str, params: dict, structure=None):
    b = 256
    if op == "spmv":
        t.check_params("sell", params, {"C": (4, 8, 16, 32), "sigma": _SIGMAS})
        c = params["C"]
        per = b // c
        body = [
            f"int s = blockIdx.x * {per} + threadIdx.x / {c};",
            f"int lane = threadIdx.x % {c};",
            "if (s >= n_slices) return;",
            f"int row = __ldg(&perm[s * {c} + lane]);",
            "if (row < 0) return;",
            "int base = __ldg(&slice_ptr[s]);",
            f"int width = (__ldg(&slice_ptr[s + 1]) - base) / {c};",
            "float acc = 0.0f;",
            "for (int k = 0; k < width; ++k) {",
            f"    int e = base + k * {c} + lane;",
            "    int col = __ldg(&sell_col[e]);",
            "    if (col >= 0) {",
            f"        acc = fmaf({t.ldg(dtype, 'sell_val', 'e')}, {t.ldg(dtype, 'x', 'col')}, acc);",
            "    }",
            "}",
            f"y[row] = {t.from_float(dtype, 'acc')};",
        ]
        launch = LaunchSpec(block=b, work="slices", per_block=per)
    else:
        t.check_params("sell", params, {"C": (4, 8), "sigma": _SIGMAS, "g": (32,), "v": _vecs(dtype)})
        c, g, v = params["C"], params["g"], params["v"]
        per = b // (c * g)
        body = [
            f"int s = blockIdx.x * {per} + threadIdx.x / {c * g};",
            f"int lane = (threadIdx.x / {g}) % {c};",
            "if (s >= n_slices) return;",
            f"int row = __ldg(&perm[s * {c} + lane]);",
            "if (row < 0) return;",
        ]
        body += t.spmm_columns(dtype, g, v) + ["if (!col_ok) return;", t.zero_acc(v)]
        body += [
            "int base = __ldg(&slice_ptr[s]);",
            f"int width = (__ldg(&slice_ptr[s + 1]) - base) / {c};",
            "for (int k = 0; k < width; ++k) {",
            f"    int e = base + k * {c} + lane;",
            "    int col = __ldg(&sell_col[e]);",
            "    if (col >= 0) {",
            f"        float v = {t.ldg(dtype, 'sell_val', 'e')};",
        ]
        body += t.indent(t.accumulate_x(dtype, v, "col", "v"), 2) + ["    }", "}"]
        body += t.store_y(dtype, v, "row")
        launch = LaunchSpec(block=b, work="slices", per_block=per, tile_n=g * v, n_align=v)
    return t.assemble(op, "sell", dtype, launch, body, family="sell", params=params,
                      format_params={"C": params["C"], "sigma": params["sigma"]})


def _always(op, dtype, n=None, nnz=None) -> bool:
    return True


FAMILIES = (
    t.Family("ell", ("spmv", "spmm"), ell_space, ell_render, _always,
             doc="ELLPACK column-major; padding (col -1) skipped"),
    t.Family("sell", ("spmv", "spmm"), sell_space, sell_render, _always,
             doc="SELL-C-sigma; thread (SpMV) or g lanes (SpMM) per slice row; padding skipped"),
)
