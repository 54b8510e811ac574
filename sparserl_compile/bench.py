"""GPU timing: CUDA events, warm-up, medians, L2 flushed between repetitions, graph replay.

* ``time_fn(fn, warmup=, reps=, flush_l2=True)``: each repetition writes a buffer twice the
  size of the device's L2 (so nothing of the operands stays cached), then records a start
  event, runs ``fn`` once and records an end event. The flush also keeps the GPU busy while
  the host enqueues ``fn`` (~35 us on the H200), so a short host launch path does not leak
  into the event time. ``hide_host_us`` adds a GPU sleep of that length after the flush for
  callables whose host path is longer (torch.sparse's ``mv``, the runtime's Python path),
  so the events time the GPU work alone.
* ``before=`` (``time_fn``): a callable run before each repetition, ahead of the flush and
  outside the events: the sandbox re-poisons the candidate's output there, so no timed call
  finds the previous call's answer in ``y`` (a kernel that skips its work when ``y`` already
  holds numbers then times as slowly as it really is).
* ``time_graph(fn, launches=)``: ``launches`` back-to-back calls captured into one CUDA graph
  and replayed; per-call time = replay time / launches. This is the figure for kernels of a
  few microseconds whose single-launch timing is dominated by the host (anchors README);
  operands stay in L2 across the launches, so it is a hot-cache figure.
* ``time_hot(call, launches)``: the hot-L2, back-to-back figure the selection compares for
  every product: ``call(k)`` for k < ``launches`` captured into one graph (the sandbox gives
  each call an output of its own, re-poisoned by ``before`` ahead of every replay, outside the
  events), falling back to back-to-back events without a flush where capture fails.
  ``hot_launches`` picks how many: enough for about ``HOT_REPLAY_US`` of replay, at least 3
  and at most 100, fewer where that many outputs would pass ``HOT_OUTPUT_BYTES``.
* ``copy_bandwidth()``: bytes read + written per second of a large device-to-device copy,
  measured once per process; ``floor_us(bytes)`` = bytes over it. A kernel measured (L2
  flushed) faster than ``floor_us / IMPOSSIBLE_SLACK`` cannot have done its work:
  ``is_impossible`` flags it (the "impossible speed" check of verification).
* ``torch_sparse_fn(...)``: the reference users have: ``torch.mv``/``torch.mm`` on a CSR
  tensor (cuSPARSE) with int32 or int64 indices.
* ``time_dense(...)``: the other alternative users have, the dense product
  (``torch.mv``/``torch.mm`` with the matrix stored dense in its value dtype: cuBLAS), timed
  as ``time_reference`` times cuSPARSE (L2 flushed, then hot).

* ``wall_median_us(fn, device)`` / ``stream_us(fn, device)``: wall-clock time per call,
  synchronized after each call or once after many back-to-back calls (host cost included);
  these two also run on the CPU (the benchmark scripts' and examples' end-to-end figures).

Everything else needs a CUDA device.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

#: a measurement may beat the copy-bandwidth floor by this factor (copy kernels do not reach
#: peak DRAM bandwidth exactly); anything faster is rejected as impossible.
IMPOSSIBLE_SLACK = 1.25


@dataclass(frozen=True)
class BenchResult:
    """Timing of one function; all times in microseconds."""

    median_us: float
    p10_us: float
    p90_us: float
    samples_us: tuple[float, ...] = field(repr=False)
    method: str = "events"  # "events" (one launch per sample) or "graph" (replay / launches)
    l2_flushed: bool = True

    @staticmethod
    def from_samples(samples: list[float], method: str, flushed: bool) -> "BenchResult":
        if not samples:
            raise ValueError("no timing samples: reps must be >= 1")
        q = np.percentile(np.asarray(samples), [10, 90])
        return BenchResult(float(statistics.median(samples)), float(q[0]), float(q[1]),
                           tuple(float(s) for s in samples), method, flushed)

    def to_dict(self) -> dict:
        return {"median_us": self.median_us, "p10_us": self.p10_us, "p90_us": self.p90_us,
                "method": self.method, "l2_flushed": self.l2_flushed, "reps": len(self.samples_us)}


def _torch():
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("bench needs a CUDA device; on a CPU-only machine there is no timing")
    return torch


_FLUSH: dict[int, object] = {}
_BANDWIDTH: dict[int, float] = {}
_CYCLES: dict[int, float] = {}

#: the sandbox's timings (candidates and reference) keep the GPU busy this long before each
#: timed call: longer than torch.sparse's host path (~17-30 us per call on the H200's hosts),
#: which the L2 flush alone (~35 us of GPU time) did not always cover
HIDE_HOST_US = 100.0


def l2_bytes(device: int | None = None) -> int:
    """The device's L2 size in bytes (50 MiB assumed if torch does not report it)."""
    torch = _torch()
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


def _flush_buffer():
    torch = _torch()
    dev = torch.cuda.current_device()
    buf = _FLUSH.get(dev)
    if buf is None:
        buf = torch.empty(2 * l2_bytes(dev), dtype=torch.uint8, device="cuda")
        _FLUSH[dev] = buf
    return buf


def flush_l2() -> None:
    """Evict the L2 by writing a buffer of twice its size (enqueued on the current stream)."""
    _flush_buffer().fill_(1)


def sleep_cycles_per_us() -> float:
    """GPU clock cycles per microsecond of ``torch.cuda._sleep`` on the current device,
    measured once per device (a spin of 2e6 cycles timed with events)."""
    torch = _torch()
    dev = torch.cuda.current_device()
    if dev not in _CYCLES:
        torch.cuda._sleep(1000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(2_000_000)
        e.record()
        e.synchronize()
        _CYCLES[dev] = 2_000_000 / (s.elapsed_time(e) * 1e3)
    return _CYCLES[dev]


def time_fn(fn: Callable[[], object], *, warmup: int = 5, reps: int = 30, flush_l2: bool = True,
            hide_host_us: float = 0.0, before: Callable[[], object] | None = None) -> BenchResult:
    """Median of ``reps`` CUDA-event timings of one ``fn()`` each, after ``warmup`` calls;
    ``hide_host_us``: keep the GPU busy that long before each start event; ``before``: run
    ahead of every call, warm-up included, outside the events (module doc)."""
    torch = _torch()
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    buf = _flush_buffer() if flush_l2 else None
    spin = int(hide_host_us * sleep_cycles_per_us()) if hide_host_us > 0 else 0
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if before is not None:
            before()
        if buf is not None:
            buf.fill_(i & 0xFF)
        if spin:
            torch.cuda._sleep(spin)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    return BenchResult.from_samples(samples, "events", flush_l2)


def time_side_by_side(ours: Callable[[], object], theirs: Callable[[], object], *,
                      reps: int = 30) -> tuple[float, float]:
    """Medians (us) of ``ours()`` and ``theirs()``, L2 flushed, host hidden (``HIDE_HOST_US``),
    each timed twice in turn (ours, theirs, ours, theirs) and the faster median of each kept: a
    ratio of the two is measured side by side, in one process, on one machine."""
    a, b = [], []
    for _ in range(2):
        a.append(time_fn(ours, reps=reps, hide_host_us=HIDE_HOST_US).median_us)
        b.append(time_fn(theirs, reps=reps, hide_host_us=HIDE_HOST_US).median_us)
    return min(a), min(b)


def time_graph(fn: Callable[[], object], *, launches: int = 100, reps: int = 10, warmup: int = 3) -> BenchResult:
    """Per-call time of ``launches`` back-to-back calls captured in one CUDA graph (hot L2)."""
    torch = _torch()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture, as torch.cuda.graphs requires
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        samples.append(s.elapsed_time(e) * 1e3 / launches)
    del graph
    return BenchResult.from_samples(samples, "graph", False)


#: replay length the hot timing aims for (us), and the most its outputs may take together
HOT_REPLAY_US = 2000.0
HOT_OUTPUT_BYTES = 1 << 30


def hot_launches(median_us: float, out_bytes: int = 0) -> int:
    """Calls per replay of ``time_hot`` for a call of ``median_us`` writing ``out_bytes``."""
    k = max(3, min(100, int(HOT_REPLAY_US / max(float(median_us), 1e-3))))
    if out_bytes > 0:
        k = min(k, max(2, HOT_OUTPUT_BYTES // int(out_bytes)))
    return k


def time_hot(call: Callable[[int], object], launches: int, *, reps: int = 5, warmup: int = 2,
             before: Callable[[], object] | None = None, hide_host_us: float = HIDE_HOST_US) -> BenchResult:
    """Per-call time of ``call(0) .. call(launches - 1)`` back to back with a hot L2: captured
    into one CUDA graph and replayed ``reps`` times (``before()`` ahead of each replay, outside
    the events; method "graph"), or, where capture fails, ``reps`` event timings of single calls
    without a flush, the host hidden behind ``hide_host_us`` of GPU sleep (method
    "events_hot")."""
    torch = _torch()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside capture, as torch.cuda.graphs requires
            for _ in range(warmup):
                for k in range(launches):
                    call(k)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for k in range(launches):
                call(k)
    except RuntimeError:  # not capturable here
        torch.cuda.synchronize()
        r = time_fn(lambda: call(0), warmup=warmup, reps=max(reps, 10), flush_l2=False,
                    hide_host_us=hide_host_us, before=before)
        return BenchResult(r.median_us, r.p10_us, r.p90_us, r.samples_us, "events_hot", False)
    if before is not None:
        before()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        if before is not None:
            before()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        samples.append(s.elapsed_time(e) * 1e3 / launches)
    del graph
    return BenchResult.from_samples(samples, "graph", False)


# ------------------------------------------------ wall-clock timing (CPU or GPU)


def sync(device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    import torch  # not _torch(): this one also runs without a GPU
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def wall_median_us(fn, device: object = "cuda", reps: int = 30, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in microseconds, each call followed by a synchronize of
    ``device`` (none on the CPU): what a caller that waits for every result pays, host
    overhead included (not a kernel time)."""
    for _ in range(warmup):
        fn()
    sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(ts))


def stream_us(fn, device: object = "cuda", calls: int = 200, warmup: int = 20) -> float:
    """Microseconds per call of ``calls`` back-to-back calls with one synchronize at the end:
    the rate of a caller that does not wait for each result. Host-bound products show their
    host cost here (launches, dispatch), device-bound ones their GPU time with a warm L2."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / calls * 1e6


def copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), measured once per device."""
    torch = _torch()
    dev = torch.cuda.current_device()
    if dev not in _BANDWIDTH:
        free = torch.cuda.mem_get_info()[0]
        nbytes = int(min(nbytes, free // 4))
        a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
        b = torch.empty_like(a)
        a.fill_(1.0)
        r = time_fn(lambda: b.copy_(a), warmup=2, reps=10, flush_l2=False)
        _BANDWIDTH[dev] = 2 * a.numel() * 4 / (r.median_us * 1e-6)
        del a, b
        torch.cuda.empty_cache()
    return _BANDWIDTH[dev]


def floor_us(nbytes: int, bandwidth: float | None = None) -> float:
    """Microseconds to move ``nbytes`` at the measured copy bandwidth."""
    bw = copy_bandwidth() if bandwidth is None else bandwidth
    return nbytes / bw * 1e6


def is_impossible(time_us: float, floor: float) -> bool:
    """True when an L2-flushed time beats the byte floor by more than IMPOSSIBLE_SLACK."""
    return time_us * IMPOSSIBLE_SLACK < floor


def csr_tensor(torch, crow, col, values, shape):
    """``torch.sparse_csr_tensor`` without its warnings ("CSR support is in beta"; and "invariant
    checks are implicitly disabled", which torch 2.11 gives even for an explicit
    ``check_invariants=False``): once in every worker process, they filled the training logs."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow, col, values, size=tuple(shape), check_invariants=False)


def torch_sparse_fn(indptr: np.ndarray, indices: np.ndarray, shape: tuple[int, int], values, x, *,
                    index_dtype: str = "int32") -> Callable[[], object]:
    """``() -> A @ x`` with A a CUDA CSR tensor (cuSPARSE); ``x`` 1-D (SpMV) or 2-D (SpMM)."""
    torch = _torch()
    it = {"int32": torch.int32, "int64": torch.int64}[index_dtype]
    crow = torch.as_tensor(np.asarray(indptr), device="cuda").to(it)
    col = torch.as_tensor(np.asarray(indices), device="cuda").to(it)
    a = csr_tensor(torch, crow, col, values, shape)
    if x.dim() == 1:
        return lambda: torch.mv(a, x)
    return lambda: torch.mm(a, x)


def _random_operands(indices, shape, *, op: str, n: int, dtype: str, seed: int):
    """The values (one per stored index) and the dense operand (a vector for SpMV, ``n``
    row-major columns for SpMM) the reference timings multiply, in ``dtype`` on the GPU: in
    [0.5, 1.5), drawn from one seeded generator so cuSPARSE and the dense product see the same."""
    torch = _torch()
    from sparserl_compile.contract import TORCH_NAMES

    tdt = getattr(torch, TORCH_NAMES[dtype])
    g = torch.Generator(device="cuda").manual_seed(seed)
    nnz = int(np.asarray(indices).size)
    vals = (torch.rand(nnz, generator=g, device="cuda") + 0.5).to(tdt)
    xs = (int(shape[1]),) if op == "spmv" else (int(shape[1]), n)
    return vals, (torch.rand(*xs, generator=g, device="cuda") + 0.5).to(tdt)


def time_reference(indptr, indices, shape, *, op: str, n: int = 1, dtype: str = "f32",
                   warmup: int = 5, reps: int = 30, seed: int = 0, hide_host_us: float = 0.0,
                   graph_below_us: float | None = None) -> dict[str, BenchResult]:
    """torch.sparse CSR timings with int32 and int64 indices (L2 flushed), keyed by index type.

    ``graph_below_us``: when the first index type timed (int32, else int64) has a flushed median
    below it (``math.inf``: always, what the sandbox asks), that index type is also timed back
    to back with a hot L2 (``time_hot``: graph replay, or events without a flush where cuSPARSE's
    path is not capturable) under the key ``"<index type>_graph"``."""
    vals, x = _random_operands(indices, shape, op=op, n=n, dtype=dtype, seed=seed)
    out = {}
    for it in ("int32", "int64"):
        try:
            fn = torch_sparse_fn(indptr, indices, shape, vals, x, index_dtype=it)
            out[it] = time_fn(fn, warmup=warmup, reps=reps, hide_host_us=hide_host_us)
        except RuntimeError:  # dtype/index combination cuSPARSE does not support
            continue
        if graph_below_us is not None and len(out) == 1 and out[it].median_us < graph_below_us:
            out_bytes = int(shape[0]) * (1 if op == "spmv" else n) * x.element_size()
            launches = hot_launches(out[it].median_us, out_bytes)
            out[f"{it}_graph"] = time_hot(lambda k, fn=fn: fn(), launches, hide_host_us=hide_host_us or HIDE_HOST_US)
    return out


def dense_matrix(indptr, indices, shape, values):
    """The CSR matrix stored dense in ``values``' dtype on its device (CPU or GPU). The pattern
    is torch tensors or host arrays, rows sorted or not, without duplicate entries (the
    runtime's CSR: ``inputs.py`` checks it)."""
    import torch  # not _torch(): the runtime's dense plans also run on the CPU

    dev = values.device

    def long(a):
        return a.to(dev, torch.int64) if isinstance(a, torch.Tensor) else \
            torch.as_tensor(np.asarray(a, np.int64), device=dev)

    n_rows, n_cols = int(shape[0]), int(shape[1])
    nnz = int(indices.numel() if isinstance(indices, torch.Tensor) else np.asarray(indices).size)
    # output_size: no device-to-host read of the row lengths' sum (nothing stalls a CUDA stream)
    flat = torch.repeat_interleave(torch.arange(n_rows, device=dev), long(indptr).diff(), output_size=nnz)
    flat.mul_(n_cols).add_(long(indices))  # row * n_cols + column, in place: one index array of nnz
    w = torch.zeros(n_rows * n_cols, dtype=values.dtype, device=dev)
    w[flat] = values
    return w.view(n_rows, n_cols)


def time_dense(indptr, indices, shape, *, op: str, n: int = 1, dtype: str = "f32", warmup: int = 5,
               reps: int = 30, seed: int = 0, hide_host_us: float = 0.0) -> dict[str, BenchResult]:
    """The dense product's timings: ``torch.mv(W, x)`` (SpMV) or ``torch.mm(W, X)`` (SpMM, ``X``
    of ``n`` columns, row-major) with ``W`` the matrix stored dense in ``dtype``, built once here
    from the pattern and the values ``time_reference`` multiplies (``_random_operands``). ``"dense"``: L2
    flushed (``time_fn``); ``"dense_graph"``: back to back with a hot L2 (``time_hot``), as
    ``time_reference`` times cuSPARSE for the selection."""
    torch = _torch()
    vals, x = _random_operands(indices, shape, op=op, n=n, dtype=dtype, seed=seed)
    w = dense_matrix(indptr, indices, shape, vals)
    del vals
    fn = (lambda: torch.mv(w, x)) if op == "spmv" else (lambda: torch.mm(w, x))
    out = {"dense": time_fn(fn, warmup=warmup, reps=reps, hide_host_us=hide_host_us)}
    out_bytes = int(shape[0]) * (1 if op == "spmv" else n) * x.element_size()
    launches = hot_launches(out["dense"].median_us, out_bytes)
    out["dense_graph"] = time_hot(lambda k: fn(), launches, hide_host_us=hide_host_us or HIDE_HOST_US)
    return out
