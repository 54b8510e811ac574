"""Stage 3's checkpoint selection on validation problems (``training/validation.py``,
``sparserl train rl --validate N``)."""

import json

import pytest

from policy_fixtures import structure_dependent_supervision
from sparserl_compile.policy.model import PolicyHParams, build_policy, load_policy, save_policy
from sparserl_compile.matrices import banded, block_diagonal
from sparserl_compile.training import validation
from sparserl_compile.training.rewards import KernelOutcome, RLProblem
from sparserl_compile.training.rl import RLConfig, rl
from sparserl_compile.training.unlabelled import FIRST_SEED, unlabelled_problems

QUIET = lambda *a: None  # noqa: E731


class _Timed:
    """An evaluator: a DIA kernel is correct and 4x faster than cuSPARSE (8 us vs 32 us); any
    other kernel is wrong (``wrong=False``: every kernel is correct and 8 us). Counts its calls;
    ``drift`` changes the cuSPARSE time it reports on every call (timing noise the validator
    must not see)."""

    def __init__(self, drift: float = 0.0, wrong: bool = True):
        self.calls = 0
        self.drift = drift
        self.wrong = wrong

    def __call__(self, pb, sources):
        self.calls += 1
        ref = 32.0 + self.drift * self.calls
        ok = [("format=dia " in s) or not self.wrong for s in sources]
        return [KernelOutcome(True, True, c, 8.0 if c else None, reference_us=ref) for c in ok]


def _probs():
    return [RLProblem(banded(48, 2), "spmv", "f32", 1, "b48"), RLProblem(block_diagonal(4, 12), "spmv", "f32", 1, "bd")]


def test_validator_scores_greedy_kernels_against_cusparse_with_fallback(tiny_tok, n_features):
    model = build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=1)
    ev = _Timed(drift=1.0, wrong=False)
    v = validation.Validator(_probs(), ev, max_new_tokens=16, speculative=False)
    a = v(model, tiny_tok, 0)
    assert a["problems"] == 2 and a["step"] == 0 and a["timed"] == 2 and a["correct_rate"] == 1.0
    assert [r["value"] for r in a["rows"]] == [33 / 8, 34 / 8]  # cuSPARSE / kernel, each problem's first time
    assert a["score"] == pytest.approx((33 / 8 * 34 / 8) ** 0.5)
    # the same model again: the same kernels, no new evaluation, the same score despite the drift
    b = v(model, tiny_tok, 1)
    assert ev.calls == 2 and (b["score"], b["correct_rate"]) == (a["score"], a["correct_rate"])
    # a wrong kernel counts as the runtime's fallback to cuSPARSE: 1.0
    c = validation.Validator(_probs(), _Timed(), max_new_tokens=16, speculative=False)(model, tiny_tok, 0)
    assert all(r["value"] == (r["reference_us"] / 8.0 if r["correct"] else 1.0) for r in c["rows"])


def test_a_tie_keeps_the_earlier_checkpoint_and_only_a_better_one_is_saved(tmp_path, tiny_tok, n_features):
    model = build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=1)
    hist = []
    assert validation.record(tmp_path, hist, {"step": 0, "score": 1.0, "correct_rate": 0.5}, model, tiny_tok)
    assert (tmp_path / "best" / "model.safetensors").is_file()
    (tmp_path / "best" / "model.safetensors").unlink()
    assert not validation.record(tmp_path, hist, {"step": 2, "score": 1.0, "correct_rate": 0.5}, model, tiny_tok)
    assert not (tmp_path / "best" / "model.safetensors").exists()  # a tie saves nothing
    assert validation.record(tmp_path, hist, {"step": 4, "score": 1.0, "correct_rate": 0.75}, model, tiny_tok)
    assert not validation.record(tmp_path, hist, {"step": 6, "score": 0.9, "correct_rate": 1.0}, model, tiny_tok)
    saved = json.loads((tmp_path / "validation.json").read_text())
    assert saved["best_step"] == 4 and [h["step"] for h in saved["history"]] == [0, 2, 4, 6]
    assert validation.load_history(tmp_path) == hist and validation.load_history(tmp_path / "none") == []


def test_validation_problems_are_new_instances_apart_from_the_training_draws():
    mix = {"banded": 1.0, "block_diagonal": 1.0}
    train = unlabelled_problems(4, 3, max_nnz=200_000, mix=mix)
    val = validation.validation_problems(4, 3, max_nnz=200_000, mix=mix)
    assert [p.label for p in val] == [p.label for p in validation.validation_problems(4, 3, 200_000, mix=mix)]
    assert not {p.label for p in val} & {p.label for p in train}
    seeds = [int(p.label.rsplit("seed=", 1)[1].rstrip(")")) for p in val]
    assert min(seeds) > validation.VALIDATION_FIRST_SEED > FIRST_SEED + 4 * 50  # apart from any training draw
    skip = {val[0].label}
    assert val[0].label not in {p.label for p in validation.validation_problems(4, 3, 200_000, skip, mix)}


def _run(tmp_path, tiny_tok, n_features, steps, **kw):
    init = tmp_path / "init"
    if not init.exists():
        save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=1), tiny_tok, init)
    data = tmp_path / "sup.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in structure_dependent_supervision()))
    cfg = RLConfig(init=str(init), data=str(data), out_dir=str(tmp_path / "rl"), steps=steps, problems_per_step=1,
                   k=4, max_new_tokens=16, lr=3e-3, algo="raft", raft_steps=4, raft_batch=4, speculative=False,
                   save_every=100, **{"validate": 2, "validate_every": 2, **kw})
    logs = []
    r = rl(cfg, problems=[RLProblem(banded(48, 2), "spmv", "f32", 1, "t")], evaluator=_Timed(),
           validation_problems=_probs(), log=logs.append)
    return r, logs


def test_rl_validates_the_start_every_few_updates_and_the_end_and_keeps_the_best(tmp_path, tiny_tok, n_features):
    r, logs = _run(tmp_path, tiny_tok, n_features, steps=5)
    assert [h["step"] for h in r.validation] == [0, 2, 4, 5]
    assert any(m.startswith("[rl] validation: 2 problems, every 2 updates") for m in logs)
    assert sum("[rl] validation after" in m for m in logs) == 4
    saved = json.loads((tmp_path / "rl" / "validation.json").read_text())
    best = validation.best_of(r.validation)
    assert saved["best_step"] == best["step"] and saved["best_score"] == best["score"]
    load_policy(tmp_path / "rl" / "best")  # a complete checkpoint
    # resumed: the history is read back, the resumed checkpoint is not validated twice
    r2, _ = _run(tmp_path, tiny_tok, n_features, steps=6)
    assert (r2.start_step, r2.step) == (5, 6) and [h["step"] for h in r2.validation] == [0, 2, 4, 5, 6]


def test_rl_validation_settings_are_checked_before_training(tmp_path, tiny_tok, n_features):
    with pytest.raises(ValueError, match="unlabelled mix entry 'stencil9=1'"):
        _run(tmp_path, tiny_tok, n_features, steps=1, validate_mix="stencil9=1")
    with pytest.raises(ValueError, match="--validate-every 0: validate every 1 or more updates"):
        _run(tmp_path, tiny_tok, n_features, steps=1, validate_every=0)


def test_rl_says_when_validation_can_only_rank_by_correct_rate(tmp_path, tiny_tok, n_features):
    init = tmp_path / "init"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=1), tiny_tok, init)
    cfg = RLConfig(init=str(init), out_dir=str(tmp_path / "rl"), steps=1, problems_per_step=1, k=2, max_new_tokens=8,
                   algo="raft", speculative=False, evaluator="header", validate=1)
    logs = []
    r = rl(cfg, problems=[RLProblem(banded(48, 2), "spmv", "f32", 1, "t")], validation_problems=_probs()[:1],
           log=logs.append)
    assert [h["step"] for h in r.validation] == [0, 1] and all(h["timed"] == 0 for h in r.validation)
    assert sum("ranked by correct rate" in m for m in logs) == 1


def test_compare_validates_several_checkpoints_on_the_same_problems(tmp_path, tiny_tok, n_features):
    for name, seed in (("a", 1), ("b", 2)):
        save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=seed), tiny_tok, tmp_path / name)
    out = tmp_path / "v.json"
    assert validation.main(["--checkpoints", f"a={tmp_path / 'a'},b={tmp_path / 'b'}", "--count", "2", "--seed", "4",
                            "--max-nnz", "200000", "--mix", "banded=1", "--evaluator", "header",
                            "--max-new-tokens", "16", "--device", "cpu", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["machine"]["host"] and res["started"].endswith("Z")  # which machine scored them, and when
    want = validation.validation_problems(2, 4, 200_000, mix={"banded": 1.0})
    assert res["problems"] == [f"{p.label} {p.op}" for p in want]
    assert set(res["checkpoints"]) == {"a", "b"}
    assert all(c["problems"] == 2 and len(c["rows"]) == 2 for c in res["checkpoints"].values())
    assert res["checkpoints"]["a"]["provenance"]["path"] == str(tmp_path / "a")  # which weights were scored
    with pytest.raises(ValueError, match="write name=folder"):
        validation.compare(f"{tmp_path / 'a'}", 2, evaluator="header")
    wide = validation.validation_problems(24, 4, 200_000, mix={"banded": 1.0}, spmm_widths=(8, 128))
    assert {p.n for p in wide if p.op == "spmm"} == {8, 128}
    with pytest.raises(SystemExit):
        validation.main(["--checkpoints", f"a={tmp_path / 'a'}", "--spmm-n", "8,x", "--evaluator", "header"])
