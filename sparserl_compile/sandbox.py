"""Run untrusted kernels in killable worker processes: hangs, crashes and CUDA errors stay there.

A ``SandboxPool`` keeps a few persistent workers, each a fresh interpreter with its own CUDA
context, nothing inherited from the parent: ``python -c`` on ``_child_main`` with the parent's
``sys.path``, talking over a ``multiprocessing`` pipe. Not ``multiprocessing``'s "spawn", which
imports the parent's main script again in every worker: a user's script that does its work at
top level would run once more per worker (and fail there, since it would start workers itself
while the worker is still starting). A ``SandboxJob``
names a candidate kernel, the op/dtype/width, value-set seeds, the executor and whether to
time it; the matrix pattern travels once per worker and is reused by the following jobs on
the same pattern (a search sends ~100 candidates for one matrix). The worker compiles,
verifies (``verify.verify``, every check, at every width of ``SandboxJob.widths``) and, on the
GPU and when asked, times the kernel twice: L2-flushed (``bench.time_fn``, the host path
hidden behind a GPU sleep of ``bench.HIDE_HOST_US``) and back to back with a hot L2
(``bench.time_hot``), its output re-poisoned before every timed call (outside the events), so
a kernel that keeps what ``y`` holds cannot time faster than its work; and it flags impossible
speed against the byte floor. A job without a candidate times the torch.sparse reference
(int32 and int64 indices, flushed and hot) in the same worker, side by side with the
candidates.

The parent waits at most ``timeout_s`` per job: a hang is killed (``timeout``); a worker that
dies (segfault, abort, OOM kill) gives ``crash``; a CUDA error (illegal address, ...) gives
``cuda_error`` and the worker, whose context is now unusable, is replaced. After any job
whose kernel ran and failed, the worker is restarted before the next job, since a wrong
kernel may have scribbled over the worker's memory. The parent never touches CUDA for a job,
so its own context and process stay healthy whatever the kernel does.

``SandboxResult.kind`` is one of ``KINDS``.

This module is over 600 lines on purpose: both ends of one process boundary (the pool in the
user's process, the worker's loop in the child) and the job protocol between them, which must
change together.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import math
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass, field, replace

import numpy as np

from sparserl_compile.contract import Candidate
from sparserl_compile.verify import Pattern, VerifyResult

KINDS = ("ok", "contract", "unsuitable", "compile_error", "wrong", "impossible", "fault",
         "cuda_error", "timeout", "crash", "internal")
#: kinds after which the worker is replaced (its kernel ran and failed, or the worker is gone)
_RESTART = {"wrong", "impossible", "fault", "cuda_error", "timeout", "crash", "internal"}
#: verify check -> result kind
_CHECK_KIND = {"header": "contract", "language": "contract", "signature": "contract", "align": "contract",
               "format": "unsuitable", "compile": "compile_error", "launch": "fault"}
#: products under this (flushed, us) were the only ones timed with a hot L2 before every
#: product was; a cached verdict for a longer one made then has no hot figure to show
GRAPH_BELOW_US = 50.0


@dataclass(frozen=True)
class SandboxJob:
    """One unit of work for a worker. ``candidate=None`` times the torch.sparse reference."""

    candidate: Candidate | None
    op: str
    dtype: str = "f32"
    n: int = 1
    executor: str = "cpu"
    seed: int = 0
    value_sets: int = 3
    time: bool = False
    warmup: int = 5
    reps: int = 30
    static: bool = True  # False skips the static checks (fault-injection tests only)
    #: dense widths to verify, ``n`` first (``verify.widths_to_verify``); () = just ``n``
    widths: tuple[int, ...] = ()
    #: False leaves out the special value sets (``operands.SPECIAL``): measurements of their cost only
    special: bool = True
    #: GPU sleep (us) before each timed call, so no host path enters a timing (bench.time_fn);
    #: None: ``bench.HIDE_HOST_US``
    hide_host_us: float | None = None
    #: a reference job also times the dense product (``bench.time_dense``) on the same worker
    dense: bool = False


@dataclass(frozen=True)
class SandboxResult:
    """What happened to one job."""

    kind: str
    error: str = ""
    verify: VerifyResult | None = None
    bench: dict | None = None  # BenchResult.to_dict() of the L2-flushed timing
    graph_bench: dict | None = None  # per-call time back to back with a hot L2 (``bench.time_hot``)
    reference: dict | None = None  # index type -> BenchResult.to_dict() (reference jobs)
    floor_us: float | None = None
    cubin: bytes | None = field(default=None, repr=False)
    compile_log: str = ""
    wall_s: float = 0.0
    worker_pid: int | None = None
    #: seconds per phase in the worker: verify's phases (``VerifyResult.phases``) plus "time"
    #: (the L2-flushed timing) and "graph" (the CUDA-graph timing)
    phases: dict = field(default_factory=dict)
    #: seconds around the job, not in ``wall_s``: "pattern" (the worker taking in a new pattern
    #: before it: ``_release_memory`` and the arrays), "take" (the parent waiting for an idle
    #: worker) and "outside" (the rest of the parent's round trip: the messages, a worker still
    #: warming up). Where a first call's time goes when the jobs' own walls do not add up to it
    overhead: dict = field(default_factory=dict)
    #: a reference job with ``dense``: ``bench.time_dense``'s results ("dense", "dense_graph"), or
    #: {"error": why} where the dense product could not be timed (its matrix did not fit, say)
    dense: dict | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def compile_ok(self) -> bool:
        return self.verify is not None and "compile" in self.verify.checks_passed

    @property
    def kernel_us(self) -> float | None:
        return None if self.bench is None else self.bench["median_us"]

    def to_dict(self) -> dict:
        return {"kind": self.kind, "error": self.error[:2000],
                "verify": self.verify.to_dict() if self.verify else None,
                "bench": self.bench, "graph_bench": self.graph_bench, "reference": self.reference,
                "floor_us": self.floor_us, "wall_s": self.wall_s, "phases": dict(self.phases),
                "overhead": dict(self.overhead), "dense": self.dense}


# ------------------------------------------------------------------ worker side

def run_job(job: SandboxJob, pattern: Pattern) -> SandboxResult:
    """Execute one job in this process (what a worker does; also usable directly for trusted kernels)."""
    t0 = time.perf_counter()
    if job.candidate is None:
        from sparserl_compile import bench

        ref = bench.time_reference(pattern.indptr, pattern.indices, pattern.shape, op=job.op, n=job.n,
                                   dtype=job.dtype, warmup=job.warmup, reps=job.reps, seed=job.seed,
                                   hide_host_us=_hide(job), graph_below_us=math.inf)
        return SandboxResult("ok", reference={k: v.to_dict() for k, v in ref.items()},
                             floor_us=_floor(job, pattern), wall_s=time.perf_counter() - t0, worker_pid=os.getpid(),
                             dense=_time_dense(job, pattern) if job.dense else None)
    from sparserl_compile import verify as V

    runners: list = []
    try:
        vr = V.verify(job.candidate, pattern, op=job.op, dtype=job.dtype, executor=job.executor, n=job.n,
                      value_sets=job.value_sets, seed=job.seed, static=job.static, runner_out=runners,
                      widths=tuple(job.widths) or None, special=job.special)
        return _after_verify(job, pattern, vr, runners[0] if runners else None, t0)
    finally:
        for r in runners:
            r.close()


def _time_dense(job: SandboxJob, pattern: Pattern) -> dict:
    """The dense product's timings beside the reference's (``SandboxResult.dense``). A failure
    (the dense matrix does not fit beside the worker's buffers, say) is reported, not raised:
    the reference's timings stand and the dense product is then no candidate."""
    from sparserl_compile import bench

    try:
        out = bench.time_dense(pattern.indptr, pattern.indices, pattern.shape, op=job.op, n=job.n,
                               dtype=job.dtype, warmup=job.warmup, reps=job.reps, seed=job.seed,
                               hide_host_us=_hide(job))
        return {k: v.to_dict() for k, v in out.items()}
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        import torch

        torch.cuda.empty_cache()  # the dense matrix's memory back before the candidates are timed


def _after_verify(job: SandboxJob, pattern: Pattern, vr: VerifyResult, runner, t0: float) -> SandboxResult:
    """The job's result once verified: on the GPU, when asked, the two timings."""
    cubin = getattr(runner, "cubin", None)
    if not vr.ok:
        kind = _CHECK_KIND.get(vr.failed, "wrong")
        if kind == "fault" and job.executor == "gpu":
            kind = "cuda_error"
        return SandboxResult(kind, vr.reason, vr, cubin=cubin, compile_log=vr.compile_log,
                             wall_s=time.perf_counter() - t0, worker_pid=os.getpid(), phases=dict(vr.phases))
    b = g = floor = None
    kind, err = "ok", ""
    phases = dict(vr.phases)
    if job.time and job.executor == "gpu":
        from sparserl_compile import bench
        from sparserl_compile import verify as V

        t1 = time.perf_counter()
        call, poison, out_bytes = V.timing_fns(runner, job.dtype, job.seed)
        br = bench.time_fn(lambda: call(0), warmup=job.warmup, reps=job.reps, flush_l2=True,
                           hide_host_us=_hide(job), before=poison)
        b = br.to_dict()
        t2 = time.perf_counter()
        phases["time"] = t2 - t1
        g = bench.time_hot(call, bench.hot_launches(br.median_us, out_bytes), before=poison,
                           hide_host_us=_hide(job)).to_dict()
        phases["graph"] = time.perf_counter() - t2
        floor = _floor(job, pattern)
        if bench.is_impossible(br.median_us, floor):
            kind, err = "impossible", (f"impossible speed: {br.median_us:.2f} us with L2 flushed is below the "
                                       f"byte floor {floor:.2f} us / {bench.IMPOSSIBLE_SLACK}")
    return SandboxResult(kind, err, vr, b, g, None, floor, cubin, vr.compile_log,
                         time.perf_counter() - t0, os.getpid(), phases)


def _hide(job: SandboxJob) -> float:
    from sparserl_compile import bench

    return bench.HIDE_HOST_US if job.hide_host_us is None else float(job.hide_host_us)


def _floor(job: SandboxJob, pattern: Pattern) -> float | None:
    try:
        from sparserl_compile import bench, formats
    except ImportError:
        return None
    vb = 4 if job.dtype == "f32" else 2
    fmt = job.candidate.header.format if job.candidate is not None else "csr"
    nbytes = formats.floor_bytes(job.op, pattern.shape[0], pattern.shape[1], pattern.nnz, job.n, vb, fmt=fmt)
    return bench.floor_us(nbytes)


def _release_memory() -> None:
    """Between matrices: drop garbage and torch's cached GPU blocks (if torch is loaded).

    What survives the collection is then frozen (``gc.freeze``): a worker holds torch's, numba's
    and the launcher's objects for good, and a full collection walking them took 70-80 ms on
    the dev CPU (the product's selection waits for this when the pattern changes); after the
    freeze a collection walks only what was made since (microseconds). Frozen objects are
    still freed when their last reference goes; only cycles among them would wait."""
    import gc
    import sys

    from sparserl_compile import verify

    verify.clear_value_sets()  # the last pattern's operands and references (GBs on large matrices)
    gc.collect()
    gc.freeze()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _warm_up(gpu: bool, conn=None) -> dict:
    """What a worker does while it waits for its first job: load the format converters
    (numba) and, for GPU work, torch and the CUDA context, then verify a small product of each
    op (``_warm_jobs``), so the first job does not pay those loads; last, a full collection and
    ``gc.freeze`` (``_release_memory``). Best effort: a failure here surfaces in the job that
    needs the piece. Returns what was done ("formats", "cuda": seconds; "jobs": ``_warm_jobs``'s
    kinds), for tests."""
    done: dict = {}
    try:
        from sparserl_compile import formats, verify  # noqa: F401 - verify: its imports

        done["formats"] = formats.warm()
        if gpu:
            import torch

            from sparserl_compile import bench, launcher  # noqa: F401

            t0 = time.perf_counter()
            torch.zeros(1, device="cuda")
            done["cuda"] = time.perf_counter() - t0
            done["jobs"] = _warm_jobs(conn)
        _release_memory()  # the first full collection (and freeze: see there) while no job waits
    except Exception:  # noqa: BLE001
        pass
    return done


#: the warm-up product's rows (and columns): small enough to take milliseconds, big enough to
#: launch every piece the jobs use
WARM_ROWS = 256


def _warm_jobs(conn=None) -> dict:
    """Verify one built-in CSR kernel, SpMV and SpMM, on a small pattern in this worker, so the
    first real job finds the lazily loaded pieces loaded: torch's CUDA kernels for the random
    operands and the comparisons, cuSPARSE's handle and its SpMV/SpMM (the verification's
    reference), NVRTC and the launcher's module loading. Nothing is timed: a worker warms up
    while another may be timing a candidate on the same GPU (a replacement starts while the
    spare takes the next job), and a few microsecond kernels on a 256-row matrix disturb that
    far less than an L2 flush would. Stops early when a job arrives on ``conn``. Returns
    {"spmv" | "spmm": result kind}."""
    from sparserl_compile import kernels, matrices
    from sparserl_compile import verify as V

    n = WARM_ROWS
    pattern = Pattern.of(matrices.banded(n, 1))  # a tridiagonal n x n pattern
    kinds: dict = {}
    try:
        for op, width in (("spmv", 1), ("spmm", 8)):
            if conn is not None and conn.poll(0):
                break
            kernel = next(c for c in kernels.space(op, "f32", n=width) if c.header.format == "csr")
            kinds[op] = run_job(SandboxJob(kernel, op, n=width, executor="gpu", value_sets=1), pattern).kind
    finally:
        V.clear_value_sets()
    return kinds


def _worker_main(conn, device: int | None = None, warm: str | None = None) -> None:
    if device is not None:  # the parent's GPU (e.g. this rank's under torchrun), not GPU 0
        import torch

        torch.cuda.set_device(device)
    pattern: Pattern | None = None
    taking_in: float | None = None  # seconds the last new pattern took to take in (reported once)
    conn.send(("ready", os.getpid()))
    faulthandler.cancel_dump_traceback_later()  # armed by the ``-c`` line: started in time
    if warm and not conn.poll(0):
        _warm_up(gpu=warm == "gpu", conn=conn)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if msg[0] == "stop":
            return
        if msg[0] == "pattern":
            _, key, indptr, indices, shape = msg
            t0 = time.perf_counter()
            pattern = None
            _release_memory()
            pattern = Pattern(indptr, indices, tuple(shape))
            taking_in = time.perf_counter() - t0
            continue
        job = msg[1]
        try:
            res = run_job(job, pattern)
        except Exception as e:  # noqa: BLE001 - report, never die on our own bug
            res = SandboxResult("internal", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}",
                                worker_pid=os.getpid())
        if taking_in is not None:
            res, taking_in = replace(res, overhead={**res.overhead, "pattern": taking_in}), None
        conn.send(("result", res))


def _child_main(argv: list[str]) -> None:
    """A worker process's entry (``_Worker`` starts ``python -c`` on it): the pipe's descriptor,
    the CUDA device or "-", the warm-up ("gpu", "cpu" or "-"), the parent's pid."""
    from multiprocessing.connection import Connection

    fd, device, warm, parent = argv
    _watch_parent(int(parent))
    _worker_main(Connection(int(fd)), None if device == "-" else int(device), None if warm == "-" else warm)


#: how often a worker checks that its parent is alive (s)
PARENT_POLL_S = 0.5


def _watch_parent(parent: int) -> None:
    """End this worker when its parent is gone, also in the middle of a job: a parent killed
    outright (SIGKILL, the OOM killer) runs no exit handler, and a worker stuck in a hung kernel
    never reads the closed pipe, so it would hold its GPU context on. A thread polls the parent
    pid (the kernel's PR_SET_PDEATHSIG fires when the parent's *thread* ends, and workers are
    started from short-lived threads). It runs while the worker waits in a call that releases
    the GIL: the CPU executor's launch (ctypes; tested), and on the GPU the bindings' stream
    and device synchronisation (not yet checked on the device)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(3)

    if os.getppid() != parent:
        os._exit(3)
    threading.Thread(target=watch, daemon=True, name="sparserl-parent-watch").start()


# ------------------------------------------------------------------ parent side

def _python() -> str:
    """The interpreter workers run on: ``multiprocessing.set_executable``'s where a host that
    embeds Python set it (``sys.executable`` is then not a Python), else ``sys.executable``."""
    import multiprocessing.spawn

    return os.fsdecode(multiprocessing.spawn.get_executable() or sys.executable)  # bytes on POSIX


#: the live workers, killed at interpreter exit (a worker left behind mid-job could run on)
_LIVE: "weakref.WeakSet[_Worker]" = weakref.WeakSet()


@atexit.register
def _kill_live_workers() -> None:
    for w in list(_LIVE):
        w.kill()


class _Worker:
    def __init__(self, start_timeout_s: float, device: int | None = None, warm: str | None = None):
        self.parent, child = mp.Pipe()
        # the parent's sys.path first, as multiprocessing's spawn does, so the worker imports this
        # sparserl_compile; no main script is imported (see the module docstring)
        # a worker that has not said it is ready shortly before the parent gives up prints every
        # thread's stack to stderr first (faulthandler, armed before any import), so the parent's
        # "did not start" has the place it was stuck beside it
        code = ("import faulthandler, sys, json; faulthandler.dump_traceback_later(float(sys.argv[1])); "
                "sys.path[:] = json.loads(sys.argv[2]); "
                "from sparserl_compile.sandbox import _child_main; _child_main(sys.argv[3:])")
        try:
            self.proc = subprocess.Popen(
                [_python(), *subprocess._args_from_interpreter_flags(), "-c", code,
                 repr(max(1.0, 0.9 * start_timeout_s)), json.dumps(sys.path),
                 str(child.fileno()), "-" if device is None else str(device), warm or "-", str(os.getpid())],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            child.close()
        _LIVE.add(self)
        self.pattern_key: str | None = None
        if not self.parent.poll(start_timeout_s):
            self.kill()
            raise RuntimeError(
                f"sandbox worker did not start within {start_timeout_s} s ({_python()} -c ... "
                "sparserl_compile.sandbox._child_main); its stacks at the time (or its error) are on this process's stderr")
        try:
            self.parent.recv()
        except (EOFError, OSError) as e:
            self.kill()
            raise RuntimeError(f"sandbox worker exited while starting (exit code {self.exitcode}); its error "
                               "is on this process's stderr") from e

    @property
    def exitcode(self) -> int | None:
        """None while it runs; negative: the signal that ended it."""
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.join(5)
        self.parent.close()
        _LIVE.discard(self)

    def stop(self) -> None:
        try:
            self.parent.send(("stop",))
            self.join(5)
        except (BrokenPipeError, OSError):
            pass
        self.kill()


def parent_device() -> int | None:
    """The CUDA device the calling process works on, when it has chosen one (torch imported and
    CUDA initialized, e.g. by ``torch.cuda.set_device(local_rank)`` under torchrun); else None
    (workers use the default device)."""
    import sys

    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available():
            return None
        if torch.cuda.is_initialized():
            return int(torch.cuda.current_device())
        local = os.environ.get("LOCAL_RANK")  # torchrun, before this process touched CUDA
        if local is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1 \
                and int(local) < torch.cuda.device_count():
            return int(local)
    except Exception:  # noqa: BLE001 - a broken CUDA setup: let the worker find out
        pass
    return None


def _parent_sees_gpu() -> bool:
    import sys

    torch = sys.modules.get("torch")
    try:
        return torch is not None and torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


class SandboxPool:
    """Persistent sandbox workers. Use as a context manager, or call ``close()``.

    ``workers`` > 1 runs jobs concurrently (``map``); on one GPU keep 1 while timing, since
    concurrent kernels disturb each other's times.

    A worker replaced after a failed job (or a hang, or a crash) is replaced in the background
    at once, so the next job finds a started worker instead of paying the start (a fresh
    interpreter, torch and a CUDA context: seconds). ``warm`` (default: when this process sees
    a GPU) makes each new worker load torch, the CUDA context and the format converters while
    it waits for its first job.
    """

    def __init__(self, workers: int = 1, *, timeout_s: float = 60.0, start_timeout_s: float = 180.0,
                 device: int | None = None, warm: bool | None = None, spare: int = 0,
                 restart_on=None):
        if workers < 1:
            raise ValueError(f"workers={workers}: need at least one")
        if not isinstance(spare, int) or isinstance(spare, bool) or spare < 0:
            raise ValueError(f"spare={spare!r}: the number of idle workers kept ready is an int >= 0")
        #: idle workers kept started beyond the one a job takes: a failed kernel's worker is
        #: replaced in the background, and the next job takes a spare instead of waiting for that
        #: start (seconds on a GPU: a fresh interpreter, torch and a CUDA context)
        self.spare = spare
        #: result kinds after which a worker is replaced (default ``_RESTART``: every kernel that
        #: ran and failed, since it may have scribbled over the worker's memory). A pool whose
        #: verdicts are only advice, checked again elsewhere (``policy.screen``: the CPU executor's
        #: bounds-checked runs before the GPU's verification), may keep its workers after a wrong
        #: kernel; a hang or a dead worker is replaced whatever this says
        self.restart_on = frozenset(_RESTART if restart_on is None else restart_on)
        unknown = self.restart_on - set(KINDS)
        if unknown:
            raise ValueError(f"restart_on={sorted(unknown)}: name result kinds of {KINDS}")
        #: CUDA device index the workers run on: ``device``, else the parent's (``parent_device``)
        self.device = device if device is not None else parent_device()
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._n = workers
        self._free: list[_Worker] = []
        self._lock = threading.Condition()
        self._spawning = 0  # replacements being started in the background
        self._retiring: list[threading.Thread] = []  # failed workers being stopped off the job's path
        self._closed = False
        gpu = _parent_sees_gpu()
        self._warm = None if not (gpu if warm is None else warm) else ("gpu" if gpu else "cpu")
        self.restarts = 0

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._free = self._free, []
            retiring, self._retiring = self._retiring, []
        for w in workers:
            w.stop()
        for t in retiring:
            t.join()

    def _new_worker(self) -> _Worker:
        return _Worker(self.start_timeout_s, self.device, self._warm)

    def start(self, wait: bool = False, count: int = 1) -> None:
        """Start workers in the background now, up to ``count`` (plus ``spare``) idle or starting ones (e.g. the
        pool's ``workers`` before a first ``map``), so the first jobs do not wait for them
        (``miss.prewarm``, RL's reward workers while the policy decodes); ``wait=True``
        returns once ``count`` are up (or none is starting any more)."""
        with self._lock:
            if self._closed:
                return
            missing = count + self.spare - len(self._free) - self._spawning
        for _ in range(max(0, missing)):
            self._replace()
        if wait:
            with self._lock:
                while len(self._free) < count and self._spawning and not self._closed:
                    self._lock.wait(self.start_timeout_s)
            if count == 1:
                self._give(self._take())  # none could be started in the background: start it here

    def _take(self, key: str | None = None) -> _Worker:
        """An idle worker, one that already holds pattern ``key`` first (with spares, a fresh
        worker would be sent the pattern again), else the most recently idle."""
        with self._lock:
            while True:
                if key is not None:
                    held = [i for i, w in enumerate(self._free) if w.pattern_key == key and w.alive()]
                    if held:
                        return self._free.pop(held[-1])
                while self._free:
                    w = self._free.pop()
                    if w.alive():
                        return w
                    w.kill()
                if not self._spawning:
                    break
                self._lock.wait(self.start_timeout_s)  # a replacement is starting: take it
        return self._new_worker()

    def _give(self, w: _Worker) -> None:
        with self._lock:
            self._free.append(w)

    def _replace(self) -> None:
        """Start a worker on a background thread and add it to the idle ones when it is up."""
        with self._lock:
            if self._closed:
                return
            self._spawning += 1

        def start():
            w = None
            try:
                w = self._new_worker()
            except Exception:  # noqa: BLE001 - the next job starts its own and reports why
                pass
            with self._lock:
                self._spawning -= 1
                closed = self._closed
                if w is not None and not closed:
                    self._free.append(w)
                self._lock.notify_all()
            if w is not None and closed:
                w.stop()

        threading.Thread(target=start, daemon=True, name="sparserl-sandbox-start").start()

    def _retire(self, w: _Worker) -> None:
        """Stop a worker after a failed kernel on a background thread, not on the job's path: a
        GPU worker's exit tears down its CUDA context and a torch-laden interpreter, and stopped
        in line it held up the product's selection (an H100 selection with one wrong candidate
        took ~1.2 s more than the candidates' own runs). ``close`` joins these threads, and a
        worker still stopping at interpreter exit is killed like any live one."""
        t = threading.Thread(target=w.stop, daemon=True, name="sparserl-sandbox-retire")
        with self._lock:
            self._retiring = [r for r in self._retiring if r.is_alive()]
            self._retiring.append(t)
        t.start()

    def run(self, job: SandboxJob, pattern, *, pattern_key: str | None = None,
            timeout_s: float | None = None) -> SandboxResult:
        """Run ``job`` on ``pattern`` (scipy CSR or ``verify.Pattern``) in a worker."""
        pattern = Pattern.of(pattern)
        key = pattern_key or _key(pattern)
        limit = self.timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        if self.spare:  # the worker this job takes, and the spares, started or starting
            self.start(count=1)
        t_take = time.perf_counter()
        w = self._take(key)
        t_sent = time.perf_counter()
        try:
            if w.pattern_key != key:
                w.parent.send(("pattern", key, pattern.indptr, pattern.indices, pattern.shape))
                w.pattern_key = key
            w.parent.send(("job", job))
            if not w.parent.poll(limit):
                w.kill()
                self.restarts += 1
                self._replace()
                return SandboxResult("timeout", f"no result within {limit:g} s: the kernel hangs or is far too "
                                                "slow; the worker was killed", wall_s=time.perf_counter() - t0,
                                     worker_pid=w.proc.pid)
            _, res = w.parent.recv()
            trip = time.perf_counter() - t_sent
            res = replace(res, overhead={**res.overhead, "take": t_sent - t_take,
                                         "outside": max(0.0, trip - res.wall_s - res.overhead.get("pattern", 0.0))})
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            w.join(5)
            code = w.exitcode
            w.kill()
            self.restarts += 1
            self._replace()
            return SandboxResult("crash", f"the worker died (exit code {code}) while running the job",
                                 wall_s=time.perf_counter() - t0, worker_pid=w.proc.pid)
        if res.kind in self.restart_on:
            self._replace()  # the replacement starts while this one stops
            self._retire(w)
            self.restarts += 1
        else:
            self._give(w)
        return res

    @property
    def workers(self) -> int:
        """How many jobs the pool runs at once (``map``)."""
        return self._n

    def map(self, jobs: list[SandboxJob], pattern, *, pattern_key: str | None = None,
            timeout_s: float | None = None) -> list[SandboxResult]:
        """Run ``jobs`` on one pattern across the pool's workers; results in job order."""
        pattern = Pattern.of(pattern)
        key = pattern_key or _key(pattern)
        if self._n == 1 or len(jobs) <= 1:
            return [self.run(j, pattern, pattern_key=key, timeout_s=timeout_s) for j in jobs]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self._n) as ex:
            return list(ex.map(lambda j: self.run(j, pattern, pattern_key=key, timeout_s=timeout_s), jobs))


def _key(p: Pattern) -> str:
    from sparserl_compile.verify import digest

    return digest([np.asarray(p.shape, np.int64), p.indptr, p.indices])
