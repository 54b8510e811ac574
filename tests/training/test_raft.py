"""Stage 3's reward-ranked fine-tuning (``--algo raft``): which candidate becomes the target,
the replay buffer, and a run that distils the best hint's kernel into the first hint's prompt."""

import json

import numpy as np
import pytest
import torch

from policy_fixtures import structure_dependent_supervision
from sparserl_compile.policy.model import PolicyHParams, build_policy, load_policy, save_policy
from sparserl_compile.matrices import banded
from sparserl_compile.training.lm import LMExample, collate, lm_loss
from sparserl_compile.training.raft import RaftBuffer, pick_target, raft_update
from sparserl_compile.training.rewards import KernelOutcome, RLProblem
from sparserl_compile.training.rl import RLConfig, rl

QUIET = lambda *a: None  # noqa: E731


def _o(correct=True, us=None):
    return KernelOutcome(True, True, correct, us, reference_us=20.0 if us else None)


def test_pick_target_keeps_the_first_kernel_unless_another_is_clearly_faster():
    assert pick_target([_o(us=10.0), _o(us=9.7), _o(us=12.0)], margin=0.05) == 0  # 3 %: noise
    assert pick_target([_o(us=10.0), _o(us=9.0), _o(us=8.0)], margin=0.05) == 2  # the fastest
    assert pick_target([_o(correct=False), _o(us=9.0), _o(us=8.0)]) == 2  # first wrong: the fastest correct
    assert pick_target([_o(correct=False), _o(correct=False)]) is None  # nothing to learn
    assert pick_target([_o(us=10.0), _o(correct=False, us=1.0)]) == 0  # a fast wrong kernel never wins
    assert pick_target([_o(), _o()]) == 0  # untimed (CPU evaluators): the first keeps its place
    assert pick_target([_o(correct=False), _o(), _o()]) == 1  # untimed, first wrong: the first correct


def test_pick_target_without_speed_keeps_any_correct_first_kernel():
    """The correctness-only control: timings never move the target."""
    assert pick_target([_o(us=10.0), _o(us=2.0)], speed=False) == 0  # 5x faster, still the first
    assert pick_target([_o(correct=False), _o(us=9.0), _o(us=8.0)], speed=False) == 1  # first correct, not fastest
    assert pick_target([_o(correct=False), _o(correct=False)], speed=False) is None


def test_buffer_batches_put_this_updates_targets_first():
    ex = [LMExample([i], [i + 100]) for i in range(10)]
    buf = RaftBuffer()
    for i, e in enumerate(ex):
        buf.add(e, switched=i % 2 == 0)
    assert buf.switched == 5
    b = buf.batch(np.random.default_rng(0), 4, newest=2)
    assert b[:2] == ex[8:] and len(b) == 4 and len({id(x) for x in b}) == 4
    assert buf.batch(np.random.default_rng(0), 50) and len(buf.batch(np.random.default_rng(0), 50)) == 10
    with pytest.raises(ValueError, match="buffer is empty"):
        RaftBuffer().batch(np.random.default_rng(0), 4)


def test_raft_update_fits_the_buffer(tiny_tok, n_features):
    model = build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=0)
    buf = RaftBuffer()
    buf.add(LMExample(tiny_tok.encode("spmv f32"), tiny_tok.encode("__global__ void k() {}")), switched=True)
    b = collate(buf.examples, tiny_tok.pad_token_id, 256)
    with torch.no_grad():
        before = float(lm_loss(model, b))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    raft_update(model, opt, buf, np.random.default_rng(0), steps=20, batch_size=1, pad_id=tiny_tok.pad_token_id,
                max_len=256, device="cpu")
    with torch.no_grad():
        assert float(lm_loss(model, b)) < before * 0.5


def test_raft_update_replays_the_anchors(tiny_tok, n_features):
    model = build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=0)
    buf = RaftBuffer()
    buf.add(LMExample(tiny_tok.encode("spmv f32"), tiny_tok.encode("__global__ void k() {}")), switched=False)
    anchor = LMExample(tiny_tok.encode("spmm f32"), tiny_tok.encode("__global__ void other(int n) {}"))
    b = collate([anchor], tiny_tok.pad_token_id, 256)
    with torch.no_grad():
        before = float(lm_loss(model, b))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    raft_update(model, opt, buf, np.random.default_rng(0), steps=20, batch_size=1, pad_id=tiny_tok.pad_token_id,
                max_len=256, device="cpu", anchors=[anchor], anchor_count=1)
    with torch.no_grad():
        assert float(lm_loss(model, b)) < before * 0.5  # trained on, though never in the buffer


def _raft_run(tmp_path, tiny_tok, n_features, *, retrieval: bool, steps: int, raft_steps: int, raft_anchor: int,
              reward: str = "hierarchical", explore: str = "temperature", screen: int = 0):
    """A RAFT run of a tiny policy on one problem (3 candidates): the evaluator times the second
    candidate 5x faster than the first and calls the third wrong. Returns the result, every
    update's candidate sources, the log, the matrix, the starting checkpoint and its model."""
    init = tmp_path / "init"
    model = build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=1)
    model.config.retrieval = retrieval
    save_policy(model, tiny_tok, init)
    data = tmp_path / "sup.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in structure_dependent_supervision()))
    seen = []

    def timed(pb, sources):
        seen.append(list(sources))
        return [_o(us=10.0), _o(us=2.0), _o(correct=False)][: len(sources)]

    timed.last_seconds = {"verify": 0.5, "time": 1.5}  # as the sandbox evaluator reports its parts

    m = banded(48, 2)
    cfg = RLConfig(init=str(init), data=str(data), out_dir=str(tmp_path / "raft"), steps=steps, problems_per_step=1,
                   k=3, max_new_tokens=16, lr=3e-3, algo="raft", raft_steps=raft_steps, raft_batch=4,
                   speculative=False, save_every=100, raft_anchor=raft_anchor, reward=reward,
                   raft_explore=explore, raft_screen=screen)
    logs = []
    r = rl(cfg, problems=[RLProblem(m, "spmv", "f32", 1, "b48")], evaluator=timed, log=logs.append)
    return r, seen, logs, m, init, model


def test_raft_run_distils_the_best_hint_into_the_first_prompt(tmp_path, tiny_tok, n_features, monkeypatch):
    """Three hints per problem; the evaluator times the second hint's kernel 5x faster than the
    first's and calls the third's wrong. After the run, the first hint's prompt is far likelier
    to write the kernel that the second hint's prompt wrote at the first update."""
    import sparserl_compile.policy.retrieval as retrieval
    from sparserl_compile.policy.sampling import completion_ids
    from sparserl_compile.policy.encoder import prepare_structure
    from sparserl_compile.policy.tokenizer import prompt_text

    hints = ["csr_scalar[block=32]", "csr_scalar[block=128]", "csr_scalar[block=512]"]
    monkeypatch.setattr(retrieval, "nearest_hints", lambda *a, **kw: hints[: a[5]])
    r, seen, logs, m, init, model = _raft_run(tmp_path, tiny_tok, n_features, retrieval=True, steps=6,
                                              raft_steps=4, raft_anchor=2)
    assert r.step == 6 and all(len(s) == 3 for s in seen)
    assert any("SFT examples replayed, 2 per gradient step" in m for m in logs)
    assert [s["switched"] for s in r.stats] == [1] * 6 and r.stats[-1]["buffer"] == 6
    assert r.stats[0]["first_reward"] < r.stats[0]["best_reward"]
    assert r.stats[0]["switched_problems"][0][2] == "hint"  # the second hint's kernel

    structure = prepare_structure(m.indptr, m.indices, m.shape, max_points=model.config.max_points)
    ex = LMExample(tiny_tok.encode(prompt_text("spmv", "f32", 1, hints[0])), completion_ids(tiny_tok, seen[0][1]),
                   structure)
    b = collate([ex], tiny_tok.pad_token_id, 256)
    with torch.no_grad():
        before = float(lm_loss(load_policy(init)[0], b))
        after = float(lm_loss(load_policy(tmp_path / "raft")[0], b))
    assert after < before * 0.5


def test_raft_without_hints_distils_the_best_sample_into_the_greedy_kernel(tmp_path, tiny_tok, n_features):
    """A policy trained without hints: the candidates are the greedy kernel and k - 1 samples of
    the same prompt (expert iteration); the evaluator times the first sample 5x faster than the
    greedy kernel, and after the run those samples are far likelier under the greedy prompt."""
    from sparserl_compile.policy.sampling import completion_ids
    from sparserl_compile.policy.encoder import prepare_structure
    from sparserl_compile.policy.tokenizer import prompt_text

    r, seen, logs, m, init, model = _raft_run(tmp_path, tiny_tok, n_features, retrieval=False, steps=4,
                                              raft_steps=8, raft_anchor=1)
    assert r.step == 4 and all(len(s) == 3 for s in seen)
    assert len({s[1] for s in seen}) > 1  # the samples change between updates, as the policy does
    assert any("SFT examples replayed, 1 per gradient step" in m for m in logs)
    assert [s["switched"] for s in r.stats] == [1] * 4 and r.stats[-1]["buffer"] == 4
    # named in the log, with its gain and where the new target came from
    assert r.stats[0]["switched_problems"] == [["b48 spmv", 5.0, "sample"]]
    assert sum("switched: b48 spmv (x5.0 faster, a sample candidate)" in m for m in logs) == 4
    assert all(s["seconds"] > 0 for s in r.stats)
    # where each update's seconds went: decoding by origin, the rewards, the gradient steps
    parts = r.stats[0]["seconds_parts"]
    assert set(parts) == {"greedy", "sample", "rewards", "rewards_verify", "rewards_time", "update"}
    assert parts["rewards_verify"] == 0.5 and parts["rewards_time"] == 1.5  # the evaluator's own split
    assert parts["greedy"] + parts["sample"] + parts["rewards"] + parts["update"] <= r.stats[0]["seconds"] + 0.3
    assert sum("s (decoding " in m and "(greedy " in m and "(verify 0, time 2)" in m for m in logs) == 4

    structure = prepare_structure(m.indptr, m.indices, m.shape, max_points=model.config.max_points)
    prompt = tiny_tok.encode(prompt_text("spmv", "f32", 1))
    b = collate([LMExample(prompt, completion_ids(tiny_tok, s[1]), structure) for s in seen], tiny_tok.pad_token_id, 256)
    with torch.no_grad():
        before = float(lm_loss(load_policy(init)[0], b))
        after = float(lm_loss(load_policy(tmp_path / "raft")[0], b))
    assert after < before * 0.5


def test_raft_correctness_only_control_never_switches_to_the_faster_kernel(tmp_path, tiny_tok, n_features):
    """``--reward correctness`` with RAFT: the same run as above, but the 5x faster sample is
    never a target; the greedy kernel (correct) is its own target at every update."""
    r, seen, logs, *_ = _raft_run(tmp_path, tiny_tok, n_features, retrieval=False, steps=3, raft_steps=2,
                                  raft_anchor=0, reward="correctness")
    assert r.step == 3
    assert [s["switched"] for s in r.stats] == [0] * 3 and [s["targets"] for s in r.stats] == [1] * 3
    assert r.stats[-1]["buffer"] == 3 and r.stats[-1]["buffer_switched"] == 0
    assert not any("switched: b48" in m for m in logs)


def test_rl_refuses_format_exploration_for_a_policy_trained_with_hints(tmp_path, tiny_tok, n_features):
    """Settings the config cannot check alone (test_config.py has those) are checked against
    the starting checkpoint before any data is read."""
    init = tmp_path / "init"
    model = build_policy(PolicyHParams.tiny(len(tiny_tok), n_features))
    model.config.retrieval = True
    save_policy(model, tiny_tok, init)
    cfg = RLConfig(init=str(init), data=str(tmp_path / "none.jsonl"), out_dir=str(tmp_path / "raft"), steps=1, k=2,
                   algo="raft", evaluator="header", speculative=False, raft_explore="formats")
    with pytest.raises(ValueError, match="is for a policy without hints; .* was trained with hints"):
        rl(cfg, problems=[RLProblem(banded(16, 1), "spmv", "f32", 1)], log=QUIET)


def _format(source: str) -> str:
    return source.split("format=", 1)[1].split()[0]


@pytest.mark.parametrize("explore", ["formats", "mixed"])
def test_raft_format_exploration_spends_candidates_on_other_formats(tmp_path, tiny_tok, n_features, explore):
    """``--raft-explore formats``: after the greedy kernel, each candidate is the greedy kernel of
    another plausible format (forced header); ``mixed`` draws half of them so and samples the
    rest. The faster candidate still becomes the target."""
    from sparserl_compile.policy.provider import plausible_formats

    r, seen, logs, m, *_ = _raft_run(tmp_path, tiny_tok, n_features, retrieval=False, steps=2, raft_steps=1,
                                     raft_anchor=0, explore=explore)
    assert r.step == 2 and r.stats[0]["switched"] == 1
    assert r.stats[0]["switched_problems"][0][2] == "format"  # the second candidate, the faster one
    assert "format" in r.stats[0]["seconds_parts"] and ("sample" in r.stats[0]["seconds_parts"]) == (explore == "mixed")
    plausible = plausible_formats(m.indptr, m.indices, m.shape)
    for sources in seen:
        assert len(sources) == 3 and sources[1] != sources[0]
        formats = [_format(s) for s in sources]
        assert formats[1] != formats[0] and formats[1] in plausible  # a forced format, not the greedy one
        if explore == "formats":
            assert formats[2] not in formats[:2] and formats[2] in plausible


@pytest.mark.parametrize("sample_drafts", [True, False])
def test_raft_samples_are_drafted_unless_sample_drafts_is_off(monkeypatch, sample_drafts):
    """The greedy kernel always decodes against the drafts; the temperature samples do too by
    default (speculatively, one at a time), and in one undrafted batch with --no-sample-drafts."""
    from types import SimpleNamespace

    from sparserl_compile.training import raft

    calls = []

    def fake_generate(model, tok, structure, op, dtype, n, k=1, config=None, references=None, **kw):
        calls.append((k, config.greedy, references))
        return [SimpleNamespace(text=f"kernel {len(calls)} {i}", extra={}) for i in range(k)]

    monkeypatch.setattr(raft, "generate", fake_generate)
    cfg = RLConfig(init="", data="", out_dir="", k=4, raft_explore="temperature", sample_drafts=sample_drafts)
    pb = SimpleNamespace(op="spmv", dtype="f32", n=1)
    seconds = {}
    rs = raft.raft_candidates(None, None, None, pb, None, ["draft"], cfg, seed=0, seconds=seconds)
    assert [r.extra["origin"] for r in rs] == ["greedy", "sample", "sample", "sample"]
    assert calls == [(1, True, ["draft"]), (3, False, ["draft"] if sample_drafts else None)]
    assert set(seconds) == {"greedy", "sample"}


@pytest.mark.parametrize("batch_drafts", [False, True])
def test_raft_batch_drafts_decodes_the_samples_and_format_candidates_together(monkeypatch, batch_drafts):
    """--batch-drafts: the temperature samples and the format candidates are decoded with
    DecodeConfig.batch_drafts (speculatively in one batch); the greedy kernel, one sample, is not."""
    from types import SimpleNamespace

    from sparserl_compile.training import raft

    seen = []

    def fake_generate(model, tok, structure, op, dtype, n, k=1, config=None, references=None, **kw):
        seen.append(("greedy" if config.greedy else "sample", config.batch_drafts))
        return [SimpleNamespace(text=f"kernel {len(seen)} {i}", extra={}) for i in range(k)]

    def fake_formats(model, tok, structure, op, dtype, n, k, formats, config=None, references=None, **kw):
        seen.append(("format", config.batch_drafts))
        return [SimpleNamespace(text=f"format {i}", extra={}) for i in range(k)]

    monkeypatch.setattr(raft, "generate", fake_generate)
    monkeypatch.setattr(raft, "format_diverse", fake_formats)
    cfg = RLConfig(init="", data="", out_dir="", k=5, raft_explore="mixed", batch_drafts=batch_drafts)
    pb = SimpleNamespace(op="spmv", dtype="f32", n=1)
    rs = raft.raft_candidates(None, None, None, pb, None, ["draft"], cfg, seed=0, formats=["csr", "ell"])
    assert [r.extra["origin"] for r in rs] == ["greedy", "format", "format", "sample", "sample"]
    assert seen == [("greedy", False), ("format", batch_drafts), ("sample", batch_drafts)]


def test_raft_branch_exploration_spends_the_candidates_on_the_greedy_kernels_departures(monkeypatch):
    """--raft-explore branches: after the greedy kernel, the k - 1 candidates are
    ``departures.branch_diverse``'s departures from it (given the greedy rollout, not decoding it
    again), tagged "branch", with their decoding seconds under "branch"."""
    from types import SimpleNamespace

    from sparserl_compile.training import raft

    seen = []

    def fake_generate(model, tok, structure, op, dtype, n, k=1, config=None, references=None, **kw):
        seen.append(("greedy", k))
        return [SimpleNamespace(text="greedy kernel", extra={})]

    def fake_branches(model, tok, structure, op, dtype, n, k, config=None, references=None, greedy=None, **kw):
        seen.append(("branches", k, greedy.text, config.greedy, config.batch_drafts))
        return [greedy] + [SimpleNamespace(text=f"branch {i}", extra={}) for i in range(k - 1)]

    monkeypatch.setattr(raft, "generate", fake_generate)
    monkeypatch.setattr(raft, "branch_diverse", fake_branches)
    cfg = RLConfig(init="", data="", out_dir="", k=4, raft_explore="branches", batch_drafts=True)
    seconds = {}
    rs = raft.raft_candidates(None, None, None, SimpleNamespace(op="spmv", dtype="f32", n=1), None, ["draft"], cfg,
                          seed=0, seconds=seconds)
    assert [r.text for r in rs] == ["greedy kernel", "branch 0", "branch 1", "branch 2"]
    assert [r.extra["origin"] for r in rs] == ["greedy", "branch", "branch", "branch"]
    assert seen == [("greedy", 1), ("branches", 4, "greedy kernel", True, True)]
    assert set(seconds) == {"greedy", "branch"}


def test_a_raft_run_with_a_screen(tmp_path, tiny_tok, n_features):
    """A real run with --raft-screen 1: the tiny policy's departures are not kernels, so the
    screen leaves every one out at the header and only the greedy kernel is rewarded; the
    update's log names the screen's seconds."""
    r, seen, logs, *_ = _raft_run(tmp_path, tiny_tok, n_features, retrieval=False, steps=1, raft_steps=1,
                                  raft_anchor=0, explore="branches", screen=1)
    assert r.step == 1 and len(seen) == 1 and len(seen[0]) == 1
    step = next(line for line in logs if line.startswith("[rl] step 1/"))
    assert "screen" in step and "branch" in step


def test_raft_screen_checks_the_departures_for_the_problems_matrix(monkeypatch):
    """--raft-screen: branch_diverse gets a screen that asks the Screen about the problem's
    matrix, op, dtype and width; its seconds are the part "screen", not the branch decoding's.
    Without branch exploration the flag is refused before any data is read."""
    from types import SimpleNamespace

    from sparserl_compile.policy.screen import Screen
    from sparserl_compile.training import raft

    asked = []

    class FakeScreen:
        checker = Screen.checker  # the real binding of a problem; check is this fake's

        def check(self, indptr, indices, shape, op, dtype, n, texts):
            asked.append((indptr, indices, shape, op, dtype, n, tuple(texts)))
            return [None, "no"]

    monkeypatch.setattr(raft, "generate", lambda *a, **kw: [SimpleNamespace(text="greedy kernel", extra={})])

    def fake_branches(model, tok, structure, op, dtype, n, k, greedy=None, screen=None, **kw):
        kept = [t for t, why in zip(["a", "b"], screen(["a", "b"])) if why is None]
        return [greedy] + [SimpleNamespace(text=t, extra={}) for t in kept]

    monkeypatch.setattr(raft, "branch_diverse", fake_branches)
    cfg = RLConfig(init="", data="", out_dir="", k=3, algo="raft", raft_explore="branches", raft_screen=1)
    pb = SimpleNamespace(op="spmm", dtype="f32", n=32, matrix=SimpleNamespace(indptr="ip", indices="ix", shape=(4, 5)))
    seconds = {}
    rs = raft.raft_candidates(None, None, None, pb, None, None, cfg, seed=0, seconds=seconds, screen=FakeScreen())
    assert [r.text for r in rs] == ["greedy kernel", "a"]
    assert asked == [("ip", "ix", (4, 5), "spmm", "f32", 32, ("a", "b"))]
    assert set(seconds) == {"greedy", "branch", "screen"} and seconds["branch"] >= 0
    with pytest.raises(ValueError, match="--raft-screen .* needs --algo raft --raft-explore branches"):
        rl(RLConfig(init="", data="", out_dir="", algo="raft", raft_explore="mixed", raft_screen=2))
