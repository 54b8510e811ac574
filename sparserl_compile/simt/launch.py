"""Load a built kernel library and launch it on numpy arrays.

``compile_kernel(source)`` = ``rewrite.prepare`` + ``build.build`` + ``ctypes`` load, with an
in-process table in front of the disk cache. ``SimtKernel.launch`` checks the argument list
against the contract signature, fills the launch record ``runtime.h`` reads, runs the grid
(the GIL is released while it runs) and turns a recorded fault into a typed ``SimtFault``.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparserl_compile import contract
from sparserl_compile.simt import errors as E
from sparserl_compile.simt.build import build
from sparserl_compile.simt.rewrite import Prepared, prepare

_MAX_ARGS = 24
_F_OOB, _F_MIS, _F_BAR, _F_WARP, _F_STEPS, _F_TIME, _F_RACE, _F_SMEM, _F_INTERNAL, _F_GRACE = range(1, 11)
#: PROT_NONE bytes around every array of a guarded launch: any int32 index times a 16-byte vector
GUARD_BYTES = 2**31 * 16
#: one guarded launch at a time in a process: its SIGSEGV handler is process-wide (guard.h)
_GUARD_LOCK = threading.Lock()


class _FaultRec(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int), ("array", ctypes.c_int),
        ("index", ctypes.c_longlong), ("extent", ctypes.c_longlong),
        ("thread", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
        ("other_thread", ctypes.c_int), ("line", ctypes.c_int),
        ("mask", ctypes.c_uint), ("pad", ctypes.c_int),
        ("msg", ctypes.c_char * 512),
    ]


class _Launch(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
        ("smem", ctypes.c_longlong), ("step_limit", ctypes.c_longlong),
        ("time_limit_s", ctypes.c_double),
        ("workers", ctypes.c_int), ("racecheck", ctypes.c_int),
        ("nargs", ctypes.c_int), ("fibers", ctypes.c_int),
        ("ival", ctypes.c_longlong * _MAX_ARGS), ("ptr", ctypes.c_void_p * _MAX_ARGS),
        ("nbytes", ctypes.c_longlong * _MAX_ARGS),
        ("max_steps", ctypes.c_longlong), ("switches", ctypes.c_longlong),
        ("blocks_done", ctypes.c_longlong),
        ("claimed", ctypes.c_int), ("abort_flag", ctypes.c_int),
        ("placement", ctypes.c_int), ("pad2", ctypes.c_int), ("guard_bytes", ctypes.c_longlong),
        ("elsize", ctypes.c_longlong * _MAX_ARGS), ("writable", ctypes.c_int * _MAX_ARGS),
        ("fault", _FaultRec),
    ]


def _bf16_dtype():
    try:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    except ImportError:  # pragma: no cover - ml_dtypes is optional
        return None


#: C element type -> accepted numpy dtypes (first = canonical)
_ELEM_DTYPES: dict[str, tuple] = {
    "int": (np.dtype(np.int32),),
    "float": (np.dtype(np.float32),),
    "__half": (np.dtype(np.float16), np.dtype(np.uint16)),
    "__nv_bfloat16": tuple(d for d in (_bf16_dtype(), np.dtype(np.uint16)) if d is not None),
}


@dataclass(frozen=True)
class LaunchStats:
    """What one launch did."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int                 # dynamic shared memory bytes
    blocks: int               # blocks run
    mode: str                 # "fibers" (barriers/shuffles) or "loops" (threads as plain calls)
    guarded: bool
    workers: int              # OS threads used
    max_steps: int            # most loop iterations any one thread ran
    context_switches: int     # fiber switches (0 in loop mode)
    wall_s: float


def _dim3(v, what: str) -> tuple[int, int, int]:
    if isinstance(v, (int, np.integer)):
        t = (int(v), 1, 1)
    else:
        t = tuple(int(a) for a in v) + (1,) * (3 - len(tuple(v)))
    if len(t) != 3 or any(a < 1 for a in t):
        raise ValueError(f"{what}={v!r}: expected 1 to 3 positive integers")
    return t  # type: ignore[return-value]


class SimtKernel:
    """One kernel built for the CPU. Create with ``compile_kernel``; thread-safe to launch."""

    def __init__(self, prep: Prepared, library: Path):
        self.header: contract.KernelHeader = prep.header
        self.params = prep.params
        self.guarded = prep.guarded
        self.uses_fibers = prep.uses_fibers
        self.library = library
        self._names = prep.array_names
        self._lib = ctypes.CDLL(str(library))
        self._fn = self._lib.simt_launch
        self._fn.argtypes = [ctypes.POINTER(_Launch)]
        self._fn.restype = ctypes.c_int

    def __repr__(self) -> str:
        h = self.header
        return (f"SimtKernel(op={h.op}, format={h.format}, dtype={h.dtype}, guarded={self.guarded}, "
                f"mode={'fibers' if self.uses_fibers else 'loops'})")

    # ------------------------------------------------------------------ arguments
    def _marshal(self, args: list, rec: _Launch) -> list[tuple[np.ndarray, np.ndarray]]:
        """Fill ``rec`` from ``args``; returns (aligned copy, original) pairs to copy back."""
        if len(args) != len(self.params):
            sig = ", ".join(f"{t} {n}" for t, n in self.params)
            raise TypeError(f"{len(args)} arguments given; the kernel takes {len(self.params)}: ({sig})")
        writeback = []
        for k, ((ctype, name), a) in enumerate(zip(self.params, args)):
            if ctype == "int":
                if isinstance(a, np.ndarray) and a.ndim == 0:
                    a = a[()]
                if not isinstance(a, (int, np.integer)) or isinstance(a, bool):
                    raise TypeError(f"argument {k} ({name}) must be an integer (np.int32), got {type(a).__name__}")
                if not -(2**31) <= int(a) < 2**31:
                    raise ValueError(f"argument {k} ({name}) = {int(a)} does not fit a 32-bit int")
                rec.ival[k] = int(a)
                continue
            base = ctype.replace("__restrict__", "").replace("const", "").replace("*", "").strip()
            allowed = _ELEM_DTYPES[base]
            if not isinstance(a, np.ndarray):
                raise TypeError(
                    f"argument {k} ({name}) must be a numpy array of {allowed[0]} (the CPU executor "
                    f"runs on host memory), got {type(a).__name__}")
            if a.dtype not in allowed:
                raise TypeError(f"argument {k} ({name}) must have dtype {' or '.join(map(str, allowed))}, got {a.dtype}")
            if not a.flags.c_contiguous:
                raise ValueError(f"argument {k} ({name}) must be C-contiguous (use np.ascontiguousarray)")
            writable = not ctype.startswith("const")
            if writable and not a.flags.writeable:
                raise ValueError(f"argument {k} ({name}) is written by the kernel but the array is read-only")
            buf = a
            if a.nbytes == 0:  # a valid address with no bytes: every access is out of bounds
                buf = np.zeros(64, np.uint8)[:0]
            elif a.ctypes.data % 64 or not a.flags.writeable:
                # aligned as CUDA allocations are; a read-only input gets a copy, since a guarded
                # launch copies every array back (a kernel that writes its inputs shows there)
                raw = np.empty(a.nbytes + 64, np.uint8)
                off = (-raw.ctypes.data) % 64
                buf = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
                buf[...] = a
                if a.flags.writeable:
                    writeback.append((buf, a))
            rec.ptr[k] = buf.ctypes.data
            rec.nbytes[k] = a.nbytes
            rec.elsize[k] = a.itemsize
            rec.writable[k] = int(writable)
            writeback.append((buf, None))  # keeps the buffer alive during the call
        return writeback

    # ------------------------------------------------------------------ launch
    def launch(self, grid, block, smem: int, args: list, *, step_limit: int | None = None,
               time_limit_s: float | None = 10.0, workers: int = 1,
               racecheck: bool | None = None, guard: bool | None = None,
               placement: int = 0) -> LaunchStats:
        """Run the grid on ``args`` (contract order, see ``formats.FormatData.kernel_args``).

        ``grid``/``block``: an int or up to three ints; ``smem``: dynamic shared memory bytes.
        Arrays are numpy: ``int32`` structure, ``float32``/``float16`` values, bfloat16 as
        ``ml_dtypes.bfloat16`` or ``uint16`` bit patterns; the output is written in place.
        ``step_limit`` caps the loop iterations of one thread, ``time_limit_s`` the launch;
        ``workers`` spreads blocks over OS threads; ``racecheck`` (guarded builds only,
        default on there) tracks shared-memory races and races on the output (two threads
        writing one element of ``y`` unordered); ``guard`` (guarded builds only, default on
        there) places every array between PROT_NONE regions of ``GUARD_BYTES`` so accesses
        through raw pointers past it fault too (``guard.h``), at the start (``placement=0``)
        or the end (``1``) of its pages. Raises a ``SimtFault`` subclass on a fault.
        """
        g, b = _dim3(grid, "grid"), _dim3(block, "block")
        nth = b[0] * b[1] * b[2]
        if nth > 1024:
            raise ValueError(f"block={b} has {nth} threads; CUDA allows at most 1024")
        if smem < 0 or smem > 227 * 1024:
            raise ValueError(f"smem={smem}: dynamic shared memory must be in [0, 227 KiB]")
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        if placement not in (0, 1):
            raise ValueError(f"placement={placement!r}: 0 (arrays at the start of their pages) or 1 (at the end)")
        guarded = self.guarded and (guard is None or guard)
        rec = _Launch()
        rec.grid[:] = g
        rec.block[:] = b
        rec.smem = int(smem)
        rec.step_limit = int(step_limit) if step_limit else 0
        rec.time_limit_s = float(time_limit_s) if time_limit_s else 0.0
        rec.workers = int(workers)
        rec.racecheck = int(self.guarded if racecheck is None else racecheck)
        rec.nargs = len(self.params)
        rec.fibers = int(self.uses_fibers)
        rec.placement = int(placement)
        rec.guard_bytes = GUARD_BYTES if guarded else 0
        keep = self._marshal(args, rec)
        t0 = time.perf_counter()
        if guarded:
            with _GUARD_LOCK:
                kind = self._fn(ctypes.byref(rec))
        else:
            kind = self._fn(ctypes.byref(rec))
        wall = time.perf_counter() - t0
        if kind == 0:
            for buf, orig in keep:
                if orig is not None:
                    orig[...] = buf
        else:
            for buf, orig in keep:  # partial results are still written back, as on a GPU
                if orig is not None:
                    orig[...] = buf
            raise self._fault(rec.fault)
        return LaunchStats(g, b, int(smem), int(rec.blocks_done),
                           "fibers" if self.uses_fibers else "loops", self.guarded,
                           min(workers, math.prod(g)), int(rec.max_steps), int(rec.switches), wall)

    def _array_name(self, aid: int) -> str:
        if aid in self._names:
            n = self._names[aid]
            return n if aid < 64 else (f"__shared__ {n}" if aid < 130 else f"local {n}")
        return "shared memory" if aid >= 64 else f"argument {aid}"

    def _fault(self, f: _FaultRec) -> E.SimtFault:
        msg = f.msg.decode(errors="replace")
        kw = dict(thread=tuple(f.thread), block=tuple(f.block), line=int(f.line))
        if f.kind in (_F_OOB, _F_MIS):
            cls = E.OutOfBounds if f.kind == _F_OOB else E.MisalignedAccess
            return cls(msg, array=self._array_name(f.array), index=int(f.index), extent=int(f.extent), **kw)
        if f.kind == _F_GRACE:
            return E.GlobalMemoryRace(msg, array=self._array_name(f.array), index=int(f.index),
                                      other_thread=int(f.other_thread), **kw)
        if f.kind == _F_RACE:
            return E.SharedMemoryRace(msg, array=self._array_name(f.array), other_thread=int(f.other_thread), **kw)
        cls = {_F_BAR: E.BarrierDivergence, _F_WARP: E.WarpMaskError, _F_STEPS: E.StepLimitExceeded,
               _F_TIME: E.Timeout, _F_SMEM: E.SharedMemoryExceeded}.get(f.kind, E.SimtFault)
        return cls(msg, **kw)


_TABLE: dict[tuple[str, bool], SimtKernel] = {}
_LOCK = threading.Lock()


def compile_kernel(source: str, *, guarded: bool = True) -> SimtKernel:
    """Build ``source`` (a kernel behind the two contract header lines) for the CPU.

    ``guarded=True`` checks every array access against its bounds, every shared-memory access
    for races, and keeps in-language faults from crashing the process; ``guarded=False`` is
    the fast build for kernels already verified. Raises ``contract.ContractError`` for a bad
    header or signature, ``SimtRefused`` for code outside the kernel language,
    ``SimtCompileError`` (with g++'s log and the numbered source) when g++ rejects it, and
    ``SimtUnavailable`` without a C++ compiler.
    """
    key = (source, guarded)
    with _LOCK:
        k = _TABLE.get(key)
    if k is not None:
        return k
    prep = prepare(source, guarded=guarded)
    k = SimtKernel(prep, build(prep))
    with _LOCK:
        _TABLE[key] = k
    return k


def compile_many(sources: list[str], *, guarded: bool = True, jobs: int | None = None) -> list:
    """``compile_kernel`` for many sources, g++ running ``jobs`` at a time (default: CPU count).

    Returns, per source, the ``SimtKernel`` or the exception its build raised (refusal,
    contract or compile error), so one bad kernel of an RL batch does not stop the others.
    """
    import os
    from concurrent.futures import ThreadPoolExecutor

    def one(src: str):
        try:
            return compile_kernel(src, guarded=guarded)
        except (E.SimtError, contract.ContractError) as e:
            return e

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        return list(pool.map(one, sources))
