"""Stage 3: reinforcement learning from compile / correctness / speed rewards.

Each step samples ``problems_per_step`` training-split problems, draws ``k`` grammar-
constrained samples per problem from the current policy (``policy.decode.generate``, which
returns the masks), scores them with an evaluator (``rewards.py``: sandboxed GPU or CPU
verification, or header-only for smoke runs), turns outcomes into rewards (hierarchical, or
correctness-only for the ablation) and applies one PPO/GRPO update (``ppo.py``) with a KL
penalty to the frozen starting (SFT) model. Resumes from ``out_dir``.

``algo="raft"`` (``raft.py``) fine-tunes the greedy prompt toward the best of k candidates:
for a policy trained with retrieval hints, one greedy kernel per each of the k nearest hints;
for one without, the greedy kernel and k - 1 temperature samples of the same prompt (expert
iteration). Its replay buffer is not checkpointed (a resumed run starts it empty).

``validate=N`` scores the policy's greedy kernels on N validation problems (new instances of
the training kinds, never held-out ones; ``validation.py``) before the first update, every
``validate_every`` updates and after the last, and keeps the best checkpoint in
``<out_dir>/best/``: which update to keep is chosen without the held-out split.
"""

from __future__ import annotations

import copy
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from sparserl_compile.training.config import check_resume, opt, resolve_device, save_config
from sparserl_compile.training.data import DEFAULT_SUPERVISION


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
                                           "greedily: policy.decode.branch_diverse)")
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


#: how RAFT draws a policy's candidates after its greedy kernel when it has no hints (``--raft-explore``)
RAFT_EXPLORE = ("temperature", "formats", "mixed", "branches")


@dataclass
class RLResult:
    out_dir: str
    start_step: int
    step: int
    mean_rewards: list[float] = field(default_factory=list)  # per update of this run
    stats: list[dict] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)  # every validation of the run, resumed ones included


def problems_from_records(records, loaded: dict | None = None) -> list:
    """``RLProblem``s for records (matrices loaded once each; ``loaded``, MatrixRef -> CSR, is
    used and filled)."""
    from sparserl_compile.training.rewards import RLProblem

    out, cache = [], ({} if loaded is None else loaded)
    for r in records:
        if r.matrix not in cache:
            cache[r.matrix] = r.matrix.load()
        best = r.best()
        out.append(RLProblem(cache[r.matrix], r.op, r.dtype, r.n, r.matrix.label, r.reference_us,
                             best.us if best else None))
    return out


def make_evaluator(name: str, workers: int = 2, records=None, parallel_verify: bool = True,
                   prestart: bool = True):
    """``gpu``, ``cpu``, ``header``, or ``measured`` (replays the H200 outcomes of ``records``'
    variants, the CPU evaluator for the rest). ``parallel_verify`` and ``prestart`` (start the
    workers now, in the background): ``SandboxEvaluator``'s; the measured evaluator's CPU
    evaluator, rarely asked, starts its workers on first use."""
    from sparserl_compile.training import rewards

    if name == "header":
        return rewards.HeaderEvaluator()
    if name in ("cpu", "gpu"):
        cm = None
        if name == "cpu":
            from sparserl_compile.training.cost_model import CostModel

            cm = CostModel.load_default()
        return rewards.SandboxEvaluator(name, workers=workers, cost_model=cm, parallel_verify=parallel_verify,
                                        prestart=prestart)
    if name == "measured":
        if records is None:
            raise ValueError("evaluator='measured' needs the supervision records it replays")
        return rewards.MeasuredEvaluator(records, inner=make_evaluator("cpu", workers, prestart=False))
    raise ValueError(f"evaluator={name!r}: use 'gpu', 'cpu', 'measured' or 'header'")


def rl(cfg: RLConfig, problems=None, evaluator=None, reward_fn=None, log=print,
       validation_problems=None) -> RLResult:
    """Run stage 3 (``_rl``); the evaluator, given or made, is closed when the run ends, and when
    it raises (a sandbox evaluator's worker processes then stop with the run, not with Python)."""
    with ExitStack() as cleanup:
        return _rl(cfg, problems, evaluator, reward_fn, log, validation_problems, cleanup)


def _rl(cfg: RLConfig, problems, evaluator, reward_fn, log, validation_problems,
        cleanup: ExitStack) -> RLResult:
    """Run stage 3. ``problems``/``evaluator``/``reward_fn``/``validation_problems`` override
    the config (tests). With ``cfg.validate`` the policy is scored on validation problems
    (``training/validation.py``) and the best so far is kept in ``<out_dir>/best/``.

    Under ``torchrun`` (``training/dist.py``): every rank draws the same ``problems_per_step``
    problems and keeps its equal contiguous share (the count must divide by the world size),
    generates and scores its samples with the same seeds one process would use, and
    ``ppo_update`` combines the ranks (global advantage moments and masked means, summed
    gradients). Rank 0 logs and writes checkpoints; the time-budget stop is rank 0's decision.
    """
    t_begin = time.perf_counter()  # the set-up's parts are logged before the first update
    setup: dict[str, float] = {}
    if cfg.raft_screen and not (cfg.algo == "raft" and cfg.raft_explore == "branches"):
        raise ValueError("--raft-screen checks departures from the greedy kernel: it needs --algo raft "
                         "--raft-explore branches")

    def took(part: str, since: float) -> float:
        now = time.perf_counter()
        setup[part] = setup.get(part, 0.0) + now - since
        return now

    from sparserl_compile.policy.decode import DecodeConfig, generate
    from sparserl_compile.policy.model import load_policy
    from sparserl_compile.policy.provider import problem_inputs
    from sparserl_compile.training.checkpoint import TrainerState, has_state, load_state, save_state
    from sparserl_compile.training.data import load_supervision, split
    from sparserl_compile.training.ppo import PPOConfig, make_batch, ppo_update
    from sparserl_compile.training import dist as tdist
    from sparserl_compile.training.rewards import REWARDS

    t = took("imports", t_begin)
    ctx = tdist.setup(resolve_device(cfg.device))
    log = tdist.quiet_unless_main(log, ctx)
    out = Path(cfg.out_dir)
    resume = has_state(out, "rl")
    if resume:
        check_resume(cfg, out, "rl")
    if ctx.is_main:
        save_config(cfg, out, "rl")
    ref_model, tok = load_policy(cfg.init)
    for p in ref_model.parameters():
        p.requires_grad_(False)
    model = load_policy(out)[0] if resume else copy.deepcopy(ref_model)
    for p in model.parameters():
        p.requires_grad_(True)
    device = ctx.device
    model.to(device)
    ref_model.to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    state = load_state(out, optim) if resume else TrainerState("rl")
    t = took("models", t)
    average = None  # --average-from: the weights averaged along the run, checked before any data is read
    if cfg.average_from:
        from sparserl_compile.training.soup import RunningAverage

        average = RunningAverage.resume(out, cfg.average_from, state.step) if resume else RunningAverage(cfg.average_from)
    raft = cfg.algo == "raft"  # checked before any data, problem or evaluator worker is made
    if raft:
        from sparserl_compile.training.raft import RaftBuffer

        if ctx.distributed:
            raise ValueError("--algo raft runs in one process (its replay buffer is not sharded); "
                             "launch without torchrun, or use --algo ppo or grpo")
        buffer = RaftBuffer()
    elif cfg.algo not in ("ppo", "grpo"):
        raise ValueError(f"--algo {cfg.algo!r}: use 'ppo', 'grpo' or 'raft'")
    if cfg.raft_explore not in RAFT_EXPLORE:
        raise ValueError(f"--raft-explore {cfg.raft_explore!r}: use " + ", ".join(map(repr, RAFT_EXPLORE)))
    if cfg.raft_explore != "temperature" and getattr(model.config, "retrieval", False):
        raise ValueError(f"--raft-explore {cfg.raft_explore!r} is for a policy without hints; {cfg.init} was trained "
                         "with hints, and RAFT's candidates are then its hints' kernels: leave --raft-explore unset")
    if reward_fn is None and cfg.reward not in REWARDS:
        raise ValueError(f"--reward {cfg.reward!r}: use " + " or ".join(repr(k) for k in REWARDS))
    mix = vmix = None
    if cfg.unlabelled_mix or cfg.validate_mix:  # a bad mix fails before any data is read
        from sparserl_compile.training.unlabelled import parse_mix

        mix = parse_mix(cfg.unlabelled_mix) if cfg.unlabelled_mix else None
        vmix = parse_mix(cfg.validate_mix) if cfg.validate_mix else mix
    from sparserl_compile.training.unlabelled import parse_spmm_widths

    try:  # a bad width list fails before any data is read
        spmm_widths = parse_spmm_widths(cfg.unlabelled_spmm_n)
    except ValueError as e:
        raise ValueError(f"--unlabelled-spmm-n: {e}") from None
    if cfg.validate and ctx.distributed:
        raise ValueError("--validate runs in one process; launch without torchrun")
    if cfg.validate and cfg.validate_every < 1:
        raise ValueError(f"--validate-every {cfg.validate_every}: validate every 1 or more updates")
    loaded: dict = {}
    _records: list = []

    def train_records():  # the training split, read once, when something needs it
        if not _records:
            _records.append(split(load_supervision(cfg.data)).train)
        return _records[0]

    t = time.perf_counter()
    if problems is None:  # every training record gives hints (below); --max-nnz only picks problems
        picked = [r for r in train_records() if _nnz(r, loaded) <= cfg.max_nnz] if cfg.max_nnz else train_records()
        problems = problems_from_records(picked, loaded) if cfg.labelled else []
        if cfg.unlabelled:
            from sparserl_compile.training.unlabelled import unlabelled_problems

            problems += unlabelled_problems(cfg.unlabelled, cfg.seed, cfg.max_nnz,
                                            exclude_labels={r.matrix.label for r in train_records()}, mix=mix,
                                            spmm_widths=spmm_widths)
    if not problems:
        raise ValueError("RL needs at least one training problem" + (f" (--max-nnz {cfg.max_nnz} left none)"
                                                                      if cfg.max_nnz else ""))
    t = took("problems", t)
    n_pick = min(cfg.problems_per_step, len(problems))
    lo, hi = tdist.shard_bounds(n_pick, ctx, f"problems per step (--problems-per-step {cfg.problems_per_step}, "
                                             f"{len(problems)} problems)")
    if evaluator is None:
        evaluator = make_evaluator(cfg.evaluator, cfg.workers,
                                   records=train_records() if cfg.evaluator == "measured" else None,
                                   parallel_verify=cfg.parallel_verify)
    if hasattr(evaluator, "close"):
        cleanup.callback(evaluator.close)
    screen = None
    if cfg.raft_screen:
        from sparserl_compile.policy.screen import Screen

        screen = Screen(cfg.raft_screen)
        cleanup.callback(screen.close)
    t = took("evaluator", t)
    reward_fn = reward_fn or REWARDS[cfg.reward]
    validator = None
    if cfg.validate:
        from sparserl_compile.training import validation

        vprobs = validation_problems if validation_problems is not None else validation.validation_problems(
            cfg.validate, cfg.seed, cfg.max_nnz, mix=vmix,
            exclude_labels={r.matrix.label for r in train_records()} | {p.label for p in problems})
        validator = validation.Validator(vprobs, evaluator, max_new_tokens=cfg.max_new_tokens,
                                         constrained=cfg.constrained, speculative=cfg.speculative)
        res_validation = validation.load_history(out) if resume else []
        log(f"[rl] validation: {len(vprobs)} problems, every {cfg.validate_every} updates; "
            + ", ".join(sorted({p.label.split("(")[0].split("[")[0] for p in vprobs}))[:300])

        def validate(at: int) -> None:
            entry = validator(model, tok, at)
            if not entry["timed"] and not res_validation:
                log("[rl] validation: the evaluator timed no validation kernel against cuSPARSE (the CPU "
                    "evaluators time none on these problems), so checkpoints are ranked by correct rate")
            was = validation.best_of(res_validation)
            new_best = validation.record(out, res_validation, entry, model, tok)
            log(f"[rl] validation after {at} updates: score {entry['score']:.4f} (x cuSPARSE, geomean), correct "
                f"{entry['correct_rate']:.3f}, timed {entry['timed']}/{entry['problems']}"
                + (" - new best, saved to best/" if new_best else f"; best {was['score']:.4f} after {was['step']}"))
    t = took("validation problems", t) if validator is not None else t
    pcfg = PPOConfig(algo=cfg.algo, kl_coef=cfg.kl_coef, temperature=cfg.temperature)
    structs, hints, refs, formats, hint_entries = {}, {}, {}, {}, None
    if getattr(model.config, "retrieval", False):  # a policy trained with retrieval hints
        from sparserl_compile.training.neighbours import entries_from_records

        hint_entries = entries_from_records(train_records(), loaded=loaded)
    anchors = []
    if raft and cfg.raft_anchor:
        from sparserl_compile.training.sft import build_examples

        anchors, _ = build_examples(train_records(), tok, model.config.max_points, log=log,
                                    hint_entries=hint_entries, loaded=loaded,
                                    hints=max(1, int(getattr(model.config, "retrieval_hints", 1) or 1)),
                                    hint_tolerance=cfg.raft_anchor_tolerance)
        log(f"[rl] raft: {len(anchors)} SFT examples replayed, {cfg.raft_anchor} per gradient step")
    loaded.clear()  # the problems keep their own references
    took("SFT replay" if anchors else "hints", t)
    log(f"[rl] ready after {time.perf_counter() - t_begin:.1f} s: "
        + ", ".join(f"{k} {v:.1f}" for k, v in setup.items()) + f" ({len(problems)} problems)")
    res = RLResult(str(out), state.step, state.step)
    t0 = time.perf_counter()
    if validator is not None and not any(h["step"] == state.step for h in res_validation):
        validate(state.step)  # the starting checkpoint (or the resumed one) is a candidate too
    for step in range(state.step, cfg.steps):
        rng = np.random.default_rng(cfg.seed * 1_000_003 + step)
        pick = rng.choice(len(problems), size=n_pick, replace=False)
        t_step = time.perf_counter()
        rolls, sts, groups, rewards = [], [], [], []
        raft_rec = {"new": 0, "switched": 0, "first": [], "best": [], "switched_problems": []}  # raft: this update's
        parts = {}  # this update's seconds: decoding by candidate origin, rewards
        for g in range(lo, hi):  # this rank's share; g stays the global index (same sampling seed)
            pi = pick[g]
            pb = problems[pi]
            if pi not in structs:
                m = pb.matrix
                # the format candidates' formats (--raft-explore formats|mixed), once per problem
                # drafts (cfg.speculative): speed only, the samples' distribution is the model's; a
                # draft of every format too: format candidates and departures leave the greedy one's
                structs[pi], formats[pi], refs[pi], _ = problem_inputs(
                    model, m, pb.op, pb.dtype, pb.n,
                    formats=raft and hint_entries is None and cfg.raft_explore in ("formats", "mixed"),
                    entries=hint_entries or None, count=max(4, cfg.k) if raft else 4, fit_formats=False,
                    references=cfg.speculative, exclude=pb.label)
                if hint_entries is not None:  # from the other matrices, as in SFT
                    from sparserl_compile.policy.retrieval import nearest_hints, problem_for

                    # raft: one hint per candidate, the first is the greedy prompt's
                    hints[pi] = nearest_hints(structs[pi].features, pb.op, pb.dtype, pb.n, hint_entries,
                                              cfg.k if raft else 1, exclude=pb.label,
                                              problem=problem_for(pb.op, pb.dtype, pb.n, m))
            sample_seed = cfg.seed * 7919 + step * 31 + g  # the same whatever the rank
            if raft:
                if hint_entries is not None and not hints[pi]:
                    continue  # the table has no runnable point for this problem: nothing to compare
                rs = _raft_candidates(model, tok, structs[pi], pb, hints.get(pi), refs.get(pi), cfg, seed=sample_seed,
                                      seconds=parts, formats=formats.get(pi), screen=screen)
            else:
                dc = DecodeConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                  constrained=cfg.constrained, seed=sample_seed, batch_drafts=cfg.batch_drafts)
                hint = hints[pi][0] if hints.get(pi) else None
                with _timed(parts, "sample"):
                    rs = generate(model, tok, structs[pi], pb.op, pb.dtype, pb.n, k=cfg.k, config=dc, hint=hint,
                                  references=refs.get(pi))
            with _timed(parts, "rewards"):
                outcomes = evaluator(pb, [r.text for r in rs])
            for k, v in getattr(evaluator, "last_seconds", {}).items():  # the sandbox evaluator's parts
                parts["rewards_" + k] = parts.get("rewards_" + k, 0.0) + v
            scores = [float(reward_fn(o)) for o in outcomes]
            rewards += scores
            if raft:
                _raft_collect(buffer, tok, structs[pi], rs, outcomes, scores, cfg.raft_margin, raft_rec,
                              f"{pb.label} {pb.op}", speed=cfg.reward != "correctness")
            else:  # the rollout batch PPO/GRPO score again
                rolls += rs
                sts += [structs[pi]] * len(rs)
                groups += [g] * len(rs)
        if raft:
            rec = _raft_step(model, optim, buffer, raft_rec, rewards, cfg, step, tok.pad_token_id, device, anchors)
        else:
            batch = make_batch(rolls, sts, groups, tok.pad_token_id).to(device)
            rec = {"step": step + 1, **ppo_update(model, ref_model, optim, batch, rewards, pcfg, ctx=ctx).__dict__}
        rec["seconds"] = round(time.perf_counter() - t_step, 1)  # decoding, rewards and the update
        # where they went: decoding by candidate origin (greedy, format, sample, hint), the rewards
        # (compile, verify, time), and the rest (mostly the gradient steps)
        rec["seconds_parts"] = {k: round(v, 1) for k, v in parts.items()}
        rec["seconds_parts"]["update"] = round(max(0.0, rec["seconds"] - sum(
            v for k, v in parts.items() if not k.startswith("rewards_"))), 1)
        state.step = step + 1
        if average is not None and ctx.is_main:
            average.update(model, state.step)
        res.mean_rewards.append(rec["mean_reward"])
        res.stats.append(rec)
        if (step + 1) % cfg.log_every == 0:
            state.log.append(rec)
            if raft:
                log(f"[rl] step {step + 1}/{cfg.steps} reward {rec['mean_reward']:.3f} first {rec['first_reward']:.3f} "
                    f"best {rec['best_reward']:.3f} switched {rec['switched']}/{rec['targets']} "
                    f"buffer {rec['buffer']} loss {rec['loss']:.4f}"
                    + f", {rec['seconds']:.0f} s ({_seconds_text(rec['seconds_parts'])})"
                    + "".join(f"\n[rl]   switched: {n} " + (f"(x{r} faster" if r else "(the first was wrong")
                              + f", a {o} candidate)" for n, r, o in rec["switched_problems"]))
            else:
                log(f"[rl] step {step + 1}/{cfg.steps} reward {rec['mean_reward']:.3f} kl {rec['kl']:.4f} "
                    f"loss {rec['loss']:.4f} entropy {rec['entropy']:.3f}")
        over = cfg.time_budget_s > 0 and time.perf_counter() - t0 > cfg.time_budget_s
        if ctx.distributed and cfg.time_budget_s > 0:
            over = tdist.broadcast_scalar(over)  # rank 0's clock: every rank stops after the same step
        if ((step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps or over) and ctx.is_main:
            save_state(out, model, tok, optim, state)
            if average is not None and average.save(model, tok, out) is not None:
                log(f"[rl] average of updates {average.start}-{average.last} ({average.count}) saved to {out / 'average'}")
        if validator is not None and ((step + 1) % cfg.validate_every == 0 or step + 1 == cfg.steps or over):
            validate(step + 1)
        if over:
            log(f"[rl] time budget of {cfg.time_budget_s:.0f} s reached after step {step + 1}")
            break
    res.step = state.step
    if validator is not None:
        res.validation = res_validation
    if ctx.distributed:
        tdist.barrier()  # rank 0's checkpoint is complete before any rank moves on
    return res


def _raft_candidates(model, tok, structure, pb, hints, references, cfg: RLConfig, seed: int,
                     seconds: dict | None = None, formats=None, screen=None) -> list:
    """A RAFT problem's candidates, the greedy prompt's kernel first: with ``hints`` (a policy
    trained with them) one greedy kernel per hint (``decode.hint_diverse``, what the runtime's
    provider draws); without, the greedy kernel and k - 1 others drawn as ``cfg.raft_explore``
    says: samples at ``cfg.temperature`` (what ``sparserl eval``'s best of k draws), or greedy
    kernels of the policy's next most likely plausible formats (``decode.format_diverse``; after
    SFT nearly all the probability is on one format, so temperature samples rarely try another),
    or half each, or the greedy kernel's most likely departures in its header
    (``decode.branch_diverse``). A format candidate that repeats the greedy kernel is dropped, so
    there may be fewer than k. ``seconds``, if given, gains each origin's decoding seconds; ``formats``: the
    problem's plausible formats where the caller has them (``provider.plausible_formats``); ``screen``: a
    ``policy.screen.Screen`` the departures pass first (``--raft-screen``; its seconds are the part
    "screen" of ``seconds``)."""
    from sparserl_compile.policy.decode import DecodeConfig, branch_diverse, format_diverse, generate, hint_diverse

    seconds = {} if seconds is None else seconds

    greedy = DecodeConfig(greedy=True, max_new_tokens=cfg.max_new_tokens, constrained=cfg.constrained, trace=False)
    together = replace(greedy, batch_drafts=cfg.batch_drafts)  # several greedy kernels: hint or format candidates
    if hints:
        with _timed(seconds, "hint"):
            return _tagged(hint_diverse(model, tok, structure, pb.op, pb.dtype, pb.n, hints, config=together,
                                        references=references), "hint")
    with _timed(seconds, "greedy"):
        rs = _tagged(generate(model, tok, structure, pb.op, pb.dtype, pb.n, k=1, config=greedy,
                              references=references), "greedy")
    if cfg.raft_explore == "branches":
        bound = screen and screen.checker(pb.matrix.indptr, pb.matrix.indices, pb.matrix.shape, pb.op, pb.dtype, pb.n)

        def check(texts):
            with _timed(seconds, "screen"):
                return bound(texts)

        before = seconds.get("screen", 0.0)
        with _timed(seconds, "branch"):
            rs += _tagged(branch_diverse(model, tok, structure, pb.op, pb.dtype, pb.n, cfg.k, config=together,
                                         references=references, greedy=rs[0],
                                         screen=check if screen is not None else None)[1:], "branch")
        seconds["branch"] -= seconds.get("screen", 0.0) - before  # the screen's seconds are its own part
        return rs
    n_formats = {"temperature": 0, "formats": cfg.k - 1, "mixed": (cfg.k - 1) // 2}[cfg.raft_explore]
    if n_formats > 0:
        if formats is None:
            from sparserl_compile.policy.provider import plausible_formats

            formats = plausible_formats(pb.matrix.indptr, pb.matrix.indices, pb.matrix.shape)
        # the most likely format is the greedy kernel's own: ask for one more, and drop repeats;
        # with drafts, the greedy kernel drafts that repeat first
        drafts = [rs[0].text] + list(references) if references else None
        with _timed(seconds, "format"):
            forced = format_diverse(model, tok, structure, pb.op, pb.dtype, pb.n, n_formats + 1, formats,
                                    config=together, references=drafts)
        rs += _tagged([r for r in forced if r.text != rs[0].text][:n_formats], "format")
    if cfg.k - 1 - n_formats > 0:
        # untraced: RAFT's loss needs no log-probabilities or masks, and untraced speculative
        # sampling computes a grammar mask only where an unmasked draw is rejected
        sampled = DecodeConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                               constrained=cfg.constrained, seed=seed, trace=False, batch_drafts=cfg.batch_drafts)
        with _timed(seconds, "sample"):  # speculative decoding writes its samples one at a time unless batch_drafts
            rs += _tagged(generate(model, tok, structure, pb.op, pb.dtype, pb.n, k=cfg.k - 1 - n_formats,
                                   config=sampled, references=references if cfg.sample_drafts else None),
                          "sample")
    return rs


@contextmanager
def _timed(seconds: dict, part: str):
    """Add the block's wall seconds to ``seconds[part]``."""
    t = time.perf_counter()
    try:
        yield
    finally:
        seconds[part] = seconds.get(part, 0.0) + time.perf_counter() - t


def _seconds_text(parts: dict) -> str:
    """``{"greedy": 3.2, "sample": 9.0, "rewards": 12.1, "rewards_verify": 4.0, "rewards_time": 6.5,
    "update": 2.0}`` -> "decoding 12 (greedy 3, sample 9), rewards 12 (verify 4, time 6), update 2":
    how an update's seconds were spent, for the log."""
    decode = {k: v for k, v in parts.items() if k not in ("rewards", "update") and not k.startswith("rewards_")}
    rewards = {k[len("rewards_"):]: v for k, v in parts.items() if k.startswith("rewards_")}

    def some(d):
        return " (" + ", ".join(f"{k} {v:.0f}" for k, v in d.items()) + ")" if len(d) > 1 else ""

    return (f"decoding {sum(decode.values()):.0f}{some(decode)}, rewards {parts.get('rewards', 0.0):.0f}"
            f"{some(rewards)}, update {parts.get('update', 0.0):.0f}")


def _tagged(rolls: list, origin: str) -> list:
    """``rolls`` with ``extra["origin"]`` set (greedy, format, sample, branch or hint): the log names where
    a switched target came from."""
    for r in rolls:
        r.extra["origin"] = origin
    return rolls


def _raft_collect(buffer, tok, structure, rolls, outcomes, scores: list, margin: float, rec: dict,
                  name: str = "", speed: bool = True) -> None:
    """Add one problem's target to the RAFT buffer (``raft.pick_target``: the greedy prompt,
    the first hint's for a hinted policy, with the chosen candidate's kernel; ``speed=False``:
    the correctness-only control), the first and best of its rewards (``scores``) to ``rec``,
    and ``name`` to its switched problems when the target is not the first kernel, with the gain
    and the origin of its new target (``_tagged``: a format or a temperature sample, say)."""
    from sparserl_compile.policy.decode import completion_ids
    from sparserl_compile.training.lm import LMExample
    from sparserl_compile.training.raft import o_us, pick_target

    rec["first"].append(scores[0])
    rec["best"].append(max(scores))
    j = pick_target(outcomes, margin, speed=speed)
    if j is None:
        return
    buffer.add(LMExample(list(rolls[0].prompt_ids), completion_ids(tok, rolls[j].text), structure), j != 0)
    rec["new"] += 1
    rec["switched"] += j != 0
    if j != 0:  # which problem, and how much faster its new target is than the first kernel (None: first wrong)
        first, best = o_us(outcomes[0]) if outcomes[0].correct else None, o_us(outcomes[j])
        rec["switched_problems"].append([name, round(first / best, 3) if first and best else None,
                                         rolls[j].extra.get("origin", "sample")])


def _raft_step(model, optim, buffer, rec: dict, rewards: list, cfg: RLConfig, step: int, pad_id: int,
               device, anchors: list) -> dict:
    """One RAFT update (``raft.raft_update``) and its logged record."""
    from sparserl_compile.training.raft import raft_update

    loss = float("nan")
    if buffer.examples:
        loss = raft_update(model, optim, buffer, np.random.default_rng(cfg.seed * 1_000_003 + step),
                           steps=cfg.raft_steps, batch_size=cfg.raft_batch, pad_id=pad_id, max_len=cfg.max_len,
                           device=device, newest=rec["new"], anchors=anchors, anchor_count=cfg.raft_anchor)
    mean = lambda xs: float(np.mean(xs)) if xs else float("nan")  # noqa: E731
    return {"step": step + 1, "mean_reward": mean(rewards), "first_reward": mean(rec["first"]),
            "best_reward": mean(rec["best"]), "targets": rec["new"], "switched": rec["switched"],
            "switched_problems": rec["switched_problems"],
            "buffer": len(buffer.examples), "buffer_switched": buffer.switched, "loss": loss}


def _nnz(record, loaded: dict) -> int:
    if record.matrix not in loaded:
        loaded[record.matrix] = record.matrix.load()
    return int(loaded[record.matrix].nnz)
