"""Rewards for RL: plain functions of a sample's outcome, and the evaluators that produce
outcomes.

The hierarchy (each level strictly above the one before, whatever the speed term)::

    no valid header            -1.0
    header, does not compile   -0.5
    compiles, wrong             0.0
    correct                     1.0 + speed_weight * speed term (>= 0)

The speed term rewards beating cuSPARSE and getting close to the best point of the
hand-written kernel space: ``max(0, log2(reference_us / us))`` (0 when slower than the
reference) plus ``min(1, best_space_us / us)`` (1 at or past the best family point). Each
reward function returns a float, or None where it does not apply (``speed_reward`` of an
incorrect kernel), and is a pure function of ``KernelOutcome``.

Evaluators turn k sources for one problem into outcomes:

- ``SandboxEvaluator(executor="gpu")``: NVRTC compile, sandboxed verification against
  cuSPARSE and fp64, and timing on the GPU (``sparserl_compile.select.evaluate`` over a
  ``SandboxPool`` of worker processes);
- ``SandboxEvaluator(executor="cpu")``: the same compile and verification, with the CPU
  executor (``simt``) in the worker processes; times come from a fitted ``CostModel``
  (``cost_model.py``) when the sample is a kernel-space point, else the speed term is 0.
- ``MeasuredEvaluator``: replays the H200 outcome of every sample that is a kernel-space point
  measured for that problem in the supervision data (the same source was compiled, verified
  in the sandbox and timed on the H200 by ``sparserl bench``), and hands the rest (novel
  kernels, points the bench did not run) to an inner evaluator (the CPU one). RL on a machine
  without a GPU then gets real H200 speeds, not the cost model's, for the samples that are
  points of the space (all of them, so far: the policies write no novel kernels).
- ``HeaderEvaluator``: parse-only, for tests and smoke runs without NVRTC.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparserl_compile.training.space import measured_sources, normalized


@dataclass(frozen=True)
class KernelOutcome:
    """What happened to one sample."""

    parsed: bool  # header parsed and matches the prompt's op/dtype
    compiled: bool
    correct: bool
    us: float | None = None  # measured or predicted kernel time
    reference_us: float | None = None  # torch.sparse / cuSPARSE time for this problem
    best_space_us: float | None = None  # fastest verified kernel-space point
    detail: str = ""  # first failure, for logs


def compile_reward(o: KernelOutcome) -> float:
    """-1 unparseable, -0.5 does not compile, 0 compiles."""
    if not o.parsed:
        return -1.0
    return 0.0 if o.compiled else -0.5


def correctness_reward(o: KernelOutcome) -> float | None:
    """1 correct, 0 wrong; None when it did not compile."""
    if not o.compiled:
        return None
    return 1.0 if o.correct else 0.0


def speed_reward(o: KernelOutcome) -> float | None:
    """The speed term (>= 0) of a correct kernel; None when not correct or not timed."""
    if not o.correct or o.us is None or o.us <= 0:
        return None
    term = 0.0
    if o.reference_us:
        term += max(0.0, math.log2(o.reference_us / o.us))
    if o.best_space_us:
        term += min(1.0, o.best_space_us / o.us)
    return term


def hierarchical_reward(o: KernelOutcome, speed_weight: float = 1.0) -> float:
    """The full reward (see the module docstring)."""
    r = compile_reward(o)
    c = correctness_reward(o)
    if c is None or c == 0.0:
        return r
    s = speed_reward(o)
    return 1.0 + speed_weight * (s or 0.0)


def correctness_only_reward(o: KernelOutcome) -> float:
    """The ablation without a speed term."""
    r = compile_reward(o)
    c = correctness_reward(o)
    return r if not c else 1.0


REWARDS = {"hierarchical": hierarchical_reward, "correctness": correctness_only_reward}


@dataclass
class RLProblem:
    """A matrix and a product to write kernels for, with what RL scores against."""

    matrix: object  # scipy CSR
    op: str
    dtype: str
    n: int
    label: str = ""
    reference_us: float | None = None
    best_space_us: float | None = None

    def runtime_problem(self, arch: str = "cpu"):
        from sparserl_compile.problem import Problem
        from sparserl_compile.structure import fingerprint

        m = self.matrix
        return Problem(self.op, self.dtype, self.n, m.shape[0], m.shape[1], m.nnz, m.indptr, m.indices,
                       fingerprint(m.indptr, m.indices, m.shape), arch)


def _parse(problem: RLProblem, source: str):
    from sparserl_compile import contract

    try:
        h = contract.parse_header(source)
    except contract.ContractError as e:
        return None, str(e)
    if h.op != problem.op or h.dtype != problem.dtype:
        return None, f"header says {h.op}/{h.dtype}, prompt asked {problem.op}/{problem.dtype}"
    return contract.Candidate(source=source, header=h), ""


class HeaderEvaluator:
    """Parse-only outcomes: a parsed header counts as compiled and correct (smoke tests)."""

    def __call__(self, problem: RLProblem, sources: list[str]) -> list[KernelOutcome]:
        out = []
        for s in sources:
            c, err = _parse(problem, s)
            out.append(KernelOutcome(c is not None, c is not None, c is not None, detail=err))
        return out


class SandboxEvaluator:
    """Compile + verify (+ time on the GPU) in sandboxed worker processes."""

    def __init__(self, executor: str = "cpu", workers: int = 2, timeout_s: float = 60.0, cost_model=None,
                 parallel_verify: bool = True, prestart: bool = True):
        from sparserl_compile.sandbox import SandboxPool

        self.executor, self.cost_model = executor, cost_model
        #: GPU rewards: verify a problem's candidates on all workers at once, then time the
        #: verified ones in turn (``select.evaluate(parallel_verify=True)``)
        self.parallel_verify = parallel_verify
        self.pool = SandboxPool(workers, timeout_s=timeout_s)
        if prestart:  # the workers start (on the GPU: torch and a CUDA context each) while the
            # caller loads and decodes, not during the first reward
            self.pool.start(count=workers)
        self.last_seconds: dict[str, float] = {}  # the last call's seconds by part (``reward_seconds``)

    def close(self) -> None:
        self.pool.close()

    def __call__(self, problem: RLProblem, sources: list[str]) -> list[KernelOutcome]:
        self.last_seconds = {}
        # a source repeated (a policy's samples are often copies of its greedy kernel) is verified
        # and timed once and its outcome shared: each run costs a sandboxed verification and 30
        # timed launches, and a copy timed again would differ only by noise, which could make a
        # copy "faster" than the kernel it copies
        unique = list(dict.fromkeys(sources))
        if len(unique) < len(sources):
            outcome = dict(zip(unique, self(problem, unique)))
            return [outcome[s] for s in sources]
        from sparserl_compile.select import evaluate

        parsed = [_parse(problem, s) for s in sources]
        cands = [c for c, _ in parsed if c is not None]
        rp = problem.runtime_problem("sm_90" if self.executor == "gpu" else "cpu")
        timed = self.executor == "gpu"
        ev = evaluate(rp, cands, pool=self.pool, executor=self.executor, time=timed,
                      precompile=True, parallel_verify=self.parallel_verify)  # every sample runs
        self.last_seconds = reward_seconds(ev)
        ref = ev.reference_us() if timed else problem.reference_us
        results = iter(ev.results)
        out = []
        for c, err in parsed:
            if c is None:
                out.append(KernelOutcome(False, False, False, detail=err))
                continue
            r = next(results)
            us = r.kernel_us
            if us is None and r.ok and self.cost_model is not None:
                us = self.cost_model.predict_source(problem.matrix, c, problem.n)
            out.append(KernelOutcome(True, r.compile_ok, r.ok, us, ref or problem.reference_us,
                                     problem.best_space_us, detail=r.kind if not r.ok else ""))
        return out


def reward_seconds(ev) -> dict[str, float]:
    """Where one ``select.evaluate`` call's seconds went: "compile" (NVRTC in this process's
    threads, before the workers), the cuSPARSE "reference" timings, the candidates'
    "verify" (in the workers: preparing the format, the value sets, the runs and the fp64
    reference) and "time" (L2-flushed and CUDA-graph), and the rest ("other": moving jobs and
    patterns to the workers, replacing a worker after a failed kernel). With
    ``parallel_verify`` "verify" is the wall time of verifying them all at once and "time" that
    of timing the verified ones in turn (each re-checked on one value set first); otherwise both
    are the workers' own seconds, summed over the candidates run one after another."""
    parts = getattr(ev, "parts", None) or {}
    ref = parts.get("reference", sum(r.wall_s for r in (ev.reference, ev.reference_again) if r is not None))
    compile_s = parts.get("compile", 0.0)
    if "verify" in parts:
        verify, timing = parts["verify"], parts.get("time", 0.0)
    else:
        verify = sum(v for r in ev.results for k, v in r.phases.items() if k not in ("time", "graph"))
        timing = sum(r.phases.get("time", 0.0) + r.phases.get("graph", 0.0) for r in ev.results)
    rest = ev.seconds - ref - compile_s - verify - timing
    return {"reference": ref, "compile": compile_s, "verify": verify, "time": timing, "other": max(0.0, rest)}


class MeasuredEvaluator:
    """Replays measured outcomes (module docstring). ``records``: the supervision records of
    the problems it will see (matched by label, op, dtype and n); ``inner``: the evaluator for
    samples that are not measured points (None: they count as not compiled, with a reason)."""

    def __init__(self, records, inner=None):
        self.records = {(r.matrix.label, r.op, r.dtype, r.n): r for r in records}
        self.inner = inner
        self._tables: dict[tuple, dict] = {}
        self.replayed = self.delegated = 0

    def close(self) -> None:
        if self.inner is not None and hasattr(self.inner, "close"):
            self.inner.close()

    def table(self, problem: RLProblem) -> dict[str, float | None]:
        key = (problem.label, problem.op, problem.dtype, problem.n)
        if key not in self._tables:
            rec = self.records.get(key)
            self._tables[key] = {} if rec is None else measured_sources(rec, problem.matrix)
        return self._tables[key]

    def __call__(self, problem: RLProblem, sources: list[str]) -> list[KernelOutcome]:
        table = self.table(problem)
        out: list[KernelOutcome | None] = []
        rest: list[int] = []
        for i, s in enumerate(sources):
            c, err = _parse(problem, s)
            key = normalized(s)
            if c is None:
                out.append(KernelOutcome(False, False, False, detail=err))
            elif key in table:
                us = table[key]
                out.append(KernelOutcome(True, True, us is not None, us, problem.reference_us,
                                         problem.best_space_us, detail="" if us is not None else "failed on the H200"))
            else:
                out.append(None)
                rest.append(i)
        self.replayed += len(sources) - len(rest)
        self.delegated += len(rest)
        if rest:
            if self.inner is None:
                for i in rest:
                    out[i] = KernelOutcome(True, False, False, detail="not a measured point (no inner evaluator)")
            else:
                for i, o in zip(rest, self.inner(problem, [sources[i] for i in rest])):
                    out[i] = o
        return out  # type: ignore[return-value]


def problems_from_records(records, loaded: dict | None = None) -> list[RLProblem]:
    """``RLProblem``s for supervision records (matrices loaded once each; ``loaded``,
    MatrixRef -> CSR, is used and filled)."""
    out, cache = [], ({} if loaded is None else loaded)
    for r in records:
        if r.matrix not in cache:
            cache[r.matrix] = r.matrix.load()
        best = r.best()
        out.append(RLProblem(cache[r.matrix], r.op, r.dtype, r.n, r.matrix.label, r.reference_us,
                             best.us if best else None))
    return out


#: the evaluators ``make_evaluator`` makes by name
EVALUATORS = ("gpu", "cpu", "measured", "header")


def make_evaluator(name: str, workers: int = 2, records=None, parallel_verify: bool = True,
                   prestart: bool = True):
    """``gpu``, ``cpu``, ``header``, or ``measured`` (replays the H200 outcomes of ``records``'
    variants, the CPU evaluator for the rest). ``parallel_verify`` and ``prestart`` (start the
    workers now, in the background): ``SandboxEvaluator``'s; the measured evaluator's CPU
    evaluator, rarely asked, starts its workers on first use."""
    if name == "header":
        return HeaderEvaluator()
    if name in ("cpu", "gpu"):
        cm = None
        if name == "cpu":
            from sparserl_compile.training.cost_model import CostModel

            cm = CostModel.load_default()
        return SandboxEvaluator(name, workers=workers, cost_model=cm, parallel_verify=parallel_verify,
                                prestart=prestart)
    if name == "measured":
        if records is None:
            raise ValueError("evaluator='measured' needs the supervision records it replays")
        return MeasuredEvaluator(records, inner=make_evaluator("cpu", workers, prestart=False))
    raise ValueError(f"evaluator={name!r}: use " + ", ".join(map(repr, EVALUATORS)))
