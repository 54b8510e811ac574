"""Shared pieces of the kernel templates: dtype snippets, dense-operand loads, assembly.

Every family renders CUDA C text in Python, per value dtype (no macros): this module holds
the few snippets they share -- loading a value as ``float``, converting an accumulator back
to the storage type, loading and storing ``V`` consecutive dense columns (``float2/float4``
for f32, ``__half2``/``__nv_bfloat162`` for f16/bf16) -- and ``assemble`` that puts the
contract header, optional ``__device__ __forceinline__`` helpers and the body behind
``contract.signature_c`` into a ``contract.Candidate``.

It does not choose launch geometry; each family states its own ``LaunchSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

from sparserl_compile import contract


class CSRLike(Protocol):
    """What structure-aware renderers read: a scipy CSR matrix satisfies it."""

    indptr: np.ndarray
    indices: np.ndarray
    shape: tuple[int, int]


@dataclass(frozen=True)
class Family:
    """One kernel family: a template, its declared parameter space and where it applies.

    ``space`` lists every parameter point per op (dicts of small ints/bools);
    ``render(op, dtype, params, structure=None)`` returns a ``contract.Candidate``;
    ``applies(op, dtype, n=None, nnz=None)`` says whether the family can serve that call at
    all (e.g. the tensor-core family only for f16/bf16 SpMM, baked kernels only for small
    matrices). ``needs_structure`` marks families whose render reads the CSR pattern.
    """

    name: str
    ops: tuple[str, ...]
    space: Callable[[str, str], list[dict]]
    render: Callable[..., contract.Candidate]
    applies: Callable[..., bool]
    needs_structure: bool = False
    doc: str = ""


def to_float(dtype: str, expr: str) -> str:
    """``expr`` (of the storage type) as a float expression."""
    if dtype == "f32":
        return expr
    if dtype == "f16":
        return f"__half2float({expr})"
    return f"__bfloat162float({expr})"


def from_float(dtype: str, expr: str) -> str:
    """A float expression converted (round to nearest) to the storage type."""
    if dtype == "f32":
        return expr
    if dtype == "f16":
        return f"__float2half_rn({expr})"
    return f"__float2bfloat16_rn({expr})"


def ldg(dtype: str, array: str, index: str) -> str:
    """``__ldg(&array[index])`` as float."""
    return to_float(dtype, f"__ldg(&{array}[{index}])")


def max_vec(dtype: str) -> int:
    """Widest vector load along the dense width: float4 for f32, half2/bfloat162 for 16-bit."""
    return 4 if dtype == "f32" else 2


def _vec_type(dtype: str, v: int) -> str:
    if dtype == "f32":
        return {2: "float2", 4: "float4"}[v]
    return {"f16": "__half2", "bf16": "__nv_bfloat162"}[dtype]


_COMP = "xyzw"


def load_vec(dtype: str, v: int, array: str, offset: str, names: Sequence[str]) -> list[str]:
    """Lines declaring ``float names[i] = array[offset + i]`` for ``i < v`` (one vector load).

    ``offset`` must be a multiple of ``v`` (the header's n_align guarantees it).
    """
    if v == 1:
        return [f"float {names[0]} = {ldg(dtype, array, offset)};"]
    vt = _vec_type(dtype, v)
    load = f"reinterpret_cast<const {vt}*>({array} + {offset})[0]"
    if dtype == "f32":
        tmp = f"{names[0]}_v"
        return [f"{vt} {tmp} = {load};"] + [f"float {n} = {tmp}.{_COMP[i]};" for i, n in enumerate(names)]
    conv = "__half22float2" if dtype == "f16" else "__bfloat1622float2"
    tmp = f"{names[0]}_v"
    return [f"float2 {tmp} = {conv}({load});", f"float {names[0]} = {tmp}.x;", f"float {names[1]} = {tmp}.y;"]


def store_vec(dtype: str, v: int, array: str, offset: str, values: Sequence[str]) -> str:
    """One statement storing the float expressions ``values`` at ``array[offset ...]``."""
    if v == 1:
        return f"{array}[{offset}] = {from_float(dtype, values[0])};"
    vt = _vec_type(dtype, v)
    if dtype == "f32":
        make = f"make_float{v}({', '.join(values)})"
    elif dtype == "f16":
        make = f"__floats2half2_rn({values[0]}, {values[1]})"
    else:
        make = f"__floats2bfloat162_rn({values[0]}, {values[1]})"
    return f"reinterpret_cast<{vt}*>({array} + {offset})[0] = {make};"


def fma_lines(v: int, acc: str, val: str, xs: str) -> list[str]:
    """``acc_i = fmaf(val, xs_i, acc_i)`` for ``i < v``."""
    return [f"{acc}{i} = fmaf({val}, {xs}{i}, {acc}{i});" for i in range(v)]


def indent(lines: Sequence[str], level: int) -> list[str]:
    pad = "    " * level
    return [pad + ln if ln else ln for ln in lines]


def assemble(
    op: str,
    fmt: str,
    dtype: str,
    launch: contract.LaunchSpec,
    body: Sequence[str],
    *,
    family: str,
    params: dict,
    format_params: dict[str, int] | None = None,
    helpers: Sequence[str] = (),
) -> contract.Candidate:
    """Header + helpers + the contract signature + ``body`` (lines, indented one level).

    The header is parsed back through ``contract.parse_header`` so a template can never emit
    a header the runtime would refuse.
    """
    if op not in contract.OPS:
        raise ValueError(f"op={op!r}: expected one of {contract.OPS}")
    if dtype not in contract.DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {tuple(contract.DTYPES)}")
    f = contract.FORMATS[fmt]
    fp = dict(format_params or {})
    if set(fp) != set(f.params):
        raise ValueError(f"format {fmt} needs header parameters {f.params}, got {sorted(fp)}")
    header = contract.KernelHeader(op, fmt, dtype, "i32", tuple((k, int(fp[k])) for k in f.params), launch)
    text = header.render()
    if helpers:
        text += "\n".join(helpers) + "\n"
    text += contract.signature_c(op, fmt, dtype) + " {\n"
    text += "\n".join(indent(body, 1)) + "\n}\n"
    parsed = contract.parse_header(text)
    if parsed != header:  # pragma: no cover - guards template bugs
        raise AssertionError(f"{family}: rendered header does not parse back: {parsed} != {header}")
    return contract.Candidate(text, header, family, tuple(sorted(params.items())))


def check_params(family: str, params: dict, allowed: dict[str, Sequence]) -> None:
    """Raise a ValueError naming any parameter outside the family's declared values."""
    unknown = set(params) - set(allowed)
    missing = set(allowed) - set(params)
    if unknown or missing:
        raise ValueError(
            f"{family}: parameters {sorted(params)} do not match the family's {sorted(allowed)} "
            f"(unknown {sorted(unknown)}, missing {sorted(missing)})"
        )
    for k, vals in allowed.items():
        if params[k] not in vals:
            raise ValueError(f"{family}: {k}={params[k]!r} is not one of {list(vals)}")


def spmm_columns(dtype: str, g: int, v: int) -> list[str]:
    """Prologue of the lanes-across-columns SpMM scheme.

    A group of ``g`` lanes shares one unit of work (a row); lane ``l`` of the group owns the
    ``v`` consecutive dense columns starting at ``c = blockIdx.y * (g*v) + l*v`` (the header
    sets ``tile_n = g*v``). ``n % v == 0`` (n_align) makes every chunk either whole or absent.
    Declares ``lane_g`` and ``c`` and ``col_ok``.
    """
    return [
        f"int lane_g = threadIdx.x % {g};",
        f"int c = blockIdx.y * {g * v} + lane_g * {v};",
        "bool col_ok = c < n;",
    ]


def accumulate_x(dtype: str, v: int, col: str, val: str) -> list[str]:
    """Lines adding ``val * x[col][c .. c+v)`` into accumulators ``a0..a{v-1}``."""
    xs = [f"xv{i}" for i in range(v)]
    lines = [f"long long xo = (long long){col} * n + c;"]
    lines += load_vec(dtype, v, "x", "xo", xs)
    lines += fma_lines(v, "a", val, "xv")
    return lines


def store_y(dtype: str, v: int, row: str) -> list[str]:
    """Lines storing accumulators ``a0..a{v-1}`` to ``y[row][c ..]``."""
    return [
        f"long long yo = (long long){row} * n + c;",
        store_vec(dtype, v, "y", "yo", [f"a{i}" for i in range(v)]),
    ]


def zero_acc(v: int, prefix: str = "a") -> str:
    return " ".join(f"float {prefix}{i} = 0.0f;" for i in range(v))
