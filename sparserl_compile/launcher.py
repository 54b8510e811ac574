"""Load a cubin and launch ``sparserl_kernel`` on torch's current CUDA stream.

What it does:

* ``load(cubin, header)`` loads the module into torch's primary context (cuda.core's
  ``Device(i).set_current()`` retains the same primary context torch uses) and returns a
  ``LoadedKernel``.
* ``LoadedKernel.launch(args, grid, block, smem)`` launches once on torch's *current* stream.
  ``args`` is the contract-ordered argument list of ``formats.FormatData.kernel_args``:
  ``np.int32`` scalars, and torch tensors (or raw device pointers as Python ints) for arrays.
  A plain Python ``int`` is a pointer, never a scalar: that is cuda.core's rule, kept here.
* ``LoadedKernel.bind(fixed_args, grid=..., block=..., smem=...)`` prepares everything but
  the two dense operands and returns a ``BoundKernel``; ``bound(x, y)`` then costs one
  ``data_ptr()`` per operand and one launch. The grid depends on the dense width ``n`` for
  SpMM, so a binding is for one ``n``; bind again for another width.

No host synchronisation, no device allocation and no host-to-device copy happen per call, so
launches are CUDA-graph capturable (torch's capture stream is just another current stream;
the cuda.core stream wrapper is cached per stream handle).

Two back ends: cuda.core (``ObjectCode.from_cubin`` / ``launch``; the path measured on the
device image, cuda-core 1.2) and, where cuda.core is missing or fails to import, the
cuda.bindings driver API (``cuModuleLoadData`` / ``cuLaunchKernel``). Dynamic shared memory
above 48 KiB is enabled through ``cuKernelSetAttribute``/``cuFuncSetAttribute``
(cuda.core's kernel attributes are read-only).

It does not compile (``compiler.py``), convert formats (``formats.py``) or check results
(``verify.py``).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from sparserl_compile.contract import KERNEL_NAME, KernelHeader

_SMEM_DEFAULT_LIMIT = 48 * 1024
#: bound launches go straight to libcuda's cuLaunchKernel where it loads (``_DirectLaunch``);
#: set SPARSERL_DIRECT_LAUNCH=0 to use the back end's own launch
DIRECT_LAUNCH = os.environ.get("SPARSERL_DIRECT_LAUNCH", "1") != "0"


class LaunchError(RuntimeError):
    """A kernel could not be loaded or launched; the message names the step and the fix."""


def _torch():
    import torch

    if not torch.cuda.is_available():
        raise LaunchError("no CUDA device is visible to torch: the launcher needs a GPU "
                          "(use executor='cpu' to run kernels through sparserl_compile.simt)")
    return torch


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # pragma: no cover - very old cuda-python
        from cuda import cuda as driver  # type: ignore[no-redef]
    return driver


def _check(result, what: str):
    """Unpack a cuda.bindings call result ``(err, *values)``, raising on error."""
    driver = _driver()
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != int(driver.CUresult.CUDA_SUCCESS):
        try:
            _, name = driver.cuGetErrorName(err)
            name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # noqa: BLE001
            name = str(err)
        raise LaunchError(f"{what} failed with {name}")
    if isinstance(result, tuple):
        rest = result[1:]
        return rest[0] if len(rest) == 1 else (rest or None)
    return None


def _have_cuda_core() -> bool:
    try:
        import cuda.core  # noqa: F401
        from cuda.core import LaunchConfig, ObjectCode, launch  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


class _TorchStream:
    """Exposes a torch stream through the ``__cuda_stream__`` protocol cuda.core reads."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def _ptr(a: Any) -> Any:
    """Kernel argument as the launch wants it: tensors -> device pointer, scalars untouched."""
    if isinstance(a, (np.integer, np.floating)):
        return a
    if isinstance(a, int):  # already a pointer
        return a
    dp = getattr(a, "data_ptr", None)
    if dp is not None:
        if not getattr(a, "is_cuda", True):
            raise LaunchError("a kernel argument is a CPU tensor; move the format data and "
                              "operands to the GPU first (formats.to_device)")
        return dp()
    raise LaunchError(f"cannot pass {type(a).__name__} to a kernel: use np.int32 for scalars "
                      "and CUDA tensors (or int device pointers) for arrays")


def _dim3(v) -> tuple[int, int, int]:
    if isinstance(v, int):
        return (v, 1, 1)
    t = tuple(int(i) for i in v) + (1, 1, 1)
    return t[:3]


@dataclass(frozen=True)
class LaunchInfo:
    """What was loaded: back end, device, registers and the shared memory granted."""

    backend: str  # "cuda.core" or "driver"
    device: int
    num_regs: int | None
    max_dynamic_smem: int


class LoadedKernel:
    """A ``sparserl_kernel`` loaded into torch's context on one device."""

    def __init__(self, cubin: bytes, header: KernelHeader, *, device: int | None = None,
                 backend: str | None = None):
        torch = _torch()
        if not cubin:
            raise LaunchError("empty cubin: compile the kernel first (compiler.compile_cubin)")
        self.header = header
        self.device = torch.cuda.current_device() if device is None else int(device)
        torch.cuda.init()
        self._streams: dict[int, Any] = {}
        # torch's raw current-stream query skips building a torch.cuda.Stream object (~2 us)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._raw_stream = raw if raw is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)
        want = backend or ("cuda.core" if _have_cuda_core() else "driver")
        if want == "cuda.core":
            self._load_cuda_core(bytes(cubin))
        elif want == "driver":
            self._load_driver(bytes(cubin))
        else:
            raise LaunchError(f"unknown launcher backend {want!r}; use 'cuda.core' or 'driver'")
        self.backend = want
        self._smem_granted = _SMEM_DEFAULT_LIMIT
        if header.launch.smem > _SMEM_DEFAULT_LIMIT:
            self._raise_smem(header.launch.smem)

    # ---- loading -------------------------------------------------------------------------
    def _load_cuda_core(self, cubin: bytes) -> None:
        from cuda.core import Device, ObjectCode

        dev = Device(self.device)
        dev.set_current()  # primary context: the one torch uses
        self._dev = dev
        try:
            self._obj = ObjectCode.from_cubin(cubin)
            self._kernel = self._obj.get_kernel(KERNEL_NAME)
        except Exception as e:  # noqa: BLE001
            raise LaunchError(f"loading the cubin failed ({type(e).__name__}: {e}); was it "
                              f"compiled for this GPU's arch and does it define {KERNEL_NAME}?") from e

    def _load_driver(self, cubin: bytes) -> None:
        driver = _driver()
        torch = _torch()
        with torch.cuda.device(self.device):
            torch.cuda.current_stream()  # make torch create/retain its primary context
            ctx = _check(driver.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
            _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self._cubin_buf = cubin  # keep alive for the module's lifetime
        self._module = _check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        self._kernel = _check(driver.cuModuleGetFunction(self._module, KERNEL_NAME.encode()),
                              f"cuModuleGetFunction({KERNEL_NAME})")

    def _raise_smem(self, nbytes: int) -> None:
        driver = _driver()
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        if self.backend == "driver":
            _check(driver.cuFuncSetAttribute(self._kernel, attr, nbytes), "cuFuncSetAttribute")
        else:
            handle = self._kernel.handle
            if type(handle).__name__ == "CUkernel":
                dev = _check(driver.cuDeviceGet(self.device), "cuDeviceGet")
                _check(driver.cuKernelSetAttribute(attr, nbytes, handle, dev),
                       "cuKernelSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
            else:
                _check(driver.cuFuncSetAttribute(handle, attr, nbytes),
                       "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        self._smem_granted = nbytes

    def info(self) -> LaunchInfo:
        regs = None
        try:
            if self.backend == "cuda.core":
                regs = int(self._kernel.attributes.num_regs)
        except Exception:  # noqa: BLE001
            pass
        return LaunchInfo(self.backend, self.device, regs, self._smem_granted)

    # ---- launching -----------------------------------------------------------------------
    def _stream(self):
        """cuda.core Stream (or raw handle) for torch's current stream, cached by handle."""
        h = self._raw_stream(self.device)
        s = self._streams.get(h)
        if s is None:
            if self.backend == "cuda.core":
                s = self._dev.create_stream(_TorchStream(h))
            else:
                s = _driver().CUstream(h)
            self._streams[h] = s
        return s

    def _config(self, grid, block, smem: int):
        if smem > self._smem_granted:
            self._raise_smem(int(smem))
        if self.backend == "cuda.core":
            from cuda.core import LaunchConfig

            return LaunchConfig(grid=_dim3(grid), block=_dim3(block), shmem_size=int(smem))
        return (_dim3(grid), _dim3(block), int(smem))

    def _launch_raw(self, stream, config, args: tuple) -> None:
        if self.backend == "cuda.core":
            from cuda.core import launch

            launch(stream, config, self._kernel, *args)
            return
        driver = _driver()
        (gx, gy, gz), (bx, by, bz), smem = config
        vals, types = [], []
        for a in args:
            if isinstance(a, np.integer):
                vals.append(int(a))
                types.append(ctypes.c_int32 if a.dtype.itemsize == 4 else ctypes.c_int64)
            elif isinstance(a, np.floating):
                vals.append(float(a))
                types.append(ctypes.c_float if a.dtype.itemsize == 4 else ctypes.c_double)
            else:
                vals.append(int(a))
                types.append(ctypes.c_void_p)
        _check(driver.cuLaunchKernel(self._kernel, gx, gy, gz, bx, by, bz, smem, stream,
                                     (tuple(vals), tuple(types)), 0), "cuLaunchKernel")

    def launch(self, args: Sequence[Any], grid, block=None, smem: int | None = None) -> None:
        """Launch once on torch's current stream. ``block``/``smem`` default to the header's."""
        block = self.header.launch.block if block is None else block
        smem = self.header.launch.smem if smem is None else smem
        cfg = self._config(grid, block, smem)
        self._launch_raw(self._stream(), cfg, tuple(_ptr(a) for a in args))

    def bind(self, fixed_args: Sequence[Any], *, grid, block=None, smem: int | None = None) -> "BoundKernel":
        """Prepare a launch with every argument but ``x`` and ``y`` fixed.

        ``fixed_args`` is the contract-ordered argument list without its last two entries
        (``x``, ``y``). Tensors passed here must stay alive as long as the binding: the
        ``BoundKernel`` keeps references to them.
        """
        block = self.header.launch.block if block is None else block
        smem = self.header.launch.smem if smem is None else smem
        return BoundKernel(self, tuple(fixed_args), self._config(grid, block, smem), (grid, block, smem))


class BoundKernel:
    """``bound(x, y)``: one launch with the prepared arguments; only the operand pointers change.

    Where the CUDA driver library can be opened through ctypes (every GPU machine), the launch
    is one ``cuLaunchKernel`` call on a parameter array built once (``_DirectLaunch``): each
    call writes the two operand pointers into it and launches, a few hundred nanoseconds of
    Python, against several microseconds for cuda.core's ``launch`` (which parses every
    argument per call). Elsewhere, or if that path fails to set up, the back end's own launch."""

    __slots__ = ("_kernel", "_keep", "_fixed", "_config", "_launch", "_stream", "_direct")

    def __init__(self, kernel: LoadedKernel, fixed: tuple, config, dims):
        self._kernel = kernel
        self._keep = fixed  # keep the tensors alive
        self._fixed = tuple(_ptr(a) for a in fixed)
        self._config = config
        self._launch: Callable = kernel._launch_raw
        self._stream = kernel._stream
        self._direct = _DirectLaunch.build(kernel, self._fixed, dims) if DIRECT_LAUNCH else None

    def __call__(self, x, y) -> None:
        if self._direct is not None:
            self._direct(x.data_ptr(), y.data_ptr())
            return
        self._launch(self._stream(), self._config, self._fixed + (x.data_ptr(), y.data_ptr()))


_libcuda: list = []


def _cuda_library():
    """``libcuda`` through ctypes, or None."""
    if not _libcuda:
        lib = None
        for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        _libcuda.append(lib)
    return _libcuda[0]


class _DirectLaunch:
    """A launch of one bound kernel straight through ``libcuda``'s ``cuLaunchKernel``: the
    parameter array (one slot per argument, in contract order) is built once; a call writes the
    operand pointers into the last two slots under a lock (another thread may launch the same
    plan: the driver copies the parameters during the call) and launches on torch's current
    stream. Every argument but the stream is a ctypes object made once (the function, the
    launch dimensions as ``unsigned int``, the parameter array), and the function pointer has
    no ``argtypes``: ctypes passes ready objects as they are instead of converting ten Python
    values per call."""

    __slots__ = ("_fn", "_head", "_slots", "_params", "_x", "_y", "_lock", "_raw_stream", "_device")

    @classmethod
    def build(cls, kernel: "LoadedKernel", fixed_ptrs: tuple, dims) -> "_DirectLaunch | None":
        import threading

        lib = _cuda_library()
        if lib is None:
            return None
        try:
            func = _function_handle(kernel)
        except Exception:  # noqa: BLE001 - the back end's own launch serves
            return None
        if func is None:
            return None
        self = cls()
        self._fn = lib["cuLaunchKernel"]  # a function object of its own: no argtypes (class doc)
        self._fn.restype = ctypes.c_int
        grid, block, smem = dims
        self._head = (ctypes.c_void_p(func), *(ctypes.c_uint(int(d)) for d in (*_dim3(grid), *_dim3(block), smem)))
        slots = []
        for a in fixed_ptrs:
            if isinstance(a, np.integer):
                slots.append((ctypes.c_int32 if a.dtype.itemsize == 4 else ctypes.c_int64)(int(a)))
            elif isinstance(a, np.floating):
                slots.append((ctypes.c_float if a.dtype.itemsize == 4 else ctypes.c_double)(float(a)))
            else:
                slots.append(ctypes.c_void_p(int(a)))
        self._x, self._y = ctypes.c_void_p(0), ctypes.c_void_p(0)
        slots += [self._x, self._y]
        self._slots = slots  # keep the storage alive
        self._params = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(s) for s in slots])
        self._lock = threading.Lock()
        self._raw_stream = kernel._raw_stream
        self._device = kernel.device
        return self

    def __call__(self, xp: int, yp: int) -> None:
        stream = ctypes.c_void_p(self._raw_stream(self._device))
        with self._lock:
            self._x.value = xp
            self._y.value = yp
            rc = self._fn(*self._head, stream, self._params, None)
        if rc:
            raise LaunchError(f"cuLaunchKernel failed with CUresult {rc}")


def _function_handle(kernel: "LoadedKernel") -> int | None:
    """The ``CUfunction`` of a loaded kernel in the current context, as an int."""
    driver = _driver()
    if kernel.backend == "driver":
        return int(kernel._kernel)
    handle = kernel._kernel.handle
    if type(handle).__name__ == "CUkernel":  # a library kernel: its function in this context
        return int(_check(driver.cuKernelGetFunction(handle), "cuKernelGetFunction"))
    return int(handle)


def load(cubin: bytes, header: KernelHeader, *, device: int | None = None,
         backend: str | None = None) -> LoadedKernel:
    """Load ``cubin`` (which must define ``sparserl_kernel``) for launches on ``device``."""
    return LoadedKernel(cubin, header, device=device, backend=backend)


def host_overhead_us(fn: Callable[[], None], *, calls: int = 2000, warmup: int = 100) -> float:
    """Host microseconds per call of ``fn`` (a launch), measured without synchronising inside."""
    import time

    torch = _torch()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6
