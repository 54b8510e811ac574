"""Reward-ranked fine-tuning: stage 3's ``--algo raft``.

Why a third algorithm beside PPO and GRPO: both learn from the reward differences between the
samples of one prompt. The retrieval policies copy their hint almost deterministically
(entropy ~0.001 nats per token after SFT), so k temperature samples of one prompt are one
kernel, their advantages are zero and the update moves nothing (docs/training.md, "Known
gaps"). Hotter sampling was tried (T = 1.5): the extra samples mostly failed or were slow.

RAFT explores across evidence instead of across tokens. A problem's k candidates are the
policy's own greedy kernels for its k nearest retrieval hints (``decode.hint_diverse``, the
candidates the runtime's policy provider draws), each compiled, verified and timed by the
evaluator. The fastest correct one becomes the target of the *first* hint's prompt (the one
greedy decoding and the provider's first candidate use) when it beats that prompt's own kernel
by more than ``margin`` (timing noise); otherwise that kernel is its own target, an anchor that
keeps the policy where it already chose well. Every update then takes a few causal-LM steps on
batches drawn from all targets collected so far (a replay buffer), mixed with examples of the
SFT stage (``--raft-anchor``: every hint of the SFT recipe, so prompts other than the first keep
their meaning; without them a first run forgot how to read hints, docs/training-history.md). The
policy so distils its
best of k into its first kernel, on structures the supervision never measured when the
problems are unlabelled (``--unlabelled``), rewarded by real timings.

A policy trained without hints has no hints to explore across. Its candidates are its greedy
kernel and k - 1 temperature samples of the same prompt (``rl._raft_candidates``), and the
same rule picks the target. On the structure-only default checkpoint this raised the held-out
greedy kernel from 0.843 to 0.864 of the space best, all of it on one circuit matrix
(docs/training-history.md, "The default checkpoint, version 2"), and with structures derived from the
shared social and GNN matrices to 0.890 (version 3).

This is reward-ranked fine-tuning (Dong et al. 2023, "RAFT"), a form of expert iteration
(Anthony et al. 2017) and of ReST (Gulcehre et al. 2023): policy improvement by best-of-k
under the reward, then imitation. No library implements it over our structure-prefixed model
and evaluators, and it is a few dozen lines on top of the SFT loss (``training/lm.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from sparserl_compile.training.lm import LMExample, collate, lm_loss


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
