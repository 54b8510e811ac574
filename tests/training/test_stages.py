"""The three stages on tiny configs: losses fall, parameters change, runs resume."""

import dataclasses
import json

import pytest
import torch

from policy_fixtures import CSR_SCALAR, structure_dependent_supervision
from sparserl_compile.policy.model import PolicyHParams, build_policy, load_policy, save_policy
from sparserl_compile.training.pretrain import PretrainConfig, pretrain
from sparserl_compile.training.rewards import KernelOutcome, RLProblem
from sparserl_compile.training.rl import RLConfig, rl
from sparserl_compile.training.sft import SFTConfig, sft
from sparserl_compile.matrices import banded

QUIET = lambda *a: None  # noqa: E731


def test_pretrain_loss_falls_and_resumes(tmp_path):
    cfg = PretrainConfig.tiny(str(tmp_path / "pt"))
    texts = [CSR_SCALAR.replace("256", str(b)) for b in (32, 64, 128, 256, 512, 1024)] * 5
    r = pretrain(cfg, texts=texts, log=QUIET)
    assert r.step == 30 and sum(r.losses[-5:]) / 5 < sum(r.losses[:5]) / 5 - 0.5
    state = json.loads((tmp_path / "pt" / "trainer_state.json").read_text())
    assert state["step"] == 30 and state["stage"] == "pretrain"
    cfg.steps = 34
    r2 = pretrain(cfg, texts=texts, log=QUIET)
    assert (r2.start_step, r2.step, len(r2.losses)) == (30, 34, 4)


def test_time_budget_caps_the_steps_and_the_schedule(tmp_path):
    cfg = PretrainConfig.tiny(str(tmp_path / "pt"))
    cfg.steps, cfg.time_budget_s, cfg.save_every = 100_000, 2.0, 100_000
    texts = [CSR_SCALAR] * 10
    logs = []
    r = pretrain(cfg, texts=texts, log=logs.append)
    assert 5 <= r.step < 100_000 and len(r.losses) == r.step  # capped, and it ran to the cap
    state = json.loads((tmp_path / "pt" / "trainer_state.json").read_text())
    assert state["step"] == r.step  # the capped end is saved even though save_every is larger
    cap = [e for e in state["log"] if "capped_steps" in e]
    assert cap and cap[0]["capped_steps"] == r.step and cap[0]["requested_steps"] == 100_000
    assert any("budget caps" in m for m in logs)
    if r.step > 20:  # past the 10 warm-up steps (a loaded machine may cap the run inside them)
        assert state["log"][-1]["lr"] < cfg.lr * 0.1  # the cosine schedule ended at the cap


def _render(family, op, dtype, params, structure):
    return CSR_SCALAR.replace("256", str(params["block"]))


def test_sft_learns_structure_dependent_targets(tmp_path, tiny_tok, n_features):
    init = tmp_path / "init"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features)), tiny_tok, init)
    lines = structure_dependent_supervision()
    data = tmp_path / "sup.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in lines))
    before = {k: v.clone() for k, v in load_policy(init)[0].state_dict().items()}
    r = sft(SFTConfig.tiny(str(init), str(data), str(tmp_path / "sft")), render=_render, log=QUIET)
    assert sum(r.losses[-5:]) / 5 < sum(r.losses[:5]) / 5 * 0.6
    assert r.eval_loss is not None and r.eval_loss < r.losses[0]  # held-out records were evaluated
    after = load_policy(tmp_path / "sft")[0].state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_sft_no_sinusoidal_ablation_replaces_the_encoder_and_trains(tmp_path, tiny_tok, n_features):
    init = tmp_path / "init"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features)), tiny_tok, init)
    data = tmp_path / "sup.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in structure_dependent_supervision()))
    cfg = SFTConfig.tiny(str(init), str(data), str(tmp_path / "nosin"))
    cfg.sinusoidal = False
    logs = []
    r = sft(cfg, render=_render, log=logs.append)
    assert any("no sinusoidal" in m for m in logs)
    assert sum(r.losses[-5:]) / 5 < sum(r.losses[:5]) / 5 * 0.6
    model = load_policy(tmp_path / "nosin")[0]
    assert model.config.sinusoidal is False and not model.encoder.use_sin
    assert model.encoder.point_mlp[0].weight.shape[1] == 4  # the four raw coordinates in


def test_sft_reset_point_mlp_control_keeps_the_embedding_and_is_seeded(tmp_path, tiny_tok, n_features):
    # the no-sinusoidal ablation's control: the point MLP starts afresh, the sinusoidal input kept
    init = tmp_path / "init"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features)), tiny_tok, init)
    start = load_policy(init)[0].encoder.point_mlp[0].weight.clone()
    data = tmp_path / "sup.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in structure_dependent_supervision()))
    fresh = []
    for name in ("a", "b"):
        cfg = SFTConfig.tiny(str(init), str(data), str(tmp_path / name))
        cfg.reset_point_mlp, cfg.steps = True, 1
        logs = []
        sft(cfg, render=_render, log=logs.append)
        assert any("point MLP starts afresh (sinusoidal embedding kept)" in m for m in logs)
        model = load_policy(tmp_path / name)[0]
        assert model.config.sinusoidal is True and model.encoder.use_sin
        w = model.encoder.point_mlp[0].weight
        assert w.shape == start.shape  # still the sinusoidal banks in
        fresh.append(w)
    assert not torch.allclose(fresh[0], start, atol=1e-3)  # not the init's MLP, even after one step
    assert torch.equal(fresh[0], fresh[1])  # the same seed draws the same fresh MLP


class _PrefersDia:
    """A reward evaluator for the test: only samples choosing the DIA format are 'correct'."""

    def __call__(self, problem, sources):
        return [KernelOutcome(True, True, "format=dia " in s) for s in sources]


def _rl_run(tmp_path, tiny_tok, n_features, algo, batch_drafts=False):
    init = tmp_path / "init"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=1), tiny_tok, init)
    cfg = RLConfig(init=str(init), out_dir=str(tmp_path / algo), steps=10, problems_per_step=1, k=8,
                   max_new_tokens=16, lr=3e-3, algo=algo, save_every=5, kl_coef=0.01, batch_drafts=batch_drafts)
    probs = [RLProblem(banded(48, 2), "spmv", "f32", 1)]
    return cfg, rl(cfg, problems=probs, evaluator=_PrefersDia(),
                   reward_fn=lambda o: 1.0 if o.correct else 0.0, log=QUIET), probs


def test_grpo_raises_the_reward(tmp_path, tiny_tok, n_features):
    cfg, r, probs = _rl_run(tmp_path, tiny_tok, n_features, "grpo")
    assert sum(r.mean_rewards[-3:]) / 3 > sum(r.mean_rewards[:3]) / 3 + 0.2
    cfg.steps = 11
    r2 = rl(cfg, problems=probs, evaluator=_PrefersDia(), reward_fn=lambda o: float(o.correct), log=QUIET)
    assert (r2.start_step, r2.step) == (10, 11)


class _Closable(_PrefersDia):
    closed = 0

    def close(self):
        self.closed += 1


def test_rl_closes_its_evaluator_when_the_run_ends_and_when_it_raises(tmp_path, tiny_tok, n_features):
    init = tmp_path / "init"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=1), tiny_tok, init)
    cfg = RLConfig(init=str(init), out_dir=str(tmp_path / "rl"), steps=1, problems_per_step=1, k=2,
                   max_new_tokens=8, algo="grpo", save_every=1)
    probs = [RLProblem(banded(48, 2), "spmv", "f32", 1)]
    ev = _Closable()
    rl(cfg, problems=probs, evaluator=ev, reward_fn=lambda o: float(o.correct), log=QUIET)
    assert ev.closed == 1

    def broken(outcome):
        raise RuntimeError("reward failed")

    ev = _Closable()
    with pytest.raises(RuntimeError, match="reward failed"):
        rl(dataclasses.replace(cfg, out_dir=str(tmp_path / "rl2")), problems=probs, evaluator=ev,
           reward_fn=broken, log=QUIET)
    assert ev.closed == 1  # the sandbox workers stop with the run that raised


def test_rl_average_from_keeps_the_mean_of_the_updates_weights_across_a_resume(tmp_path, tiny_tok, n_features):
    """--average-from 2: after update 2 the average is update 2's weights; resumed to update 3,
    it is the mean of updates 2 and 3 (each read back from the run's own checkpoints)."""
    init = tmp_path / "init"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=1), tiny_tok, init)
    out = tmp_path / "avg"
    cfg = RLConfig(init=str(init), out_dir=str(out), steps=2, problems_per_step=1, k=4, max_new_tokens=16,
                   lr=3e-3, algo="grpo", save_every=1, kl_coef=0.01, average_from=2)
    probs = [RLProblem(banded(48, 2), "spmv", "f32", 1)]
    logs = []
    run = lambda c: rl(c, problems=probs, evaluator=_PrefersDia(), reward_fn=lambda o: float(o.correct),  # noqa: E731
                       log=logs.append)
    run(cfg)
    w2 = load_policy(out)[0].state_dict()
    avg = load_policy(out / "average")[0].state_dict()
    assert all(torch.equal(avg[k], w2[k]) for k in w2)  # one update averaged: itself
    assert json.loads((out / "average" / "average.json").read_text()) == {"from_update": 2, "updates": 1,
                                                                           "last_update": 2}
    run(dataclasses.replace(cfg, steps=3))
    w3 = load_policy(out)[0].state_dict()
    avg = load_policy(out / "average")[0].state_dict()
    assert any(not torch.equal(w2[k], w3[k]) for k in w2)  # the third update moved the weights
    assert all(torch.allclose(avg[k], (w2[k] + w3[k]) / 2, atol=1e-6) for k in w2)
    assert any("average of updates 2-3 (2) saved" in m for m in logs)
    (out / "average" / "average.json").unlink()  # a run at update 3 without its average cannot resume it
    with pytest.raises(ValueError, match="holds no average of updates 2-3"):
        run(dataclasses.replace(cfg, steps=4))
    with pytest.raises(ValueError, match="1 or later"):
        run(dataclasses.replace(cfg, out_dir=str(tmp_path / "neg"), average_from=-1))


def test_rl_refuses_to_resume_a_run_started_with_other_settings(tmp_path, tiny_tok, n_features):
    """A second run pointed at a left-over folder must not continue the first one silently."""
    init = tmp_path / "init"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=1), tiny_tok, init)
    cfg = RLConfig(init=str(init), out_dir=str(tmp_path / "rl"), steps=1, problems_per_step=1, k=2,
                   max_new_tokens=8, algo="grpo", seed=1, speculative=False)
    probs = [RLProblem(banded(48, 2), "spmv", "f32", 1)]
    run = lambda c: rl(c, problems=probs, evaluator=_PrefersDia(), reward_fn=lambda o: float(o.correct),  # noqa: E731
                       log=QUIET)
    run(cfg)
    saved = (tmp_path / "rl" / "rl_config.json").read_text()
    with pytest.raises(ValueError, match=r"other settings \(--reward 'hierarchical' -> 'correctness'; --seed 1 -> 3\)"
                                         r".*new --out-dir"):
        run(dataclasses.replace(cfg, seed=3, reward="correctness"))
    assert (tmp_path / "rl" / "rl_config.json").read_text() == saved  # the first run's record is kept
    # longer, and verifying and sampling another way (same outcomes and distribution): a resume
    r = run(dataclasses.replace(cfg, steps=2, time_budget_s=100.0, workers=4, parallel_verify=False,
                                sample_drafts=False))
    assert (r.start_step, r.step) == (1, 2)


def test_pretrain_refuses_to_resume_with_another_learning_rate(tmp_path):
    cfg = PretrainConfig.tiny(str(tmp_path / "pt"))
    cfg.steps = 2
    texts = [CSR_SCALAR] * 4
    pretrain(cfg, texts=texts, log=QUIET)
    with pytest.raises(ValueError, match="holds a 'sparserl train pretrain' run started with other settings .*--lr"):
        pretrain(dataclasses.replace(cfg, lr=cfg.lr * 2), texts=texts, log=QUIET)


@pytest.mark.parametrize("batch_drafts", [False, True])
def test_ppo_raises_the_reward_and_starts_at_ratio_one(tmp_path, tiny_tok, n_features, batch_drafts):
    """Also with the rollouts decoded speculatively in one batch (--batch-drafts): PPO scores the
    samples again under the grammar masks the batch recorded for each of them."""
    _, r, _ = _rl_run(tmp_path, tiny_tok, n_features, "ppo", batch_drafts=batch_drafts)
    assert r.stats[0]["kl"] == 0.0 or abs(r.stats[0]["kl"]) < 1e-4  # same model as the reference
    assert sum(r.mean_rewards[-3:]) / 3 > sum(r.mean_rewards[:3]) / 3 + 0.2


def test_rl_max_nnz_filters_the_training_problems(tmp_path, tiny_tok, n_features):
    import pytest

    init = tmp_path / "init"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features)), tiny_tok, init)
    data = tmp_path / "sup.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in structure_dependent_supervision()))
    cfg = RLConfig(init=str(init), data=str(data), out_dir=str(tmp_path / "rl"), steps=1, k=2,
                   max_new_tokens=8, max_nnz=1, evaluator="header")
    with pytest.raises(ValueError, match="max-nnz 1 left none"):
        rl(cfg, log=QUIET)


@pytest.mark.parametrize("mix", ["", "banded=1,block_diagonal=2"])
def test_rl_on_unlabelled_problems_only(tmp_path, tiny_tok, n_features, mix):
    init = tmp_path / "init"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features)), tiny_tok, init)
    data = tmp_path / "sup.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in structure_dependent_supervision()))
    cfg = RLConfig(init=str(init), data=str(data), out_dir=str(tmp_path / "rl"), steps=1, k=2, problems_per_step=2,
                   max_new_tokens=8, max_nnz=20_000, evaluator="header", labelled=False, unlabelled=2,
                   unlabelled_mix=mix, speculative=False)
    r = rl(cfg, log=QUIET)
    assert r.step == 1 and len(r.mean_rewards) == 1
    with pytest.raises(ValueError, match="unlabelled mix entry 'stencil9=1'"):
        rl(dataclasses.replace(cfg, out_dir=str(tmp_path / "bad"), unlabelled_mix="rmat=1,stencil9=1"), log=QUIET)
    for bad in ("32,x", "1", ""):
        with pytest.raises(ValueError, match="--unlabelled-spmm-n"):
            rl(dataclasses.replace(cfg, out_dir=str(tmp_path / "bad"), unlabelled_spmm_n=bad), log=QUIET)


def test_sft_rejects_hints_without_retrieval(tmp_path):
    for bad in (SFTConfig(out_dir=str(tmp_path), hints=4), SFTConfig(out_dir=str(tmp_path), hints=0, retrieval=True)):
        with pytest.raises(ValueError, match="--hints"):
            sft(bad)


def test_sft_held_out_loss_skips_held_out_matrices_absent_from_a_trimmed_folder(tmp_path, tiny_tok, n_features,
                                                                                   monkeypatch):
    """A device carry may hold only the matrices that training reads: SFT then trains, and its
    held-out loss covers the held-out records whose matrix is there, saying which are absent."""
    folder = tmp_path / "matrices"
    folder.mkdir()
    (folder / "MANIFEST.json").write_text(json.dumps([{"name": "uk", "file": "uk.npz", "kind": "road_planar",
                                                       "n_rows": 8, "n_cols": 8, "nnz": 8}]))
    monkeypatch.setenv("SPARSERL_SHARED_MATRICES", str(folder))
    init = tmp_path / "init"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features)), tiny_tok, init)
    lines = structure_dependent_supervision()
    absent = {**lines[0], "matrix": {"source": "shared", "name": "uk"}}  # held out by the frozen list
    data = tmp_path / "sup.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in [*lines, absent]))
    logs = []
    cfg = dataclasses.replace(SFTConfig.tiny(str(init), str(data), str(tmp_path / "sft")), steps=2)
    r = sft(cfg, render=_render, log=logs.append)
    assert r.step == 2
    assert any("held-out records: 1 shared matrices absent (uk)" in m for m in logs), logs
