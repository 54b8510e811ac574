"""Load-balanced families: nnz-balanced static row partitions and merge-path.

The structure is known before the first call, so balancing work costs nothing at run time:
``formats.py`` cuts the rows ahead of time.

* ``csr_part`` (format ``csr_part``): one warp per part; a part is a run of rows holding about
  ``nnz_per_part`` nonzeros. SpMV: the warp walks its rows ``32/tpr`` at a time, ``tpr``
  lanes per row with a shuffle reduction (every lane runs the same number of outer
  iterations, so full-mask shuffles are legal). SpMM: the warp walks its rows one by one, the
  lanes spread across ``v``-wide dense columns. A single row longer than a part still lands in
  one part (see ``formats.py``), so ``merge`` remains the answer to one giant row.
* ``merge`` (format ``merge``): merge-path. The merge of row ends and nonzeros is cut into
  pieces of ``items_per_part`` items; SpMV gives one thread a piece, SpMM one warp (lanes
  across dense columns). A row whose nonzeros all fall in the piece that also consumes its row
  end is stored directly; rows cut by a piece boundary are summed with ``atomicAdd`` into an
  output the runtime zeroes first (``zero_output=1``). f32 only: the kernel language allows
  ``atomicAdd(float*, float)`` and nothing narrower, and half-precision atomics would also sum
  partial rows in 16-bit precision.
"""

from __future__ import annotations

from sparserl_compile.contract import LaunchSpec
from sparserl_compile.kernels import template as t
from sparserl_compile.kernels.csr import _shfl_reduce

# ----------------------------------------------------------------------------- csr_part

_PART_SIZES = (512, 4096)


def part_space(op: str, dtype: str) -> list[dict]:
    if op == "spmv":
        return [{"block": 128, "tpr": g, "nnz_per_part": s} for g in (1, 4, 8, 32) for s in _PART_SIZES]
    return [{"block": 128, "v": v, "nnz_per_part": s} for v in (1, t.max_vec(dtype)) for s in _PART_SIZES]


def part_render(op: str, dtype: str, params: dict, structure=None):
    b = params["block"]
    per = b // 32
    head = [
        f"int part = blockIdx.x * {per} + threadIdx.x / 32;",
        "if (part >= n_parts) return;",
        "int r0 = __ldg(&part_ptr[part]);",
        "int r1 = __ldg(&part_ptr[part + 1]);",
    ]
    if op == "spmv":
        t.check_params("csr_part", params, {"block": (128, 256), "tpr": (1, 2, 4, 8, 16, 32), "nnz_per_part": _PART_SIZES})
        g = params["tpr"]
        body = head + [
            "int lane = threadIdx.x % 32;",
            f"for (int rb = r0; rb < r1; rb += {32 // g}) {{",
            f"    int row = rb + lane / {g};",
            "    float acc = 0.0f;",
            "    if (row < r1) {",
            "        int end = __ldg(&row_ptr[row + 1]);",
            f"        for (int k = __ldg(&row_ptr[row]) + lane % {g}; k < end; k += {g}) {{",
            f"            acc = fmaf({t.ldg(dtype, 'vals', 'k')}, {t.ldg(dtype, 'x', '__ldg(&col_idx[k])')}, acc);",
            "        }",
            "    }",
        ]
        body += t.indent(_shfl_reduce("acc", g), 1)
        body += [f"    if (row < r1 && lane % {g} == 0) {{", f"        y[row] = {t.from_float(dtype, 'acc')};", "    }", "}"]
        launch = LaunchSpec(block=b, work="parts", per_block=per)
    else:
        vs = (1, 2, 4) if dtype == "f32" else (1, 2)
        t.check_params("csr_part", params, {"block": (128, 256), "v": vs, "nnz_per_part": _PART_SIZES})
        v = params["v"]
        body = head + t.spmm_columns(dtype, 32, v) + ["if (!col_ok) return;"]
        body += [
            "for (int row = r0; row < r1; ++row) {",
            "    " + t.zero_acc(v),
            "    int end = __ldg(&row_ptr[row + 1]);",
            "    for (int k = __ldg(&row_ptr[row]); k < end; ++k) {",
            "        int col = __ldg(&col_idx[k]);",
            f"        float v = {t.ldg(dtype, 'vals', 'k')};",
        ]
        body += t.indent(t.accumulate_x(dtype, v, "col", "v"), 2) + ["    }"]
        body += t.indent(t.store_y(dtype, v, "row"), 1) + ["}"]
        launch = LaunchSpec(block=b, work="parts", per_block=per, tile_n=32 * v, n_align=v)
    return t.assemble(op, "csr_part", dtype, launch, body, family="csr_part", params=params,
                      format_params={"nnz_per_part": params["nnz_per_part"]})


def _always(op, dtype, n=None, nnz=None) -> bool:
    return True


# ----------------------------------------------------------------------------- merge

_ITEMS = {"spmv": (16, 32, 64), "spmm": (64, 256)}


def merge_space(op: str, dtype: str) -> list[dict]:
    if dtype != "f32":
        return []
    return [{"block": 128, "items_per_part": it} for it in _ITEMS[op]]


def merge_render(op: str, dtype: str, params: dict, structure=None):
    if dtype != "f32":
        raise ValueError("merge renders f32 only (atomicAdd(float*, float) fix-up); use csr_part for f16/bf16")
    t.check_params("merge", params, {"block": (128, 256), "items_per_part": _ITEMS[op]})
    b, items = params["block"], params["items_per_part"]
    if op == "spmv":
        per = b
        head = [f"int p = blockIdx.x * {b} + threadIdx.x;", "if (p >= n_parts) return;"]
        target, acc0 = "y[{row}]", "float acc = 0.0f;"
        term = "fmaf(__ldg(&vals[j]), __ldg(&x[__ldg(&col_idx[j])]), acc)"
        launch = LaunchSpec(block=b, work="parts", per_block=per, zero_output=True)
    else:
        per = b // 32
        head = [
            f"int p = blockIdx.x * {per} + threadIdx.x / 32;",
            "if (p >= n_parts) return;",
            "int c = blockIdx.y * 32 + threadIdx.x % 32;",
            "if (c >= n) return;",
        ]
        target, acc0 = "y[(long long){row} * n + c]", "float acc = 0.0f;"
        term = "fmaf(__ldg(&vals[j]), __ldg(&x[(long long)__ldg(&col_idx[j]) * n + c]), acc)"
        launch = LaunchSpec(block=b, work="parts", per_block=per, tile_n=32, zero_output=True)
    body = head + [
        "int total = n_rows + __ldg(&row_ptr[n_rows]);",
        "int i = __ldg(&part_row[p]);",
        "int i_end = __ldg(&part_row[p + 1]);",
        f"int d0 = min(p * {items}, total);",
        f"int d1 = min(d0 + {items}, total);",
        "int j = d0 - i;",
        "int j_end = d1 - i_end;",
        "for (; i < i_end; ++i) {",
        "    int first = j;",
        "    int re = __ldg(&row_ptr[i + 1]);",
        "    " + acc0,
        "    for (; j < re; ++j) {",
        f"        acc = {term};",
        "    }",
        "    if (first == __ldg(&row_ptr[i])) {",
        f"        {target.format(row='i')} = acc;",
        "    } else {",
        f"        atomicAdd(&{target.format(row='i')}, acc);",
        "    }",
        "}",
        "if (j < j_end) {",
        "    " + acc0,
        "    for (; j < j_end; ++j) {",
        f"        acc = {term};",
        "    }",
        f"    atomicAdd(&{target.format(row='i_end')}, acc);",
        "}",
    ]
    return t.assemble(op, "merge", dtype, launch, body, family="merge", params=params,
                      format_params={"items_per_part": items})


def _merge_applies(op, dtype, n=None, nnz=None) -> bool:
    return dtype == "f32"


FAMILIES = (
    t.Family("csr_part", ("spmv", "spmm"), part_space, part_render, _always,
             doc="warp per nnz-balanced row partition"),
    t.Family("merge", ("spmv", "spmm"), merge_space, merge_render, _merge_applies,
             doc="merge-path pieces (thread per piece for SpMV, warp for SpMM), atomicAdd fix-up, f32"),
)
