"""The three stages under ``torchrun --nproc-per-node 2`` (gloo, CPU) against one process.

One launch (``python -m torch.distributed.run --standalone --nproc-per-node 2`` on this file)
runs, on each rank: pretraining (4 steps, then resumed to 6), SFT (targets of unequal token
counts, so a plain per-shard mean would differ from the global mean), RL (PPO, 2 problems per
step, one per rank) and a time-budget-capped pretraining. The same sequence runs again in the
test process without a launch; the checkpoints must agree. Each rank reports its results and
the checkpoint writes it made (``save_state`` is wrapped) as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-5
QUIET = lambda *a, **k: None  # noqa: E731


def _texts():
    from policy_fixtures import CSR_SCALAR

    return [CSR_SCALAR.replace("256", str(b)) for b in (32, 64, 128, 256, 512, 1024)] * 5


def _render(family, op, dtype, params, structure):
    from policy_fixtures import CSR_SCALAR

    # targets of different lengths: the ranks' shards hold unequal token counts
    return CSR_SCALAR.replace("256", str(params["block"])) + "// " + " ".join(map(str, range(params["block"] // 16)))


class _EvenLength:
    """A stand-in evaluator (as ``_PrefersDia`` in test_stages.py): samples of even length count
    as correct, so the rewards of a step vary and the advantages are not all zero."""

    def __call__(self, problem, sources):
        from sparserl_compile.training.rewards import KernelOutcome

        return [KernelOutcome(True, True, len(s) % 2 == 0) for s in sources]


def _reward(o):
    return 1.0 if o.correct else 0.0


def write_inputs(base: Path) -> None:
    """The SFT/RL starting checkpoint and the supervision file (the test process writes them)."""
    from sparserl_compile.policy.model import PolicyHParams, build_policy, save_policy
    from sparserl_compile.policy.tokenizer import TokenizerSpec, train_tokenizer
    from policy_fixtures import CSR_SCALAR, structure_dependent_supervision
    from sparserl_compile.training.pretrain import hparams_for

    tok = train_tokenizer([CSR_SCALAR] * 10, TokenizerSpec(vocab_size=400))
    n_feat = hparams_for("tiny", 400).n_features
    save_policy(build_policy(PolicyHParams.tiny(len(tok), n_feat), seed=1), tok, base / "init")
    lines = structure_dependent_supervision()
    (base / "sup.jsonl").write_text("\n".join(json.dumps(x) for x in lines))


def run_stages(base: Path, tag: str) -> dict:
    """Pretrain (4 steps, resumed to 6), SFT, RL and a budget-capped pretrain into ``base/tag``."""
    import sparserl_compile.training.checkpoint as ck
    from sparserl_compile.matrices import banded
    from sparserl_compile.training.pretrain import PretrainConfig, pretrain
    from sparserl_compile.training.rewards import RLProblem
    from sparserl_compile.training.rl import RLConfig, rl
    from sparserl_compile.training.sft import SFTConfig, sft

    saves = []
    orig = ck.save_state

    def recording_save(directory, *a, **k):
        saves.append(Path(directory).name)
        return orig(directory, *a, **k)

    ck.save_state = recording_save
    out = base / tag
    res = {}
    try:
        pc = PretrainConfig.tiny(str(out / "pt"))
        pc.steps, pc.batch_size, pc.block_size, pc.save_every, pc.device = 4, 4, 64, 2, "cpu"
        r = pretrain(pc, texts=_texts(), log=QUIET)
        pc.steps = 6
        r2 = pretrain(pc, texts=_texts(), log=QUIET)
        res["pretrain"] = [r.step, r2.start_step, r2.step, r.losses + r2.losses]

        sc = SFTConfig.tiny(str(base / "init"), str(base / "sup.jsonl"), str(out / "sft"))
        sc.steps, sc.batch_size, sc.save_every, sc.device = 4, 4, 2, "cpu"
        r = sft(sc, render=_render, log=QUIET)
        res["sft"] = [r.step, r.losses, r.eval_loss]

        rc = RLConfig(init=str(base / "init"), out_dir=str(out / "rl"), steps=3, problems_per_step=2, k=4,
                      max_new_tokens=12, lr=3e-3, algo="ppo", save_every=2, kl_coef=0.01, device="cpu")
        probs = [RLProblem(banded(48, 2), "spmv", "f32", 1), RLProblem(banded(40, 1), "spmv", "f32", 1),
                 RLProblem(banded(56, 3), "spmv", "f32", 1)]
        r = rl(rc, problems=probs, evaluator=_EvenLength(), reward_fn=_reward, log=QUIET)
        res["rl"] = [r.step, r.mean_rewards, [s["kl"] for s in r.stats]]

        bc = PretrainConfig.tiny(str(out / "budget"))
        bc.steps, bc.batch_size, bc.block_size, bc.device = 100_000, 2, 32, "cpu"
        bc.time_budget_s, bc.save_every = 1.0, 100_000
        res["budget"] = pretrain(bc, texts=_texts(), log=QUIET).step
    finally:
        ck.save_state = orig
    res["saves"] = saves
    return res


def _params(d: Path) -> dict[str, torch.Tensor]:
    from sparserl_compile.policy.model import load_policy

    return load_policy(d)[0].state_dict()


def _max_diff(a: Path, b: Path) -> float:
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    return max(float((pa[k] - pb[k]).abs().max()) for k in pa)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ddp")
    write_inputs(base)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           __file__, str(base)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    ranks = [json.loads((base / f"rank{r}.json").read_text()) for r in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks ran one thread each: the same reduction order where it matters
    try:
        one = run_stages(base, "one")
    finally:
        torch.set_num_threads(threads)
    return base, ranks, one


@pytest.mark.slow
def test_pretrain_two_ranks_match_one_process_and_resume(runs):
    base, (r0, r1), one = runs
    assert r0["pretrain"][:3] == r1["pretrain"][:3] == one["pretrain"][:3] == [4, 4, 6]
    assert r0["pretrain"][3] == pytest.approx(one["pretrain"][3], abs=1e-4)  # global mean losses
    assert _max_diff(base / "ddp" / "pt", base / "one" / "pt") < ATOL
    assert r1["saves"] == [] and r0["saves"].count("pt") == 3  # steps 2, 4 (first run) and 6


@pytest.mark.slow
def test_sft_two_ranks_match_one_process_with_unequal_token_counts(runs):
    base, (r0, r1), one = runs
    assert r0["sft"][0] == r1["sft"][0] == 4
    assert r0["sft"][1] == pytest.approx(one["sft"][1], abs=1e-4)
    assert r0["sft"][2] == pytest.approx(one["sft"][2], abs=1e-4)  # held-out loss split over ranks
    assert _max_diff(base / "ddp" / "sft", base / "one" / "sft") < ATOL
    assert r0["saves"].count("sft") == 2 and "sft" not in r1["saves"]


@pytest.mark.slow
def test_rl_two_ranks_shard_problems_only_rank0_saves(runs):
    base, (r0, r1), one = runs
    assert r0["rl"][0] == r1["rl"][0] == 3
    assert r0["rl"][1] == r1["rl"][1] == pytest.approx(one["rl"][1])  # global mean reward, same samples
    assert r0["saves"].count("rl") == 2 and r1["saves"] == []
    before, after = _params(base / "init"), _params(base / "ddp" / "rl")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert _max_diff(base / "ddp" / "rl", base / "one" / "rl") < ATOL


@pytest.mark.slow
def test_time_budget_cap_is_agreed_across_ranks(runs):
    _, (r0, r1), _ = runs
    assert r0["budget"] == r1["budget"] and 5 <= r0["budget"] < 100_000


def test_batch_not_divisible_by_world_size_is_a_clear_error():
    from sparserl_compile.training.dist import DistContext, shard

    with pytest.raises(ValueError, match="multiple of the world size"):
        shard(list(range(5)), DistContext(rank=0, world_size=2), "sequences per step")
    assert shard(list(range(6)), DistContext(rank=1, world_size=2)) == [3, 4, 5]


if __name__ == "__main__":  # one rank of the launch in the `runs` fixture
    from sparserl_compile.training import dist as tdist

    base = Path(sys.argv[1])
    result = run_stages(base, "ddp")
    (base / f"rank{tdist.rank()}.json").write_text(json.dumps(result))
    tdist.cleanup()
