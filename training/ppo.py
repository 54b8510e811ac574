"""A compact PPO (and GRPO) for the policy: rollout batches, masked log-probabilities, GAE,
the clipped objective and the KL penalty to the frozen SFT model.

Why our own: the policy reads an ``inputs_embeds`` structure prefix and samples under grammar
masks, and the loss must see the same masks. ``token_logprobs`` therefore rebuilds the exact
sampling distribution of the rollout: logits at the action positions, disallowed tokens set to
-inf from the rollout's packed llguidance bitmasks (``Rollout.masks``), divided by the rollout
temperature, log-softmax. The reference (SFT) model is scored under the same masks, so the KL
is between two distributions over the tokens the grammar allowed.

PPO: per-token reward = -kl_coef * (logp - logp_ref), plus the sample's reward on its last
token; GAE(gamma, lam) over the value head; advantages whitened over the batch; clipped
policy ratio and clipped value loss. GRPO (``algo="grpo"``): no value loss; the advantage of
every token of a sample is its reward standardized within its group (the k samples of one
matrix), and the KL (k3 estimator) is a loss term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparserl_compile.policy.masks import unpack_masks
from sparserl_compile.policy.sampling import Rollout
from sparserl_compile.policy.encoder import PreparedStructure, StructureBatch


@dataclass(frozen=True)
class PPOConfig:
    algo: str = "ppo"  # "ppo" or "grpo"
    clip: float = 0.2  # policy ratio clip
    value_clip: float = 0.2  # value prediction clip (PPO)
    vf_coef: float = 0.5  # value loss weight (PPO)
    kl_coef: float = 0.05  # KL to the reference model
    entropy_coef: float = 0.0  # entropy bonus
    gamma: float = 1.0  # discount
    lam: float = 0.95  # GAE lambda
    epochs: int = 2  # optimization passes over each rollout batch
    temperature: float = 1.0  # must equal the rollout's sampling temperature
    max_grad_norm: float = 1.0


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # (B, L) prompt + actions, right-padded
    attention_mask: torch.Tensor  # (B, L)
    positions: torch.Tensor  # (B, A) index of the logit that predicts action t
    actions: torch.Tensor  # (B, A)
    action_mask: torch.Tensor  # (B, A) bool, True for real actions
    allowed: torch.Tensor | None  # (B, A, W) packed int32 bitmasks, or None (unconstrained)
    structure: StructureBatch
    groups: torch.Tensor  # (B,) group id (samples of the same problem)

    def to(self, device) -> "RolloutBatch":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return RolloutBatch(mv(self.input_ids), mv(self.attention_mask), mv(self.positions), mv(self.actions),
                            mv(self.action_mask), mv(self.allowed), self.structure.to(device), mv(self.groups))


def make_batch(rollouts: list[Rollout], structures: list[PreparedStructure], groups: list[int],
               pad_id: int) -> RolloutBatch:
    B = len(rollouts)
    L = max(len(r.prompt_ids) + len(r.tokens) for r in rollouts)
    A = max(1, max(len(r.tokens) for r in rollouts))
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    att = torch.zeros((B, L), dtype=torch.long)
    pos = torch.zeros((B, A), dtype=torch.long)
    act = torch.full((B, A), pad_id, dtype=torch.long)
    amask = torch.zeros((B, A), dtype=torch.bool)
    constrained = all(r.masks is not None for r in rollouts if r.tokens)
    W = next((r.masks.shape[-1] for r in rollouts if r.masks is not None), 0)
    allowed = torch.full((B, A, W), -1, dtype=torch.int32) if constrained and W else None
    for i, r in enumerate(rollouts):
        P, n = len(r.prompt_ids), len(r.tokens)
        seq = r.prompt_ids + r.tokens
        ids[i, : len(seq)] = torch.tensor(seq)
        att[i, : len(seq)] = 1
        pos[i] = torch.clamp(torch.arange(A) + P - 1, max=L - 1)
        if n:
            act[i, :n] = torch.tensor(r.tokens)
            amask[i, :n] = True
            if allowed is not None:
                allowed[i, :n] = r.masks
    return RolloutBatch(ids, att, pos, act, amask, allowed, StructureBatch.collate(structures),
                        torch.tensor(groups))


def token_logprobs(model, batch: RolloutBatch, temperature: float = 1.0):
    """(logp of actions, values at actions, entropy) under the rollout's masks; each (B, A)."""
    out = model(batch.input_ids, batch.structure, attention_mask=batch.attention_mask)
    idx = batch.positions
    logits = out.logits.gather(1, idx.unsqueeze(-1).expand(-1, -1, out.logits.shape[-1]))
    if batch.allowed is not None:
        ok = unpack_masks(batch.allowed, logits.shape[-1])
        logits = logits.masked_fill(~ok, float("-inf"))
    logp_all = torch.log_softmax(logits / max(temperature, 1e-5), -1)
    logp = logp_all.gather(-1, batch.actions.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    ent = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    values = out.values.gather(1, idx)
    zero = torch.zeros_like(logp)
    m = batch.action_mask
    return torch.where(m, logp, zero), torch.where(m, values, zero), torch.where(m, ent, zero)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalized advantage estimation over (B, A) right-padded sequences -> (adv, returns)."""
    B, A = rewards.shape
    adv = torch.zeros_like(rewards)
    last = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    zero = torch.zeros_like(last)
    for t in reversed(range(A)):
        nxt = values[:, t + 1] * mask[:, t + 1] if t + 1 < A else zero
        delta = rewards[:, t] + gamma * nxt - values[:, t]
        last = delta + gamma * lam * last * (mask[:, t + 1] if t + 1 < A else zero)
        adv[:, t] = last * mask[:, t]
    return adv, (adv + values) * mask


@dataclass
class PPOStats:
    loss: float
    policy_loss: float
    value_loss: float
    kl: float
    entropy: float
    clip_frac: float
    mean_reward: float


def ppo_update(model, ref_model, optimizer, batch: RolloutBatch, rewards: list[float],
               cfg: PPOConfig = PPOConfig(), ctx=None) -> PPOStats:
    """One PPO/GRPO update on a rollout batch with one scalar reward per sample.

    ``ctx`` (``training.dist.DistContext`` of several ranks): ``batch`` and ``rewards`` are this
    rank's share of the global rollout batch (whole groups: GRPO's group statistics stay
    local). Every masked mean is over the global batch (token counts all-reduced), PPO's
    advantage whitening uses the global moments, each rank's loss is its share of the global
    loss and the gradients are summed over the ranks before clipping, so the update is the one
    process's update on the whole batch (up to float rounding). Stats are global.
    """
    from sparserl_compile.training import dist as tdist

    on = ctx is not None and ctx.distributed

    def gsum(x: torch.Tensor) -> torch.Tensor:
        return tdist.all_reduce_sum(x) if on else x

    m = batch.action_mask.float()
    r = torch.tensor(rewards, dtype=torch.float32, device=batch.input_ids.device)
    M = gsum(m.sum()).clamp(min=1)  # action tokens in the global batch

    def mm(x: torch.Tensor) -> torch.Tensor:  # this rank's share of the global masked mean
        return (x * m).sum() / M

    with torch.no_grad():
        old_lp, old_v, _ = token_logprobs(model, batch, cfg.temperature)
        ref_lp, _, _ = token_logprobs(ref_model, batch, cfg.temperature)
        kl_tok = (old_lp - ref_lp) * m
        last = (batch.action_mask.long().sum(1) - 1).clamp(min=0)
        if cfg.algo == "ppo":
            tok_r = -cfg.kl_coef * kl_tok
            tok_r[torch.arange(len(r), device=r.device), last] += r
            adv, ret = gae(tok_r, old_v, m, cfg.gamma, cfg.lam)
            mu = gsum(mm(adv))
            sd = gsum(mm((adv - mu) ** 2)).sqrt()
            adv = (adv - mu) / (sd + 1e-6) * m
        elif cfg.algo == "grpo":
            adv_s = torch.zeros_like(r)
            for g in batch.groups.unique():
                sel = batch.groups == g
                rg = r[sel]
                adv_s[sel] = (rg - rg.mean()) / (rg.std(unbiased=False) + 1e-6) if sel.sum() > 1 else 0.0
            adv, ret = adv_s[:, None] * m, None
        else:
            raise ValueError(f"algo={cfg.algo!r}: use 'ppo' or 'grpo'")
    model.train()
    for _ in range(cfg.epochs):
        lp, v, ent = token_logprobs(model, batch, cfg.temperature)
        ratio = torch.exp(lp - old_lp)
        pg = -torch.min(ratio * adv, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * adv)
        policy_loss = mm(pg)
        if cfg.algo == "ppo":
            v_clip = old_v + (v - old_v).clamp(-cfg.value_clip, cfg.value_clip)
            value_loss = 0.5 * mm(torch.max((v - ret) ** 2, (v_clip - ret) ** 2))
            kl_loss = torch.zeros((), device=r.device)
        else:
            value_loss = torch.zeros((), device=r.device)
            d = ref_lp - lp
            kl_loss = cfg.kl_coef * mm(torch.exp(d) - d - 1)
        loss = policy_loss + cfg.vf_coef * value_loss + kl_loss - cfg.entropy_coef * mm(ent)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if on:
            tdist.all_reduce_grads(model.parameters(), ctx)  # summed shares: the global loss's gradient
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
    model.eval()
    with torch.no_grad():
        clip_frac = mm(((ratio - 1).abs() > cfg.clip).float())
        n_samples = gsum(torch.tensor(float(len(r)), device=r.device)).clamp(min=1)
        parts = torch.stack([loss.detach(), policy_loss.detach(), value_loss.detach().float(), mm(kl_tok),
                             mm(ent.detach()), clip_frac, r.sum() / n_samples])
        parts = gsum(parts).tolist()
    return PPOStats(*parts)
