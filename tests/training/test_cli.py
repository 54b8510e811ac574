"""training/cli.py: ``sparserl train`` and ``sparserl eval`` as a user meets them: a missing
``train`` extra, a bad flag and a failed run each end in one line on stderr and an exit code."""

from __future__ import annotations

import sys

import pytest

from sparserl_compile.commands.cli import main
from sparserl_compile.training.cli import BASE_POLICY_EXTRA, TRAIN_EXTRA, missing_train_extra


@pytest.mark.parametrize("argv", [["train", "rl"], ["train", "sft", "--steps", "1"], ["train", "soup", "--checkpoints",
                                                                                      "a,b", "--out", "c"], ["eval"]])
def test_without_the_train_extra_one_line_says_what_to_install(argv, monkeypatch, capsys):
    for name in ("llguidance", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails, as where it is not installed
    assert set(missing_train_extra()) == {"llguidance", "transformers"}
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "transformers, llguidance not installed" in err and "pip install 'sparserl[train]'" in err
    assert err.startswith(f"sparserl {' '.join(argv[:2]) if argv[0] == 'train' else 'eval'} needs the train extra")


def test_the_train_extra_is_what_pyproject_declares():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on

    spec = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    declared = {d.split(">")[0].split("=")[0].split("[")[0].strip()
                for d in spec["project"]["optional-dependencies"]["train"]}
    assert set(TRAIN_EXTRA) | set(BASE_POLICY_EXTRA) == declared


def test_a_bad_flag_value_is_one_line_and_exit_code_2(capsys):
    assert main(["train", "rl", "--algo", "dpo"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "sparserl train rl: --algo 'dpo': use 'ppo', 'grpo' or 'raft'\n"


def test_a_failed_run_is_one_line_and_exit_code_1(tmp_path, capsys):
    missing = tmp_path / "none.jsonl"
    assert main(["eval", "--data", str(missing)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("sparserl eval: supervision file") and str(missing) in err


def test_fetch_base_install_keeps_a_copied_file_and_checks_its_hash(tmp_path, monkeypatch, capsys):
    import hashlib

    monkeypatch.setenv("SPARSERL_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "copied.gguf"
    f.write_bytes(b"GGUF copied by hand")
    assert main(["train", "fetch-base", "--install", str(f), "--sha256", "0" * 64]) == 1
    assert "not the expected" in capsys.readouterr().err
    assert main(["train", "fetch-base", "--install", str(f), "--sha256", hashlib.sha256(f.read_bytes()).hexdigest()]) == 0
    assert (tmp_path / "cache" / "base" / "base.json").is_file()


def test_a_wrong_base_path_is_refused_before_the_corpus_is_collected(tmp_path, monkeypatch, capsys):
    from sparserl_compile.training import corpus

    def no_corpus(*a, **k):
        raise AssertionError("the corpus was collected before --base was checked")

    monkeypatch.setattr(corpus, "build_corpus", no_corpus)
    missing = tmp_path / "no-such-base"
    assert main(["train", "pretrain", "--base", str(missing), "--out-dir", str(tmp_path / "run"), "--steps", "1"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"sparserl train pretrain: base model {missing}") and "give a .gguf file" in err


@pytest.mark.parametrize("stage", ["sft", "rl"])
def test_a_missing_init_checkpoint_names_the_folder_and_what_to_pass(stage, tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    assert main(["train", stage, "--init", str(missing), "--out-dir", str(tmp_path / "run"), "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"no policy checkpoint in {missing}" in err
    assert "`sparserl train sft`" not in err  # the stage that writes an --init differs per stage
    assert "--out-dir" in err and "policy/checkpoints/default" in err
