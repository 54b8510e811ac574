"""Stage 3: reinforcement learning from compile / correctness / speed rewards.

Each step samples ``problems_per_step`` training-split problems, draws ``k`` grammar-
constrained samples per problem from the current policy (``policy.decode.generate``, which
returns the masks), scores them with an evaluator (``rewards.py``: sandboxed GPU or CPU
verification, or header-only for smoke runs), turns outcomes into rewards (hierarchical, or
correctness-only for the ablation) and applies one PPO/GRPO update (``ppo.py``) with a KL
penalty to the frozen starting (SFT) model. Resumes from ``out_dir``. Every update logs its
mean reward, and for PPO/GRPO the KL to the reference, the entropy and the clip fraction
(``ppo.PPOStats``), and the novel-kernel rate of its samples (``novelty.is_novel``: correct and
no point of the kernel space; ``novel_text_rate``: whatever the outcome); ``curves.py`` plots
them from the checkpoint's log.

``algo="raft"`` (``raft.py``) fine-tunes the greedy prompt toward the best of k candidates:
for a policy trained with retrieval hints, one greedy kernel per each of the k nearest hints;
for one without, the greedy kernel and k - 1 other candidates of the same prompt (expert
iteration; ``raft_explore``). Its replay buffer is not checkpointed (a resumed run starts it
empty).

``validate=N`` scores the policy's greedy kernels on N validation problems (new instances of
the training kinds, never held-out ones; ``validation.py``) before the first update, every
``validate_every`` updates and after the last, and keeps the best checkpoint in
``<out_dir>/best/``: which update to keep is chosen without the held-out split.

``RLConfig`` checks its own fields when it is made; what depends on the starting checkpoint or
on ``torchrun`` is checked when the run starts, before any data is read.
"""

from __future__ import annotations

import copy
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sparserl_compile.training import dist as tdist
from sparserl_compile.training import raft as raft_mod
from sparserl_compile.training.config import check_resume, opt, resolve_device, save_config
from sparserl_compile.training.data import DEFAULT_SUPERVISION
from sparserl_compile.training.raft import RAFT_EXPLORE
from sparserl_compile.training.rewards import EVALUATORS, REWARDS, make_evaluator, problems_from_records
from sparserl_compile.training.stats import seconds_text, timed
from sparserl_compile.training.unlabelled import parse_mix, parse_spmm_widths


@dataclass
class RLConfig:
    init: str = opt("runs/sft", "checkpoint to start from and to stay close to (stage 2 output)")
    data: str = opt(DEFAULT_SUPERVISION, "supervision file(s), a comma list, naming the training problems")
    out_dir: str = opt("runs/rl", "output checkpoint folder (resumed if it holds an RL state)")
    steps: int = opt(200, "policy updates")
    problems_per_step: int = opt(2, "matrices per update")
    k: int = opt(8, "samples per matrix")
    temperature: float = opt(1.0, "sampling temperature (the loss uses the same)")
    max_new_tokens: int = opt(1024, "tokens per sample")
    constrained: bool = opt(True, "grammar-constrained sampling (off: the unconstrained ablation)")
    algo: str = opt("ppo", "'ppo', 'grpo' or 'raft' (reward-ranked fine-tuning toward the best of k candidates: "
                           "the k nearest hints' kernels for a policy trained with hints, else the greedy kernel "
                           "and k - 1 samples; training/raft.py)")
    kl_coef: float = opt(0.05, "KL penalty to the starting model")
    lr: float = opt(1e-5, "learning rate")
    reward: str = opt("hierarchical", "'hierarchical' or 'correctness' (ablation; with --algo raft a correct "
                                      "greedy kernel is always its own target, timings unused)")
    evaluator: str = opt("cpu", "'gpu' (compile+verify+time), 'cpu' (compile+simt verify+cost model), "
                                "'measured' (H200 outcomes of measured points, 'cpu' for the rest), 'header'")
    workers: int = opt(2, "sandbox worker processes")
    parallel_verify: bool = opt(True, "gpu rewards: verify a problem's candidates on all the workers at once, then "
                                      "time the verified ones one at a time (off: each verified and timed in turn)")
    seed: int = opt(0, "seed")
    log_every: int = opt(1, "log every this many steps")
    save_every: int = opt(10, "checkpoint every this many steps")
    device: str = opt("auto", "'auto' (cuda when torch sees a GPU), 'cpu' or 'cuda' for the policy")
    max_nnz: int = opt(0, "train only on problems with at most this many nonzeros (0 = all; e.g. for the "
                          "CPU evaluators, whose executor is slow on large matrices)")
    unlabelled: int = opt(0, "also this many generated problems no supervision record covers "
                             "(training/unlabelled.py), rewarded against cuSPARSE timed by the evaluator")
    unlabelled_mix: str = opt("", "weights of the unlabelled problems' sources, e.g. 'shared:social_powerlaw=3,"
                                  "rmat=1': generators, 'shared' or 'shared:<kind>' (structures derived from the "
                                  "shared folder's training side); default: the generators equally")
    unlabelled_spmm_n: str = opt("32", "the unlabelled SpMM problems' widths N, comma-separated, drawn equally "
                                       "(e.g. '8,32,128'; the held-out split has SpMM with N = 8, 32 and 128)")
    labelled: bool = opt(True, "the training records' problems (off with --unlabelled N: new structures only)")
    speculative: bool = opt(True, "decode rollouts speculatively against the nearest measured kernels "
                                  "(the same samples' distribution, fewer model calls)")
    sample_drafts: bool = opt(True, "raft: decode the temperature samples speculatively, one at a time against the "
                                    "drafts (off: all of a problem's samples in one batch without drafts; the "
                                    "greedy and format candidates keep their drafts)")
    batch_drafts: bool = opt(True, "decode a problem's drafted samples (ppo, grpo; raft: also its format and "
                                    "hint candidates) speculatively in one batch (each its own drafts; "
                                    "DecodeConfig.batch_drafts) instead of one at a time: the same distribution "
                                    "(traced: the same masks and log-probabilities), fewer model calls")
    time_budget_s: float = opt(0.0, "stop (and checkpoint) after the update that passes this many seconds (0 = none)")
    raft_margin: float = opt(0.05, "raft: another hint's kernel replaces the first's as its prompt's target only "
                                   "when this much faster (a fraction; timing noise)")
    raft_steps: int = opt(4, "raft: gradient steps per update, on batches from every target so far")
    raft_batch: int = opt(16, "raft: examples per gradient step (this update's targets first)")
    max_len: int = opt(1536, "raft: prompt + kernel tokens kept per example (as SFT's --max-len)")
    raft_anchor: int = opt(0, "raft: SFT examples added to each gradient step's batch (the training records "
                              "with the shipped SFT recipe: one example per hint, --raft-anchor-tolerance; "
                              "without hints, one per record, its fastest variant)")
    raft_anchor_tolerance: float = opt(0.25, "raft: the anchors' SFT --hint-tolerance")
    raft_explore: str = opt("temperature", "raft without hints: the k - 1 candidates after the greedy kernel are "
                                           "'temperature' samples, 'formats' (the next most likely plausible "
                                           "formats, each forced and written greedily: policy.decode."
                                           "format_diverse), 'mixed' (half each) or 'branches' (the greedy "
                                           "kernel's k - 1 most likely departures in the header, each completed "
                                           "greedily: policy.departures.branch_diverse)")
    raft_screen: int = opt(0, "raft --raft-explore branches: check each departure on the CPU before its reward "
                              "(its format fits the matrix; it passes verification on the CPU executor on the "
                              "matrix's first rows: policy.screen) with this many CPU workers, and replace the "
                              "ones that fail by the next most likely departures; 0 = no screen")
    validate: int = opt(0, "score the policy on this many validation problems (new instances of the training "
                           "kinds, never held-out ones; training/validation.py) before the first update, every "
                           "--validate-every updates and after the last, keeping the best in <out>/best/")
    validate_every: int = opt(4, "updates between validations")
    average_from: int = opt(0, "also keep the uniform average of the weights after every update from this one "
                               "on (weight averaging along the run; 0 = off), written to <out>/average/ with "
                               "each checkpoint (training/soup.py)")
    validate_mix: str = opt("", "the validation problems' sources, as --unlabelled-mix (default: --unlabelled-mix)")

    def __post_init__(self):
        _one_of("algo", self.algo, ALGOS)
        _one_of("reward", self.reward, tuple(REWARDS))
        _one_of("evaluator", self.evaluator, EVALUATORS)
        _one_of("raft_explore", self.raft_explore, RAFT_EXPLORE)
        for name in ("problems_per_step", "k", "max_new_tokens", "workers", "log_every", "save_every",
                     "raft_steps", "raft_batch", "max_len"):
            _at_least(name, getattr(self, name), 1)
        for name in ("steps", "max_nnz", "unlabelled", "raft_anchor", "raft_screen", "validate", "kl_coef",
                     "time_budget_s", "raft_margin", "raft_anchor_tolerance"):
            _at_least(name, getattr(self, name), 0)
        if not self.temperature > 0:
            raise ValueError(f"--temperature {self.temperature}: a sampling temperature is above 0")
        if not self.lr > 0:
            raise ValueError(f"--lr {self.lr}: a learning rate is above 0")
        if self.validate_every < 1:
            raise ValueError(f"--validate-every {self.validate_every}: validate every 1 or more updates")
        if self.average_from < 0:
            raise ValueError(f"--average-from {self.average_from}: the first update to average is 1 or later "
                             "(0 = no average)")
        if self.raft_screen and not (self.algo == "raft" and self.raft_explore == "branches"):
            raise ValueError("--raft-screen checks departures from the greedy kernel: it needs --algo raft "
                             "--raft-explore branches")
        self.mixes()  # a bad mix or width list fails here, before any data is read
        try:
            self.spmm_widths()
        except ValueError as e:
            raise ValueError(f"--unlabelled-spmm-n: {e}") from None

    def mixes(self) -> tuple[dict | None, dict | None]:
        """The unlabelled and the validation problems' source weights (``unlabelled.parse_mix``;
        None: the generators equally)."""
        mix = parse_mix(self.unlabelled_mix) if self.unlabelled_mix else None
        return mix, (parse_mix(self.validate_mix) if self.validate_mix else mix)

    def spmm_widths(self) -> tuple[int, ...]:
        """The unlabelled SpMM problems' widths (``unlabelled.parse_spmm_widths``)."""
        return parse_spmm_widths(self.unlabelled_spmm_n)


#: the update rules of ``RLConfig.algo``
ALGOS = ("ppo", "grpo", "raft")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        alts = ", ".join(map(repr, allowed[:-1])) + f" or {allowed[-1]!r}" if len(allowed) > 1 else repr(allowed[0])
        raise ValueError(f"{_flag(name)} {value!r}: use {alts}")


def _at_least(name: str, value, low) -> None:
    if value < low:
        raise ValueError(f"{_flag(name)} {value}: must be {low} or more")


@dataclass
class RLResult:
    out_dir: str
    start_step: int
    step: int
    mean_rewards: list[float] = field(default_factory=list)  # per update of this run
    stats: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)  # every validation of the run, resumed ones included


def rl(cfg: RLConfig, problems=None, evaluator=None, reward_fn=None, log=print,
       validation_problems=None) -> RLResult:
    """Run stage 3. ``problems``/``evaluator``/``reward_fn``/``validation_problems`` override
    the config (tests). With ``cfg.validate`` the policy is scored on validation problems
    (``training/validation.py``) and the best so far is kept in ``<out_dir>/best/``. The
    evaluator, given or made, is closed when the run ends, and when it raises (a sandbox
    evaluator's worker processes then stop with the run, not with Python).

    Under ``torchrun`` (``training/dist.py``): every rank draws the same ``problems_per_step``
    problems and keeps its equal contiguous share (the count must divide by the world size),
    generates and scores its samples with the same seeds one process would use, and
    ``ppo_update`` combines the ranks (global advantage moments and masked means, summed
    gradients). Rank 0 logs and writes checkpoints; the time-budget stop is rank 0's decision.
    """
    with ExitStack() as cleanup:
        run = _Run(cfg, log)
        _start(run)
        _load_problems(run, problems)
        _start_evaluator(run, evaluator, reward_fn, cleanup)
        if cfg.validate:
            _start_validation(run, validation_problems)
        _load_hints(run)
        run.log(f"[rl] ready after {time.perf_counter() - run.t_begin:.1f} s: "
                + ", ".join(f"{k} {v:.1f}" for k, v in run.setup.items()) + f" ({len(run.problems)} problems)")
        return _updates(run)


@dataclass
class _Run:
    """One RL run's state, shared by the parts of ``rl``: set up by ``_start`` and the loaders,
    advanced by ``_update``."""

    cfg: RLConfig
    log: object
    t_begin: float = field(default_factory=time.perf_counter)
    setup: dict = field(default_factory=dict)  # the set-up's seconds by part, logged before the first update
    ctx: object = None  # training.dist.DistContext
    out: Path | None = None
    resume: bool = False
    model: object = None
    ref_model: object = None
    tok: object = None
    optim: object = None
    state: object = None  # training.checkpoint.TrainerState
    average: object = None  # soup.RunningAverage (--average-from)
    buffer: object = None  # raft.RaftBuffer (--algo raft)
    problems: list = field(default_factory=list)
    span: tuple[int, int] = (0, 0)  # this rank's share of the problems drawn per update
    evaluator: object = None
    reward_fn: object = None
    screen: object = None  # policy.screen.Screen (--raft-screen)
    validator: object = None  # validation.Validator (--validate)
    history: list = field(default_factory=list)  # validations so far, resumed ones included
    hint_entries: list | None = None  # the nearest table of a policy trained with hints
    anchors: list = field(default_factory=list)  # SFT examples replayed by RAFT (--raft-anchor)
    loaded: dict = field(default_factory=dict)  # MatrixRef -> CSR, while the set-up reads records
    inputs: dict = field(default_factory=dict)  # problem index -> (structure, formats, references, hints)
    _records: list | None = None

    @property
    def raft(self) -> bool:
        return self.cfg.algo == "raft"

    def took(self, part: str, since: float) -> float:
        now = time.perf_counter()
        self.setup[part] = self.setup.get(part, 0.0) + now - since
        return now

    def train_records(self) -> list:
        """The training split, read once, when something needs it."""
        if self._records is None:
            from sparserl_compile.training.data import load_supervision, split

            self._records = split(load_supervision(self.cfg.data)).train
        return self._records


def _start(run: _Run) -> None:
    """The process group, the output folder, the models and the optimizer (resumed where the
    folder holds an RL state), and the checks that depend on them."""
    from sparserl_compile.policy.model import load_policy
    from sparserl_compile.training.checkpoint import TrainerState, has_state, load_state

    cfg = run.cfg
    t = run.took("imports", run.t_begin)
    run.ctx = tdist.setup(resolve_device(cfg.device))
    run.log = tdist.quiet_unless_main(run.log, run.ctx)
    run.out = Path(cfg.out_dir)
    run.resume = has_state(run.out, "rl")
    if run.resume:
        check_resume(cfg, run.out, "rl")
    if run.ctx.is_main:
        save_config(cfg, run.out, "rl")
    run.ref_model, run.tok = load_policy(cfg.init)
    for p in run.ref_model.parameters():
        p.requires_grad_(False)
    run.model = load_policy(run.out)[0] if run.resume else copy.deepcopy(run.ref_model)
    for p in run.model.parameters():
        p.requires_grad_(True)
    run.model.to(run.ctx.device)
    run.ref_model.to(run.ctx.device)
    run.optim = torch.optim.AdamW(run.model.parameters(), lr=cfg.lr)
    run.state = load_state(run.out, run.optim) if run.resume else TrainerState("rl")
    run.took("models", t)
    if cfg.average_from:  # checked before any data is read
        from sparserl_compile.training.soup import RunningAverage

        run.average = (RunningAverage.resume(run.out, cfg.average_from, run.state.step) if run.resume
                       else RunningAverage(cfg.average_from))
    if run.raft:
        if run.ctx.distributed:
            raise ValueError("--algo raft runs in one process (its replay buffer is not sharded); "
                             "launch without torchrun, or use --algo ppo or grpo")
        run.buffer = raft_mod.RaftBuffer()
    if cfg.raft_explore != "temperature" and getattr(run.model.config, "retrieval", False):
        raise ValueError(f"--raft-explore {cfg.raft_explore!r} is for a policy without hints; {cfg.init} was trained "
                         "with hints, and RAFT's candidates are then its hints' kernels: leave --raft-explore unset")
    if cfg.validate and run.ctx.distributed:
        raise ValueError("--validate runs in one process; launch without torchrun")


def _load_problems(run: _Run, problems) -> None:
    """The training problems (``problems`` where given): the training records' (at most
    ``--max-nnz`` nonzeros) and ``--unlabelled`` generated ones; and this rank's share."""
    cfg, t = run.cfg, time.perf_counter()
    if problems is None:  # every training record gives hints (below); --max-nnz only picks problems
        records = run.train_records()
        picked = [r for r in records if _nnz(r, run.loaded) <= cfg.max_nnz] if cfg.max_nnz else records
        problems = problems_from_records(picked, run.loaded) if cfg.labelled else []
        if cfg.unlabelled:
            from sparserl_compile.training.unlabelled import unlabelled_problems

            problems += unlabelled_problems(cfg.unlabelled, cfg.seed, cfg.max_nnz,
                                            exclude_labels={r.matrix.label for r in records}, mix=cfg.mixes()[0],
                                            spmm_widths=cfg.spmm_widths())
    if not problems:
        raise ValueError("RL needs at least one training problem" + (f" (--max-nnz {cfg.max_nnz} left none)"
                                                                      if cfg.max_nnz else ""))
    run.problems = problems
    run.took("problems", t)
    n_pick = min(cfg.problems_per_step, len(problems))
    run.span = tdist.shard_bounds(n_pick, run.ctx, f"problems per step (--problems-per-step "
                                                   f"{cfg.problems_per_step}, {len(problems)} problems)")


def _start_evaluator(run: _Run, evaluator, reward_fn, cleanup: ExitStack) -> None:
    """The reward evaluator (``evaluator`` where given) and the departures' CPU screen, both
    closed by ``cleanup``; the reward function."""
    cfg, t = run.cfg, time.perf_counter()
    if evaluator is None:
        evaluator = make_evaluator(cfg.evaluator, cfg.workers,
                                   records=run.train_records() if cfg.evaluator == "measured" else None,
                                   parallel_verify=cfg.parallel_verify)
    if hasattr(evaluator, "close"):
        cleanup.callback(evaluator.close)
    run.evaluator = evaluator
    if cfg.raft_screen:
        from sparserl_compile.policy.screen import Screen

        run.screen = Screen(cfg.raft_screen)
        cleanup.callback(run.screen.close)
    run.took("evaluator", t)
    run.reward_fn = reward_fn or REWARDS[cfg.reward]


def _start_validation(run: _Run, validation_problems) -> None:
    """``--validate``: the validation problems (new instances of the training kinds, none of
    the training labels) and the validator; the history of a resumed run."""
    from sparserl_compile.training import validation

    cfg, t = run.cfg, time.perf_counter()
    vprobs = validation_problems if validation_problems is not None else validation.validation_problems(
        cfg.validate, cfg.seed, cfg.max_nnz, mix=cfg.mixes()[1],
        exclude_labels={r.matrix.label for r in run.train_records()} | {p.label for p in run.problems})
    run.validator = validation.Validator(vprobs, run.evaluator, max_new_tokens=cfg.max_new_tokens,
                                         constrained=cfg.constrained, speculative=cfg.speculative)
    run.history = validation.load_history(run.out) if run.resume else []
    run.log(f"[rl] validation: {len(vprobs)} problems, every {cfg.validate_every} updates; "
            + ", ".join(sorted({p.label.split("(")[0].split("[")[0] for p in vprobs}))[:300])
    run.took("validation problems", t)


def _validate(run: _Run, at: int) -> None:
    """Score the policy after ``at`` updates; keep it in ``best/`` when it is the best so far."""
    from sparserl_compile.training import validation

    entry = run.validator(run.model, run.tok, at)
    if not entry["timed"] and not run.history:
        run.log("[rl] validation: the evaluator timed no validation kernel against cuSPARSE (the CPU "
                "evaluators time none on these problems), so checkpoints are ranked by correct rate")
    was = validation.best_of(run.history)
    new_best = validation.record(run.out, run.history, entry, run.model, run.tok)
    run.log(f"[rl] validation after {at} updates: score {entry['score']:.4f} (x cuSPARSE, geomean), correct "
            f"{entry['correct_rate']:.3f}, timed {entry['timed']}/{entry['problems']}"
            + (" - new best, saved to best/" if new_best else f"; best {was['score']:.4f} after {was['step']}"))


def _load_hints(run: _Run) -> None:
    """A policy trained with retrieval hints: the training records as its nearest table. RAFT
    with ``--raft-anchor``: the SFT examples it replays."""
    cfg, t = run.cfg, time.perf_counter()
    if getattr(run.model.config, "retrieval", False):
        from sparserl_compile.training.neighbours import entries_from_records

        run.hint_entries = entries_from_records(run.train_records(), loaded=run.loaded)
    if run.raft and cfg.raft_anchor:
        from sparserl_compile.training.sft import build_examples

        run.anchors, _ = build_examples(run.train_records(), run.tok, run.model.config.max_points, log=run.log,
                                        hint_entries=run.hint_entries, loaded=run.loaded,
                                        hints=max(1, int(getattr(run.model.config, "retrieval_hints", 1) or 1)),
                                        hint_tolerance=cfg.raft_anchor_tolerance)
        run.log(f"[rl] raft: {len(run.anchors)} SFT examples replayed, {cfg.raft_anchor} per gradient step")
    run.loaded.clear()  # the problems keep their own references
    run.took("SFT replay" if run.anchors else "hints", t)


def _updates(run: _Run) -> RLResult:
    """The updates from the resumed step on: each logged, checkpointed every ``save_every`` and
    at the end (and at the time budget), validated every ``validate_every``."""
    from sparserl_compile.training.checkpoint import save_state

    cfg, state = run.cfg, run.state
    res = RLResult(str(run.out), state.step, state.step)
    t0 = time.perf_counter()
    if run.validator is not None and not any(h["step"] == state.step for h in run.history):
        _validate(run, state.step)  # the starting checkpoint (or the resumed one) is a candidate too
    for step in range(state.step, cfg.steps):
        rec = _update(run, step)
        state.step = step + 1
        if run.average is not None and run.ctx.is_main:
            run.average.update(run.model, state.step)
        res.mean_rewards.append(rec["mean_reward"])
        res.stats.append(rec)
        if (step + 1) % cfg.log_every == 0:
            state.log.append(rec)
            _log_update(run, rec)
        over = cfg.time_budget_s > 0 and time.perf_counter() - t0 > cfg.time_budget_s
        if run.ctx.distributed and cfg.time_budget_s > 0:
            over = tdist.broadcast_scalar(over)  # rank 0's clock: every rank stops after the same step
        last = step + 1 == cfg.steps or over
        if ((step + 1) % cfg.save_every == 0 or last) and run.ctx.is_main:
            save_state(run.out, run.model, run.tok, run.optim, state)
            if run.average is not None and run.average.save(run.model, run.tok, run.out) is not None:
                a = run.average
                run.log(f"[rl] average of updates {a.start}-{a.last} ({a.count}) saved to {run.out / 'average'}")
        if run.validator is not None and ((step + 1) % cfg.validate_every == 0 or last):
            _validate(run, step + 1)
        if over:
            run.log(f"[rl] time budget of {cfg.time_budget_s:.0f} s reached after step {step + 1}")
            break
    res.step = state.step
    if run.validator is not None:
        res.validation = run.history
    if run.ctx.distributed:
        tdist.barrier()  # rank 0's checkpoint is complete before any rank moves on
    return res


def _update(run: _Run, step: int) -> dict:
    """One update: draw this step's problems, write and score candidates for this rank's share,
    then a PPO/GRPO update on the rollouts or a RAFT update on the targets; its record."""
    from sparserl_compile.training.ppo import PPOConfig, make_batch, ppo_update

    cfg = run.cfg
    rng = np.random.default_rng(cfg.seed * 1_000_003 + step)
    lo, hi = run.span
    pick = rng.choice(len(run.problems), size=min(cfg.problems_per_step, len(run.problems)), replace=False)
    t_step = time.perf_counter()
    rolls, sts, groups, rewards = [], [], [], []
    raft_rec = raft_mod.new_record()  # raft: this update's targets
    parts: dict = {}  # this update's seconds: decoding by candidate origin, rewards
    novel = [0, 0, 0]  # this rank's samples: novel and correct, novel (any outcome), all
    for g in range(lo, hi):  # this rank's share; g stays the global index (same sampling seed)
        pi = int(pick[g])
        pb = run.problems[pi]
        structure, formats, refs, hints = _inputs(run, pi)
        if run.raft and run.hint_entries is not None and not hints:
            continue  # the table has no runnable point for this problem: nothing to compare
        rs = _candidates(run, pb, structure, formats, refs, hints, cfg.seed * 7919 + step * 31 + g, parts)
        with timed(parts, "rewards"):
            outcomes = run.evaluator(pb, [r.text for r in rs])
        for k, v in getattr(run.evaluator, "last_seconds", {}).items():  # the sandbox evaluator's parts
            parts["rewards_" + k] = parts.get("rewards_" + k, 0.0) + v
        scores = [float(run.reward_fn(o)) for o in outcomes]
        rewards += scores
        _count_novel(novel, pb, rs, outcomes)
        if run.raft:
            raft_mod.collect_target(run.buffer, run.tok, structure, rs, outcomes, scores, cfg.raft_margin, raft_rec,
                                    f"{pb.label} {pb.op}", speed=cfg.reward != "correctness")
        else:  # the rollout batch PPO/GRPO score again
            rolls += rs
            sts += [structure] * len(rs)
            groups += [g] * len(rs)
    if run.raft:
        rec = raft_mod.raft_step(run.model, run.optim, run.buffer, raft_rec, rewards, cfg, step,
                                 run.tok.pad_token_id, run.ctx.device, run.anchors)
    else:
        batch = make_batch(rolls, sts, groups, run.tok.pad_token_id).to(run.ctx.device)
        pcfg = PPOConfig(algo=cfg.algo, kl_coef=cfg.kl_coef, temperature=cfg.temperature)
        rec = {"step": step + 1,
               **ppo_update(run.model, run.ref_model, run.optim, batch, rewards, pcfg, ctx=run.ctx).__dict__}
    rec.update(_novel_rates(run, novel))
    rec["seconds"] = round(time.perf_counter() - t_step, 1)  # decoding, rewards and the update
    # where they went: decoding by candidate origin (greedy, format, sample, hint), the rewards
    # (compile, verify, time), and the rest (mostly the gradient steps)
    rec["seconds_parts"] = {k: round(v, 1) for k, v in parts.items()}
    rec["seconds_parts"]["update"] = round(max(0.0, rec["seconds"] - sum(
        v for k, v in parts.items() if not k.startswith("rewards_"))), 1)
    return rec


def _count_novel(counts: list, pb, rollouts, outcomes) -> None:
    """Add one problem's samples to ``counts`` (novel and correct, novel, all): novel = no point
    of the kernel space for the problem's (op, dtype) up to form (``novelty.is_novel``)."""
    from sparserl_compile.training.novelty import is_novel

    for r, o in zip(rollouts, outcomes):
        new = is_novel(r.text, pb.op, pb.dtype, pb.matrix)
        counts[0] += bool(new and o.correct)
        counts[1] += bool(new)
        counts[2] += 1


def _novel_rates(run: _Run, counts: list) -> dict:
    """The update's novel-kernel rates over every rank's samples: ``novel_rate`` (novel and
    correct, the evaluation's), ``novel_text_rate`` (novel whatever the outcome)."""
    c = torch.tensor(counts, dtype=torch.float64)
    if run.ctx.distributed:
        c = tdist.all_reduce_sum(c.to(run.ctx.device)).cpu()
    n = max(1.0, float(c[2]))
    return {"novel_rate": float(c[0]) / n, "novel_text_rate": float(c[1]) / n}


def _inputs(run: _Run, pi: int) -> tuple:
    """Problem ``pi``'s decoding inputs, made once per run: its prepared structure, its format
    candidates' formats (RAFT ``--raft-explore formats|mixed``), its drafts (``--speculative``:
    speed only, the samples' distribution is the model's; a draft of every format too, since
    format candidates and departures leave the greedy one's) and its retrieval hints."""
    if pi not in run.inputs:
        from sparserl_compile.policy.provider import problem_inputs

        cfg, pb = run.cfg, run.problems[pi]
        m, hinted = pb.matrix, run.hint_entries is not None
        structure, formats, refs, _ = problem_inputs(
            run.model, m, pb.op, pb.dtype, pb.n,
            formats=run.raft and not hinted and cfg.raft_explore in ("formats", "mixed"),
            entries=run.hint_entries or None, count=max(4, cfg.k) if run.raft else 4, fit_formats=False,
            references=cfg.speculative, exclude=pb.label)
        hints = None
        if hinted:  # from the other matrices, as in SFT; raft: one hint per candidate, the first is the greedy prompt's
            from sparserl_compile.policy.retrieval import nearest_hints, problem_for

            hints = nearest_hints(structure.features, pb.op, pb.dtype, pb.n, run.hint_entries,
                                  cfg.k if run.raft else 1, exclude=pb.label,
                                  problem=problem_for(pb.op, pb.dtype, pb.n, m))
        run.inputs[pi] = (structure, formats, refs, hints)
    return run.inputs[pi]


def _candidates(run: _Run, pb, structure, formats, refs, hints, seed: int, parts: dict) -> list:
    """One problem's candidates: RAFT's (``raft.raft_candidates``), or ``k`` samples of the
    policy for PPO/GRPO, traced (their masks and log-probabilities are scored again)."""
    from sparserl_compile.policy.decode import generate
    from sparserl_compile.policy.sampling import DecodeConfig

    cfg = run.cfg
    if run.raft:
        return raft_mod.raft_candidates(run.model, run.tok, structure, pb, hints, refs, cfg, seed=seed,
                                        seconds=parts, formats=formats, screen=run.screen)
    dc = DecodeConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                      constrained=cfg.constrained, seed=seed, batch_drafts=cfg.batch_drafts)
    with timed(parts, "sample"):
        return generate(run.model, run.tok, structure, pb.op, pb.dtype, pb.n, k=cfg.k, config=dc,
                        hint=hints[0] if hints else None, references=refs)


def _log_update(run: _Run, rec: dict) -> None:
    steps = run.cfg.steps
    if run.raft:
        run.log(f"[rl] step {rec['step']}/{steps} reward {rec['mean_reward']:.3f} first {rec['first_reward']:.3f} "
                f"best {rec['best_reward']:.3f} novel {rec['novel_rate']:.3f} switched {rec['switched']}/{rec['targets']} "
                f"buffer {rec['buffer']} loss {rec['loss']:.4f}"
                + f", {rec['seconds']:.0f} s ({seconds_text(rec['seconds_parts'])})"
                + "".join(f"\n[rl]   switched: {n} " + (f"(x{r} faster" if r else "(the first was wrong")
                          + f", a {o} candidate)" for n, r, o in rec["switched_problems"]))
    else:
        run.log(f"[rl] step {rec['step']}/{steps} reward {rec['mean_reward']:.3f} kl {rec['kl']:.4f} "
                f"loss {rec['loss']:.4f} entropy {rec['entropy']:.3f} clip {rec['clip_frac']:.3f} "
                f"novel {rec['novel_rate']:.3f} (text {rec['novel_text_rate']:.3f})")


def _nnz(record, loaded: dict) -> int:
    if record.matrix not in loaded:
        loaded[record.matrix] = record.matrix.load()
    return int(loaded[record.matrix].nnz)
