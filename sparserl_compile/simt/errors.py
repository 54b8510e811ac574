"""The exceptions of the CPU executor: refusals, compile errors and kernel faults.

``SimtRefused`` and ``SimtCompileError`` come from ``compile_kernel``; every ``SimtFault``
subclass comes from ``SimtKernel.launch`` and carries the CUDA coordinates of the faulting
thread, so that a reward function or a user's bug report can say exactly what went wrong.
"""

from __future__ import annotations


class SimtError(Exception):
    """Base class of everything the CPU executor raises."""


class SimtUnavailable(SimtError):
    """No C++ compiler to build kernels with (install g++ or set ``$CXX``)."""


class SimtRefused(SimtError):
    """The kernel uses a construct outside the kernel language; leave it to GPU verification.

    ``construct`` names it (``"inline assembly"``, ``"wmma (tensor cores)"``, ...), ``token``
    is the word that was found and ``line`` its 1-based line in the kernel source.
    """

    def __init__(self, construct: str, token: str, line: int):
        self.construct, self.token, self.line = construct, token, line
        super().__init__(
            f"line {line}: {construct} ({token!r}) is outside the kernel language the CPU "
            f"executor runs; verify this kernel on a GPU instead"
        )


class SimtCompileError(SimtError):
    """g++ rejected the kernel. ``log`` is the compiler output, ``source`` the kernel."""

    def __init__(self, message: str, log: str, source: str, command: list[str] | None = None):
        self.log, self.source, self.command = log, source, command or []
        super().__init__(f"{message}\n{log.strip()}\n--- kernel source ---\n{numbered(source)}")


def numbered(source: str) -> str:
    """The source with 1-based line numbers, as compile errors print it."""
    lines = source.splitlines()
    w = len(str(len(lines)))
    return "\n".join(f"{i + 1:>{w}} | {ln}" for i, ln in enumerate(lines))


class SimtFault(SimtError):
    """A kernel did something wrong while running.

    ``thread`` and ``block`` are the (x, y, z) coordinates of the thread that faulted (or that
    was first found waiting, for a deadlock), ``line`` the kernel source line where that is
    known (barriers and warp operations), ``detail`` the executor's own description.
    """

    def __init__(self, detail: str, *, thread=(0, 0, 0), block=(0, 0, 0), line: int = 0,
                 kernel: str = "sparserl_kernel"):
        self.detail, self.thread, self.block, self.line = detail, tuple(thread), tuple(block), line
        where = f"thread {self.thread} of block {self.block}"
        super().__init__(f"{type(self).__name__} in {kernel}, {where}: {detail}")


class OutOfBounds(SimtFault):
    """An access outside an array: ``array`` names it (a kernel parameter such as ``x``, or a
    shared/local array), ``index`` is the element index and ``extent`` the array's length."""

    def __init__(self, detail: str, *, array: str, index: int, extent: int, **kw):
        self.array, self.index, self.extent = array, index, extent
        super().__init__(f"array {array!r}: {detail}", **kw)


class MisalignedAccess(OutOfBounds):
    """A vector load/store (``float4``, ``__half2``, ...) at an offset that is not a multiple
    of its size: the GPU raises a misaligned-address error there."""


class BarrierDivergence(SimtFault):
    """``__syncthreads()`` reached by only part of a block, or at different source lines."""


class WarpMaskError(SimtFault):
    """A warp operation whose mask is wrong: it leaves out the calling lane, names lanes that
    never arrive (exited or waiting elsewhere), lanes disagree on it, or a lane reads the
    value of a lane outside it."""


class StepLimitExceeded(SimtFault):
    """A thread ran more loop iterations than ``step_limit``."""


class Timeout(SimtFault):
    """The launch ran longer than ``time_limit_s``."""


class SharedMemoryRace(SimtFault):
    """Two threads touched the same shared-memory bytes, at least one writing, with no
    barrier (or, within one warp, no ``__syncwarp``/shuffle) between them."""

    def __init__(self, detail: str, *, array: str, other_thread: int, **kw):
        self.array, self.other_thread = array, other_thread
        super().__init__(f"array {array!r}: {detail}", **kw)


class GlobalMemoryRace(SimtFault):
    """Two threads touched one element of an output array, one of them with a plain write, with
    nothing ordering them: threads of different blocks, or of one block with no barrier or
    warp sync between. On a GPU the result depends on timing (lost updates); ``atomicAdd``
    is the ordered way for several threads to add into one element."""

    def __init__(self, detail: str, *, array: str, index: int, other_thread: int, **kw):
        self.array, self.index, self.other_thread = array, index, other_thread
        super().__init__(f"array {array!r}: {detail}", **kw)


class SharedMemoryExceeded(SimtFault):
    """Static plus dynamic shared memory above the 227 KiB a block may have."""
