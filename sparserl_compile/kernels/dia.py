"""DIA: diagonal storage for banded and stencil matrices (no column indices to read).

``dia_val[d*n_rows + i]`` holds ``A[i, i + offsets[d]]``. SpMV: one thread per row, walking
the ``n_diags`` diagonals; consecutive threads read consecutive values and consecutive ``x``
entries, and the only index traffic is the (broadcast, cached) ``offsets`` array. SpMM: ``g``
lanes per row across ``v``-wide dense columns.

Padding choice: a diagonal slot where the pattern has no entry holds 0 and the kernel still
multiplies it; only slots whose column falls outside ``[0, n_cols)`` are skipped (by the
column-range test, not by testing the value). So ``y`` differs from CSR semantics only when
``x[j]`` is inf or NaN at such a padded slot (0 * inf = NaN): a deliberate trade, since a value
test would cost a compare per slot on the matrices DIA exists for. Verification with finite
``x`` is unaffected; the runtime should not choose DIA when ``x`` may hold non-finite values.
"""

from __future__ import annotations

from sparserl_compile.contract import LaunchSpec
from sparserl_compile.kernels import template as t


def dia_space(op: str, dtype: str) -> list[dict]:
    if op == "spmv":
        return [{"block": b} for b in (128, 256)]
    return [{"g": g, "v": v} for g in (8, 32) for v in (1, t.max_vec(dtype))]


def dia_render(op: str, dtype: str, params: dict, structure=None):
    loop = [
        "for (int d = 0; d < n_diags; ++d) {",
        "    int col = row + __ldg(&offsets[d]);",
        "    if (col >= 0 && col < n_cols) {",
    ]
    if op == "spmv":
        t.check_params("dia", params, {"block": (64, 128, 256)})
        b = params["block"]
        body = [f"int row = blockIdx.x * {b} + threadIdx.x;", "if (row >= n_rows) return;", "float acc = 0.0f;"]
        body += loop + [
            f"        acc = fmaf({t.ldg(dtype, 'dia_val', '(long long)d * n_rows + row')}, {t.ldg(dtype, 'x', 'col')}, acc);",
            "    }",
            "}",
            f"y[row] = {t.from_float(dtype, 'acc')};",
        ]
        launch = LaunchSpec(block=b, work="rows", per_block=b)
    else:
        t.check_params("dia", params, {"g": (4, 8, 16, 32), "v": (1, t.max_vec(dtype))})
        g, v = params["g"], params["v"]
        b = 256
        body = [f"int row = blockIdx.x * {b // g} + threadIdx.x / {g};", "if (row >= n_rows) return;"]
        body += t.spmm_columns(dtype, g, v) + ["if (!col_ok) return;", t.zero_acc(v)]
        body += loop + [f"        float v = {t.ldg(dtype, 'dia_val', '(long long)d * n_rows + row')};"]
        body += t.indent(t.accumulate_x(dtype, v, "col", "v"), 2) + ["    }", "}"]
        body += t.store_y(dtype, v, "row")
        launch = LaunchSpec(block=b, work="rows", per_block=b // g, tile_n=g * v, n_align=v)
    return t.assemble(op, "dia", dtype, launch, body, family="dia", params=params)


def _always(op, dtype, n=None, nnz=None) -> bool:
    return True


FAMILIES = (
    t.Family("dia", ("spmv", "spmm"), dia_space, dia_render, _always,
             doc="diagonal storage; out-of-range columns skipped, in-range padding multiplies 0"),
)
