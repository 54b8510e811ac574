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
* The dense product: where ``dense_unsuitable(problem)`` finds nothing against it (the matrix
  is at least ``RuntimeConfig.dense_min_density`` stored and its dense copy in the value dtype
  takes at most ``RuntimeConfig.dense_max_bytes``: decided from the structure and dtype alone,
  so the cache key needs nothing more), ``choose`` has the worker time ``torch.mv``/``torch.mm``
  with the matrix stored dense (cuBLAS) in each reference job, both ways, as it times the
  reference (``bench.time_dense``); the faster of its two timings counts each way. The dense
  product wins where it beats, by ``margin``, flushed and hot, the reference and the kept
  kernel if there is one: the user's own alternative for a pruned ``nn.Linear`` is the dense
  layer, and a model must never be made slower than that. ``Choice.dense`` is then True and
  ``candidate`` None; the runtime keeps the dense matrix (``plans.DensePlan``).
* CPU executor (or ``time=False``): nothing can be timed, so the rule is "the first verified
  candidate in the provider's order" (providers list their best guess first); all times None,
  and the dense product never wins.

``Choice.record`` holds every candidate's outcome (kind, reason, times, errors), the outcome
("kernel", "reference" or "dense") and ``selection_version`` as plain JSON for the cache entry
and for debugging. Nothing is cached or launched here.
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
#: the rules ``decide`` applies, in every record: 2 also times the dense product (records
#: without the field are of version 1: kernel against reference only)
SELECTION_VERSION = 2


@dataclass(frozen=True)
class Choice:
    """The selection for one problem. ``candidate=None``: use the reference."""

    candidate: Candidate | None
    cubin: bytes | None = field(default=None, repr=False)
    kernel_us: float | None = None
    reference_us: float | None = None
    record: dict = field(default_factory=dict, repr=False)
    #: the dense product's flushed median (None: not timed) and whether it won (``candidate`` is then None)
    dense_us: float | None = None
    dense: bool = False

    @property
    def outcome(self) -> str:
        """"kernel", "reference" or "dense": what serves the product."""
        return "dense" if self.dense else "reference" if self.candidate is None else "kernel"

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

    def dense_us(self, *, hot: bool = False) -> float | None:
        """The dense product's flushed median (``hot``: its hot-L2 one), the faster of its timings
        in the reference jobs; None where it was not timed (or failed)."""
        times = []
        for r in (self.reference, self.reference_again):
            d = r.dense if r is not None and r.ok and r.dense else {}
            t = d.get("dense_graph" if hot else "dense")
            if t is not None:
                times.append(float(t["median_us"]))
        return min(times) if times else None

    def dense_error(self) -> str | None:
        """Why the dense product was asked for and not timed, where it was not."""
        for r in (self.reference, self.reference_again):
            if r is not None and r.ok and r.dense and "error" in r.dense:
                return str(r.dense["error"])
        return None


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
             first_verified: bool = False, precompile: bool = False, parallel_verify: bool = False,
             dense: bool = False) -> Evaluation:
    """Sandbox every candidate (and, when timing on the GPU, the reference) for ``problem``.

    ``dense=True`` (what ``choose`` asks for where ``dense_unsuitable`` allows it): every
    reference job also times the dense product.

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
        ref = run(SandboxJob(None, **common, dense=dense))
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
        again = run(SandboxJob(None, **common, dense=dense))
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
    """Apply the selection rule of the module docstring to an ``Evaluation``: a kernel against
    the reference, then the dense product (where it was timed) against what that kept."""
    return _with_dense(_kernel_or_reference(candidates, ev, margin), ev, margin)


def _kernel_or_reference(candidates: list[Candidate], ev: Evaluation, margin: float) -> Choice:
    """The rule between the candidates and the reference (the dense product aside)."""
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
    runs = [x for x in (ev.reference, ev.reference_again) if x is not None]
    if ref_us is None and runs and not any(x.ok for x in runs):
        # asked for and not timed (the job crashed or ran out of time): nothing shows the
        # kernel faster than what the user would otherwise run, so that stays
        why = "; ".join(f"{x.kind}: {x.error}" if x.error else x.kind for x in runs)
        record.update(chosen=None, best=c.name, best_us=r.kernel_us, best_hot_us=_hot(r), transient=True,
                      rule=f"reference kept: its timing failed ({why}), so no kernel is shown faster")
        return Choice(None, None, r.kernel_us, None, record)
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


def _with_dense(choice: Choice, ev: Evaluation, margin: float) -> Choice:
    """``choice`` with the dense product's timings and verdict: it wins where it beats the
    reference and the kept kernel (if any) by ``margin``, flushed and hot (module doc)."""
    rec = choice.record
    rec.update(selection_version=SELECTION_VERSION, outcome=choice.outcome)
    if ev.reference is None or ev.reference.dense is None:  # not asked for (or nothing timed)
        return choice
    d, d_hot = ev.dense_us(), ev.dense_us(hot=True)
    rec.update(dense_us=d, dense_hot_us=d_hot)
    if ev.dense_error() is not None:
        rec["dense_error"] = ev.dense_error()
    rivals = [("the reference", choice.reference_us, rec.get("reference_hot_us"))]
    if choice.candidate is not None:
        rivals.append((f"kernel {choice.candidate.name}", choice.kernel_us, rec.get("chosen_hot_us")))
    why = _dense_loses(d, d_hot, rivals, margin)
    if why is not None:
        rec["dense_rule"] = why
        return replace(choice, dense_us=d)
    beaten = " and ".join(f"{name} ({_us(us)} flushed, {_us(hot)} hot)" for name, us, hot in rivals)
    rec.update(outcome="dense", chosen=None, kept_kernel=choice.candidate.name if choice.candidate else None,
               rule_without_dense=rec.get("rule"),
               rule=f"the dense product wins: {_us(d)} flushed and {_us(d_hot)} hot beat {beaten} by {margin}")
    return Choice(None, None, choice.kernel_us, choice.reference_us, rec, dense_us=d, dense=True)


def _dense_loses(d: float | None, d_hot: float | None, rivals, margin: float) -> str | None:
    """Why the dense product (``d`` flushed, ``d_hot`` hot) is not kept against ``rivals``
    ((name, flushed, hot) each), or None where it beats every one by ``margin`` both ways. A
    figure missing on either side keeps the rival, as for a kernel against the reference."""
    if d is None or d_hot is None:
        return "the dense product was not timed both ways"
    for name, us, hot in rivals:
        if us is None or hot is None:
            return f"{name} has no {'flushed' if us is None else 'hot'} figure to compare with"
        if not d < (1.0 - margin) * us:
            return f"{name} is kept: dense {_us(d)} not below (1-{margin}) x {_us(us)} flushed"
        if not d_hot < (1.0 - margin) * hot:
            return f"{name} is kept: dense {_us(d_hot)} not below (1-{margin}) x {_us(hot)} hot"
    return None


def dense_unsuitable(problem, cfg=None) -> str | None:
    """Why the dense product is no selection candidate for ``problem``, or None where it is:
    its matrix must be at least ``dense_min_density`` stored and fit ``dense_max_bytes`` stored
    dense in its value dtype (``RuntimeConfig``; ``cfg``: the runtime's current settings).
    From the structure and dtype alone, as the cache key is. The one place that decides it:
    ``choose`` asks it before timing, the runtime before it trusts a cached verdict."""
    from sparserl_compile import config
    from sparserl_compile.contract import TORCH_NAMES

    cfg = cfg or config.current
    cells = int(problem.n_rows) * int(problem.n_cols)
    if cells == 0:
        return "an empty matrix"
    density = int(problem.nnz) / cells
    if density < cfg.dense_min_density:
        return f"density {density:.4g} is below dense_min_density {cfg.dense_min_density:g}"
    nbytes = cells * {"float32": 4, "float16": 2, "bfloat16": 2}[TORCH_NAMES[problem.dtype]]
    if nbytes > cfg.dense_max_bytes:
        return f"stored dense it takes {nbytes} bytes, over dense_max_bytes {cfg.dense_max_bytes}"
    return None


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
           value_sets: int = 3, seed: int = 0, dense: bool | None = None) -> Choice:
    """Verify (and time) ``candidates`` for ``problem`` in sandboxes and pick one (or None, or
    the dense product).

    ``pool``: reuse an existing ``SandboxPool`` (the runtime keeps one); otherwise a
    one-worker pool is started and closed here. ``dense``: time the dense product too (None:
    where ``dense_unsuitable`` allows it); only a timed selection can keep it, and with it
    ``candidates`` may be empty (the dense product against the reference alone).
    """
    executor = executor or default_executor()
    if executor not in ("gpu", "cpu"):
        raise ValueError(f"executor={executor!r}; use 'gpu', 'cpu' or None (auto)")
    timed = time and executor == "gpu"
    why_not = dense_unsuitable(problem) if dense is None else (None if dense else "not asked for")
    dense = timed and why_not is None
    if not candidates and not dense:
        return Choice(None, record={"candidates": [], "chosen": None, "rule": "no candidates proposed",
                                    "selection_version": SELECTION_VERSION, "outcome": "reference"})
    own = pool is None
    pool = pool or SandboxPool(1, timeout_s=timeout_s)
    try:
        ev = evaluate(problem, list(candidates), pool=pool, executor=executor, time=time,
                      value_sets=value_sets, seed=seed, timeout_s=timeout_s, first_verified=not timed,
                      dense=dense)
    finally:
        if own:
            pool.close()
    choice = decide(list(candidates), ev, margin=margin)
    choice.record["executor"] = executor
    if not dense:
        choice.record["dense_not_timed"] = why_not or "the selection was not timed"
    return choice
