"""``sparserl eval``: how good the policy's kernels are on the held-out split.

For every held-out record (``data.py``) and every policy variant under comparison, it draws a
greedy sample and ``k`` sampled ones, scores them with a reward evaluator (``rewards.py``) and
reports per matrix kind:

- compile rate and correctness rate (over all samples),
- speedup over torch.sparse (reference_us / us of the best correct sample; greedy and best-of-k),
- fraction of the kernel-space best (best_space_us / us, 1.0 = as fast as the best family point),
- the novel-kernel rate: the share of samples that are correct and no point of the whole kernel
  space for their (op, dtype) after normalising whitespace, comments and identifier names
  (``novelty.is_novel``; ``novel_rate`` over all samples, ``novel_share_of_correct`` over the
  correct ones), and ``unmeasured_rate``: how often a correct sample is none of the record's
  measured points (whitespace-insensitive; such a sample has no measured time),
- the fraction of the kernel-space best **by the measured (H200) times**: when a correct
  sample is, whitespace-insensitively, the rendered source of one of the record's measured
  variants, its time is that variant's measured ``us`` from the supervision file and the
  fraction is ``best_us / that us`` (greedy, and best-of-k over the samples that are points);
  samples that are no measured point have no measured time and are left out (counted in
  ``unmeasured_rate``; a record whose greedy kernel is such a sample is counted in
  ``greedy_novel`` and flagged in its row, with the evaluator's own time for it in
  ``greedy_novel_us``: live on the GPU evaluator, so not comparable with the measured times).

The report also holds every record's row under ``per_record`` (the greedy, greedy-with-fallback
and best-of-k fractions, compile and correct counts, and under ``failures`` each failed sample's
stage, parse, compile or verify, with the evaluator's first error, cut to 200 characters, and
the sample's first header line; each variant's summary counts them under ``failure_causes``), for
paired comparisons of two variants record by record (``python -m sparserl_compile.training.compare``) and for
reading why samples fail.

``--baselines nearest`` scores the ``"nearest"`` provider (winners of the most alike training
records) through the same evaluator, as the row a learned policy has to beat.

Ablations are separate checkpoints (no RL = the SFT checkpoint; no sinusoidal embedding and
correctness-only reward = checkpoints trained with those settings) plus unconstrained
decoding, a decoding switch (``--ablate-unconstrained``). Speeds need timings: on the CPU
evaluator they come from the cost model and exist only for kernel-space points.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from sparserl_compile.training.config import opt, resolve_device
from sparserl_compile.training.data import DEFAULT_SUPERVISION
from sparserl_compile.training.novelty import is_novel
from sparserl_compile.training.space import default_render, measured_sources, normalized
from sparserl_compile.training.stats import geomean


@dataclass
class EvalConfig:
    checkpoints: str = opt("policy=runs/rl", "comma-separated name=folder pairs to compare (e.g. rl=runs/rl,no_rl=runs/sft)")
    data: str = opt(DEFAULT_SUPERVISION, "supervision file(s), a comma list; only the held-out split is used")
    split: str = opt("all", "which held-out records: 'all' (the whole held-out split: generated siblings of the "
                            "training generators and held-out shared matrices) or 'source' (only the matrices of "
                            "whole source collections no stage trains on, frozen in training/data/"
                            "heldout_sources.json and checked against its hash: training/source_split.py)")
    evaluator: str = opt("cpu", "'gpu', 'cpu', 'measured' (replays H200 outcomes of measured points) or 'header'")
    k: int = opt(8, "samples for best-of-k")
    temperature: float = opt(0.8, "sampling temperature for best-of-k")
    max_new_tokens: int = opt(1536, "tokens per sample")
    ablate_unconstrained: bool = opt(True, "also evaluate each checkpoint without grammar constraints")
    max_records: int = opt(0, "evaluate only the first this many held-out records (0 = all)")
    ops: str = opt("", "only records of these ops, comma-separated (e.g. 'spmv'; empty = all)")
    out: str = opt("", "write the report as JSON here")
    device: str = opt("auto", "where the policy runs: 'auto' (cuda when torch sees a GPU), 'cpu' or 'cuda'")
    workers: int = opt(2, "sandbox worker processes of the cpu/gpu evaluator")
    baselines: str = opt("", "also score these non-LM candidate sources the same way, comma-separated: "
                             "'nearest' (the nearest provider, its table built from this file's training split)")
    samples: str = opt("temperature", "how the k candidates after the greedy one are drawn: 'temperature' "
                                      "(k samples at --temperature), 'formats' (the k most likely plausible "
                                      "formats, each written greedily: policy.candidates.format_diverse) or 'hints' "
                                      "(one greedy sample per retrieval hint, the k nearest measured winners: "
                                      "policy.candidates.hint_diverse; policies trained with hints only) or "
                                      "'branches' (the greedy kernel and its k - 1 most likely single-token "
                                      "departures, each completed greedily: policy.departures.branch_diverse)")
    branch_scope: str = opt("header", "--samples branches: where the departures are looked for, 'header' (the "
                                      "two contract header lines) or 'all' (any position)")
    untraced_samples: bool = opt(False, "decode the temperature samples untraced (no masks or log-probabilities "
                                        "are scored here) and speculatively in one batch: the same distribution, "
                                        "other draws for a seed than the traced default's; faster where a model "
                                        "call is dear (a GPU), about 10 % slower in all on a CPU")
    screen_workers: int = opt(0, "--samples branches: check each departure on the CPU before it is scored (its "
                                 "format fits the matrix; it passes verification on the CPU executor on the "
                                 "matrix's first rows: policy.screen) with this many CPU workers, and replace "
                                 "the ones that fail by the next most likely departures; 0 = no screen")
    fit_formats: bool = opt(True, "leave out of the grammar the parameter-free padded formats (ELL, DIA) the "
                                  "matrix does not convert to, as the policy provider does "
                                  "(policy.provider.grammar_for); --no-fit-formats: the plain grammar")


@dataclass
class KindStats:
    samples: int = 0
    compiled: int = 0
    correct: int = 0
    unmeasured: int = 0  # correct samples that are none of the record's measured points (whitespace aside)
    novel: int = 0  # correct samples that are no point of the whole space up to form (training/novelty.py)
    speedup_greedy: list[float] = field(default_factory=list)
    speedup_best_of_k: list[float] = field(default_factory=list)
    space_frac_best_of_k: list[float] = field(default_factory=list)
    measured_frac_greedy: list[float] = field(default_factory=list)  # per record, greedy sample a point
    #: per record: as measured_frac_greedy, and a wrong greedy kernel counts as the runtime's
    #: cuSPARSE fallback (the space best over torch.sparse's time) instead of being left out
    measured_frac_greedy_fallback: list[float] = field(default_factory=list)
    measured_frac_best_of_k: list[float] = field(default_factory=list)  # per record, some sample a point
    #: the samples whose text is not the greedy kernel's (``_score``: the departures of "branches",
    #: the other formats' kernels, the temperature samples that differ from the greedy kernel),
    #: and how many of them compiled and were correct: the rates above count the greedy kernel
    #: again wherever the mode's first candidate is it
    others: int = 0
    others_compiled: int = 0
    others_correct: int = 0
    greedy_correct: int = 0
    greedy_novel: int = 0  # records whose greedy kernel is correct and no measured point (no greedy fraction)
    records: int = 0
    hint_samples: int = 0  # samples='hints': samples conditioned on a hint
    hint_followed: int = 0  # ... that are exactly the hinted point rendered for the matrix
    #: one row per record (``_score``): the report's ``per_record`` (paired comparisons, training/compare.py)
    rows: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        return {"samples": self.samples,
                "compile_rate": self.compiled / self.samples if self.samples else None,
                "correct_rate": self.correct / self.samples if self.samples else None,
                "others": self.others,
                "others_compile_rate": self.others_compiled / self.others if self.others else None,
                "others_correct_rate": self.others_correct / self.others if self.others else None,
                "novel_rate": self.novel / self.samples if self.samples else None,
                "novel_share_of_correct": self.novel / self.correct if self.correct else None,
                "unmeasured_rate": self.unmeasured / self.correct if self.correct else None,
                "speedup_greedy_geomean": geomean(self.speedup_greedy),
                "speedup_best_of_k_geomean": geomean(self.speedup_best_of_k),
                "space_best_fraction_geomean": geomean(self.space_frac_best_of_k),
                "records": self.records,
                "greedy_correct_rate": self.greedy_correct / self.records if self.records else None,
                "greedy_novel": self.greedy_novel,
                "measured_space_fraction_greedy_geomean": geomean(self.measured_frac_greedy),
                "measured_space_fraction_greedy_n": len(self.measured_frac_greedy),
                "measured_space_fraction_greedy_fallback_geomean": geomean(self.measured_frac_greedy_fallback),
                "measured_space_fraction_greedy_fallback_n": len(self.measured_frac_greedy_fallback),
                "measured_space_fraction_best_of_k_geomean": geomean(self.measured_frac_best_of_k),
                "measured_space_fraction_best_of_k_n": len(self.measured_frac_best_of_k),
                "hint_follow_rate": self.hint_followed / self.hint_samples if self.hint_samples else None,
                "failure_causes": self.failure_causes()}

    def failure_causes(self, top: int = 10) -> dict[str, int]:
        """The failed samples counted by stage and the start of their error (``failures`` of
        the rows), most frequent first: where the compile and correct rates go."""
        from collections import Counter

        causes = Counter(f"{f['stage']}: {f['detail'][:40]}" for row in self.rows for f in row.get("failures", ()))
        return dict(causes.most_common(top))


def overall(stats: dict[str, KindStats]) -> KindStats:
    """All kinds' stats pooled into one (the report's ``"all"`` row)."""
    out = KindStats()
    for st in stats.values():
        for f in fields(KindStats):
            setattr(out, f.name, getattr(out, f.name) + getattr(st, f.name))
    return out


def _summaries(stats: dict[str, KindStats]) -> dict:
    return {"all": overall(stats).summary(), **{kind: s.summary() for kind, s in stats.items()}}


def _rows(stats: dict[str, KindStats]) -> list[dict]:
    """Every record's row (``KindStats.rows``) with its kind, for the report's ``per_record``."""
    return [{"kind": kind, **row} for kind, st in stats.items() for row in st.rows]


def evaluate_policy(model, tok, problems, evaluator, *, k: int, temperature: float, max_new_tokens: int,
                    constrained: bool, space_sources=None, log=None, samples: str = "temperature",
                    hint_entries=None, progress=None, untraced_samples: bool = False,
                    fit_formats: bool = False, branch_scope: str = "header", screen=None) -> dict[str, KindStats]:
    """Per-kind stats for one policy variant. ``problems``: (kind, RLProblem) pairs;
    ``space_sources``: per problem, normalized kernel-space source -> measured us (None when
    the variant failed), or None. ``samples``: how the k candidates after the greedy one are
    drawn (``EvalConfig.samples``). ``hint_entries``: a ``nearest`` table for a policy trained
    with retrieval hints (``model.config.retrieval``). ``progress(stats)`` is called after
    every record. ``untraced_samples``: ``EvalConfig.untraced_samples``. ``fit_formats``: decode
    under ``policy.provider.grammar_for``'s grammar for each matrix (``EvalConfig.fit_formats``).
    ``branch_scope``: ``EvalConfig.branch_scope``. ``screen``: a ``policy.screen.Screen`` the
    departures of ``samples="branches"`` pass before they are scored (``EvalConfig.screen_workers``);
    each record's row lists the departures left out and why (``screened_out``): the screen's,
    and those ``departures.stale_departure`` leaves out with or without a screen."""
    from sparserl_compile.policy.candidates import check_samples
    from sparserl_compile.policy.decode import generate
    from sparserl_compile.policy.provider import problem_inputs
    from sparserl_compile.policy.retrieval import hint_name
    from sparserl_compile.policy.sampling import DecodeConfig

    check_samples(samples, model)
    if samples == "hints" and hint_entries is None:
        raise ValueError("samples='hints' takes its hints from hint_entries (a nearest table): none given")

    stats: dict[str, KindStats] = {}
    for i, (kind, pb) in enumerate(problems):
        st = stats.setdefault(kind, KindStats())
        m = pb.matrix
        # drafts for speculative decoding (the decoding's speed only, never its samples)
        s, formats, refs, grammar = problem_inputs(model, m, pb.op, pb.dtype, pb.n, formats=samples == "formats",
                                                   entries=hint_entries, count=max(4, k) if samples == "hints" else 4,
                                                   fit_formats=fit_formats and constrained)
        hint, points = _hints(model, s, pb, hint_entries, samples, k)
        # untraced: no logprobs or masks are scored here, so greedy skips the masks it can (same tokens)
        greedy_cfg = DecodeConfig(greedy=True, max_new_tokens=max_new_tokens, constrained=constrained, trace=False)
        greedy = generate(model, tok, s, pb.op, pb.dtype, pb.n, k=1, hint=hint, references=refs, config=greedy_cfg,
                          grammar_text=grammar)
        if samples == "hints":
            from sparserl_compile.policy.candidates import hint_diverse

            # the first hint is the greedy sample's own: its sample is that one, not decoded twice
            sampled = greedy + (hint_diverse(model, tok, s, pb.op, pb.dtype, pb.n,
                                             [hint_name(*p) for p in points[1:]], config=greedy_cfg,
                                             references=refs, grammar_text=grammar) if len(points) > 1 else [])
            _count_followed(st, sampled, points, pb)
        elif samples == "formats":
            from sparserl_compile.policy.candidates import format_diverse

            sampled = format_diverse(model, tok, s, pb.op, pb.dtype, pb.n, k, formats, hint=hint,
                                     config=greedy_cfg, references=refs, grammar_text=grammar)
        elif samples == "branches":
            from sparserl_compile.policy.departures import branch_diverse

            # the greedy kernel is the first of the k (as format_diverse's most likely format is)
            check = screen and screen.checker(m.indptr, m.indices, m.shape, pb.op, pb.dtype, pb.n)
            sampled = branch_diverse(model, tok, s, pb.op, pb.dtype, pb.n, k, config=greedy_cfg, grammar_text=grammar,
                                     hint=hint, references=refs, greedy=greedy[0], scope=branch_scope, screen=check)
        else:
            sampled = generate(model, tok, s, pb.op, pb.dtype, pb.n, k=k, hint=hint, references=refs,
                               grammar_text=grammar, config=DecodeConfig(temperature=temperature, max_new_tokens=max_new_tokens,
                                                   constrained=constrained, seed=i, trace=not untraced_samples,
                                                   batch_drafts=untraced_samples))
        texts = [r.text for r in greedy + sampled]
        outs = evaluator(pb, texts)
        if log is not None:
            log(f"[eval] {pb.label} {pb.op} n={pb.n} constrained={constrained}: "
                f"compiled {[o.compiled for o in outs]} correct {[o.correct for o in outs]}")
        _score(st, pb, outs, texts, None if space_sources is None else space_sources[i], best_from=1)
        if "screened_out" in greedy[0].extra:
            st.rows[-1]["screened_out"] = [why[:120] for _p, _a, why in greedy[0].extra["screened_out"]]
        if progress is not None:
            progress(stats)
    return stats


def _hints(model, structure, pb, hint_entries, samples: str, k: int):
    """``(hint, points)`` for one problem of a policy trained with retrieval hints: the greedy
    prompt's hint and, for ``samples="hints"``, the k nearest runnable points (one per sample,
    the greedy sample's first); ``(None, None)`` for a policy without hints."""
    if hint_entries is None or not getattr(model.config, "retrieval", False):
        return None, None
    from sparserl_compile.policy.retrieval import hint_name, nearest_hint, nearest_points, problem_for

    runnable = problem_for(pb.op, pb.dtype, pb.n, pb.matrix)  # hints are points this matrix can run
    if samples == "hints":
        points = nearest_points(structure.features, pb.op, pb.dtype, pb.n, hint_entries, k, problem=runnable)
        return (hint_name(*points[0]) if points else None), points
    return nearest_hint(structure.features, pb.op, pb.dtype, pb.n, hint_entries, problem=runnable), None


def _count_followed(st: KindStats, sampled, points, pb) -> None:
    """Count the hint samples and those that are exactly their hint's rendered point."""
    for r, (family, params) in zip(sampled, points):
        try:
            src = normalized(default_render(family, pb.op, pb.dtype, dict(params), pb.matrix))
        except Exception:  # noqa: BLE001 - a point the current families no longer render
            src = None
        st.hint_samples += 1
        st.hint_followed += normalized(r.text) == src


def _score(st: KindStats, pb, outs, texts, space: dict | None, best_from: int) -> None:
    """Add one record's outcomes to ``st``: ``outs[0]`` is the greedy/first pick, best-of-k
    is over ``outs[best_from:]`` (1 for the policy: the k samples after the greedy one; 0 for a
    baseline whose k proposals include its first)."""
    st.records += 1
    st.greedy_correct += bool(outs[0].correct)
    measured = []  # measured us of each correct sample that is a measured point (None otherwise)
    for j, (o, t) in enumerate(zip(outs, texts)):
        st.samples += 1
        st.compiled += o.compiled
        st.correct += o.correct
        if j >= best_from and t != texts[0]:
            st.others += 1
            st.others_compiled += o.compiled
            st.others_correct += o.correct
        us = None
        if o.correct:
            st.novel += is_novel(t, pb.op, pb.dtype, pb.matrix)
        if o.correct and space is not None:
            key = normalized(t)
            if key not in space:
                st.unmeasured += 1
            else:
                us = space[key]
        measured.append(us)
    row = {"label": pb.label, "op": pb.op, "n": pb.n, "greedy_correct": bool(outs[0].correct),
           "greedy_fraction": None, "greedy_fallback_fraction": None, "best_of_k_fraction": None,
           "compiled": sum(bool(o.compiled) for o in outs), "correct": sum(bool(o.correct) for o in outs),
           "samples": len(outs)}
    failures = [{"sample": j, "stage": "parse" if not o.parsed else "compile" if not o.compiled else "verify",
                 "detail": " ".join(str(o.detail).split())[:200], "header": (t or "").split("\n", 1)[0][:160]}
                for j, (o, t) in enumerate(zip(outs, texts)) if not o.correct]
    if failures:  # why each failed sample failed (sample 0: the greedy kernel, for the policy)
        row["failures"] = failures
    if outs[0].correct and space is not None and measured[0] is None:  # a correct kernel of its own
        st.greedy_novel += 1
        row["greedy_novel"], row["greedy_novel_us"] = True, outs[0].us
    if pb.best_space_us:
        if measured[0]:
            row["greedy_fraction"] = row["greedy_fallback_fraction"] = pb.best_space_us / measured[0]
            st.measured_frac_greedy.append(row["greedy_fraction"])
        elif not outs[0].correct and pb.reference_us:
            row["greedy_fallback_fraction"] = pb.best_space_us / pb.reference_us
        if row["greedy_fallback_fraction"] is not None:
            st.measured_frac_greedy_fallback.append(row["greedy_fallback_fraction"])
        ms = [u for u in measured[best_from:] if u]
        if ms:
            row["best_of_k_fraction"] = pb.best_space_us / min(ms)
            st.measured_frac_best_of_k.append(row["best_of_k_fraction"])
    st.rows.append(row)
    if outs[0].correct and outs[0].us and pb.reference_us:
        st.speedup_greedy.append(pb.reference_us / outs[0].us)
    timed = [o.us for o in outs[best_from:] if o.correct and o.us]
    if timed and pb.reference_us:
        st.speedup_best_of_k.append(pb.reference_us / min(timed))
    if timed and pb.best_space_us:
        st.space_frac_best_of_k.append(pb.best_space_us / min(timed))


def evaluate_nearest(table, problems, evaluator, *, k: int, space_sources=None, log=None) -> dict[str, KindStats]:
    """Per-kind stats of the ``"nearest"`` provider (``table``: its entries) scored exactly as
    the policy's samples are: its first proposal stands for "greedy", and best-of-k is over its
    first ``k`` proposals (the first included)."""
    from sparserl_compile.policy.retrieval import problem_for
    from sparserl_compile.nearest import NearestProvider

    prov = NearestProvider(table, k=k)
    stats: dict[str, KindStats] = {}
    for i, (kind, pb) in enumerate(problems):
        m = pb.matrix
        problem = problem_for(pb.op, pb.dtype, pb.n, m)
        texts = [c.source for c in prov.candidates(problem, k)]
        outs = evaluator(pb, texts)
        if log is not None:
            log(f"[eval] {pb.label} {pb.op} n={pb.n} nearest {prov.last_neighbours}: "
                f"correct {[o.correct for o in outs]}")
        _score(stats.setdefault(kind, KindStats()), pb, outs, texts,
               None if space_sources is None else space_sources[i], best_from=0)
    return stats


def _held_out(cfg: EvalConfig):
    """The supervision's split, the held-out records ``cfg`` asks for, their problems as (kind,
    ``RLProblem``) pairs and each record's measured kernel-space sources."""
    from sparserl_compile.training.data import load_supervision, split
    from sparserl_compile.training.rewards import problems_from_records

    both = split(load_supervision(cfg.data))
    records = both.held_out
    if cfg.split == "source":
        from sparserl_compile.training.source_split import held_out_names

        names = held_out_names()  # raises where the frozen file was edited
        records = [r for r in records if r.matrix.source == "shared" and r.matrix.name in names]
    elif cfg.split != "all":
        raise ValueError(f"--split {cfg.split!r}: use 'all' or 'source'")
    if cfg.ops:
        records = [r for r in records if r.op in cfg.ops.split(",")]
    if cfg.max_records:
        records = records[: cfg.max_records]
    if not records:
        raise ValueError(f"{cfg.data}: no held-out records to evaluate on (--split {cfg.split})")
    problems = list(zip([r.matrix.kind for r in records], problems_from_records(records)))
    space = [measured_sources(r, pb.matrix, default_render) for r, (_, pb) in zip(records, problems)]
    return both, records, problems, space


def _split_stamp(name: str) -> dict:
    """What the report says of its held-out split: its name, and the frozen file's hash for 'source'."""
    if name != "source":
        return {"name": name}
    from sparserl_compile.training.source_split import SOURCE_SPLIT_PATH, load

    return {"name": name, "file": SOURCE_SPLIT_PATH.name, "sha256": load().sha256}


def run_eval(cfg: EvalConfig, log=print) -> dict:
    """``sparserl eval`` (module docstring): every checkpoint of ``cfg.checkpoints``, constrained
    and unconstrained, then the baselines, on the held-out records; the report, also written to
    ``cfg.out`` after every record."""
    from sparserl_compile.policy.model import load_policy
    from sparserl_compile.training.rewards import make_evaluator
    from sparserl_compile.training.soup import provenance

    if cfg.screen_workers and cfg.samples != "branches":
        raise ValueError(f"--screen-workers checks departures from the greedy kernel: it needs --samples branches, "
                         f"not {cfg.samples!r}")
    both, records, problems, space = _held_out(cfg)
    evaluator = make_evaluator(cfg.evaluator, cfg.workers, records=records)
    screen = None
    if cfg.screen_workers:
        from sparserl_compile.policy.screen import Screen

        screen = Screen(cfg.screen_workers)
    tables: list = []

    def train_entries():  # the training split as a nearest table (hints, the nearest baseline)
        if not tables:
            from sparserl_compile.training.neighbours import entries_from_records

            tables.append(entries_from_records(both.train))
        return tables[0]

    from sparserl_compile.fileio import write_json
    from sparserl_compile.version import run_stamp

    report = {**run_stamp(), "held_out_records": len(records), "split": _split_stamp(cfg.split), "k": cfg.k, "data": cfg.data, "evaluator": cfg.evaluator,
              "samples": cfg.samples + (" untraced" if cfg.untraced_samples and cfg.samples == "temperature" else "")
              + (f" screened ({cfg.screen_workers} CPU workers)" if screen is not None else ""),
              "in_progress": None, "checkpoints": {}, "variants": {}, "per_record": {}}

    def save():  # after every record: a run cut short keeps what it measured
        if cfg.out:
            write_json(cfg.out, report)

    def partial(label, stats):  # a variant's figures so far; "in_progress" names it until it ends
        report["variants"][label] = _summaries(stats)
        report["per_record"][label] = _rows(stats)
        report["in_progress"] = label
        save()

    try:
        for pair in filter(None, cfg.checkpoints.split(",")):
            name, _, path = pair.partition("=")
            model, tok = load_policy(path or name, resolve_device(cfg.device))
            report["checkpoints"][name] = provenance(path or name)
            modes = [(name, True)] + ([(name + "/unconstrained", False)] if cfg.ablate_unconstrained else [])
            for label, constrained in modes:
                st = evaluate_policy(model, tok, problems, evaluator, k=cfg.k, temperature=cfg.temperature,
                                     max_new_tokens=cfg.max_new_tokens, constrained=constrained,
                                     space_sources=space, log=log, samples=cfg.samples,
                                     hint_entries=train_entries() if getattr(model.config, "retrieval", False) else None,
                                     progress=lambda st_, label=label: partial(label, st_),
                                     untraced_samples=cfg.untraced_samples, fit_formats=cfg.fit_formats,
                                     branch_scope=cfg.branch_scope, screen=screen)
                report["variants"][label] = _summaries(st)
                report["per_record"][label] = _rows(st)
                report["in_progress"] = None
                log(f"[eval] {label}: " + json.dumps(report["variants"][label]))
                save()
        for name in filter(None, cfg.baselines.split(",")):
            if name != "nearest":
                raise ValueError(f"baselines={name!r}: the only baseline is 'nearest'")
            st = evaluate_nearest(train_entries(), problems, evaluator, k=cfg.k,
                                  space_sources=space, log=log)
            report["variants"]["baseline/nearest"] = _summaries(st)
            report["per_record"]["baseline/nearest"] = _rows(st)
            log("[eval] baseline/nearest: " + json.dumps(report["variants"]["baseline/nearest"]))
            save()
    finally:
        if hasattr(evaluator, "close"):
            evaluator.close()
        if screen is not None:
            report["screen"] = dict(screen.counts)
            screen.close()
    save()
    return report

