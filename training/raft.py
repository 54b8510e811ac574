"""Reward-ranked fine-tuning: stage 3's ``--algo raft``.

Why a third algorithm beside PPO and GRPO: both learn from the reward differences between the
samples of one prompt. The retrieval policies copy their hint almost deterministically
(about 0.001 nats per token after SFT), so k temperature samples of one prompt are one
kernel, their advantages are zero and the update moves nothing. Hotter sampling does not help:
the extra samples mostly fail or are slow.

RAFT explores across evidence instead of across tokens. A problem's k candidates are the
policy's own greedy kernels for its k nearest retrieval hints (``candidates.hint_diverse``, the
candidates the runtime's policy provider draws), each compiled, verified and timed by the
evaluator. The fastest correct one becomes the target of the *first* hint's prompt (the one
greedy decoding and the provider's first candidate use) when it beats that prompt's own kernel
by more than ``margin`` (timing noise); otherwise that kernel is its own target, an anchor that
keeps the policy where it already chose well. Every update then takes a few causal-LM steps on
batches drawn from all targets collected so far (a replay buffer), mixed with examples of the
SFT stage (``--raft-anchor``: every hint of the SFT recipe, so prompts other than the first keep
their meaning; without them the policy forgets how to read hints). The policy so distils its
best of k into its first kernel, on structures the supervision never measured when the
problems are unlabelled (``--unlabelled``), rewarded by real timings.

A policy trained without hints has no hints to explore across. Its candidates are its greedy
kernel and k - 1 other candidates of the same prompt (``raft_candidates``), and the
same rule picks the target. Departures from the greedy kernel (``--raft-explore branches``)
spend those candidates on the header choices that matter for speed.

This is reward-ranked fine-tuning (Dong et al. 2023, "RAFT"), a form of expert iteration
(Anthony et al. 2017) and of ReST (Gulcehre et al. 2023): policy improvement by best-of-k
under the reward, then imitation. No library implements it over our structure-prefixed model
and evaluators, and it is a few dozen lines on top of the SFT loss (``training/lm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from sparserl_compile.policy.candidates import format_diverse, hint_diverse
from sparserl_compile.policy.decode import generate
from sparserl_compile.policy.departures import branch_diverse
from sparserl_compile.policy.sampling import DecodeConfig, completion_ids
from sparserl_compile.training.lm import LMExample, collate, lm_loss
from sparserl_compile.training.stats import timed

#: how RAFT draws a policy's candidates after its greedy kernel when it has no hints (``--raft-explore``)
RAFT_EXPLORE = ("temperature", "formats", "mixed", "branches")


def pick_target(outcomes, margin: float = 0.05, speed: bool = True) -> int | None:
    """Which candidate the first prompt should learn: the index of the fastest correct timed
    outcome if it is more than ``margin`` faster than candidate 0 (or candidate 0 is not
    correct), else 0 when candidate 0 is correct; None when no candidate is correct.
    Candidates correct but untimed (an evaluator without timing) only count as candidate 0
    keeping its place.

    ``speed=False`` is the correctness-only control (``--reward correctness``): timings are
    ignored, so candidate 0 keeps its place whenever it is correct and otherwise the first
    correct candidate replaces it. The policy then imitates its own correct kernels on the same
    problems, with the same anchors and steps, and only the speed signal is taken away."""
    correct = [i for i, o in enumerate(outcomes) if o.correct]
    if not correct:
        return None
    first_ok = outcomes[0].correct
    if not speed:
        return 0 if first_ok else correct[0]
    timed = [i for i in correct if o_us(outcomes[i]) is not None]
    if not timed:
        return 0 if first_ok else correct[0]
    best = min(timed, key=lambda i: o_us(outcomes[i]))
    if not first_ok:
        return best
    first = o_us(outcomes[0])
    if first is None:
        return 0
    return best if o_us(outcomes[best]) < first * (1.0 - margin) else 0


def o_us(o) -> float | None:
    """An outcome's time in microseconds, None when it has none (or a non-positive one)."""
    return o.us if o.us is not None and o.us > 0 else None


@dataclass
class RaftBuffer:
    """All targets so far: (first-hint prompt, chosen kernel) examples. ``switched`` counts the
    ones whose kernel is not the first prompt's own."""

    examples: list[LMExample] = field(default_factory=list)
    switched: int = 0

    def add(self, example: LMExample, switched: bool) -> None:
        self.examples.append(example)
        self.switched += bool(switched)

    def batch(self, rng: np.random.Generator, size: int, newest: int = 0) -> list[LMExample]:
        """``size`` examples: the ``newest`` latest ones first (this update's targets), the rest
        drawn without replacement from the older ones."""
        n = len(self.examples)
        if n == 0:
            raise ValueError("the RAFT buffer is empty: no candidate of any problem was correct yet")
        newest = min(newest, size, n)
        picked = list(range(n - newest, n))
        rest = n - newest
        if size > newest and rest:
            picked += rng.choice(rest, size=min(size - newest, rest), replace=False).tolist()
        return [self.examples[i] for i in picked]


def raft_update(model, optimizer, buffer: RaftBuffer, rng: np.random.Generator, *, steps: int, batch_size: int,
                pad_id: int, max_len: int, device, newest: int = 0, max_grad_norm: float = 1.0,
                anchors: list[LMExample] | None = None, anchor_count: int = 0) -> float:
    """``steps`` causal-LM steps on batches from ``buffer`` (each holding the ``newest``
    examples first), each batch with ``anchor_count`` examples drawn from ``anchors`` (the SFT
    examples, replayed so that the policy keeps reading every hint as SFT taught it); returns
    the mean loss."""
    model.train()
    losses = []
    for _ in range(steps):
        exs = buffer.batch(rng, batch_size, newest)
        if anchors and anchor_count:
            exs += [anchors[i] for i in rng.choice(len(anchors), size=min(anchor_count, len(anchors)), replace=False)]
        b = collate(exs, pad_id, max_len).to(device)
        loss = lm_loss(model, b)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    return float(np.mean(losses)) if losses else float("nan")


def raft_candidates(model, tok, structure, pb, hints, references, cfg, seed: int,
                    seconds: dict | None = None, formats=None, screen=None) -> list:
    """A RAFT problem's candidates, the greedy prompt's kernel first (``cfg``: the ``RLConfig``).
    With ``hints`` (a policy trained with them) one greedy kernel per hint
    (``candidates.hint_diverse``, what the runtime's provider draws); without, the greedy kernel
    and k - 1 others drawn as ``cfg.raft_explore`` says: samples at ``cfg.temperature`` (what
    ``sparserl eval``'s best of k draws), or greedy kernels of the policy's next most likely
    plausible formats (``candidates.format_diverse``; after SFT nearly all the probability is on
    one format, so temperature samples rarely try another), or half each, or the greedy kernel's
    most likely departures in its header (``departures.branch_diverse``). A format candidate
    that repeats the greedy kernel is dropped, so there may be fewer than k. ``seconds``, if
    given, gains each origin's decoding seconds; ``formats``: the problem's plausible formats
    where the caller has them (``provider.plausible_formats``); ``screen``: a
    ``policy.screen.Screen`` the departures pass first (``--raft-screen``; its seconds are the
    part "screen" of ``seconds``)."""
    seconds = {} if seconds is None else seconds
    greedy = DecodeConfig(greedy=True, max_new_tokens=cfg.max_new_tokens, constrained=cfg.constrained, trace=False)
    together = replace(greedy, batch_drafts=cfg.batch_drafts)  # several greedy kernels: hint or format candidates
    if hints:
        with timed(seconds, "hint"):
            return tagged(hint_diverse(model, tok, structure, pb.op, pb.dtype, pb.n, hints, config=together,
                                       references=references), "hint")
    with timed(seconds, "greedy"):
        rs = tagged(generate(model, tok, structure, pb.op, pb.dtype, pb.n, k=1, config=greedy,
                             references=references), "greedy")
    if cfg.raft_explore == "branches":
        return rs + _branch_candidates(model, tok, structure, pb, references, cfg, together, rs[0], seconds, screen)
    n_formats = {"temperature": 0, "formats": cfg.k - 1, "mixed": (cfg.k - 1) // 2}[cfg.raft_explore]
    if n_formats > 0:
        if formats is None:
            from sparserl_compile.policy.provider import plausible_formats

            formats = plausible_formats(pb.matrix.indptr, pb.matrix.indices, pb.matrix.shape)
        # the most likely format is the greedy kernel's own: ask for one more, and drop repeats;
        # with drafts, the greedy kernel drafts that repeat first
        drafts = [rs[0].text] + list(references) if references else None
        with timed(seconds, "format"):
            forced = format_diverse(model, tok, structure, pb.op, pb.dtype, pb.n, n_formats + 1, formats,
                                    config=together, references=drafts)
        rs += tagged([r for r in forced if r.text != rs[0].text][:n_formats], "format")
    if cfg.k - 1 - n_formats > 0:
        # untraced: RAFT's loss needs no log-probabilities or masks, and untraced speculative
        # sampling computes a grammar mask only where an unmasked draw is rejected
        sampled = DecodeConfig(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                               constrained=cfg.constrained, seed=seed, trace=False, batch_drafts=cfg.batch_drafts)
        with timed(seconds, "sample"):  # speculative decoding writes its samples one at a time unless batch_drafts
            rs += tagged(generate(model, tok, structure, pb.op, pb.dtype, pb.n, k=cfg.k - 1 - n_formats,
                                  config=sampled, references=references if cfg.sample_drafts else None),
                         "sample")
    return rs


def _branch_candidates(model, tok, structure, pb, references, cfg, config, greedy, seconds: dict, screen) -> list:
    """``raft_candidates``' departures from the greedy rollout (``--raft-explore branches``),
    through the screen where there is one; the screen's seconds are their own part."""
    bound = screen and screen.checker(pb.matrix.indptr, pb.matrix.indices, pb.matrix.shape, pb.op, pb.dtype, pb.n)

    def check(texts):
        with timed(seconds, "screen"):
            return bound(texts)

    before = seconds.get("screen", 0.0)
    with timed(seconds, "branch"):
        rs = tagged(branch_diverse(model, tok, structure, pb.op, pb.dtype, pb.n, cfg.k, config=config,
                                   references=references, greedy=greedy,
                                   screen=check if screen is not None else None)[1:], "branch")
    seconds["branch"] -= seconds.get("screen", 0.0) - before
    return rs


def tagged(rolls: list, origin: str) -> list:
    """``rolls`` with ``extra["origin"]`` set (greedy, format, sample, branch or hint): the log names where
    a switched target came from."""
    for r in rolls:
        r.extra["origin"] = origin
    return rolls


def collect_target(buffer: RaftBuffer, tok, structure, rolls, outcomes, scores: list, margin: float, rec: dict,
                   name: str = "", speed: bool = True) -> None:
    """Add one problem's target to the buffer (``pick_target``: the greedy prompt, the first
    hint's for a hinted policy, with the chosen candidate's kernel; ``speed=False``: the
    correctness-only control), the first and best of its rewards (``scores``) to ``rec``, and
    ``name`` to its switched problems when the target is not the first kernel, with the gain and
    the origin of its new target (``tagged``: a format or a temperature sample, say)."""
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


def new_record() -> dict:
    """An update's RAFT record, filled by ``collect_target`` and summed up by ``raft_step``."""
    return {"new": 0, "switched": 0, "first": [], "best": [], "switched_problems": []}


def raft_step(model, optim, buffer: RaftBuffer, rec: dict, rewards: list, cfg, step: int, pad_id: int,
              device, anchors: list) -> dict:
    """One RAFT update (``raft_update``) with ``cfg``'s settings, and its logged record."""
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
