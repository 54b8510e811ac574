"""Is a candidate kernel correct? Every check of the design's verification list, in order.

``verify(candidate, matrix, executor="gpu"|"cpu", n=1, value_sets=3, seed=0)`` returns a
``VerifyResult`` naming the first failed check, or ``ok=True`` with the list of checks passed.
The checks, in the order they run:

1. ``header``: the two contract header lines parse and agree with the candidate's header
   and the requested op/dtype.
2. ``language``: ``language.check(source)`` reports no violation of the kernel language
   (no ``__device__`` globals, includes, asm, printf, clock reads, ...).
3. ``signature``: the ``sparserl_kernel`` parameter types are exactly the contract's for
   (op, format, dtype) (names may differ; ``__restrict__`` and spacing are ignored).
4. ``align``: SpMM width ``n`` is a multiple of the header's ``n_align``.
5. ``format``: the pattern converts to the header's format (``FormatNotSuitable`` fails).
6. ``compile``: NVRTC compiles it (both executors; the CPU executor then builds it with simt).
7. per value set (values AND x fresh random, magnitudes in [0.5, 1.5] with random signs, so
   never zero), each run on an output poisoned with a NaN bit pattern (zeroed first only if
   the header says ``zero_output=1``, exactly as the runtime does) inside guard zones:
   ``launch`` (no fault / CUDA error), ``bounds`` (guard zones before and after y unchanged:
   no out-of-bounds write), ``inputs`` (every input array hashed before and after: no write
   to an input), ``written`` (no poison left: every output written), ``error_bound``
   (per row ``|y_i - ref_i| <= 2 * gamma(len_i + 1) * sum_j |a_ij x_j| + u_out * |ref_i|``
   with ``gamma(k) = k u / (1 - k u)``, ``u = 2^-24`` for float accumulation, and
   ``u_out`` half an ulp of the output type (0 for f32); ref in float64 from the
   dtype-rounded inputs, by scipy for the CPU executor and by torch.sparse on the GPU for the
   GPU executor, whose checks all run on device tensors), ``deterministic`` (a second run is bit-identical; kernels with
   ``zero_output=1`` accumulate with ``atomicAdd`` in a varying order, so for them the second
   run must only meet the same error bound), and on the GPU ``cusparse`` (within twice the
   bound of ``torch.sparse`` CSR, where cuSPARSE supports the dtype).
   State kept across launches shows up as a failure on a later value set or run.

Not here: the "impossible speed" check needs L2-flushed timing (``bench.is_impossible``,
applied by ``select``/``suite``), and hangs need a killable process (``sandbox``).
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp

from sparserl_compile import contract
from sparserl_compile.bench import csr_tensor
from sparserl_compile.contract import Candidate, ContractError

#: unit roundoff of float accumulation
U_F32 = 2.0**-24
#: half an ulp (relative) of the output type
U_OUT = {"f32": 0.0, "f16": 2.0**-11, "bf16": 2.0**-8}
#: NaN bit patterns used to poison outputs and guard zones (distinctive payloads)
_POISON = {"f32": (np.uint32, 0x7FC0DEAD), "f16": (np.uint16, 0x7E5A), "bf16": (np.uint16, 0x7FDA)}
#: guard zone elements on each side of y
GUARD = 256

CHECKS = ("header", "language", "signature", "align", "format", "compile", "launch", "bounds",
          "inputs", "written", "error_bound", "deterministic", "cusparse")


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
    max_rel_err: tuple[float, ...] = ()  # per value set: max |y - ref| / (sum |a||x|)
    executor: str = "cpu"
    n: int = 1
    value_sets: int = 0
    compile_log: str = ""
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())
    #: seconds per phase: "prepare" (static checks, format conversion, compile, upload),
    #: "values" (building value sets and their float64 references, when not cached),
    #: "runs" (launches and the checks on their outputs), "cusparse" (the comparison)
    phases: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "reason": self.reason, "failed": self.failed,
                "checks_passed": list(self.checks_passed), "max_rel_err": list(self.max_rel_err),
                "executor": self.executor, "n": self.n, "value_sets": self.value_sets,
                "seconds": self.seconds, "notes": list(self.notes), "phases": dict(self.phases)}


class _Fail(Exception):
    def __init__(self, check: str, reason: str):
        super().__init__(reason)
        self.check = check
        self.reason = reason


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
        raise _Fail("header", str(e)) from None
    if header != candidate.header:
        raise _Fail("header", "the source's header lines differ from the candidate's parsed header")
    if header.op != op or header.dtype != dtype:
        raise _Fail("header", f"kernel is for op={header.op} dtype={header.dtype}, "
                              f"the problem is op={op} dtype={dtype}")
    passed.append("header")
    try:
        from sparserl_compile import language
    except ImportError:
        language = None
    if language is not None:
        problems = language.check(candidate.source)
        if problems:
            raise _Fail("language", "kernel language violation: " + "; ".join(map(str, problems[:5])))
        passed.append("language")
    try:
        check_signature(candidate.source, header.op, header.format, header.dtype)
    except ContractError as e:
        raise _Fail("signature", str(e)) from None
    passed.append("signature")
    return header


# ------------------------------------------------------------------ values and reference

def _random_operand(rng: np.random.Generator, shape) -> np.ndarray:
    """float32 values of magnitude uniform in [0.5, 1.5) (23 random bits: exact in float32) and
    random sign, from one draw of 32 random bits per value, computed in float32. Drawing float64
    magnitudes and signs apart took ~8 s per 10^6 x 256 operand on the H200's host, most of a
    new 10^7-nonzero structure's first call; this is 7.5x faster on the development CPU."""
    bits = rng.integers(0, 1 << 32, size=shape, dtype=np.uint32)
    out = (bits >> np.uint32(9)).astype(np.float32)
    out *= np.float32(2.0 ** -23)
    out += np.float32(0.5)
    np.negative(out, out=out, where=(bits & np.uint32(1)).astype(bool))
    return out


def to_dtype(a: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(array in the kernel's storage type, its exact float64 value).

    bf16 has no numpy type: it is stored as uint16 bit patterns (rounded to nearest even).
    """
    if dtype == "f32":
        s = a.astype(np.float32)
        return s, s.astype(np.float64)
    if dtype == "f16":
        s = a.astype(np.float16)
        return s, s.astype(np.float64)
    if dtype == "bf16":
        bits = a.astype(np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        s = rounded.astype(np.uint16)
        return s, from_storage(s, "bf16")
    raise ValueError(f"dtype={dtype!r}; expected one of {tuple(contract.DTYPES)}")


def from_storage(a: np.ndarray, dtype: str) -> np.ndarray:
    """Kernel storage array (as returned by ``to_dtype``) -> float64."""
    if dtype == "bf16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def error_bound(lengths, absref, ref, dtype: str):
    """Per-output allowed error (see the module docstring); shapes of ``ref``. numpy arrays, or
    tensors (the GPU executor computes it where its outputs are), in float64."""
    k = ((lengths.double() if hasattr(lengths, "double") else lengths.astype(np.float64)) + 1.0) * U_F32
    gamma = k / (1.0 - k).clip(min=1e-3)
    if ref.ndim == 2:
        gamma = gamma[:, None]
    return 2.0 * gamma * absref + U_OUT[dtype] * abs(ref) + 1e-30


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


def _torch_operand(torch, numel: int, seed: int, device: str):
    """``_random_operand``'s distribution drawn by torch on ``device`` (Philox on CUDA): float32
    magnitudes uniform in [0.5, 1.5) on a 2^-23 grid, random sign. Drawing a 10^6 x 256 operand
    on the H200's host and uploading it took seconds per value set (22 s of a 10^7-nonzero
    graph's first call for three sets); on the GPU it takes milliseconds."""
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    bits = torch.randint(0, 1 << 24, (int(numel),), dtype=torch.int32, device=device, generator=g)
    out = (bits >> 1).to(torch.float32).mul_(2.0 ** -23).add_(0.5)
    return torch.where((bits & 1).bool(), -out, out)


class _ValueSet:
    """One value set's operands, shared by every candidate of a pattern, and its float64
    reference, error bound and cuSPARSE result, each built on first use: for the CPU executor
    on the host (numpy operands, scipy reference: ``host``), for the GPU executor on the GPU
    (operands drawn there by torch, float64 reference by torch.sparse: ``device``), so a GPU
    verification moves no operand or output between host and device. The two executors draw
    different values from the same seed; each is checked against a reference of its own."""

    __slots__ = ("p", "lengths", "x_shape", "dtype", "seed", "s", "_vals", "_x", "_host", "_device",
                 "_operands", "cusparse")

    def __init__(self, p: "Pattern", lengths, x_shape, dtype: str, seed: int, s: int):
        if dtype not in contract.TORCH_NAMES:
            raise ValueError(f"dtype={dtype!r}; expected one of {tuple(contract.DTYPES)}")
        self.p, self.lengths, self.x_shape, self.dtype = p, lengths, tuple(x_shape), dtype
        self.seed, self.s = seed, s
        self._vals = self._x = self._host = self._device = self._operands = None
        self.cusparse = None  # filled by the first GPU candidate that compares

    def _host_operands(self):
        if self._vals is None:
            rng = np.random.default_rng([self.seed, self.s])
            self._vals = to_dtype(_random_operand(rng, self.p.nnz), self.dtype)[0]
            self._x = to_dtype(_random_operand(rng, self.x_shape), self.dtype)[0]
        return self._vals, self._x

    @property
    def vals(self) -> np.ndarray:
        """The host operands (storage arrays, ``to_dtype``) of the CPU executor."""
        return self._host_operands()[0]

    @property
    def x(self) -> np.ndarray:
        return self._host_operands()[1]

    def device_operands(self, device: str = "cuda"):
        """(vals, x flat) as tensors of the kernel's storage type on ``device``, drawn there once
        and read by every candidate's runs. A run that writes into them is failed by the input
        check and calls ``drop_device_operands``; the next run draws them again, the same values
        from the same seed, so the reference stays valid."""
        if self._operands is None:
            import torch

            st = getattr(torch, contract.TORCH_NAMES[self.dtype])
            seeds = np.random.SeedSequence([self.seed, self.s]).generate_state(2, np.uint64) >> np.uint64(1)
            n_x = int(np.prod(self.x_shape))
            self._operands = (_torch_operand(torch, self.p.nnz, seeds[0], device).to(st),
                              _torch_operand(torch, n_x, seeds[1], device).to(st))
        return self._operands

    def drop_device_operands(self) -> None:
        self._operands = None

    def host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ref, absref, bound), float64 numpy arrays, by scipy from the dtype-rounded inputs."""
        if self._host is None:
            p = self.p
            vals, x = self._host_operands()
            x64 = from_storage(x, self.dtype)
            a = sp.csr_matrix((from_storage(vals, self.dtype), p.indices, p.indptr), shape=p.shape)
            ref = a @ x64
            absref = abs(a) @ np.abs(x64)
            self._host = (ref, absref, error_bound(self.lengths, absref, ref, self.dtype))
        return self._host

    def device(self, device: str = "cuda"):
        """(ref, absref, bound) as tensors on ``device``: ref and bound float64 (ref by
        torch.sparse CSR in float64 from ``device_operands``, i.e. cuSPARSE, whose error is
        ~1e-16 relative, far below the float32 bound), absref float32 (it only scales the
        reported relative error). Where torch.sparse cannot (empty patterns), the reference is
        computed on the host from the same operands and uploaded."""
        if self._device is None:
            import torch

            vals, x = self.device_operands(device)
            x = x.reshape(self.x_shape)
            try:
                ref, absref = _device_reference(torch, self.p, vals, x, self.dtype, device)
            except RuntimeError:
                ref, absref = _host_reference(torch, self.p, vals, x, self.dtype, device)
            bound = error_bound(torch.from_numpy(self.lengths).to(device), absref, ref, self.dtype)
            self._device = (ref, absref.float(), bound)
        return self._device


def _host_reference(torch, p: "Pattern", vals, x, dtype: str, device: str):
    """(A @ x, |A| @ |x|) in float64 by scipy from tensor operands (patterns torch.sparse
    cannot take, e.g. empty ones), on ``device``."""
    v64 = vals.detach().to("cpu", torch.float64).numpy()
    x64 = x.detach().to("cpu", torch.float64).numpy()
    a = sp.csr_matrix((v64, p.indices, p.indptr), shape=p.shape)
    return (torch.from_numpy(np.ascontiguousarray(a @ x64)).to(device),
            torch.from_numpy(np.ascontiguousarray(abs(a) @ np.abs(x64))).to(device))


def _storage_tensor(torch, a: np.ndarray, dtype: str, device: str = "cuda"):
    """A kernel storage array (``to_dtype``) as a tensor of the kernel's type."""
    t = torch.from_numpy(np.ascontiguousarray(a.view(np.int16) if dtype == "bf16" else a)).to(device)
    return t.view(torch.bfloat16) if dtype == "bf16" else t


def _as_storage(torch, a, dtype: str, device: str = "cuda"):
    """A storage array as a tensor on ``device``; a tensor (already there) as it is."""
    return a if isinstance(a, torch.Tensor) else _storage_tensor(torch, a, dtype, device)


def _device_reference(torch, p: "Pattern", vals: np.ndarray, x: np.ndarray, dtype: str, device: str = "cuda"):
    """(A @ x, |A| @ |x|) in float64 on ``device`` from the dtype-rounded operands (storage
    arrays, or tensors already on ``device``)."""
    if p.nnz == 0 or 0 in p.shape:
        raise RuntimeError("empty pattern: use the host reference")
    v64 = _as_storage(torch, vals, dtype, device).double()
    x64 = _as_storage(torch, x, dtype, device).double()
    ip = torch.from_numpy(p.indptr.astype(np.int64)).to(device)
    ix = torch.from_numpy(p.indices.astype(np.int64)).to(device)

    def product(v, xx):
        a = csr_tensor(torch, ip, ix, v, p.shape)  # v is float64 already
        return torch.mv(a, xx) if xx.dim() == 1 else torch.mm(a, xx)

    return product(v64, x64), product(v64.abs(), x64.abs())


#: (pattern, dtype, x shape, seed) of the cached value sets, and the sets by index. A search
#: verifies tens of candidates on one pattern in one worker; building the operands and the
#: float64 reference once instead of per candidate is most of the cost on large matrices.
_VALUE_SETS: dict = {"key": None, "pattern": None, "sets": {}}


def clear_value_sets() -> None:
    """Drop the cached value sets (the sandbox worker does when its pattern changes)."""
    _VALUE_SETS.update(key=None, pattern=None, sets={})


def _value_set(p: "Pattern", lengths, x_shape, dtype: str, seed: int, s: int) -> _ValueSet:
    key = (id(p), id(p.indptr), id(p.indices), p.shape, dtype, tuple(x_shape), seed)
    if _VALUE_SETS["key"] != key or _VALUE_SETS["pattern"] is not p:
        _VALUE_SETS.update(key=key, pattern=p, sets={})
    sets = _VALUE_SETS["sets"]
    if s not in sets:
        sets[s] = _ValueSet(p, lengths, x_shape, dtype, seed, s)
    return sets[s]


def _bytes(t):
    t = t.detach().reshape(-1)
    return t.view(__import__("torch").uint8) if t.numel() else t


def _snapshot(tensors) -> list:
    """Device-side copies of CUDA input tensors (compared bytewise after the launch: cheaper
    than hashing them on the host, which dominated verification of large matrices)."""
    return [_bytes(t).clone() for t in tensors]


def _unchanged(tensors, snapshot) -> bool:
    torch = __import__("torch")
    return all(torch.equal(_bytes(t), b) for t, b in zip(tensors, snapshot))


@dataclass
class _Run:
    y: np.ndarray  # float64, output shape
    raw: np.ndarray  # the output's bits (uint view), for bitwise comparison
    guards_ok: bool
    inputs_ok: bool


# ------------------------------------------------------------------ executors

class CpuRunner:
    """Runs the kernel through ``simt`` on numpy arrays (after an NVRTC compile check)."""

    executor = "cpu"

    def __init__(self, candidate: Candidate, header, pattern: Pattern, fd, n: int):
        self.header, self.pattern, self.fd, self.n = header, pattern, fd, n
        self.compile_log = ""
        try:
            from sparserl_compile import compiler
        except ImportError:
            compiler = None
        if compiler is not None:
            try:
                res = compiler.compile_cubin(candidate.source, arch="sm_90")
                self.compile_log = getattr(res, "log", "") or ""
                self.cubin = res.cubin
            except compiler.CompileError as e:
                raise _Fail("compile", f"NVRTC rejected the kernel:\n{getattr(e, 'log', e)}") from None
        from sparserl_compile import simt

        try:
            self.kernel = simt.compile_kernel(candidate.source)
        except Exception as e:  # noqa: BLE001 - any simt build failure is a compile failure
            raise _Fail("compile", f"the CPU executor could not build the kernel: {type(e).__name__}: {e}") from None
        self.arrays = {k: np.ascontiguousarray(v) for k, v in fd.arrays.items()}

    def run(self, vals: np.ndarray, x: np.ndarray, out_shape, dtype: str) -> _Run:
        from sparserl_compile import simt

        udt, bits = _POISON[dtype]
        size = int(np.prod(out_shape))
        buf = np.full(size + 2 * GUARD, bits, dtype=udt)
        if self.header.launch.zero_output:
            buf[GUARD:GUARD + size] = 0
        store = np.float32 if dtype == "f32" else (np.float16 if dtype == "f16" else np.uint16)
        ybuf = buf.view(store)
        y = ybuf[GUARD:GUARD + size]
        vfmt = self.fd.gather_values(vals)
        xf = np.ascontiguousarray(x).reshape(-1)
        inputs = list(self.arrays.values()) + [vfmt, xf]
        before = digest(inputs)
        args = self.fd.kernel_args(self.header.op, self.n, self.arrays, vfmt, xf, y)
        grid = self.header.launch.grid(self.fd.scalars, self.n)
        try:
            self.kernel.launch(grid, (self.header.launch.block, 1, 1), self.header.launch.smem, args)
        except simt.SimtFault as e:
            raise _Fail("launch", f"the kernel faulted on the CPU executor: {type(e).__name__}: {e}") from None
        guards_ok = bool((buf[:GUARD] == bits).all() and (buf[GUARD + size:] == bits).all())
        raw = buf[GUARD:GUARD + size].copy()
        yv = from_storage(raw.view(store), dtype).reshape(out_shape)
        return _Run(yv, raw, guards_ok, digest(inputs) == before)


class GpuRunner:
    """Compiles with NVRTC, launches through ``launcher`` on torch CUDA tensors."""

    executor = "gpu"

    def __init__(self, candidate: Candidate, header, pattern: Pattern, fd, n: int, cubin: bytes | None = None):
        import torch

        from sparserl_compile import formats, launcher

        self.torch = torch
        self.header, self.pattern, self.fd, self.n = header, pattern, fd, n
        self.compile_log = ""
        if cubin is None:
            from sparserl_compile import compiler

            major, minor = torch.cuda.get_device_capability()
            try:
                res = compiler.compile_cubin(candidate.source, arch=f"sm_{major}{minor}")
            except compiler.CompileError as e:
                raise _Fail("compile", f"NVRTC rejected the kernel:\n{getattr(e, 'log', e)}") from None
            cubin, self.compile_log = res.cubin, getattr(res, "log", "") or ""
        self.cubin = cubin
        try:
            self.kernel = launcher.load(cubin, header)
        except launcher.LaunchError as e:
            raise _Fail("compile", str(e)) from None
        self.arrays = formats.to_device(fd, "cuda")
        self.grid = header.launch.grid(fd.scalars, n)
        self.last = None

    def run(self, vals: np.ndarray, x: np.ndarray, out_shape, dtype: str) -> _Run:
        """One launch on a poisoned, guarded output; the output stays on the GPU (``_Run.y``
        float64 and ``_Run.raw`` its bits, as CUDA tensors)."""
        torch = self.torch
        udt, bits = _POISON[dtype]
        size = int(np.prod(out_shape))
        int_t = torch.int32 if udt == np.uint32 else torch.int16
        signed_bits = int(np.array(bits, dtype=udt).view(np.int32 if udt == np.uint32 else np.int16))
        store_t = getattr(torch, contract.TORCH_NAMES[dtype])
        buf = torch.empty(size + 2 * GUARD, dtype=store_t, device="cuda")
        buf.view(int_t).fill_(signed_bits)
        y = buf[GUARD:GUARD + size]
        if self.header.launch.zero_output:
            y.zero_()
        vt = _as_storage(torch, vals, dtype)
        vfmt = self.fd.gather_values(vt).contiguous()
        xt = _as_storage(torch, x.reshape(-1), dtype)
        inputs = list(self.arrays.values()) + [vfmt, xt]
        before = _snapshot(inputs)
        args = self.fd.kernel_args(self.header.op, self.n, self.arrays, vfmt, xt, y)
        try:
            self.kernel.launch(args, self.grid)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - CUDA errors surface as RuntimeError or LaunchError
            raise _Fail("launch", f"CUDA error while running the kernel: {type(e).__name__}: {e}") from None
        self.last = (args, xt, y, vt)
        guard_bits = buf.view(int_t)
        guards_ok = bool((guard_bits[:GUARD] == signed_bits).all() and (guard_bits[GUARD + size:] == signed_bits).all())
        raw = y.view(int_t).clone()
        return _Run(y.double().reshape(out_shape), raw, guards_ok, _unchanged(inputs, before))

    def launch_fn(self):
        """A zero-argument callable running the product once on the last value set (bound), as
        the runtime runs it: a ``zero_output=1`` kernel's output is zeroed first, and that
        memset is part of what is timed (it is part of every call's cost)."""
        args, xt, y, _ = self.last
        bound = self.kernel.bind(args[:-2], grid=self.grid)
        if self.header.launch.zero_output:
            def zero_then_launch():
                y.zero_()
                bound(xt, y)

            return zero_then_launch
        return lambda: bound(xt, y)

    def cusparse(self, vals, x, dtype: str):
        """torch.sparse CSR (cuSPARSE) in the kernel's dtype, as a float64 CUDA tensor
        (``vals`` and ``x``: storage arrays, or tensors from ``_ValueSet.device_operands``)."""
        torch = self.torch
        p = self.pattern
        vt = _as_storage(torch, vals, dtype)
        xt = _as_storage(torch, x, dtype)
        if self.header.op != "spmv":
            xt = xt.reshape(p.shape[1], self.n)  # device operands are uploaded flat
        a = torch.sparse_csr_tensor(torch.from_numpy(p.indptr).cuda(), torch.from_numpy(p.indices).cuda(),
                                    vt, size=p.shape)
        out = torch.mv(a, xt) if xt.dim() == 1 else torch.mm(a, xt)
        return out.double()


# ------------------------------------------------------------------ the driver

def prepare(candidate: Candidate, matrix, *, op: str | None = None, dtype: str | None = None,
            executor: str = "gpu", n: int = 1, cubin: bytes | None = None, static: bool = True,
            passed: list[str] | None = None):
    """Static checks, format conversion and compile: returns a runner (raises ``_Fail``)."""
    from sparserl_compile import formats

    passed = [] if passed is None else passed
    op = op or candidate.header.op
    dtype = dtype or candidate.header.dtype
    if static:
        header = static_checks(candidate, op, dtype, passed)
    else:
        header = candidate.header
    n = 1 if op == "spmv" else int(n)
    if n % header.launch.n_align:
        raise _Fail("align", f"dense width n={n} is not a multiple of the kernel's n_align={header.launch.n_align}")
    passed.append("align")
    pattern = Pattern.of(matrix)
    try:
        fd = formats.convert(pattern.indptr, pattern.indices, pattern.shape, header.format, header.params)
    except formats.FormatNotSuitable as e:
        raise _Fail("format", f"the matrix does not suit format {header.format}: {e}") from None
    passed.append("format")
    if executor == "gpu":
        runner = GpuRunner(candidate, header, pattern, fd, n, cubin)
    elif executor == "cpu":
        runner = CpuRunner(candidate, header, pattern, fd, n)
    else:
        raise ValueError(f"executor={executor!r}; use 'gpu' or 'cpu'")
    passed.append("compile")
    return runner


def verify(candidate: Candidate, matrix, *, op: str | None = None, dtype: str | None = None,
           executor: str = "gpu", n: int = 1, value_sets: int = 3, seed: int = 0,
           cubin: bytes | None = None, compare_cusparse: bool = True, static: bool = True,
           runner_out: list | None = None) -> VerifyResult:
    """Run every check on ``candidate`` for ``matrix`` (scipy CSR or ``Pattern``).

    ``static=False`` skips checks 1-3 (fault-injection tests use it to reach the dynamic
    checks). ``runner_out``, if given, receives the runner (the sandbox times through it).
    """
    t0 = time.perf_counter()
    passed: list[str] = []
    errs: list[float] = []
    notes: list[str] = []
    op = op or candidate.header.op
    dtype = dtype or candidate.header.dtype
    n = 1 if op == "spmv" else int(n)
    log = ""
    phases = dict.fromkeys(("prepare", "values", "runs", "cusparse"), 0.0)
    try:
        runner = prepare(candidate, matrix, op=op, dtype=dtype, executor=executor, n=n, cubin=cubin,
                         static=static, passed=passed)
        phases["prepare"] = time.perf_counter() - t0
        log = runner.compile_log
        if runner_out is not None:
            runner_out.append(runner)
        p = runner.pattern
        lengths = np.diff(p.indptr)
        x_shape = (p.shape[1],) if op == "spmv" else (p.shape[1], n)
        out_shape = (p.shape[0],) if op == "spmv" else (p.shape[0], n)
        zero_out = candidate.header.launch.zero_output
        for s in range(value_sets):
            t1 = time.perf_counter()
            vs = _value_set(p, lengths, x_shape, dtype, seed, s)
            gpu = runner.executor == "gpu"
            vals, x = vs.device_operands() if gpu else (vs.vals, vs.x)
            ref, absref, bound = vs.device() if gpu else vs.host()
            t2 = time.perf_counter()
            phases["values"] += t2 - t1
            first = runner.run(vals, x, out_shape, dtype)
            if not first.inputs_ok:
                vs.drop_device_operands()  # the shared operands were written into: next runs upload afresh
            _check_run(first, ref, bound, s, "")
            second = runner.run(vals, x, out_shape, dtype)
            if not second.inputs_ok:
                vs.drop_device_operands()
            _check_run(second, ref, bound, s, " (second run)")
            if not zero_out and not _same_bits(first.raw, second.raw):
                raise _Fail("deterministic", f"value set {s}: two runs of the same inputs differ bit for bit "
                                             "(a kernel without atomics must be deterministic)")
            errs.append(_max_rel_err(first.y, ref, absref))
            t3 = time.perf_counter()
            phases["runs"] += t3 - t2
            if executor == "gpu" and compare_cusparse:
                try:
                    cs = vs.cusparse if vs.cusparse is not None else runner.cusparse(vals, x, dtype)
                    vs.cusparse = cs
                except RuntimeError as e:
                    notes.append(f"cusparse comparison skipped: {str(e).splitlines()[0][:120]}")
                    compare_cusparse = False
                else:
                    bad = abs(first.y - cs) > 2 * bound
                    if bad.any():
                        i = _first(bad)
                        raise _Fail("cusparse", f"value set {s}: output {i} = {_at(first.y, i)!r} "
                                                f"disagrees with cuSPARSE {_at(cs, i)!r}")
            phases["cusparse"] += time.perf_counter() - t3
        for c in ("launch", "bounds", "inputs", "written", "error_bound", "deterministic"):
            passed.append(c)
        if executor == "gpu" and compare_cusparse:
            passed.append("cusparse")
        reason = f"passed {len(passed)} checks on {value_sets} value sets"
        return VerifyResult(True, reason, None, tuple(passed), tuple(errs), executor, n, value_sets, log,
                            time.perf_counter() - t0, tuple(notes), phases)
    except _Fail as f:
        return VerifyResult(False, f"{f.check}: {f.reason}", f.check, tuple(passed), tuple(errs), executor, n,
                            value_sets, log, time.perf_counter() - t0, tuple(notes), phases)


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


def _check_run(run: _Run, ref, bound, s: int, which: str) -> None:
    """The output checks of one run; ``run.y``, ``ref`` and ``bound`` are all numpy arrays
    (CPU executor) or all CUDA tensors (GPU executor, checked where they are)."""
    if not run.guards_ok:
        raise _Fail("bounds", f"value set {s}{which}: the kernel wrote outside y (guard zone changed)")
    if not run.inputs_ok:
        raise _Fail("inputs", f"value set {s}{which}: the kernel modified an input array")
    nan = run.y != run.y
    if nan.any():
        i = _first(nan)
        raise _Fail("written", f"value set {s}{which}: output {i} (and {int(nan.sum()) - 1} more) left "
                               "unwritten or NaN")
    err = abs(run.y - ref)
    bad = ~(err <= bound)
    if bad.any():
        i = int((err - bound).reshape(-1).argmax())
        raise _Fail("error_bound", f"value set {s}{which}: output {i} = {_at(run.y, i)!r}, float64 "
                                   f"reference {_at(ref, i)!r}, error {_at(err, i):.3g} > "
                                   f"bound {_at(bound, i):.3g} ({int(bad.sum())} outputs out of bound)")
