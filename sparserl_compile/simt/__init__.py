"""simt: run kernels of the kernel language on the CPU, with CUDA semantics, for verification.

CI machines and build machines have no GPU, yet every generated kernel must be checked
there too. No package runs CUDA C on a CPU, so sparserl carries a small executor that is
exact about the semantics the kernel language (DESIGN.md, "Generated code contract") uses.

API::

    from sparserl_compile import simt
    k = simt.compile_kernel(candidate.source)             # guarded=True by default
    stats = k.launch(grid, (block, 1, 1), smem, args)     # args = fd.kernel_args(op, n, ...)
    # -> LaunchStats(mode, blocks, max_steps, context_switches, wall_s, ...)

``compile_many(sources, *, guarded=True, jobs=None)`` builds a batch in parallel (results or
exceptions, in order). ``compile_kernel(source, *, guarded=True) -> SimtKernel`` parses the contract header
(``contract.parse_header``), refuses constructs outside the language with ``SimtRefused``
naming the construct (inline assembly, clock reads, printf, templates, static or
file-scope state, non-``_sync`` shuffles, warp votes, ...), rewrites the kernel (``rewrite``)
and builds it with g++ against ``runtime.h`` into a shared library cached by content hash
under ``$SPARSERL_CACHE_DIR/simt`` (``build``). g++ errors raise ``SimtCompileError`` with the
log and the numbered source.

``SimtKernel.launch(grid, block, smem, args, *, step_limit=None, time_limit_s=10.0,
workers=1, racecheck=None, guard=None, placement=0) -> LaunchStats`` takes exactly the contract-ordered argument list
``formats.FormatData.kernel_args`` builds: ``np.int32`` scalars and C-contiguous numpy arrays
(``int32`` structure, ``float32``/``float16`` values, bfloat16 as ``ml_dtypes.bfloat16`` or
``uint16`` bit patterns); ``y`` is written in place.

What is modelled:

* built-ins ``threadIdx/blockIdx/blockDim/gridDim``, ``warpSize``; vector types
  ``int2/int4/float2/float4`` (16-byte aligned like CUDA), ``__half``/``__nv_bfloat16`` and
  their ``2`` forms with IEEE round-to-nearest-even conversions (bit-exact with CUDA,
  canonical NaN 0x7fff); ``__ldg``, ``min/max/fmaf``, ``atomicAdd`` (really atomic: blocks
  may run on several OS threads);
* every thread of a block is a fiber when the kernel uses ``__syncthreads``, ``__syncwarp``
  or ``__shfl*_sync``: a barrier waits for the whole block, warp operations exchange values
  among the 32 lanes honouring masks and ``width``; kernels without them run their threads
  as plain calls (much faster);
* ``__shared__`` arrays (static and ``extern`` dynamic) are per block, poisoned with 0xFF
  bytes (NaN / -1) in guarded builds so reads of unwritten shared memory show.
* ``nvcuda::wmma`` (``fragment``, ``fill_fragment``, ``load_matrix_sync``, ``mma_sync``,
  ``store_matrix_sync``), emulated: every lane holds a whole fragment and computes the whole
  product in float (the same result on every lane; the tensor cores' own rounding inside one
  mma may differ within verification's bound); the three ``_sync`` calls are warp-collective
  (a lane that skips one is a ``WarpMaskError``) without ordering what the kernel must order
  with ``__syncwarp``; misaligned fragment pointers or ``ldm`` raise ``MisalignedAccess``;

Faults raise ``SimtFault`` subclasses naming the thread, block and (where known) line:
``OutOfBounds`` (array name, index, extent; guarded builds check every access through the
kernel's pointers, shared and local arrays, and a guarded launch copies every array argument
between 32 GiB of PROT_NONE address space, so an access through a raw pointer past it (``(&x[0])[k]``)
faults too and a write into the fill beside it is found after the launch: ``guard.h``),
``GlobalMemoryRace`` (guarded: two threads touching one element of ``y``, one writing, with
nothing ordering them), ``MisalignedAccess`` (a ``float4``/``half2``
access off its alignment), ``BarrierDivergence`` (``__syncthreads`` reached by part of a
block or at different lines), ``WarpMaskError`` (mask without the caller, lanes that never
arrive, disagreeing masks, reads from lanes outside the mask), ``SharedMemoryRace``
(guarded: two threads on the same shared bytes, one writing, with no barrier or warp sync
between), ``StepLimitExceeded`` and ``Timeout`` (endless loops), ``SharedMemoryExceeded``.

What is not: anything outside the language (refused); exact float summation order of the
GPU's FMA contraction (the CPU build uses ``-ffp-contract=off``: verify with a tolerance,
or with integer-valued data for bit-exactness); memory-model subtleties beyond barriers
(fibers run in a fixed order); accesses through raw pointers taken with ``&a[i]`` and
multi-dimensional arrays are not checked per access (the guard regions catch them once they
leave the array's pages; inside those pages, the 0xFF fill shows a read as NaN or -1);
unguarded builds check nothing and a bad access there can crash the process (run untrusted
kernels guarded, or in ``sandbox``).
Barrier semantics are the strict ones of the CUDA programming guide: a thread that exits
before a ``__syncthreads`` its block still reaches is reported as divergence.
"""

from sparserl_compile.simt.errors import (
    BarrierDivergence,
    GlobalMemoryRace,
    MisalignedAccess,
    OutOfBounds,
    SharedMemoryExceeded,
    SharedMemoryRace,
    SimtCompileError,
    SimtError,
    SimtFault,
    SimtRefused,
    SimtUnavailable,
    StepLimitExceeded,
    Timeout,
    WarpMaskError,
)
from sparserl_compile.simt.launch import LaunchStats, SimtKernel, compile_kernel, compile_many

__all__ = [
    "compile_kernel", "compile_many", "SimtKernel", "LaunchStats",
    "SimtError", "SimtUnavailable", "SimtRefused", "SimtCompileError", "SimtFault",
    "OutOfBounds", "MisalignedAccess", "BarrierDivergence", "WarpMaskError",
    "SharedMemoryRace", "GlobalMemoryRace", "SharedMemoryExceeded", "StepLimitExceeded", "Timeout",
]
