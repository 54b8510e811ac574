"""The generated-code contract: what a kernel source must say about itself.

Every kernel sparserl launches -- a hand-written family point, a policy sample, a
fault-injection test kernel -- is one ``extern "C" __global__ void sparserl_kernel(...)``
behind two header lines that this module parses::

    // sparserl op=spmv format=sell dtype=f32 index=i32 C=32 sigma=256
    // launch block=256 work=slices per_block=8 tile_n=0 smem=0 zero_output=0 n_align=1

Line 1 names the operation, the storage format the host converts the CSR matrix into (with
the format's own parameters, here the slice height ``C`` and sort window ``sigma``), the value
dtype and the index type (always ``i32``). Line 2 says how to launch: threads per block,
the unit of work (``rows``, ``parts``, ``slices``, ``brows``, ``bands``) and how many units one block
covers, for SpMM the dense columns one block covers along ``grid.y`` (``tile_n``, 0 = all),
bytes of dynamic shared memory, whether the runtime must zero the output first (kernels that
accumulate with ``atomicAdd``), and the alignment the dense width ``n`` must have (float4
loads need ``n % 4 == 0``).

The kernel's parameter list is fixed by (op, format): the format's scalars (``int``), then
``int n`` for SpMM (the dense width), then the format's arrays, then ``const T* x`` and
``T* y``. ``FORMATS`` below is the single table of those signatures; ``formats.py`` produces
the arrays, ``launcher.py`` and ``simt`` pass them in this order, and the policy's grammar
fixes the same signature. Dense operands are row-major and contiguous: SpMV ``x[n_cols]``,
``y[n_rows]``; SpMM ``x[n_cols][n]``, ``y[n_rows][n]``.

This module only parses and checks; it does not render, compile or launch.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field

KERNEL_NAME = "sparserl_kernel"

OPS = ("spmv", "spmm")

#: value dtype name -> C type of values, x and y (accumulation is always float)
DTYPES = {"f32": "float", "f16": "__half", "bf16": "__nv_bfloat16"}

#: torch dtype name -> contract dtype name
TORCH_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
#: contract dtype -> the torch dtype's name (``getattr(torch, ...)``): the inverse of TORCH_DTYPES
TORCH_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


@dataclass(frozen=True)
class Format:
    """One storage format: the kernel's scalar and array parameters, in order.

    ``value_array`` is the one array holding matrix values (converted from CSR values by a
    gather, see ``formats.py``); every other array holds int32 structure.
    """

    name: str
    scalars: tuple[str, ...]
    arrays: tuple[str, ...]
    value_array: str
    work: tuple[str, ...]  # the work units a kernel of this format may launch over
    params: tuple[str, ...] = ()  # header parameters of the format conversion
    doc: str = ""


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format(
            "csr", ("n_rows", "n_cols"), ("row_ptr", "col_idx", "vals"), "vals", ("rows",),
            doc="plain CSR, sorted column indices",
        ),
        Format(
            "csr_perm", ("n_rows", "n_cols"), ("perm", "row_ptr", "col_idx", "vals"), "vals",
            ("rows",), doc="CSR plus a row order (perm[k] = k-th row to process, longest first)",
        ),
        Format(
            "csr_part", ("n_rows", "n_cols", "n_parts"),
            ("part_ptr", "row_ptr", "col_idx", "vals"), "vals", ("parts",), ("nnz_per_part",),
            doc="CSR plus nnz-balanced row partitions: part p covers rows "
            "[part_ptr[p], part_ptr[p+1]); a part has about nnz_per_part nonzeros "
            "(one long row may exceed it)",
        ),
        Format(
            "merge", ("n_rows", "n_cols", "n_parts", "items_per_part"),
            ("part_row", "row_ptr", "col_idx", "vals"), "vals", ("parts",),
            ("items_per_part",),
            doc="merge-path: the merge of row ends and nonzeros is cut into n_parts pieces of "
            "items_per_part items; part_row[p] (n_parts+1 entries) is the row at which piece p "
            "starts (nonzero start = p*items_per_part - part_row[p]); rows that span pieces "
            "are finished with atomicAdd, so the header sets zero_output=1",
        ),
        Format(
            "ell", ("n_rows", "n_cols", "width"), ("ell_col", "ell_val"), "ell_val", ("rows",),
            doc="ELLPACK, column-major: entry k of row i at [k*n_rows + i]; padding has "
            "col -1 and value 0",
        ),
        Format(
            "sell", ("n_rows", "n_cols", "n_slices"),
            ("slice_ptr", "perm", "sell_col", "sell_val"), "sell_val", ("slices",),
            ("C", "sigma"),
            doc="SELL-C-sigma: rows sorted by length inside windows of sigma rows, cut into "
            "slices of C rows; slice s holds rows perm[s*C + lane] (perm entries past "
            "n_rows are -1), entry k of lane at slice_ptr[s] + k*C + lane; slice width = "
            "(slice_ptr[s+1]-slice_ptr[s])/C; padding has col -1 and value 0",
        ),
        Format(
            "dia", ("n_rows", "n_cols", "n_diags"), ("offsets", "dia_val"), "dia_val",
            ("rows",),
            doc="diagonal storage: dia_val[d*n_rows + i] = A[i, i+offsets[d]], 0 where the "
            "pattern has no entry (no column indices are read)",
        ),
        Format(
            "bsr", ("n_rows", "n_cols", "n_brows"), ("bsr_ptr", "bsr_col", "bsr_val"),
            "bsr_val", ("brows",), ("R", "C"),
            doc="block CSR with R x C blocks: block row b holds blocks bsr_ptr[b].."
            "bsr_ptr[b+1]-1 at block column bsr_col[k]; block k's values at "
            "bsr_val[(k*R + r)*C + c], zero-filled",
        ),
        Format(
            "csr_split", ("n_rows", "n_cols", "n_hubs", "n_parts"),
            ("row_id", "piece_ptr", "srow_ptr", "scol", "sval"), "sval", ("parts",),
            ("order", "piece", "hub", "warps", "split"),
            doc="CSR stored in processing order (graphformats.py): stored row k adds into the "
            "user's row row_id[k], its entries srow_ptr[k]..srow_ptr[k+1]-1 of scol/sval; "
            "stored rows 0..n_hubs-1 are chunks of the hub rows (length >= hub; a hub row is cut "
            "into min(split, ceil(length/hub)) chunks), one per block of `warps` warps; the "
            "other stored rows are cut into pieces of at most `piece` work, piece p covering "
            "stored rows piece_ptr[p]..piece_ptr[p+1]-1, one per warp after the hub blocks; "
            "n_parts = n_hubs*warps + pieces; order: 1 natural, 2 degree, 3 rcm, 4 bfs",
        ),
        Format(
            "tcw", ("n_rows", "n_cols", "n_parts"),
            ("row_id", "win_ptr", "tile_col", "tile_ptr", "tcw_pos", "tcw_val"), "tcw_val",
            ("parts",), ("order", "H"),
            doc="condensed row windows for tensor cores (graphformats.py): the rows in the "
            "order are cut into n_parts windows of H rows (row_id[w*H + r] = user's row, -1 "
            "past the end); window w owns tiles win_ptr[w]..win_ptr[w+1]-1, tile t condenses 16 "
            "of the window's distinct columns, tile_col[t*16 + j] (-1 = padding, X row reads as "
            "0); its nonzeros tile_ptr[t]..tile_ptr[t+1]-1 sit at tcw_pos[q] = r*16 + j of the "
            "dense H x 16 tile with value tcw_val[q]",
        ),
        Format(
            "bitmap", ("n_rows", "n_cols", "n_bands", "n_ctiles"), ("tile_ptr", "bitmap", "bm_val"),
            "bm_val", ("bands",), ("R",),
            doc="bitmap tiles: rows are cut into n_bands bands of R rows (R in 1, 2, 4, 8, 16, 32), "
            "a band's columns into n_ctiles tiles of 1024/R columns; tile t = band*n_ctiles + ctile "
            "is 32 int32 words bitmap[t*32 + l]: bit b of word l is set when row band*R + l%R "
            "stores an entry at column ctile*(1024/R) + (l/R)*32 + b (never past n_rows or "
            "n_cols); tile t's values are "
            "bm_val[tile_ptr[t] ..] in word order, each word's set bits ascending; tile_ptr "
            "(n_bands*n_ctiles + 1 entries) is a multiple of 8 and the slots between one tile's "
            "last value and the next tile's start are 0",
        ),
    )
}

_WORK_SCALAR = {"rows": "n_rows", "parts": "n_parts", "slices": "n_slices", "brows": "n_brows"}
_WORK_SCALAR["bands"] = "n_bands"  # bitmap: R-row bands


class ContractError(ValueError):
    """A kernel source does not follow the generated-code contract."""


@dataclass(frozen=True)
class LaunchSpec:
    """Line 2 of the header."""

    block: int
    work: str
    per_block: int = 1
    tile_n: int = 0
    smem: int = 0
    zero_output: bool = False
    n_align: int = 1

    def grid(self, scalars: dict[str, int], n: int = 1) -> tuple[int, int, int]:
        """Grid for a launch, from the format's scalars (and the dense width for SpMM)."""
        items = int(scalars[_WORK_SCALAR[self.work]])
        gx = max(1, math.ceil(items / self.per_block))
        gy = max(1, math.ceil(n / self.tile_n)) if self.tile_n else 1
        return (gx, gy, 1)


@dataclass(frozen=True)
class KernelHeader:
    """Both header lines, parsed and checked."""

    op: str
    format: str
    dtype: str
    index: str
    format_params: tuple[tuple[str, int], ...]
    launch: LaunchSpec

    @property
    def params(self) -> dict[str, int]:
        return dict(self.format_params)

    def render(self) -> str:
        fp = "".join(f" {k}={v}" for k, v in self.format_params)
        l = self.launch
        return (
            f"// sparserl op={self.op} format={self.format} dtype={self.dtype} "
            f"index={self.index}{fp}\n"
            f"// launch block={l.block} work={l.work} per_block={l.per_block} "
            f"tile_n={l.tile_n} smem={l.smem} zero_output={int(l.zero_output)} "
            f"n_align={l.n_align}\n"
        )


@dataclass(frozen=True)
class Candidate:
    """A kernel ready to compile: its full source and parsed header.

    ``family``/``params`` name the hand-written family point it came from (None for policy
    samples that match no family). ``name`` spells the point, or for a generated kernel
    ``generated[<format>]#<8 hex of its source's BLAKE2b>``, so that the records of a
    selection (and ``pregen --share``'s ranking, which keys candidates by name) tell two
    generated kernels apart.
    """

    source: str
    header: KernelHeader
    family: str | None = None
    params: tuple[tuple[str, object], ...] = field(default=())

    @property
    def name(self) -> str:
        if self.family is None:
            digest = hashlib.blake2b(self.source.encode(), digest_size=4).hexdigest()
            return f"generated[{self.header.format}]#{digest}"
        return self.family + "".join(f"[{k}={v}]" for k, v in self.params)


_LINE1 = re.compile(r"^\s*//\s*sparserl\s+(?P<kv>.*)$")
_LINE2 = re.compile(r"^\s*//\s*launch\s+(?P<kv>.*)$")
_KV = re.compile(r"^([A-Za-z_][A-Za-z_0-9]*)=([A-Za-z_0-9]+)$")


def _kv(text: str, line_no: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for tok in text.split():
        m = _KV.match(tok)
        if not m:
            raise ContractError(f"header line {line_no}: cannot read {tok!r} (expected key=value)")
        if m.group(1) in out:
            raise ContractError(f"header line {line_no}: {m.group(1)!r} given twice")
        out[m.group(1)] = m.group(2)
    return out


def _int(d: dict[str, str], key: str, default: int | None, line_no: int) -> int:
    if key not in d:
        if default is None:
            raise ContractError(f"header line {line_no}: missing {key}=")
        return default
    try:
        return int(d.pop(key))
    except ValueError:
        raise ContractError(f"header line {line_no}: {key} must be an integer") from None


def parse_header(source: str) -> KernelHeader:
    """Parse and check the two header lines at the top of ``source``.

    Raises ``ContractError`` naming the first problem.
    """
    lines = [ln for ln in source.lstrip().splitlines()[:2]]
    if len(lines) < 2:
        raise ContractError("kernel source must start with the two sparserl header lines")
    m1, m2 = _LINE1.match(lines[0]), _LINE2.match(lines[1])
    if not m1:
        raise ContractError("header line 1 must be '// sparserl op=... format=... dtype=... index=i32'")
    if not m2:
        raise ContractError("header line 2 must be '// launch block=... work=... per_block=...'")
    h1, h2 = _kv(m1.group("kv"), 1), _kv(m2.group("kv"), 2)
    op, fmt, dtype, index = (h1.pop(k, None) for k in ("op", "format", "dtype", "index"))
    if op not in OPS:
        raise ContractError(f"header line 1: op={op!r}, expected one of {OPS}")
    if fmt not in FORMATS:
        raise ContractError(f"header line 1: format={fmt!r}, expected one of {tuple(FORMATS)}")
    if dtype not in DTYPES:
        raise ContractError(f"header line 1: dtype={dtype!r}, expected one of {tuple(DTYPES)}")
    if index != "i32":
        raise ContractError(f"header line 1: index={index!r}; only i32 indices are supported")
    f = FORMATS[fmt]
    fparams = []
    for k in f.params:
        fparams.append((k, _int(h1, k, None, 1)))
    if h1:
        raise ContractError(f"header line 1: unknown keys {sorted(h1)} for format {fmt}")
    launch = LaunchSpec(
        block=_int(h2, "block", None, 2),
        work=h2.pop("work", "?"),
        per_block=_int(h2, "per_block", 1, 2),
        tile_n=_int(h2, "tile_n", 0, 2),
        smem=_int(h2, "smem", 0, 2),
        zero_output=bool(_int(h2, "zero_output", 0, 2)),
        n_align=_int(h2, "n_align", 1, 2),
    )
    if h2:
        raise ContractError(f"header line 2: unknown keys {sorted(h2)}")
    if launch.work not in f.work:
        raise ContractError(f"header line 2: work={launch.work!r}; format {fmt} allows {f.work}")
    if not (1 <= launch.block <= 1024) or launch.block % 32:
        raise ContractError(f"header line 2: block={launch.block} must be a multiple of 32 in [32, 1024]")
    if launch.per_block < 1 or launch.tile_n < 0 or launch.smem < 0 or launch.n_align not in (1, 2, 4, 8):
        raise ContractError("header line 2: per_block >= 1, tile_n >= 0, smem >= 0, n_align in {1,2,4,8}")
    if launch.smem > 227 * 1024:
        raise ContractError(f"header line 2: smem={launch.smem} exceeds the 227 KiB a block may have")
    if op == "spmv" and (launch.tile_n or launch.n_align != 1):
        raise ContractError("header line 2: tile_n and n_align apply to spmm only")
    return KernelHeader(op, fmt, dtype, index, tuple(fparams), launch)


def signature(op: str, fmt: str, dtype: str) -> list[tuple[str, str]]:
    """The kernel's parameter list as (C type, name) pairs, in launch order."""
    f = FORMATS[fmt]
    t = DTYPES[dtype]
    params = [("int", s) for s in f.scalars]
    if op == "spmm":
        params.append(("int", "n"))
    for a in f.arrays:
        params.append((f"const {t}* __restrict__" if a == f.value_array else "const int* __restrict__", a))
    params.append((f"const {t}* __restrict__", "x"))
    params.append((f"{t}* __restrict__", "y"))
    return params


def signature_c(op: str, fmt: str, dtype: str) -> str:
    """``extern "C" __global__ void sparserl_kernel(...)`` for (op, format, dtype)."""
    args = ", ".join(f"{t} {n}" for t, n in signature(op, fmt, dtype))
    return f'extern "C" __global__ void {KERNEL_NAME}({args})'
