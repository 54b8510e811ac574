"""A provider that lives in a worker process of its own: ``ProcessProvider``.

The policy's work -- importing transformers, loading the model, its first decodings and every
proposal -- is Python that holds the interpreter's lock for seconds. Run on a thread of the
user's process, it slows every other thread there, the user's hot loop included. Here it runs
in a separate interpreter: the user's process sends the ``Problem`` over a pipe and waits in
``recv`` (which releases the lock), so a background load or search costs the user's thread
nothing but the pipe's few microseconds.

The worker is started like the sandbox's (``python -c`` with the parent's ``sys.path``, no main
script imported, it ends when its parent does) and builds the provider by its ``module:class``
path, so this module imports no provider. On a GPU machine the worker holds its own CUDA
context (the model's weights live there).

Requests are answered one at a time, in order. A worker that dies is started again on the
next request; a request that fails raises ``RuntimeError`` with the worker's error, which the
runtime treats as any provider failure (it logs it and serves the reference).
"""

from __future__ import annotations

import atexit
import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import weakref

from sparserl_compile.problem import Problem, Provider

#: seconds a worker may take to start (a fresh interpreter importing torch)
START_TIMEOUT_S = 120.0
_LIVE: "weakref.WeakSet[ProcessProvider]" = weakref.WeakSet()


class ProviderClosed(RuntimeError):
    """A request whose worker ``close()`` stopped (nothing failed: no fallback is reported)."""


@atexit.register
def _stop_all() -> None:
    for p in list(_LIVE):
        p.close()


class ProcessProvider(Provider):
    """The provider built by ``factory`` (``"package.module:Class"``, called with no arguments)
    in a worker process, asked over a pipe.

    ``name``, ``checkpoint_hash`` and ``sandbox_spare`` are what the caller knows before the
    worker has built the provider (the runtime keys the cache by the hash without loading the
    model); once built, the worker's own values replace them."""

    def __init__(self, factory: str, *, name: str, checkpoint_hash: str | None = None,
                 sandbox_spare: int = 0, start_timeout_s: float = START_TIMEOUT_S):
        if ":" not in factory:
            raise ValueError(f"factory={factory!r}: give it as 'package.module:Class'")
        self.factory = factory
        self.name = name
        self.checkpoint_hash = checkpoint_hash
        self.sandbox_spare = sandbox_spare
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()  # one request at a time over the one pipe
        self._proc: subprocess.Popen | None = None
        self._conn = None
        self._warmed = False
        self._loader: threading.Thread | None = None
        self._killed = False  # close() killed the worker under a request in flight
        _LIVE.add(self)

    # ------------------------------------------------------------------ requests

    def candidates(self, problem: Problem, k: int) -> list:
        return self._ask("candidates", problem, k)

    def warm_up(self) -> None:
        """Start the worker, build the provider there and pay its first decodings (once)."""
        if not self._warmed:
            self._ask("warm_up")
            self._warmed = True

    def load_in_background(self) -> None:
        """``warm_up`` on a thread that only waits on the pipe (it holds no lock while the
        worker loads)."""
        if self._warmed or (self._loader is not None and self._loader.is_alive()):
            return
        self._loader = threading.Thread(target=self._warm_quietly, daemon=True, name="sparserl-proposer-warm")
        self._loader.start()

    def ready(self) -> bool:
        """Whether the provider is built and warmed up in its worker."""
        return self._warmed

    def _warm_quietly(self) -> None:
        try:
            self.warm_up()
        except Exception:  # noqa: BLE001 - the next proposal starts it again and reports the error
            pass

    def _ask(self, what: str, *args):
        with self._lock:
            self._killed = False  # a close() of an earlier request's
            try:
                conn = self._ensure_started()
                conn.send((what, *args))
                reply = conn.recv()
            except (EOFError, OSError, RuntimeError) as e:
                if self._killed:  # close() stopped this request on purpose (an exiting interpreter)
                    self._drop()
                    raise ProviderClosed(f"the {self.name} worker was stopped by close() during {what!r}") from None
                if isinstance(e, RuntimeError):
                    raise
                code = self._proc.poll() if self._proc else None
                self._drop()
                raise RuntimeError(f"the {self.name} worker process ended during {what!r} (exit code {code}); "
                                   "its error, if it printed one, is on this process's stderr") from e
        kind, value = reply
        if kind == "error":
            raise RuntimeError(f"{self.name} worker: {value}")
        info = reply[1] if what == "warm_up" else None
        if info:
            self.name = info.get("name", self.name)
            self.checkpoint_hash = info.get("checkpoint_hash", self.checkpoint_hash)
            self.sandbox_spare = info.get("sandbox_spare", self.sandbox_spare)
        return value

    # ------------------------------------------------------------------ the process

    def _ensure_started(self):
        if self._proc is not None and self._proc.poll() is None:
            return self._conn
        self._drop()
        parent, child = mp.Pipe()
        code = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
                "from sparserl_compile.proposer import _child_main; _child_main(sys.argv[2:])")
        try:
            self._proc = subprocess.Popen(
                [_python(), *subprocess._args_from_interpreter_flags(), "-c", code, json.dumps(sys.path),
                 str(child.fileno()), self.factory, str(os.getpid())],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            child.close()
        self._conn = parent
        if not parent.poll(self.start_timeout_s):
            self._drop()
            raise RuntimeError(f"the {self.name} worker process did not start within {self.start_timeout_s} s")
        try:
            parent.recv()  # ("ready",)
        except (EOFError, OSError) as e:
            self._drop()
            raise RuntimeError(f"the {self.name} worker process exited while starting; its error is on this "
                               "process's stderr") from e
        return parent

    def _drop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None
        self._warmed = False

    def close(self) -> None:
        """Stop the worker (it is started again by the next request). A request in flight (a
        warm-up, a proposal: seconds to minutes) is not waited for: the worker is killed and
        that request fails as one whose worker ended, so an exiting interpreter never waits."""
        if not self._lock.acquire(blocking=False):
            self._killed = True
            proc = self._proc
            if proc is not None and proc.poll() is None:
                proc.kill()  # the requesting thread sees the pipe close and drops the rest
            return
        try:
            if self._conn is not None and self._proc is not None and self._proc.poll() is None:
                try:
                    self._conn.send(("stop",))
                    self._proc.wait(5)
                except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                    pass
            self._drop()
        finally:
            self._lock.release()

    @property
    def pid(self) -> int | None:
        """The worker's process id while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None


def _python() -> str:
    """The interpreter the worker runs on (``multiprocessing.set_executable``'s, else ours)."""
    import multiprocessing.spawn

    return os.fsdecode(multiprocessing.spawn.get_executable() or sys.executable)


# ---------------------------------------------------------------------- the worker's side


def _child_main(argv: list[str]) -> None:
    """The worker: build the provider on the first request, answer until told to stop."""
    import importlib
    from multiprocessing.connection import Connection

    from sparserl_compile.sandbox import _watch_parent

    fd, factory, parent = argv
    _watch_parent(int(parent))
    conn = Connection(int(fd))
    conn.send(("ready",))
    provider = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        try:
            if provider is None:
                mod, cls = factory.split(":")
                provider = getattr(importlib.import_module(mod), cls)()
            if msg[0] == "warm_up":
                provider.warm_up()
                conn.send(("ok", {"name": provider.name,
                                  "checkpoint_hash": getattr(provider, "checkpoint_hash", None),
                                  "sandbox_spare": getattr(provider, "sandbox_spare", 0)}))
            elif msg[0] == "candidates":
                conn.send(("ok", list(provider.candidates(msg[1], msg[2]))))
            else:
                conn.send(("error", f"unknown request {msg[0]!r}"))
        except Exception as e:  # noqa: BLE001 - the parent raises it as the provider's failure
            conn.send(("error", f"{type(e).__name__}: {e}"))
