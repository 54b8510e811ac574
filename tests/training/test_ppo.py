"""PPO and GRPO updates on the tiny policy (TRL-style checks): the update moves the parameters,
its loss is finite, and the logged clip fraction, entropy and novel-kernel rate are measured."""

from __future__ import annotations

import math

import pytest
import torch

from policy_fixtures import banded_structure
from sparserl_compile.policy.decode import generate
from sparserl_compile.policy.sampling import DecodeConfig
from sparserl_compile.training.ppo import PPOConfig, make_batch, ppo_update


def _rollouts(model, tok, k=6, constrained=True):
    s = banded_structure()
    rs = generate(model, tok, s, "spmv", "f32", 1, k=k,
                  config=DecodeConfig(temperature=1.0, max_new_tokens=24, constrained=constrained, seed=3))
    return rs, [s] * len(rs)


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_an_update_moves_the_parameters_with_finite_loss_clipping_and_entropy(tiny_model, tiny_tok, algo):
    import copy

    ref = copy.deepcopy(tiny_model).eval()
    rs, sts = _rollouts(tiny_model, tiny_tok)
    batch = make_batch(rs, sts, [0] * len(rs), tiny_tok.pad_token_id)
    rewards = [float(i % 3) for i in range(len(rs))]  # unequal: a non-zero advantage
    before = [p.detach().clone() for p in tiny_model.parameters()]
    opt = torch.optim.AdamW(tiny_model.parameters(), lr=3e-2)
    st = ppo_update(tiny_model, ref, opt, batch, rewards, PPOConfig(algo=algo, epochs=4))
    changed = sum(not torch.equal(b, p) for b, p in zip(before, tiny_model.parameters()))
    assert changed > 0
    for name in ("loss", "policy_loss", "value_loss", "kl", "entropy", "clip_frac"):
        assert math.isfinite(getattr(st, name)), name
    assert st.clip_frac > 0.0  # four epochs at a large step leave the trust region somewhere
    assert st.entropy > 0.0  # an untrained policy is far from certain
    # the KL is measured on the rollout before the update, when the policy is still the reference
    assert st.kl == pytest.approx(0.0, abs=1e-5) and st.mean_reward == pytest.approx(sum(rewards) / len(rewards))


def test_rl_logs_clip_fraction_entropy_and_novel_rate_per_update(tmp_path, tiny_tok, n_features):
    from sparserl_compile.matrices import banded
    from sparserl_compile.policy.model import PolicyHParams, build_policy, save_policy
    from sparserl_compile.training.checkpoint import STATE_FILE
    from sparserl_compile.training.rewards import KernelOutcome, RLProblem
    from sparserl_compile.training.rl import RLConfig, rl

    init = tmp_path / "init"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=1), tiny_tok, init)
    cfg = RLConfig(init=str(init), out_dir=str(tmp_path / "rl"), steps=3, problems_per_step=1, k=4,
                   max_new_tokens=16, lr=3e-2, save_every=3)
    logs = []

    def all_correct(problem, sources):
        return [KernelOutcome(True, True, True) for _ in sources]

    r = rl(cfg, problems=[RLProblem(banded(48, 2), "spmv", "f32", 1)], evaluator=all_correct,
           reward_fn=lambda o: 1.0, log=logs.append)
    assert len(r.stats) == 3
    for rec in r.stats:
        assert {"clip_frac", "entropy", "kl", "mean_reward", "novel_rate", "novel_text_rate"} <= set(rec)
        # an untrained policy's 16 tokens are no kernel-space point, and every one is "correct" here
        assert rec["novel_rate"] == rec["novel_text_rate"] == 1.0
        assert rec["entropy"] > 0.0
    assert any(rec["clip_frac"] > 0.0 for rec in r.stats[1:])
    assert any(" clip " in m and " novel " in m for m in logs)
    import json

    log = json.loads((tmp_path / "rl" / STATE_FILE).read_text())["log"]
    assert len(log) == 3 and all("novel_rate" in p and "clip_frac" in p for p in log)
