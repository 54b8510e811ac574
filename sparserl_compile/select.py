"""Pick the kernel for a problem: sandboxed verify + time every candidate against the reference.

``choose(problem, candidates)`` runs each candidate through a ``SandboxPool`` worker
(compile, every verification check at every dense width the plan will serve, and on the GPU
the two timings with the impossible-speed check), times the reference (torch.sparse CSR, i.e.
cuSPARSE, int32 and int64 indices) in the same worker so both are measured side by side, and
returns a ``Choice``:

* Widths: plans and cache entries are keyed by ``cache.width_bucket(n)``, so each candidate
  is verified at ``verify.widths_to_verify(op, n, n_align)``: the call's ``n`` and the other
  widths of its bucket the kernel can take; the record lists them (``widths_verified``).
* GPU with timing: every product is timed twice, with the L2 flushed before each call and
  back to back with a hot L2 (``bench.time_hot``). A verified candidate is kept only if it
  beats the reference by ``margin`` both ways: its flushed median strictly below
  ``(1 - margin)`` x the reference's (int32 indices; int64 if int32 is unsupported) and its
  hot figure strictly below ``(1 - margin)`` x the reference's hot figure. A kernel that wins
  flushed but loses with cached operands (an eager loop over one matrix) would be slower per
  call than torch.sparse; one that wins hot but loses flushed would be slower where the
  operands are evicted between calls. Among the candidates that pass both, the fastest
  flushed is kept; otherwise ``candidate=None``: the reference wins and the runtime falls back
  to it. A candidate or reference without a hot figure cannot pass. The reference is timed
  before the candidates and, once one of them has a time, again after them; the faster of its
  two medians (each way) counts. A reference timed while the GPU was slow (its clocks still
  rising, another process busy) would otherwise let a kernel through that only beat a bad
  measurement: the rule errs towards cuSPARSE.
* CPU executor (or ``time=False``): nothing can be timed, so the rule is "the first verified
  candidate in the provider's order" (providers list their best guess first); all times None.

``Choice.record`` holds every candidate's outcome (kind, reason, times, errors) as plain JSON
for the cache entry and for debugging. Nothing is cached or launched here.
"""

from __future__ import annotations

import time as _time
from dataclasses import dataclass, field, replace

import numpy as np

from sparserl_compile.contract import Candidate
from sparserl_compile.sandbox import SandboxJob, SandboxPool, SandboxResult
from sparserl_compile.verify import Pattern

#: a candidate must beat the reference by this fraction to be kept
DEFAULT_MARGIN = 0.03


@dataclass(frozen=True)
class Choice:
    """The selection for one problem. ``candidate=None``: use the reference."""

    candidate: Candidate | None
    cubin: bytes | None = field(default=None, repr=False)
    kernel_us: float | None = None
    reference_us: float | None = None
    record: dict = field(default_factory=dict, repr=False)

    @property
    def speedup(self) -> float | None:
        if self.kernel_us is None or self.reference_us is None or self.kernel_us <= 0:
            return None
        return self.reference_us / self.kernel_us


@dataclass(frozen=True)
class Evaluation:
    """Every candidate's sandbox result, plus the reference timing (None on the CPU)."""

    results: tuple[SandboxResult, ...]
    reference: SandboxResult | None
    seconds: float
    #: the reference timed again after the candidates (None: not timed again)
    reference_again: SandboxResult | None = None
    #: wall seconds by stage in this process: "compile" (``precompile``), "reference" (its
    #: timings), and "candidates" (each verified and timed in turn) or, with
    #: ``parallel_verify``, "verify" (all at once) and, when timed, "time" (the verified ones in turn)
    parts: dict = field(default_factory=dict)

    def reference_us(self) -> float | None:
        """The reference's median (int32 indices, else int64): the faster of its two timings."""
        times = [t for t in (_reference_median(self.reference), _reference_median(self.reference_again))
                 if t is not None]
        return min(times) if times else None

    def reference_graph_us(self) -> float | None:
        """The reference's hot-L2 (graph replay) median for the index type ``reference_us``
        uses: the faster of its timings, None where it was not graph-timed."""
        times = [t for t in (_reference_median(self.reference, graph=True),
                             _reference_median(self.reference_again, graph=True)) if t is not None]
        return min(times) if times else None

    def reference_runs_us(self) -> list[float | None]:
        """Each timing of the reference, in order (one or two)."""
        runs = [self.reference] + ([self.reference_again] if self.reference_again is not None else [])
        return [_reference_median(r) for r in runs]


def _reference_median(r: SandboxResult | None, *, graph: bool = False) -> float | None:
    """The flushed median of the first index type timed (int32, else int64), or with ``graph``
    that index type's graph-replay median (None where it has none)."""
    if r is None or not r.ok or not r.reference:
        return None
    for it in ("int32", "int64"):
        if it in r.reference:
            key = f"{it}_graph" if graph else it
            return float(r.reference[key]["median_us"]) if key in r.reference else None
    return None


def default_executor() -> str:
    """"gpu" when torch sees a CUDA device, else "cpu"."""
    try:
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover
        return "cpu"


def _pattern(problem) -> Pattern:
    return Pattern(np.asarray(problem.indptr, np.int32), np.asarray(problem.indices, np.int32),
                   (int(problem.n_rows), int(problem.n_cols)))


def evaluate(problem, candidates: list[Candidate], *, pool: SandboxPool, executor: str, time: bool = True,
             value_sets: int = 3, seed: int = 0, timeout_s: float | None = None, reps: int = 30,
             first_verified: bool = False, precompile: bool = False, parallel_verify: bool = False) -> Evaluation:
    """Sandbox every candidate (and, when timing on the GPU, the reference) for ``problem``.

    ``first_verified=True`` (what ``choose`` asks for when nothing is timed) stops at the first
    verified candidate, the one ``decide`` would take; ``Evaluation.results`` then covers only
    the candidates run. The benchmark suite and the RL rewards run them all.

    ``precompile=True`` (the suite and the RL rewards, which run many candidates) first
    compiles every candidate in parallel threads of this process (``compiler.precompile``), so
    the worker finds them in the disk cache. The runtime leaves it off: NVRTC then only ever
    sees generated code inside the worker.

    ``parallel_verify=True`` (the RL rewards), with a pool of several workers: every candidate
    is first verified (all value sets, no timing) on the pool's workers at once. When timing,
    the verified ones are then timed one at a time, each re-checked on one value set in the
    worker that times it. Nothing is timed while another job runs, so the timings are as side
    by side as in the default order (each candidate verified and timed in turn), and the
    verification of many candidates takes the time of the slowest few instead of their sum.
    Untimed (the CPU executor) the verification is all there is.
    """
    t0 = _time.perf_counter()
    parts: dict[str, float] = {}
    pattern = _pattern(problem)
    timed = time and executor == "gpu"
    common = dict(op=problem.op, dtype=problem.dtype, n=problem.n, executor=executor, seed=seed,
                  value_sets=value_sets, time=timed, reps=reps)
    widths = [_widths(problem, c) for c in candidates]
    run = lambda job: pool.run(job, pattern, pattern_key=problem.fingerprint, timeout_s=timeout_s)  # noqa: E731
    if precompile and executor == "gpu" and not first_verified and len(candidates) > 1:
        from sparserl_compile import compiler

        compiler.precompile([c.source for c in candidates])
        parts["compile"] = _time.perf_counter() - t0
    checked = None
    if parallel_verify and not first_verified and len(candidates) > 1 and pool.workers > 1:
        t1 = _time.perf_counter()
        checked = pool.map([SandboxJob(c, **{**common, "time": False}, widths=w) for c, w in zip(candidates, widths)],
                           pattern, pattern_key=problem.fingerprint, timeout_s=timeout_s)
        parts["verify"] = _time.perf_counter() - t1
    ref = None
    if timed:
        t1 = _time.perf_counter()
        ref = run(SandboxJob(None, **common))
        parts["reference"] = _time.perf_counter() - t1
    t1 = _time.perf_counter()
    results = []
    for i, c in enumerate(candidates):
        if checked is None:
            r = run(SandboxJob(c, **common, widths=widths[i]))
        elif checked[i].ok and timed:  # verified on every value set: re-checked on the first, then timed
            r = run(SandboxJob(c, **{**common, "value_sets": 1}))
            r = _merged(checked[i], r)
        else:
            r = checked[i]
        results.append(r)
        if first_verified and r.ok:
            break
    if checked is None:
        parts["candidates"] = _time.perf_counter() - t1
    elif timed:
        parts["time"] = _time.perf_counter() - t1
    again = None
    if ref is not None and any(r.ok and r.kernel_us is not None for r in results):
        t1 = _time.perf_counter()
        again = run(SandboxJob(None, **common))
        parts["reference"] += _time.perf_counter() - t1
    return Evaluation(tuple(results), ref, _time.perf_counter() - t0, again, parts)


def _widths(problem, c: Candidate) -> tuple[int, ...]:
    """The widths ``c`` is verified at for ``problem`` (just ``n`` where ``n`` does not suit its
    ``n_align``: the align check then rejects it)."""
    from sparserl_compile.verify import widths_to_verify

    align = c.header.launch.n_align
    return (problem.n,) if problem.n % align else widths_to_verify(problem.op, problem.n, align)


def _merged(checked: SandboxResult, timed: SandboxResult) -> SandboxResult:
    """A candidate's outcome under ``parallel_verify``: the timed job's (its kind, times and
    cubin; a failed re-check stands), with the full verification's result and phases."""
    if not timed.ok:
        return timed
    phases = {k: v for k, v in checked.phases.items() if k not in ("time", "graph")}
    phases.update({k: timed.phases[k] for k in ("time", "graph") if k in timed.phases})
    phases["recheck"] = sum(v for k, v in timed.phases.items() if k not in ("time", "graph"))
    return replace(timed, verify=checked.verify, wall_s=checked.wall_s + timed.wall_s, phases=phases)


def outcome_record(c: Candidate, r: SandboxResult) -> dict:
    """One candidate's outcome as plain JSON."""
    v = r.verify
    return {"name": c.name, "family": c.family, "params": {k: _jsonable(x) for k, x in c.params},
            "format": c.header.format, "kind": r.kind, "error": r.error[:500],
            "failed_check": v.failed if v else None,
            "max_rel_err": max(v.max_rel_err) if v and v.max_rel_err else None,
            "widths_verified": list(v.widths) if v else [], "oob": v.oob if v else None,
            "kernel_us": r.kernel_us, "p10_us": r.bench["p10_us"] if r.bench else None,
            "p90_us": r.bench["p90_us"] if r.bench else None,
            "graph_us": r.graph_bench["median_us"] if r.graph_bench else None,
            "hot_us": r.graph_bench["median_us"] if r.graph_bench else None,
            "hot_method": r.graph_bench.get("method") if r.graph_bench else None,
            "floor_us": r.floor_us, "wall_s": round(r.wall_s, 4),
            "phases": {k: round(v, 4) for k, v in r.phases.items()},
            "overhead": {k: round(v, 4) for k, v in r.overhead.items()}}


def _jsonable(x):
    return x if isinstance(x, (int, float, str, bool, type(None))) else str(x)


def decide(candidates: list[Candidate], ev: Evaluation, *, margin: float = DEFAULT_MARGIN) -> Choice:
    """Apply the selection rule of the module docstring to an ``Evaluation``."""
    ref_us, ref_hot = ev.reference_us(), ev.reference_graph_us()
    record = {"candidates": [outcome_record(c, r) for c, r in zip(candidates, ev.results)],
              "reference": ev.reference.reference if ev.reference else None,
              "reference_us": ref_us, "reference_runs_us": ev.reference_runs_us(),
              "reference_graph_us": ref_hot, "reference_hot_us": ref_hot,
              "margin": margin, "seconds": round(ev.seconds, 3),
              "parts": {k: round(v, 4) for k, v in ev.parts.items()},
              "reference_wall_s": round(ev.reference.wall_s, 4) if ev.reference else None}
    ok = [(c, r) for c, r in zip(candidates, ev.results) if r.ok]
    if not ok:
        record.update(chosen=None, rule="no candidate verified")
        return Choice(None, None, None, ref_us, record)
    timed = [(c, r) for c, r in ok if r.kernel_us is not None]
    if not timed:
        c, r = ok[0]
        record.update(chosen=c.name, widths_verified=list(r.verify.widths) if r.verify else [],
                      rule="untimed: first verified candidate in provider order")
        return Choice(c, r.cubin, None, ref_us, record)
    c, r = min(timed, key=lambda cr: cr[1].kernel_us)
    beats = timed if ref_us is None else [(c2, r2) for c2, r2 in timed if r2.kernel_us < (1.0 - margin) * ref_us]
    if not beats:
        record.update(chosen=None, best=c.name, best_us=r.kernel_us, best_hot_us=_hot(r),
                      rule=f"reference wins: best {r.kernel_us:.2f} us not below (1-{margin}) x {ref_us:.2f} us")
        return Choice(None, None, r.kernel_us, ref_us, record)
    hot = beats if ref_us is None else [(c2, r2) for c2, r2 in beats if _hot_ok(r2, ref_hot, margin)]
    if not hot:
        g = _hot(r)
        record.update(chosen=None, best=c.name, best_us=r.kernel_us, best_graph_us=g, best_hot_us=g,
                      rule=f"reference wins with a hot L2: no candidate that beats it flushed also beats it by "
                           f"{margin} back to back (fastest flushed: {_us(g)} vs the reference's {_us(ref_hot)})")
        return Choice(None, None, r.kernel_us, ref_us, record)
    c, r = min(hot, key=lambda cr: cr[1].kernel_us)
    record.update(chosen=c.name, chosen_us=r.kernel_us, chosen_hot_us=_hot(r),
                  widths_verified=list(r.verify.widths) if r.verify else [],
                  rule="fastest verified candidate beats the reference flushed and hot")
    return Choice(c, r.cubin, r.kernel_us, ref_us, record)


def _hot(r: SandboxResult) -> float | None:
    return None if r.graph_bench is None else float(r.graph_bench["median_us"])


def _us(t: float | None) -> str:
    return "none" if t is None else f"{t:.2f} us"


def _hot_ok(r: SandboxResult, ref_hot_us: float | None, margin: float) -> bool:
    """Beats the reference by ``margin`` with a hot L2 (both must have the figure)."""
    g = _hot(r)
    return g is not None and ref_hot_us is not None and g < (1.0 - margin) * ref_hot_us


def outdated(record: dict) -> str | None:
    """Why a cached verdict's record (``Choice.record``) was decided by rules older than
    ``decide``'s, or None. Only a kept kernel can be outdated: the rules only grew stricter,
    so a verdict that the reference wins stands. A kept kernel must list the widths it was
    verified at and, if timed, the reference's hot figure it beat."""
    chosen = record.get("chosen")
    if chosen is None or not record.get("candidates"):
        return None
    if "widths_verified" not in record:
        return "it was verified at one width only, not at every width of its bucket"
    if record.get("reference_us") is not None and record.get("reference_hot_us") is None:
        return "it was not compared with the reference with a hot L2"
    return None


def choose(problem, candidates: list[Candidate], *, executor: str | None = None, time: bool = True,
           timeout_s: float = 60.0, margin: float = DEFAULT_MARGIN, pool: SandboxPool | None = None,
           value_sets: int = 3, seed: int = 0) -> Choice:
    """Verify (and time) ``candidates`` for ``problem`` in sandboxes and pick one (or None).

    ``pool``: reuse an existing ``SandboxPool`` (the runtime keeps one); otherwise a
    one-worker pool is started and closed here.
    """
    executor = executor or default_executor()
    if executor not in ("gpu", "cpu"):
        raise ValueError(f"executor={executor!r}; use 'gpu', 'cpu' or None (auto)")
    if not candidates:
        return Choice(None, record={"candidates": [], "chosen": None, "rule": "no candidates proposed"})
    own = pool is None
    pool = pool or SandboxPool(1, timeout_s=timeout_s)
    try:
        timed = time and executor == "gpu"
        ev = evaluate(problem, list(candidates), pool=pool, executor=executor, time=time,
                      value_sets=value_sets, seed=seed, timeout_s=timeout_s, first_verified=not timed)
    finally:
        if own:
            pool.close()
    choice = decide(list(candidates), ev, margin=margin)
    choice.record["executor"] = executor
    return choice
