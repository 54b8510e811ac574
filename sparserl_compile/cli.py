"""The ``sparserl`` command.

Each subcommand lives beside the code it drives and registers itself through an
``add_cli(subparsers)`` function that sets ``func`` on its parser; this file only lists them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, what it adds); imported lazily so `sparserl cache ls` does not import the policy.
_SUBCOMMANDS = (
    "sparserl_compile.demo",       # demo
    "sparserl_compile.cache",      # cache ls | show | clear | verify
    "sparserl_compile.suite",      # bench
    "sparserl_compile.pregen",     # pregen
    "sparserl_compile.warmup",     # warm
    "sparserl_compile.training.cli",                # train pretrain | sft | rl, eval
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparserl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _SUBCOMMANDS:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and (e.name == mod or mod.startswith(e.name + ".")):
                continue  # subcommand not built yet
            raise
        m.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
