"""sparserl: sparse matrix products with CUDA kernels written for each matrix's structure.

Each subcommand module in this package registers itself through an ``add_cli(subparsers)``
function that sets ``func`` on its parser; this file only lists them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# (module, what it adds); imported lazily so `sparserl cache ls` does not import the policy.
_SUBCOMMANDS = (
    "sparserl_compile.commands.demo",    # demo
    "sparserl_compile.commands.cache",   # cache ls | show | clear | verify | merge
    "sparserl_compile.commands.bench",   # bench
    "sparserl_compile.commands.pregen",  # pregen, target
    "sparserl_compile.commands.warm",    # warm
    "sparserl_compile.training.cli",     # train pretrain | sft | rl, eval
)


def build_parser() -> argparse.ArgumentParser:
    from sparserl_compile.version import version

    parser = argparse.ArgumentParser(prog="sparserl", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sparserl {version()}")
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
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--version"]:  # answered without importing every subcommand
        from sparserl_compile.version import version

        print(f"sparserl {version()}")
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `sparserl cache ls | head`: the reader has gone; drop the rest quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (so the exit's flush cannot fail too)
        return 1


if __name__ == "__main__":
    sys.exit(main())
