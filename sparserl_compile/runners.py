"""Run one candidate kernel once, as verification needs it: on a poisoned (or a given) output,
with every array where an out-of-bounds access faults or shows, inputs compared after.

``CpuRunner`` runs through ``simt`` on numpy arrays: every array is copied into a guarded
mapping for the launch (``simt/guard.h``), so raw-pointer accesses past it fault, and writes
beside it or races on ``y`` are reported as faults. ``GpuRunner`` launches through
``launcher`` on torch CUDA tensors placed in ``guarded.Regions``. Both take the value set's
operands (CSR values in the storage type, ``x`` at the set's full width), the dense width of
this run, the placement (0: arrays at the start of their regions, 1: at the end) and, for the
stale-output check, the output's starting bits instead of the poison. ``verify.py`` drives
them and checks what they return (``Run``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparserl_compile import contract
from sparserl_compile.operands import as_storage, from_storage

#: NaN bit patterns used to poison outputs (distinctive payloads)
POISON = {"f32": (np.uint32, 0x7FC0DEAD), "f16": (np.uint16, 0x7E5A), "bf16": (np.uint16, 0x7FDA)}


class Fail(Exception):
    """A failed check: ``check`` names it (``verify.CHECKS``), ``reason`` says what happened."""

    def __init__(self, check: str, reason: str):
        super().__init__(reason)
        self.check = check
        self.reason = reason


@dataclass
class Run:
    """One launch's output: ``y`` float64 in the output's shape, ``raw`` its bits (numpy arrays
    or CUDA tensors), ``unwritten`` a mask of outputs still holding the poison (None when the
    run started from given bits), ``guards_ok`` no write beside an array, ``inputs_ok`` every
    input unchanged."""

    y: object
    raw: object
    guards_ok: bool
    inputs_ok: bool
    unwritten: object = None
    guard_detail: str = ""


def out_shape(p, op: str, w: int) -> tuple[int, ...]:
    return (p.shape[0],) if op == "spmv" else (p.shape[0], w)


class CpuRunner:
    """Runs the kernel through ``simt`` on numpy arrays (after an NVRTC compile check)."""

    executor = "cpu"
    oob = "mmap guard regions (raw pointers fault), per-access bounds checks"

    def __init__(self, candidate, header, pattern, fd, n: int):
        self.header, self.pattern, self.fd, self.n = header, pattern, fd, n
        self.compile_log = ""
        self.cubin = None
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
                raise Fail("compile", f"NVRTC rejected the kernel:\n{getattr(e, 'log', e)}") from None
        from sparserl_compile import simt

        try:
            self.kernel = simt.compile_kernel(candidate.source)
        except Exception as e:  # noqa: BLE001 - any simt build failure is a compile failure
            raise Fail("compile", f"the CPU executor could not build the kernel: {type(e).__name__}: {e}") from None
        self.arrays = {k: np.ascontiguousarray(v) for k, v in fd.arrays.items()}

    def run(self, vals, x, w: int, dtype: str, *, placement: int = 0, start=None) -> Run:
        """One launch at width ``w`` (``x``: the set's operand, sliced to ``w`` columns here);
        ``start``: the output's bits to begin with instead of the poison."""
        from sparserl_compile import simt

        op = self.header.op
        shape = out_shape(self.pattern, op, w)
        udt, bits = POISON[dtype]
        if start is not None:
            raw = np.array(start, dtype=udt).reshape(-1)
        else:
            raw = np.full(int(np.prod(shape)), bits, dtype=udt)
        if self.header.launch.zero_output:
            raw[:] = 0
        store = np.float32 if dtype == "f32" else (np.float16 if dtype == "f16" else np.uint16)
        y = raw.view(store)
        vfmt = self.fd.gather_values(vals)
        xf = np.ascontiguousarray(x if op == "spmv" else np.asarray(x)[:, :w]).reshape(-1)
        inputs = list(self.arrays.values()) + [vfmt, xf]
        before = [a.copy() for a in inputs]
        args = self.fd.kernel_args(op, w, self.arrays, vfmt, xf, y)
        grid = self.header.launch.grid(self.fd.scalars, w)
        try:
            self.kernel.launch(grid, (self.header.launch.block, 1, 1), self.header.launch.smem, args,
                               placement=placement)
        except simt.OutOfBounds as e:
            if isinstance(e, simt.MisalignedAccess):
                raise Fail("launch", f"the kernel faulted on the CPU executor: {type(e).__name__}: {e}") from None
            raise Fail("bounds", f"out-of-bounds access on the CPU executor: {e}") from None
        except simt.GlobalMemoryRace as e:
            raise Fail("race", f"a race on the output on the CPU executor: {e}") from None
        except simt.SharedMemoryRace as e:
            raise Fail("race", f"a shared-memory race on the CPU executor: {e}") from None
        except simt.SimtFault as e:
            raise Fail("launch", f"the kernel faulted on the CPU executor: {type(e).__name__}: {e}") from None
        inputs_ok = all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(inputs, before))
        unwritten = (raw == bits).reshape(shape) if start is None and not self.header.launch.zero_output else None
        yv = from_storage(y, dtype).reshape(shape)
        return Run(yv, raw.copy(), True, inputs_ok, unwritten)

    def close(self) -> None:
        pass


class GpuRunner:
    """Compiles with NVRTC, launches through ``launcher`` on CUDA tensors in guarded regions."""

    executor = "gpu"

    def __init__(self, candidate, header, pattern, fd, n: int, cubin: bytes | None = None,
                 widest: int | None = None, *, device: str = "cuda", kernel=None):
        """``device``/``kernel``: where the arrays live and what launches there (a loaded
        cubin by default); the tests run this runner's logic on CPU tensors with a CPU-executor
        kernel in place of the cubin."""
        import torch

        from sparserl_compile import launcher
        from sparserl_compile.guarded import Regions

        self.torch, self.device = torch, device
        self.header, self.pattern, self.fd, self.n = header, pattern, fd, n
        self.compile_log = ""
        if kernel is not None:
            self.kernel, self.cubin = kernel, cubin
        elif cubin is None:
            from sparserl_compile import compiler

            major, minor = torch.cuda.get_device_capability()
            try:
                res = compiler.compile_cubin(candidate.source, arch=f"sm_{major}{minor}")
            except compiler.CompileError as e:
                raise Fail("compile", f"NVRTC rejected the kernel:\n{getattr(e, 'log', e)}") from None
            cubin, self.compile_log = res.cubin, getattr(res, "log", "") or ""
        if kernel is None:
            self.cubin = cubin
            try:
                self.kernel = launcher.load(cubin, header)
            except launcher.LaunchError as e:
                raise Fail("compile", str(e)) from None
        self.regions = Regions(torch, device)
        self.oob = f"{self.regions.mode}: {self.regions.reason}"
        self.structure = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in fd.arrays.items()}
        self.widest = max(n, widest or n)
        self.last = None

    def _place(self, name: str, t, placement: int):
        r = self.regions.region(name, t.numel() * t.element_size())
        return r.place(self.torch, t.dtype, tuple(t.shape), placement, t)

    def run(self, vals, x, w: int, dtype: str, *, placement: int = 0, start=None) -> Run:
        """One launch at width ``w`` on a poisoned output (or one starting from ``start``'s
        bits); the output stays on the GPU (``Run.y`` float64 and ``Run.raw`` its bits)."""
        torch = self.torch
        op = self.header.op
        shape = out_shape(self.pattern, op, w)
        udt, bits = POISON[dtype]
        int_t = torch.int32 if udt == np.uint32 else torch.int16
        signed_bits = int(np.array(bits, dtype=udt).view(np.int32 if udt == np.uint32 else np.int16))
        store_t = getattr(torch, contract.TORCH_NAMES[dtype])
        if op != "spmv":  # regions for the widest width first, so narrower ones reuse them
            es = 4 if dtype == "f32" else 2
            self.regions.region("x", self.pattern.shape[1] * self.widest * es)
            self.regions.region("y", self.pattern.shape[0] * self.widest * es)
        arrays = {k: self._place(k, t, placement) for k, t in self.structure.items()}
        vt = as_storage(torch, vals, dtype, self.device)
        vfmt = self._place("vals", self.fd.gather_values(vt).contiguous(), placement)
        xt = as_storage(torch, x, dtype, self.device)
        if op != "spmv":
            xt = xt.reshape(self.pattern.shape[1], -1)[:, :w]
        xt = self._place("x", xt.contiguous(), placement)
        ybytes = int(np.prod(shape)) * (4 if udt == np.uint32 else 2)
        yr = self.regions.region("y", ybytes)
        y = yr.place(torch, store_t, shape, placement)
        if start is not None:
            y.view(int_t).copy_(start.reshape(shape))
        else:
            y.view(int_t).fill_(signed_bits)
        if self.header.launch.zero_output:
            y.zero_()
        inputs = list(arrays.values()) + [vfmt, xt]
        before = [_bytes(t).clone() for t in inputs]
        args = self.fd.kernel_args(op, w, arrays, vfmt, xt.reshape(-1), y)
        try:
            self.kernel.launch(args, self.header.launch.grid(self.fd.scalars, w))
            if self.regions.device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - CUDA errors surface as RuntimeError or LaunchError
            msg = f"{type(e).__name__}: {e}"
            if "illegal" in msg.lower() and self.regions.mode == "vmm":
                raise Fail("bounds", f"the kernel accessed unmapped memory (an address outside every array, "
                                     f"e.g. out of bounds; each array has {self.oob}): {msg}") from None
            raise Fail("launch", f"CUDA error while running the kernel: {msg}") from None
        self.last = (args, w)
        outside = self.regions.outside_ok()
        detail = "" if outside is None else f"a byte beside array {outside[0]!r} changed (byte offset {outside[1]})"
        raw = y.view(int_t).clone()
        unwritten = (raw == signed_bits) if start is None and not self.header.launch.zero_output else None
        inputs_ok = all(torch.equal(_bytes(t), b) for t, b in zip(inputs, before))
        return Run(y.double().reshape(shape), raw, outside is None, inputs_ok, unwritten, detail)

    def timing_fns(self, vals, x, dtype: str):
        """(call, poison, out_bytes) for timing the primary width: ``call(k)`` runs the product
        once into output ``k`` (placement 0, the runtime's launch: a ``zero_output=1`` kernel's
        output is zeroed first, inside the call), ``poison()`` refills every output handed out
        so far with the NaN pattern (outside the timed events), so no call finds a previous
        answer in ``y``."""
        torch = self.torch
        self.run(vals, x, self.n, dtype, placement=0)
        args, w = self.last
        bound = self.kernel.bind(args[:-2], grid=self.header.launch.grid(self.fd.scalars, w))
        xt, y0 = args[-2], args[-1]
        udt, bits = POISON[dtype]
        int_t = torch.int32 if udt == np.uint32 else torch.int16
        signed_bits = int(np.array(bits, dtype=udt).view(np.int32 if udt == np.uint32 else np.int16))
        outs = [y0]
        zero = self.header.launch.zero_output

        def out(k: int):
            while len(outs) <= k:
                outs.append(torch.empty_like(y0))
            return outs[k]

        def call(k: int = 0):
            yk = out(k)
            if zero:
                yk.zero_()
            bound(xt, yk)

        def poison():
            for o in outs:
                o.view(int_t).fill_(signed_bits)

        return call, poison, y0.numel() * y0.element_size()

    def cusparse(self, vals, x, dtype: str, w: int):
        """torch.sparse CSR (cuSPARSE) at width ``w`` on the kernel's operands, float64 on the GPU.
        Half-precision operands are multiplied in float32 (exactly representable there):
        cuSPARSE's bf16 SpMM strays further from the exact product than a kernel that rounds
        once at the end is allowed to, and this is the second reference, not the user's
        alternative (``bench`` times that one)."""
        torch = self.torch
        from sparserl_compile.bench import csr_tensor
        from sparserl_compile.reference import HALF

        p = self.pattern
        vt = as_storage(torch, vals, dtype, self.device)
        xt = as_storage(torch, x, dtype, self.device)
        if vt.dtype in HALF:
            vt, xt = vt.float(), xt.float()
        if self.header.op != "spmv":
            xt = xt.reshape(p.shape[1], -1)[:, :w].contiguous()
        a = csr_tensor(torch, torch.from_numpy(p.indptr).to(self.device), torch.from_numpy(p.indices).to(self.device),
                       vt, p.shape)
        out = torch.mv(a, xt) if xt.dim() == 1 else torch.mm(a, xt)
        return out.double()

    def close(self) -> None:
        self.last = None
        self.regions.close()


def _bytes(t):
    t = t.detach().reshape(-1)
    return t.view(__import__("torch").uint8) if t.numel() else t
