"""Stage configs as dataclasses: every field has a ``help`` string and becomes a command-line
flag (``--field-name``); booleans take ``--flag/--no-flag``. Plain argparse, no framework."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from sparserl_compile.fileio import write_atomic


def opt(default: Any, help: str):
    """A dataclass field with a help string."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def add_dataclass_args(parser: argparse.ArgumentParser, cls) -> None:
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        h = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %: "10 %" is text
        if isinstance(default, bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=h)
        else:
            parser.add_argument(flag, dest=f.name, type=type(default) if default is not None else str,
                                default=default, help=h)


def from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def resolve_device(name: str) -> str:
    """``"auto"`` -> ``"cuda"`` when torch sees a GPU, else ``"cpu"``; anything else as given."""
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def save_config(cfg, directory: str | Path, name: str) -> Path:
    p = Path(directory) / f"{name}_config.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    # written beside and renamed: under torchrun the other ranks read it (check_resume) while
    # rank 0 writes it, and must never see it half-written
    write_atomic(p, json.dumps(dataclasses.asdict(cfg), indent=1, default=str))
    return p


# Settings a resumed run may change: how long it runs, how often it logs and saves, where it
# runs, and paths that differ between machines. Anything else makes a different run.
RESUMABLE = frozenset({"steps", "time_budget_s", "log_every", "save_every", "workers", "device", "out_dir",
                       "init", "base", "validate_every", "parallel_verify", "sample_drafts", "batch_drafts"})


def check_resume(cfg, directory: str | Path, name: str, may_change=RESUMABLE) -> None:
    """Refuse to resume the run in ``directory`` under other settings than it was started with
    (its ``<name>_config.json``): a second run pointed at a left-over folder (a reused machine's
    ``/tmp``) would otherwise continue the first one silently, e.g. another seed or
    reward on top of the first run's updates. Call it only when resuming, before
    ``save_config`` overwrites the file."""
    p = Path(directory) / f"{name}_config.json"
    if not p.is_file():
        return
    try:
        old = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{p} is unreadable ({e}); the run in {directory} cannot be checked for resuming: "
                         "use a new --out-dir") from e
    new = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    diff = [f"--{k.replace('_', '-')} {old[k]!r} -> {v!r}" for k, v in new.items()
            if k in old and k not in may_change and old[k] != v]
    if diff:
        raise ValueError(f"{directory} holds a 'sparserl train {name}' run started with other settings ({'; '.join(diff)}); "
                         "resuming it would mix two runs. Use a new --out-dir, or the first run's settings")
