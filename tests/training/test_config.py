"""training/config.py: dataclass configs as command-line flags."""

from __future__ import annotations

import pytest

from sparserl_compile.commands.cli import main


@pytest.mark.parametrize("argv", [["eval"], ["train", "pretrain"], ["train", "sft"], ["train", "rl"]])
def test_every_flags_help_renders(argv, capsys):
    """argparse formats help text with %; a literal "10 %" in a help string once printed the
    option's internal dict instead of its help (sparserl eval --help)."""
    with pytest.raises(SystemExit) as done:
        main(argv + ["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "option_strings" not in text and "--device" in text
    if argv == ["eval"]:
        assert "about 10 % slower" in " ".join(text.split())


@pytest.mark.parametrize("setting, message", [
    ({"algo": "dpo"}, "--algo 'dpo': use 'ppo', 'grpo' or 'raft'"),
    ({"reward": "speed"}, "--reward 'speed': use 'hierarchical' or 'correctness'"),
    ({"evaluator": "tpu"}, "--evaluator 'tpu': use 'gpu', 'cpu', 'measured' or 'header'"),
    ({"raft_explore": "hints"}, "--raft-explore 'hints': use 'temperature', 'formats', 'mixed' or 'branches'"),
    ({"k": 0}, "--k 0: must be 1 or more"),
    ({"problems_per_step": 0}, "--problems-per-step 0: must be 1 or more"),
    ({"steps": -1}, "--steps -1: must be 0 or more"),
    ({"temperature": 0.0}, "--temperature 0.0: a sampling temperature is above 0"),
    ({"lr": 0.0}, "--lr 0.0: a learning rate is above 0"),
    ({"validate": 2, "validate_every": 0}, "--validate-every 0: validate every 1 or more updates"),
    ({"average_from": -1}, "--average-from -1: the first update to average is 1 or later"),
    ({"algo": "raft", "raft_explore": "mixed", "raft_screen": 2},
     "--raft-screen checks departures .* needs --algo raft --raft-explore branches"),
    ({"unlabelled_mix": "rmat=1,stencil9=1"}, "unlabelled mix entry 'stencil9=1'"),
    ({"validate_mix": "stencil9=1"}, "unlabelled mix entry 'stencil9=1'"),
    ({"unlabelled_spmm_n": "32,x"}, "--unlabelled-spmm-n: SpMM widths '32,x'"),
])
def test_rl_config_checks_its_fields_when_made(setting, message):
    """A bad RL setting fails when the config is made (from flags or in Python), naming the flag,
    before any checkpoint or data is read."""
    from sparserl_compile.training.rl import RLConfig

    with pytest.raises(ValueError, match=message):
        RLConfig(**setting)
    RLConfig(algo="raft", raft_explore="branches", raft_screen=2, unlabelled_mix="rmat=1", unlabelled_spmm_n="8,32")
