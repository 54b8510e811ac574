"""The miss path: what the runtime does for a structure its plan table does not know.

``verdict(...)`` decides, for one product on a CUDA device, where its kernel comes from:

1. the disk cache (``cache.KernelCache.default()``; a cached "reference wins" or "dense wins"
   verdict counts); a cached kernel never timed on this GPU (pre-generated on a CPU) is timed
   once against cuSPARSE in the sandbox before it is trusted. A verdict reached without timing
   the dense product, where the dense product is now a candidate (``dense_stale``), is decided
   again: a kernel is timed again (one candidate, beside cuSPARSE and the dense product), a
   reference verdict is searched again as on a miss. A dense verdict the current settings no
   longer allow (a smaller ``dense_max_bytes``) is searched again too;
2. else, by ``RuntimeConfig.on_miss``: ``"search"`` asks the active provider for ``k``
   candidates and ``select.choose`` compiles, verifies (in a killable sandbox worker) and
   times them against the reference, and the product waits; ``"reference"`` keeps the
   reference (a process served from a pre-generated cache never stalls); ``"background"``
   queues the same search on a background thread and returns a ``Verdict`` holding its future.

It returns a ``Verdict`` (a cache entry or the reason the reference serves), never a plan:
``plans.py`` turns verdicts into plans. Every verdict is cached on disk when it came from a
search. Where the time of each first product went is kept in ``first_uses()``.

Nothing here launches a kernel in this process: ``select`` verifies and times in the sandbox.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from collections import deque

import torch

from sparserl_compile import cache, config, contract, providers
from sparserl_compile.problem import Problem, device_arch, make_problem

log = logging.getLogger("sparserl_compile.miss")

#: plans built on a miss kept in the ``first_uses()`` log (the oldest are dropped)
FIRST_USE_LOG_SIZE = 256

_lock = threading.RLock()
_logged: set[tuple] = set()
_first_uses: deque = deque(maxlen=FIRST_USE_LOG_SIZE)


@dataclass
class Verdict:
    """Where one structure's products come from, as the miss path decided.

    Exactly one of: ``reason`` (the reference serves; why), ``entry`` (a cache entry: a kernel,
    or the recorded verdict that the reference wins), ``future`` (a background search that
    will give an entry). ``record`` is the row for ``first_uses()`` without the plan's own
    time, which ``plans`` adds (``log_first_use``); None where no row is logged."""

    problem: Problem | None = None
    key: cache.CacheKey | None = None
    reason: str | None = None
    entry: cache.CacheEntry | None = None
    future: Future | None = None
    asked_provider: bool = False  # the provider proposed (not a cached kernel's re-timing)
    record: dict | None = field(default=None, repr=False)


def log_once(kind: str, fp: str, msg: str) -> None:
    """Log one warning per (kind, structure)."""
    if (kind, fp) not in _logged:
        _logged.add((kind, fp))
        log.warning("%s (structure %s): %s", kind, fp[:12], msg)


def clear() -> None:
    """Forget which warnings were logged (they are logged again once)."""
    _logged.clear()


def problem_of(op, crow, col, val, x, n_rows, n_cols, fp) -> Problem:
    """The ``Problem`` of one product (its pattern copied to the host)."""
    dname = str(val.dtype).removeprefix("torch.")
    return make_problem(op, contract.TORCH_DTYPES[dname], 1 if x.dim() == 1 else int(x.shape[1]),
                        crow, col, (n_rows, n_cols), fp, device_arch(x.device))


def verdict(op, crow, col, val, x, n_rows, n_cols, fp) -> Verdict:
    """Decide where a new structure's products come from (see the module doc). Raises on a
    failure of the kernel path; ``plans`` logs it and serves the reference."""
    t0 = time.perf_counter()
    problem = problem_of(op, crow, col, val, x, n_rows, n_cols, fp)
    t_problem = time.perf_counter()
    store = _store()
    key = entry = candidates = None
    if store is not None:
        try:
            key = cache_key_for(problem, x.device)
            entry = lookup(store, key)
        except Exception as e:  # noqa: BLE001 - an unusable cache must never stop a product
            log_once("disk cache unusable, searching without it", fp, f"{type(e).__name__}: {e}")
            store = None
    t_cache = time.perf_counter()
    times = (t0, t_problem, t_cache)
    stale = None if entry is None else dense_stale(entry, problem, timed=x.device.type == "cuda")
    if entry is not None and stale is not None and not entry.outcome == "kernel":
        log_once("cached verdict decided again", fp, stale)
        entry = None  # a reference or dense verdict: searched again as on a miss
    if entry is not None:
        config.counts["cache_hits"] += 1
        if entry.reference_wins:
            return Verdict(problem, key, reason="cached verdict: " + entry.verification.get("why", "the reference wins"))
        if entry.dense_wins or ("kernel_us" in entry.times and not timed_before_hot_rule(entry) and stale is None):
            return Verdict(problem, entry.key, entry=entry, record=_row(problem, "cache", None, *times, t_cache))
        # pre-generated without a GPU (verified on the CPU, never timed on this GPU), timed
        # before the selection compared short products with a hot L2, or before it timed the
        # dense product: timed against cuSPARSE (and the dense product) in the sandbox (one
        # candidate) before it is trusted
        candidates = [contract.Candidate(entry.source, contract.parse_header(entry.header or entry.source))]
    elif config.current.on_miss == "reference":
        why = "not in the kernel cache" if stale is None else f"the cached verdict is decided again ({stale})"
        return Verdict(problem, key, reason=f"{why} (on_miss='reference')")
    if config.current.on_miss == "background":
        fut = _background_search(problem, key, store, fp, candidates, x.device)
        return Verdict(problem, key, future=fut, asked_provider=candidates is None)
    entry = search_entry(problem, key, candidates=candidates)
    _put(store, entry, fp)
    source = "search" if candidates is None else "cache+timing"
    return Verdict(problem, key, entry=entry, asked_provider=candidates is None,
                   record=_row(problem, source, entry.verification, *times, time.perf_counter()))


def _row(problem, source, record, t0, t_problem, t_cache, t_selected) -> dict:
    record = dict(record or {})
    propose = record.get("propose_s", 0.0)
    return {"fingerprint": problem.fingerprint, "op": problem.op, "n": problem.n, "dtype": problem.dtype,
            "nnz": problem.nnz, "source": source, "problem_s": t_problem - t0, "cache_s": t_cache - t_problem,
            "propose_s": propose, "select_s": max(t_selected - t_cache - propose, 0.0),
            "t0": t0, "verification": record or None}


def log_first_use(v: Verdict, plan_kind: str) -> None:
    """Append one plan's time split to the ``first_uses()`` log (once its plan is built)."""
    if v.record is None:
        return
    row = dict(v.record)
    t0 = row.pop("t0")
    now = time.perf_counter()
    row["total_s"] = now - t0
    row["plan_s"] = max(row["total_s"] - row["problem_s"] - row["cache_s"] - row["propose_s"] - row["select_s"], 0.0)
    row["plan"] = plan_kind
    with _lock:
        _first_uses.append(row)


def first_uses() -> list[dict]:
    """Where the time of each plan built on a miss went, oldest first (the last
    ``FIRST_USE_LOG_SIZE``): what a slow first product on a new structure paid for. Each dict:

    * ``fingerprint``, ``op``, ``n``, ``dtype``, ``nnz``; ``source``: ``"search"`` (the provider
      was asked), ``"cache"`` (served by the disk cache) or ``"cache+timing"`` (a pre-generated
      entry never timed on this GPU, timed now);
    * seconds: ``problem_s`` (the pattern copied to the host), ``cache_s`` (disk-cache lookup),
      ``propose_s`` (the provider's ``propose``), ``select_s`` (compile, sandboxed
      verification and timing, ``select.choose``, and the disk-cache write), ``plan_s``
      (format conversion, upload and loading the winner), ``total_s``;
    * ``plan``: ``"kernel"``, ``"reference"`` or ``"dense"``; ``verification``: the selection record
      (per-candidate worker phases, the reference's time, why the reference won), when one ran.

    Background searches (``on_miss="background"``) and products served straight from the
    plan table are not in it."""
    with _lock:
        return [dict(r) for r in _first_uses]


def clear_first_uses() -> None:
    with _lock:
        _first_uses.clear()


def timed_before_hot_rule(entry) -> bool:
    """Whether a cached kernel verdict for a short product (under ``sandbox.GRAPH_BELOW_US``
    flushed) was chosen before ``select.decide`` also compared short products with a hot L2:
    its record has no ``reference_graph_us``. Such an entry is timed again, once, under the
    current rule; longer products are decided alike by both rules."""
    from sparserl_compile.sandbox import GRAPH_BELOW_US

    us = entry.times.get("kernel_us")
    return us is not None and us < GRAPH_BELOW_US and "reference_graph_us" not in entry.verification


def dense_stale(entry, problem: Problem, *, timed: bool) -> str | None:
    """Why a cached verdict must be decided again for the dense product, or None where it
    stands: a dense verdict the current settings no longer allow (``select.dense_unsuitable``),
    or, where the decision would be timed (``timed``: on a GPU), a verdict reached without
    timing the dense product (its record has no ``dense_us``: an entry of selection version 1,
    or pre-generated without a GPU) where the dense product is now a candidate."""
    from sparserl_compile import select

    why_not = select.dense_unsuitable(problem)
    if entry.dense_wins:
        return None if why_not is None else f"its dense verdict is no longer allowed: {why_not}"
    if why_not is not None or not timed or "dense_us" in entry.verification:
        return None
    how = "by selection version 1" if entry.verification.get("selection_version", 1) < 2 else "untimed"
    return f"it was reached without timing the dense product ({how}), which is now a candidate"


# ------------------------------------------------------------------------- the search


def search_entry(problem: Problem, key, *, candidates=None, executor: str | None = None) -> cache.CacheEntry:
    """Ask the active provider (or take ``candidates``), select, and return the cache entry.

    The entry holds the winning kernel (cubin, source, header, times) or, with ``cubin=None``,
    the verdict that the reference wins or (``outcome="dense"``) that the dense product does.
    ``select.choose`` does all compiling, sandboxed verification and timing; nothing is launched
    in this process.
    """
    from sparserl_compile import select

    t0 = time.perf_counter()
    if candidates is None:
        provider = providers.get_provider()
        if not isinstance(provider, providers.ReferenceProvider):
            # a process's first search: the sandbox worker (seconds on a GPU) starts while the
            # provider proposes instead of after it
            try:
                sandbox_pool(provider).start()
            except Exception:  # noqa: BLE001 - best effort: the selection starts one and reports why not
                pass
        candidates, proposer = provider.propose(problem, config.current.k)
    else:
        provider, proposer = None, "given"
    config.counts["searches"] += 1
    record: dict = {"provider": proposer, "candidates": len(candidates), "propose_s": time.perf_counter() - t0}
    reference_only = isinstance(provider, providers.ReferenceProvider)
    if not candidates and (reference_only or (executor or select.default_executor()) != "gpu"
                           or select.dense_unsuitable(problem)):
        # (with none, the dense product may still beat the reference: timed where it can be,
        # except under the reference provider, whose verdict is the reference by choice)
        record["why"] = f"provider {record['provider']!r} proposed no candidates"
        if reference_only:
            record.update(dense_us=None, dense_not_timed="the reference provider keeps the reference")
        return cache.CacheEntry(key=key, cubin=None, times={}, verification=record)
    choice = select.choose(problem, candidates, executor=executor, pool=sandbox_pool(provider))
    record.update(dict(choice.record or {}))
    cand = choice.candidate
    times = {k: v for k, v in (("kernel_us", choice.kernel_us), ("reference_us", choice.reference_us),
                               ("dense_us", choice.dense_us)) if v is not None}
    if choice.dense:
        record["why"] = record.get("rule") or "the dense product beat the reference and the candidates"
        return cache.CacheEntry(key=key, cubin=None, times=times, verification=record, outcome="dense")
    if cand is None:
        record.setdefault("why", record.get("rule") or "no verified candidate beat the reference")
        return cache.CacheEntry(key=key, cubin=None, times=times, verification=record)
    record["winner_family"] = cand.name
    return cache.CacheEntry(key=key, cubin=choice.cubin, source=cand.source, header=cand.header.render(),
                            times=times, verification=record)


def load_provider_later() -> None:
    """After a search that asked the provider has built its plan: the provider may start loading
    in the background (``Provider.load_in_background``: the ``DefaultProvider`` loads the policy;
    nothing for the others). Not sooner: until the process's first plan is built, the sandbox
    worker's start, the timing and the plan's conversion and upload have the process and the
    GPU to themselves."""
    providers.get_provider().load_in_background()


# ------------------------------------------------------------------------- the sandbox pool


_pool = None
_pool_lock = threading.Lock()


def sandbox_spare(provider=None) -> int:
    """The idle sandbox workers the runtime keeps for ``provider``: ``RuntimeConfig.sandbox_spare``
    when set, else the provider's own ``sandbox_spare`` (0 for no provider)."""
    if config.current.sandbox_spare is not None:
        return config.current.sandbox_spare
    wish = provider.sandbox_spare if provider is not None else 0
    return wish if isinstance(wish, int) and not isinstance(wish, bool) and wish > 0 else 0


def sandbox_pool(provider=None):
    """The runtime's one sandbox worker for verification (started on the first search, or by
    ``prewarm``), and ``sandbox_spare(provider)`` idle ones."""
    global _pool
    with _pool_lock:
        if _pool is None:
            from sparserl_compile.sandbox import SandboxPool

            _pool = SandboxPool(1)
            atexit.register(_pool.close)
        _pool.spare = sandbox_spare(provider)  # configure() or the provider may change between products
    return _pool


def prewarm(*, provider: bool = True) -> threading.Thread:
    """Pay this process's one-time costs now, in the background, instead of in the first
    product on a new structure: start the sandbox worker (a fresh interpreter with torch and,
    on a GPU, a CUDA context, which then loads the format converters), load the converters
    and structure statistics here (numba, from its disk cache), and build the active provider
    (``provider=True``; for the policy, the default, that is loading the model and its
    ``warm_up``: its first decoding costs; without it the lookup proposes for the first new
    structures while the model loads in the background). For serving processes: call it at
    start-up. Returns the thread (``join()`` it to wait); errors are left for the first
    product to report.

    The sandbox workers are fresh interpreters that import only ``sparserl_compile``, never the
    main script, so a script needs no ``if __name__ == "__main__":`` guard for them."""

    def go():
        try:
            from sparserl_compile import formats

            pool = sandbox_pool()
            pool.start()
            formats.warm()
            if provider:
                prov = providers.get_provider()
                prov.warm_up()  # the policy (default or set): load it and pay its first decoding
                sandbox_pool(prov)  # and the spare workers it asks for
            pool.start(wait=True)
        except Exception:  # noqa: BLE001 - best effort; the first product reports real errors
            pass

    t = threading.Thread(target=go, daemon=True, name="sparserl-prewarm")
    t.start()
    return t


# ------------------------------------------------------------------------- the background queue


_bg_queue: queue.Queue | None = None


def _background_search(problem, key, store, fp, candidates=None, device=None) -> Future:
    """Queue ``search_entry`` for ``problem`` on the one background thread; returns a Future.
    The thread is a daemon: a search still running when the process exits is abandoned (its
    sandbox worker is closed at exit) and nothing half-done is cached. The search runs with
    ``device`` current (a thread starts on CUDA device 0), so its sandbox follows the product's GPU."""
    global _bg_queue
    with _lock:
        if _bg_queue is None:
            _bg_queue = queue.Queue()
            threading.Thread(target=_background_worker, args=(_bg_queue,), name="sparserl-search",
                             daemon=True).start()
    fut: Future = Future()
    config.counts["background"] += 1
    _bg_queue.put((fut, problem, key, store, fp, candidates, device))
    return fut


def _background_worker(q) -> None:
    while True:
        fut, problem, key, store, fp, candidates, device = q.get()
        if not fut.set_running_or_notify_cancel():
            continue
        try:
            with torch.cuda.device(device) if device is not None and device.type == "cuda" else nullcontext():
                entry = search_entry(problem, key, candidates=candidates)
                _put(store, entry, fp)
        except BaseException as e:  # noqa: BLE001 - handed to the product that resolves it
            fut.set_exception(e)
        else:
            fut.set_result(entry)
        finally:
            if candidates is None:
                load_provider_later()


# ------------------------------------------------------------------------- the disk cache


_targets: dict[tuple, cache.Target] = {}


def key_for(problem: Problem, target: cache.Target) -> cache.CacheKey:
    """The disk-cache key of ``problem`` on ``target`` as the runtime makes it: under the active
    provider's policy hash (pre-generation keys its entries the same way)."""
    return cache.cache_key(problem, target, providers.policy_hash(providers.get_provider()))


def lookup(store, key: cache.CacheKey):
    """``store``'s entry for ``key`` as the runtime looks it up: the key itself, then the
    families-only entries (``"none"``: built with the search or the lookup), then the shipped
    policy's (``cache.lookup``'s ``fallback_hashes``)."""
    return cache.lookup(store, key, fallback_hashes=("none", providers.shipped_policy_hash()))


def cache_key_for(problem: Problem, device: torch.device) -> cache.CacheKey:
    """The disk-cache key of ``problem`` on ``device`` under the active provider."""
    k = (device.type, device.index)
    if k not in _targets:
        _targets[k] = cache.local_target(device)
    return key_for(problem, _targets[k])


def _store():
    if not config.current.cache:
        return None
    try:
        return cache.KernelCache.default()
    except Exception as e:  # noqa: BLE001
        log_once("disk cache unusable, searching without it", "-", f"{type(e).__name__}: {e}")
        return None


def _put(store, entry, fp: str) -> None:
    """Write ``entry`` to the disk cache, unless it has no key or its verdict came from a
    failure that may not recur (``transient`` in its record: the next process decides again)."""
    if store is None or entry.key is None or entry.verification.get("transient"):
        return
    try:
        store.put(entry)
    except Exception as e:  # noqa: BLE001
        log_once("could not write the kernel cache", fp, f"{type(e).__name__}: {e}")


def forget_cached(key) -> None:
    """Drop the disk entry of a kernel that failed its first-use re-check."""
    store = _store()
    if store is not None and key is not None:
        try:
            store.remove(key)
        except Exception:  # noqa: BLE001
            pass
