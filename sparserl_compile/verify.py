"""Is a candidate kernel correct? Every check of the design's verification list, in order.

``verify(candidate, matrix, executor="gpu"|"cpu", n=1, widths=None, value_sets=3, seed=0)``
returns a ``VerifyResult`` naming the first failed check, or ``ok=True`` with the checks
passed, the widths verified and how out-of-bounds accesses were watched. It assumes a kernel
that tries to cheat (DESIGN.md, "Threats verification must assume"). The checks, in order:

1. ``header``: the two contract header lines parse and agree with the candidate's header
   and the requested op/dtype.
2. ``language``: ``language.check(source)`` reports no violation of the kernel language
   (no ``__device__`` globals, includes, asm, printf, clock reads, ...).
3. ``signature``: the ``sparserl_kernel`` parameter types are exactly the contract's for
   (op, format, dtype) (names may differ; ``__restrict__`` and spacing are ignored).
4. ``align``: every dense width verified is a multiple of the header's ``n_align``.
5. ``format``: the pattern converts to the header's format (``FormatNotSuitable`` fails).
6. ``compile``: NVRTC compiles it (both executors; the CPU executor then builds it with simt).
7. Runs on the value sets of ``operands`` (``value_sets`` random ones, then ``"ranges"``:
   zeros, negatives, large, small and subnormal magnitudes, and ``"nonfinite"``: NaN and
   +-inf in ``x`` and in the values). At the first width (the call's ``n``) every set runs
   twice, once with every array at the start of its guarded region and once at its end, each
   on an output poisoned with a NaN bit pattern (zeroed first where the header says
   ``zero_output=1``, as the runtime does); every other width runs once per set kind in turn.
   Per run: ``launch`` (no fault / CUDA error), ``bounds`` (no access outside an array: the
   CPU executor faults on raw-pointer accesses past any array, the GPU executor places
   arrays between unmapped address ranges (``guarded``); a write beside an array is found in
   the fill around it), ``race`` (CPU executor: no two threads writing one output element
   unordered, no shared-memory race), ``inputs`` (every input byte unchanged), ``written``
   (no output left holding the poison, no NaN where the reference is finite),
   ``nonfinite`` (NaN where the float64 reference is NaN, +-inf with its sign where it is
   +-inf; in formats that multiply their padding zeros (DIA, BSR, and bitmap, whose tiles may
   be multiplied dense: every unstored position counts) NaN is also accepted where a padding
   slot meets a non-finite ``x``, since 0 * inf is NaN, as in the dense product),
   ``error_bound`` (every finite output within ``operands.error_bound`` of the float64
   reference: by scipy for the CPU executor, by torch.sparse on the GPU for the GPU executor,
   whose checks all run on device tensors), ``deterministic`` (the two runs bit-identical; ``zero_output=1``
   kernels accumulate with ``atomicAdd`` in a varying order, so only the bound applies to
   them), on the GPU ``cusparse`` (random sets: within twice the bound of ``torch.sparse``
   CSR, where cuSPARSE supports the dtype; half-precision operands multiplied in float32), and
   ``stale`` (two calls into one un-poisoned
   output with different operands: the second gives the second answer, so a kernel that
   keeps what ``y`` already holds is caught; ``zero_output=1`` kernels get a zeroed ``y``).
   State kept across launches shows up as a failure on a later set or run.

Widths. Plans and cache entries are keyed by ``cache.width_bucket(n)``, so a kernel selected
at ``n`` also serves the bucket's other widths: ``widths_to_verify`` lists them.

Not here: the "impossible speed" check needs L2-flushed timing (``bench.is_impossible``,
applied in the sandbox), and hangs need a killable process (``sandbox``).

This module is over 600 lines on purpose: the checks above, in the order they run, read as one
list; each is short and they share the runner and the operand sets.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp

from sparserl_compile import contract, operands
from sparserl_compile.contract import Candidate, ContractError
from sparserl_compile.operands import (  # noqa: F401 - the names verification has always exported
    U_F32, U_OUT, _VALUE_SETS, _random_operand, clear_value_sets, error_bound, from_storage, to_dtype)
from sparserl_compile.runners import POISON, CpuRunner, Fail, GpuRunner, Run

_ValueSet = operands.ValueSet
_Fail = Fail
_Run = Run
_POISON = POISON

CHECKS = ("header", "language", "signature", "align", "format", "compile", "launch", "bounds", "race",
          "inputs", "written", "nonfinite", "error_bound", "deterministic", "cusparse", "stale")
#: buckets with up to this many widths are verified at every width; larger ones at their
#: edges and one width per residue modulo ``WIDTH_PERIOD`` (``widths_to_verify``)
EVERY_WIDTH_UP_TO = 128
#: the largest period along the dense width of the kernel space's tilings: ``tile_n`` up to
#: 32, 32 lanes times vectors of up to 4 (float4)
WIDTH_PERIOD = 128


@dataclass(frozen=True)
class Pattern:
    """A CSR sparsity pattern: int32 ``indptr`` (n_rows + 1) and ``indices`` (nnz), shape."""

    indptr: np.ndarray
    indices: np.ndarray
    shape: tuple[int, int]

    @staticmethod
    def of(m: Any) -> "Pattern":
        """From a ``Pattern``, a scipy CSR matrix or anything with indptr/indices/shape."""
        if isinstance(m, Pattern):
            return m
        if sp.issparse(m):
            m = sp.csr_matrix(m)
        return Pattern(np.ascontiguousarray(m.indptr, dtype=np.int32),
                       np.ascontiguousarray(m.indices, dtype=np.int32),
                       (int(m.shape[0]), int(m.shape[1])))

    @property
    def nnz(self) -> int:
        return int(self.indices.size)


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of ``verify``. ``failed`` is the name of the first failed check (None if ok)."""

    ok: bool
    reason: str
    failed: str | None
    checks_passed: tuple[str, ...]
    max_rel_err: tuple[float, ...] = ()  # per random value set: max |y - ref| / (sum |a||x|)
    executor: str = "cpu"
    n: int = 1
    value_sets: int = 0
    compile_log: str = ""
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())
    #: seconds per phase: "prepare" (static checks, format conversion, compile, upload),
    #: "values" (building value sets and their float64 references, when not cached),
    #: "runs" (launches at ``n`` and the checks on their outputs), "widths" (the other
    #: widths), "cusparse" (the comparison)
    phases: dict = field(default_factory=dict)
    #: the dense widths verified (``n`` first); a failed result lists those fully passed
    widths: tuple[int, ...] = ()
    #: the value sets run (random ones by index, then the special ones by name)
    sets: tuple = ()
    #: how out-of-bounds accesses were watched (the executor's guard)
    oob: str = ""

    def to_dict(self) -> dict:
        return {"ok": self.ok, "reason": self.reason, "failed": self.failed,
                "checks_passed": list(self.checks_passed), "max_rel_err": list(self.max_rel_err),
                "executor": self.executor, "n": self.n, "value_sets": self.value_sets,
                "seconds": self.seconds, "notes": list(self.notes), "phases": dict(self.phases),
                "widths": list(self.widths), "sets": [str(s) for s in self.sets], "oob": self.oob}


# ------------------------------------------------------------------ static checks

_SIG = re.compile(r'extern\s+"C"\s+__global__\s+void\s+' + contract.KERNEL_NAME + r"\s*\((?P<params>[^)]*)\)", re.S)


def _param_type(p: str) -> str:
    p = p.replace("__restrict__", " ")
    toks = re.findall(r"[A-Za-z_][A-Za-z_0-9]*|\*", p)
    if toks and toks[-1] != "*":
        toks = toks[:-1]  # drop the parameter name
    return " ".join(toks).replace(" *", "*")


def check_signature(source: str, op: str, fmt: str, dtype: str) -> None:
    """Raise ``ContractError`` unless the kernel's parameter types are the contract's."""
    m = _SIG.search(source)
    if not m:
        raise ContractError(f'no `extern "C" __global__ void {contract.KERNEL_NAME}(...)` found')
    got = [_param_type(p) for p in m.group("params").split(",") if p.strip()]
    want = [_param_type(f"{t} {n}") for t, n in contract.signature(op, fmt, dtype)]
    if got != want:
        raise ContractError(f"parameter types {got} differ from the contract's {want} for "
                            f"op={op} format={fmt} dtype={dtype}; see contract.signature_c")


def static_checks(candidate: Candidate, op: str, dtype: str, passed: list[str]) -> contract.KernelHeader:
    try:
        header = contract.parse_header(candidate.source)
    except ContractError as e:
        raise Fail("header", str(e)) from None
    if header != candidate.header:
        raise Fail("header", "the source's header lines differ from the candidate's parsed header")
    if header.op != op or header.dtype != dtype:
        raise Fail("header", f"kernel is for op={header.op} dtype={header.dtype}, "
                             f"the problem is op={op} dtype={dtype}")
    passed.append("header")
    try:
        from sparserl_compile import language
    except ImportError:
        language = None
    if language is not None:
        problems = language.check(candidate.source)
        if problems:
            raise Fail("language", "kernel language violation: " + "; ".join(map(str, problems[:5])))
        passed.append("language")
    try:
        check_signature(candidate.source, header.op, header.format, header.dtype)
    except ContractError as e:
        raise Fail("signature", str(e)) from None
    passed.append("signature")
    return header


def digest(arrays) -> str:
    """BLAKE2b of the bytes of numpy arrays / torch tensors (tensors are copied to the host)."""
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        if hasattr(a, "detach"):
            a = a.detach().contiguous().view(-1)
            a = a.view(__import__("torch").uint8).cpu().numpy() if a.numel() else np.zeros(0, np.uint8)
        h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
        h.update(b"|")
    return h.hexdigest()


# ------------------------------------------------------------------ widths

def widths_to_verify(op: str, n: int, n_align: int = 1) -> tuple[int, ...]:
    """The dense widths a kernel selected for a call of width ``n`` must be verified at: ``n``
    first, then the other widths of ``cache.width_bucket(n)`` that are multiples of
    ``n_align`` (the runtime never launches it at the others), ascending.

    Buckets of up to ``EVERY_WIDTH_UP_TO`` widths (n <= 256): every one. Larger buckets: both
    edges and, for each residue modulo ``WIDTH_PERIOD``, its smallest width in the bucket.
    Why that covers the rest for the kernel space's tilings: a kernel's work along the dense
    width is a grid of tiles of ``T`` columns (``tile_n``, or lanes times vector width), with
    ``T`` a power of two dividing ``WIDTH_PERIOD``; every full tile runs the same code, and
    what differs between two widths of the bucket is the number of full tiles (both edges
    give the fewest and the most) and the last partial tile, ``n mod T``, which is determined
    by ``n mod WIDTH_PERIOD``. A kernel that special-cases one width in other ways is not
    covered there; every width of the buckets GNNs use (up to 256) is."""
    from sparserl_compile.cache import width_bucket

    if op == "spmv":
        return (1,)
    n, n_align = int(n), max(1, int(n_align))
    b = width_bucket(n)
    lo = 1 if b <= 1 else b // 2 + 1
    every = [w for w in range(lo, b + 1) if w % n_align == 0]
    if len(every) <= EVERY_WIDTH_UP_TO:
        chosen = every
    else:
        first: dict[int, int] = {}
        for w in every:
            first.setdefault(w % WIDTH_PERIOD, w)
        chosen = sorted(set(first.values()) | {every[0], every[-1]})
    return (n,) + tuple(w for w in chosen if w != n)


def timing_fns(runner, dtype: str, seed: int = 0):
    """(call, poison, out_bytes) for timing a verified GPU runner at its first width on the
    first random value set (``GpuRunner.timing_fns``)."""
    p = runner.pattern
    x_shape = (p.shape[1],) if runner.header.op == "spmv" else (p.shape[1], runner.widest)
    vs = operands.value_set(p, np.diff(p.indptr), x_shape, dtype, seed, 0)
    vals, x = vs.device_operands()
    return runner.timing_fns(vals, x, dtype)


# ------------------------------------------------------------------ padding of padded formats

#: ``padding_pattern`` of the bitmap format: a kernel may multiply every position its tiles do
#: not store (the tensor-core family expands them to dense), i.e. every unstored position
UNSTORED = "unstored"
#: ``padding_pattern`` of the ``tcw`` format: every row of a window meets every column of its
#: tiles, found by ``_tile_lenient`` from the format's own arrays
TILES = "tiles"


def padding_pattern(fd) -> sp.csr_matrix | str | None:
    """The (row, column) slots a DIA or BSR kernel multiplies although the pattern has no entry
    there (value 0), as a 0/1 matrix; ``UNSTORED`` for the bitmap format (every position the
    pattern does not store); ``TILES`` for ``tcw``'s dense windows; None for formats whose
    kernels skip their padding."""
    if fd.fmt == "bitmap":
        return UNSTORED
    if fd.fmt == "tcw":
        return TILES
    n_rows, n_cols = int(fd.scalars["n_rows"]), int(fd.scalars["n_cols"])
    pad = fd.value_map < 0
    if fd.fmt == "dia":
        offs = fd.arrays["offsets"].astype(np.int64)
        d, i = np.divmod(np.nonzero(pad)[0], max(n_rows, 1))
        rows, cols = i, i + offs[d]
    elif fd.fmt == "bsr":
        R, C = int(fd.params["R"]), int(fd.params["C"])
        ptr, bcol = fd.arrays["bsr_ptr"].astype(np.int64), fd.arrays["bsr_col"].astype(np.int64)
        slot = np.nonzero(pad)[0]
        q, rc = np.divmod(slot, R * C)
        r, c = np.divmod(rc, C)
        brow = np.searchsorted(ptr, q, side="right") - 1
        rows, cols = brow * R + r, bcol[q] * C + c
    else:
        return None
    keep = (rows >= 0) & (rows < n_rows) & (cols >= 0) & (cols < n_cols)
    rows, cols = rows[keep], cols[keep]
    return sp.csr_matrix((np.ones(rows.size, np.float32), (rows, cols)), shape=(n_rows, n_cols))


def _tile_lenient(fd, bad: np.ndarray) -> np.ndarray:
    """Outputs of the ``tcw`` format that may be NaN: ``bad`` marks the non-finite entries of
    ``x`` (n_cols,) or (n_cols, n); an output may be NaN where its row shares a window's tile with
    a column of ``x`` holding one, since the kernel multiplies the tile's zeros."""
    n_rows, n_cols = int(fd.scalars["n_rows"]), int(fd.scalars["n_cols"])
    b2 = bad.reshape(n_cols, -1).astype(bool)
    out = np.zeros((n_rows, b2.shape[1]), dtype=bool)
    H = int(fd.params["H"])
    win_ptr, tile_col, row_id = (fd.arrays[k].astype(np.int64) for k in ("win_ptr", "tile_col", "row_id"))
    n_tiles = tile_col.size // 16
    if n_tiles:
        cols = tile_col.reshape(n_tiles, 16)
        tb = (b2[np.clip(cols, 0, None)] & (cols >= 0)[:, :, None]).any(axis=1)  # (tiles, n)
        win = np.repeat(np.arange(win_ptr.size - 1), np.diff(win_ptr))
        wb = np.zeros((win_ptr.size - 1, b2.shape[1]), dtype=bool)
        np.logical_or.at(wb, win, tb)
        rows = row_id.reshape(-1, H)[: wb.shape[0]]
        for r in range(H):
            ok = rows[:, r] >= 0
            out[rows[ok, r]] |= wb[ok]
    return out.reshape(n_rows) if bad.ndim == 1 else out


def _lenient(runner, pad, x_w):
    """Outputs where a padding slot meets a non-finite ``x`` (None: no such output)."""
    if pad is UNSTORED:
        return _lenient_unstored(runner, x_w)
    if pad is TILES:  # dense windows: found from the format's arrays, on the host
        if runner.executor == "cpu":
            return _tile_lenient(runner.fd, ~np.isfinite(from_storage(x_w, runner.header.dtype)))
        torch = runner.torch
        bad = (~torch.isfinite(x_w.float())).cpu().numpy()
        return torch.from_numpy(_tile_lenient(runner.fd, bad)).to(x_w.device)
    if pad is None or pad.nnz == 0:
        return None
    if runner.executor == "cpu":
        bad = (~np.isfinite(from_storage(x_w, runner.header.dtype))).astype(np.float32)
        return (pad @ bad) > 0
    torch = runner.torch
    if not hasattr(runner, "_pad_t"):
        c = pad.tocsr()
        dev = runner.device
        runner._pad_t = torch.sparse_csr_tensor(torch.from_numpy(c.indptr.astype(np.int64)).to(dev),
                                                torch.from_numpy(c.indices.astype(np.int64)).to(dev),
                                                torch.from_numpy(c.data).to(dev), size=c.shape)
    bad = (~torch.isfinite(x_w.float())).float()
    out = torch.mv(runner._pad_t, bad) if bad.dim() == 1 else torch.mm(runner._pad_t, bad)
    return out > 0


def _lenient_unstored(runner, x_w):
    """Outputs where an unstored position meets a non-finite ``x``: rows that store fewer of a
    dense column's non-finite ``x`` entries than that column has, counted through the pattern
    itself (its complement, most of a pruned weight, is never built)."""
    p = runner.pattern
    if runner.executor == "cpu":
        bad = (~np.isfinite(from_storage(x_w, runner.header.dtype))).astype(np.float32)
        stored = sp.csr_matrix((np.ones(p.nnz, np.float32), p.indices, p.indptr), shape=p.shape)
        return (bad.sum(axis=0) - stored @ bad) > 0
    torch = runner.torch
    if not hasattr(runner, "_stored_t"):
        dev = runner.device
        runner._stored_t = torch.sparse_csr_tensor(torch.from_numpy(p.indptr.astype(np.int64)).to(dev),
                                                   torch.from_numpy(p.indices.astype(np.int64)).to(dev),
                                                   torch.ones(p.nnz, dtype=torch.float32, device=dev), size=p.shape)
    bad = (~torch.isfinite(x_w.float())).float()
    hits = torch.mv(runner._stored_t, bad) if bad.dim() == 1 else torch.mm(runner._stored_t, bad)
    return (bad.sum(dim=0) - hits) > 0


# ------------------------------------------------------------------ the driver

def prepare(candidate: Candidate, matrix, *, op: str | None = None, dtype: str | None = None,
            executor: str = "gpu", n: int = 1, cubin: bytes | None = None, static: bool = True,
            passed: list[str] | None = None, widths: tuple[int, ...] | None = None):
    """Static checks, format conversion and compile: returns a runner (raises ``Fail``)."""
    from sparserl_compile import formats

    passed = [] if passed is None else passed
    op = op or candidate.header.op
    dtype = dtype or candidate.header.dtype
    header = static_checks(candidate, op, dtype, passed) if static else candidate.header
    n = 1 if op == "spmv" else int(n)
    for w in widths or (n,):
        if w % header.launch.n_align:
            raise Fail("align", f"dense width n={w} is not a multiple of the kernel's n_align={header.launch.n_align}")
    passed.append("align")
    pattern = Pattern.of(matrix)
    try:
        fd = formats.convert(pattern.indptr, pattern.indices, pattern.shape, header.format, header.params)
    except formats.FormatNotSuitable as e:
        raise Fail("format", f"the matrix does not suit format {header.format}: {e}") from None
    passed.append("format")
    if executor == "gpu":
        runner = GpuRunner(candidate, header, pattern, fd, n, cubin, widest=max(widths or (n,)))
    elif executor == "cpu":
        runner = CpuRunner(candidate, header, pattern, fd, n)
    else:
        raise ValueError(f"executor={executor!r}; use 'gpu' or 'cpu'")
    passed.append("compile")
    return runner


@dataclass
class _Expect:
    """What one run at one width is checked against (numpy arrays or device tensors)."""

    ref: object
    bound: object
    absref: object
    nonfinite: bool
    lenient: object = None


def verify(candidate: Candidate, matrix, *, op: str | None = None, dtype: str | None = None,
           executor: str = "gpu", n: int = 1, value_sets: int = 3, seed: int = 0,
           cubin: bytes | None = None, compare_cusparse: bool = True, static: bool = True,
           runner_out: list | None = None, widths: tuple[int, ...] | None = None,
           special: bool = True) -> VerifyResult:
    """Run every check on ``candidate`` for ``matrix`` (scipy CSR or ``Pattern``).

    ``widths``: the dense widths to verify, the call's first (default ``(n,)``; the selection
    passes ``widths_to_verify``). ``special=False`` leaves out the special value sets (the
    fault-injection tests of one check use it). ``static=False`` skips checks 1-3 (to reach
    the dynamic checks). ``runner_out``, if given, receives the runner, still open (the
    sandbox times through it, then closes it).
    """
    t0 = time.perf_counter()
    passed: list[str] = []
    op = op or candidate.header.op
    dtype = dtype or candidate.header.dtype
    n = 1 if op == "spmv" else int(n)
    widths = (1,) if op == "spmv" else tuple(int(w) for w in (widths or (n,)))
    if widths[0] != n:
        raise ValueError(f"widths={widths}: the first width verified must be the call's n={n}")
    try:
        runner = prepare(candidate, matrix, op=op, dtype=dtype, executor=executor, n=n, cubin=cubin,
                         static=static, passed=passed, widths=widths)
    except Fail as f:
        return VerifyResult(False, f"{f.check}: {f.reason}", f.check, tuple(passed), (), executor, n, value_sets,
                            seconds=time.perf_counter() - t0, phases={"prepare": time.perf_counter() - t0})
    try:
        return run_checks(runner, widths=widths, value_sets=value_sets, seed=seed, special=special,
                          compare_cusparse=compare_cusparse, passed=passed, t0=t0)
    finally:
        if runner_out is not None:
            runner_out.append(runner)
        else:
            runner.close()


def run_checks(runner, *, widths: tuple[int, ...], value_sets: int = 3, seed: int = 0, special: bool = True,
               compare_cusparse: bool = True, passed: list[str] | None = None,
               t0: float | None = None) -> VerifyResult:
    """The runs of ``verify`` (check 7 of the module docstring) on a prepared runner."""
    t0 = time.perf_counter() if t0 is None else t0
    passed = [] if passed is None else passed
    op, dtype, n = runner.header.op, runner.header.dtype, widths[0]
    executor = runner.executor
    errs: list[float] = []
    notes: list[str] = []
    keys: tuple = tuple(range(value_sets)) + (operands.SPECIAL if special else ())
    done: list[int] = []
    phases = dict.fromkeys(("prepare", "values", "runs", "widths", "cusparse"), 0.0)
    phases["prepare"] = time.perf_counter() - t0
    log, oob = runner.compile_log, runner.oob
    try:
        ctx = _Context(runner, op, dtype, seed, max(widths), phases)
        cmp = executor == "gpu" and compare_cusparse
        for key in keys:
            err, cmp = ctx.full(key, n, notes, cmp)
            if err is not None:
                errs.append(err)
        stale = ctx.stale(keys, n)
        done.append(n)
        rotation = keys[:1] + (operands.SPECIAL if special else keys[1:])
        for i, w in enumerate(widths[1:]):
            ctx.once(rotation[i % len(rotation)], w, placement=i % 2)
            done.append(w)
        passed += [c for c in ("launch", "bounds", "race", "inputs", "written", "nonfinite", "error_bound",
                               "deterministic") if c != "nonfinite" or special]
        passed += (["cusparse"] if cmp else []) + (["stale"] if stale else [])
        reason = (f"passed {len(passed)} checks on {len(keys)} value sets at {len(widths)} width"
                  f"{'s' if len(widths) > 1 else ''}")
        return VerifyResult(True, reason, None, tuple(passed), tuple(errs), executor, n, value_sets, log,
                            time.perf_counter() - t0, tuple(notes), phases, tuple(done), keys, oob)
    except Fail as f:
        return VerifyResult(False, f"{f.check}: {f.reason}", f.check, tuple(passed), tuple(errs), executor, n,
                            value_sets, log, time.perf_counter() - t0, tuple(notes), phases, tuple(done), keys, oob)


class _Context:
    """The runs of one verification: value sets by key, sliced to each width."""

    def __init__(self, runner, op: str, dtype: str, seed: int, widest: int, phases: dict):
        self.runner, self.op, self.dtype, self.seed, self.phases = runner, op, dtype, seed, phases
        p = runner.pattern
        self.p, self.lengths = p, np.diff(p.indptr)
        self.x_shape = (p.shape[1],) if op == "spmv" else (p.shape[1], widest)
        self.gpu = runner.executor == "gpu"
        self.zero_out = runner.header.launch.zero_output
        self._pad: list = []

    def operands(self, key):
        t = time.perf_counter()
        vs = operands.value_set(self.p, self.lengths, self.x_shape, self.dtype, self.seed, key)
        dev = getattr(self.runner, "device", "cuda")
        vals, x = vs.device_operands(dev) if self.gpu else (vs.vals, vs.x)
        ref, absref, bound = vs.device(dev) if self.gpu else vs.host()
        self.phases["values"] += time.perf_counter() - t
        return vs, vals, x, (ref, absref, bound)

    def expect(self, vs, refs, x, w: int) -> _Expect:
        ref, absref, bound = refs
        cut = (lambda a: a) if self.op == "spmv" else (lambda a: a[:, :w])
        lenient = None
        if vs.key == "nonfinite":
            if not self._pad:
                self._pad.append(padding_pattern(self.runner.fd))
            xw = x if self.op == "spmv" else (x.reshape(self.x_shape)[:, :w] if self.gpu else x[:, :w])
            lenient = _lenient(self.runner, self._pad[0], xw)
        return _Expect(cut(ref), cut(bound), cut(absref), vs.special, lenient)

    def run(self, vs, vals, x, w: int, exp: _Expect, placement: int, which: str, start=None):
        where = f"value set {vs.key}{which} at n={w}"
        try:
            r = self.runner.run(vals, x, w, self.dtype, placement=placement, start=start)
        except Fail as f:
            raise Fail(f.check, f"{where}: {f.reason}") from None
        if not r.inputs_ok:
            vs.drop_device_operands()  # the shared operands were written into: next runs draw them afresh
        _check_run(r, exp, where)
        return r

    def full(self, key, w: int, notes: list, cmp: bool):
        """Both placements of set ``key`` at the call's width; (max rel. error or None, cmp)."""
        vs, vals, x, refs = self.operands(key)
        t = time.perf_counter()
        exp = self.expect(vs, refs, x, w)
        first = self.run(vs, vals, x, w, exp, 0, "")
        second = self.run(vs, vals, x, w, exp, 1, " (second run, arrays at the end of their regions)")
        if not self.zero_out and not _same_bits(first.raw, second.raw):
            raise Fail("deterministic", f"value set {key} at n={w}: two runs of the same inputs differ bit for "
                                        "bit (a kernel without atomics must be deterministic)")
        self.phases["runs"] += time.perf_counter() - t
        if vs.special:
            return None, cmp
        err = _max_rel_err(first.y, exp.ref, exp.absref)
        if cmp:
            t = time.perf_counter()
            try:
                if vs.cusparse is None or vs.cusparse[0] != w:
                    vs.cusparse = (w, self.runner.cusparse(vals, x, self.dtype, w))
                cs = vs.cusparse[1]
            except RuntimeError as e:
                notes.append(f"cusparse comparison skipped: {str(e).splitlines()[0][:120]}")
                cmp = False
            else:
                bad = abs(first.y - cs) > 2 * exp.bound
                if bad.any():
                    i = _first(bad)
                    raise Fail("cusparse", f"value set {key}: output {i} = {_at(first.y, i)!r} "
                                           f"disagrees with cuSPARSE {_at(cs, i)!r}")
            self.phases["cusparse"] += time.perf_counter() - t
        return err, cmp

    def once(self, key, w: int, placement: int) -> None:
        vs, vals, x, refs = self.operands(key)
        t = time.perf_counter()
        self.run(vs, vals, x, w, self.expect(vs, refs, x, w), placement, "")
        self.phases["widths"] += time.perf_counter() - t

    def stale(self, keys, w: int) -> bool:
        """Two calls into one output buffer that is never poisoned, with different operands
        (False: not run, for a ``zero_output=1`` kernel or a single value set)."""
        if self.zero_out or len(keys) < 2:
            return False
        a, b = keys[0], keys[1]
        vs_a, vals_a, x_a, refs_a = self.operands(a)
        vs_b, vals_b, x_b, refs_b = self.operands(b)
        t = time.perf_counter()
        size = self.p.shape[0] * (1 if self.op == "spmv" else w)
        if self.gpu:  # the first call's output starts as zeros, as new memory often does
            torch = self.runner.torch
            zeros = torch.zeros(size, dtype=torch.int32 if self.dtype == "f32" else torch.int16,
                                device=self.runner.device)
        else:
            zeros = np.zeros(size, dtype=POISON[self.dtype][0])
        try:
            first = self.run(vs_a, vals_a, x_a, w, self.expect(vs_a, refs_a, x_a, w), 0,
                             " (stale check: called into a zeroed, unpoisoned output)", start=zeros)
            self.run(vs_b, vals_b, x_b, w, self.expect(vs_b, refs_b, x_b, w), 0,
                     f" (stale check: called again into the output of value set {a})", start=first.raw)
        except Fail as f:
            if f.check in ("written", "error_bound", "nonfinite"):
                raise Fail("stale", f"{f.reason}; the kernel answered from what y already held") from None
            raise
        self.phases["runs"] += time.perf_counter() - t
        return True


def _first(mask) -> int:
    """Flat index of the first True of a boolean numpy array or tensor."""
    return int((mask.reshape(-1) * 1).argmax())


def _at(a, i: int) -> float:
    return float(a.reshape(-1)[i])


def _same_bits(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    return bool(__import__("torch").equal(a, b))


def _max_rel_err(y, ref, absref) -> float:
    """max |y - ref| / (sum |a||x|) (numpy arrays or tensors)."""
    if (y.size if isinstance(y, np.ndarray) else y.numel()) == 0:
        return 0.0
    err = abs(y - ref)
    denom = np.maximum(absref, 1e-30) if isinstance(absref, np.ndarray) else absref.double().clamp_min(1e-30)
    return float((err / denom).max())


def _check_run(run: Run, exp: _Expect, where: str) -> None:
    """The output checks of one run; ``run.y`` and ``exp``'s arrays are all numpy arrays (CPU
    executor) or all CUDA tensors (GPU executor, checked where they are)."""
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf where non-finite outputs are expected
        _check_output(run, exp, where)


def _check_output(run: Run, exp: _Expect, where: str) -> None:
    if not run.guards_ok:
        raise Fail("bounds", f"{where}: the kernel wrote outside its arrays ({run.guard_detail or 'guard changed'})")
    if not run.inputs_ok:
        raise Fail("inputs", f"{where}: the kernel modified an input array")
    y, ref = run.y, exp.ref
    if run.unwritten is not None and run.unwritten.any():
        i = _first(run.unwritten)
        raise Fail("written", f"{where}: output {i} (and {int(run.unwritten.sum()) - 1} more) left unwritten "
                              "(still holding the poison)")
    ynan = y != y
    if exp.nonfinite:
        _check_nonfinite(y, ref, ynan, exp.lenient, where)
        finite = (ref == ref) & (abs(ref) != float("inf"))
    else:
        finite = None
        if ynan.any():
            i = _first(ynan)
            raise Fail("written", f"{where}: output {i} (and {int(ynan.sum()) - 1} more) left unwritten or NaN")
    err = abs(y - ref)
    bad = ~(err <= exp.bound)
    if finite is not None:
        bad = bad & finite & ~ynan
    if bad.any():
        i = _first(bad)
        raise Fail("error_bound", f"{where}: output {i} = {_at(y, i)!r}, float64 reference {_at(ref, i)!r}, "
                                  f"error {_at(err, i):.3g} > bound {_at(exp.bound, i):.3g} "
                                  f"({int(bad.sum())} outputs out of bound)")


def _check_nonfinite(y, ref, ynan, lenient, where: str) -> None:
    """NaN where the reference is NaN, +-inf with its sign where it is +-inf, nothing
    non-finite where it is finite (``lenient``: outputs that may also be NaN)."""
    inf = float("inf")
    rnan = ref != ref
    may_nan = (ynan & False) if lenient is None else lenient
    ok_nan = ynan & may_nan
    cases = (
        (rnan & ~ynan, "NaN"),
        ((ref == inf) & (y != inf) & ~ok_nan, "+inf"),
        ((ref == -inf) & (y != -inf) & ~ok_nan, "-inf"),
        (~rnan & (abs(ref) != inf) & ((ynan & ~may_nan) | (abs(y) == inf)), "finite"),
    )
    for bad, want in cases:
        if bad.any():
            i = _first(bad)
            raise Fail("nonfinite", f"{where}: output {i} = {_at(y, i)!r} where the float64 reference is "
                                    f"{_at(ref, i)!r} ({want}): non-finite products must propagate as in the "
                                    f"reference, and finite outputs stay finite ({int(bad.sum())} outputs)")
