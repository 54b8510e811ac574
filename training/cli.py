"""``sparserl train pretrain|sft|rl|soup`` and ``sparserl eval``: every config field is a flag."""

from __future__ import annotations

import argparse


def add_cli(subparsers) -> None:
    from sparserl_compile.training.config import add_dataclass_args, from_args
    from sparserl_compile.training.evaluate import EvalConfig
    from sparserl_compile.training.pretrain import PretrainConfig
    from sparserl_compile.training.rl import RLConfig
    from sparserl_compile.training.sft import SFTConfig

    train = subparsers.add_parser("train", help="train the policy (three stages)")
    stages = train.add_subparsers(dest="stage", metavar="STAGE", required=True)

    def stage(name, cls, fn, help):
        p = stages.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_dataclass_args(p, cls)
        p.set_defaults(func=lambda a: _run(fn, from_args(cls, a)))

    def _pretrain(c):
        from sparserl_compile.training.pretrain import pretrain
        return pretrain(c)

    def _sft(c):
        from sparserl_compile.training.sft import sft
        return sft(c)

    def _rl(c):
        from sparserl_compile.training.rl import rl
        return rl(c)

    stage("pretrain", PretrainConfig, _pretrain, "stage 1: causal LM on the CUDA corpus")
    stage("sft", SFTConfig, _sft, "stage 2: matrix -> best verified kernel")
    stage("rl", RLConfig, _rl, "stage 3: PPO/GRPO on compile/correct/speed rewards")
    from sparserl_compile.training.soup import add_parser as add_soup
    add_soup(stages)

    ev = subparsers.add_parser("eval", help="evaluate policy checkpoints on the held-out split")
    add_dataclass_args(ev, EvalConfig)

    def _eval(a):
        from sparserl_compile.training.evaluate import run_eval
        run_eval(from_args(EvalConfig, a))
        return 0

    ev.set_defaults(func=_eval)


def _run(fn, cfg) -> int:
    """Run a stage; under ``torchrun`` end the process group after it (``training/dist.py``)."""
    from sparserl_compile.training import dist as tdist

    try:
        result = fn(cfg)
        if tdist.is_main():
            _report(result)
    finally:
        tdist.cleanup()
    return 0


def _report(result) -> int:
    print(f"done: step {result.step} (started at {result.start_step}), checkpoint in {result.out_dir}")
    return 0
