"""Resumable training state: the policy checkpoint folder plus the optimizer and step.

A stage's output folder holds ``config.json``, ``model.safetensors``, ``tokenizer.json``
(``policy.model.save_policy``), ``optimizer.safetensors`` (every tensor of the optimizer's
state dict, flattened), and ``trainer_state.json`` (step, stage, param groups, the loss log).
No pickle: ``torch.save`` is not used. A run started on a folder that holds a trainer state
continues from its step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

STATE_FILE = "trainer_state.json"
OPT_FILE = "optimizer.safetensors"


@dataclass
class TrainerState:
    stage: str
    step: int = 0
    log: list[dict] = field(default_factory=list)  # one entry per logged step


def has_state(directory: str | Path, stage: str | None = None) -> bool:
    """Whether ``directory`` holds a resumable state, of ``stage`` when one is given (an SFT run
    does not resume a pretraining folder)."""
    d = Path(directory)
    if not ((d / STATE_FILE).is_file() and (d / "model.safetensors").is_file()):
        return False
    return stage is None or json.loads((d / STATE_FILE).read_text()).get("stage") == stage


def save_state(directory: str | Path, model, tokenizer, optimizer, state: TrainerState) -> Path:
    from safetensors.torch import save_file

    from sparserl_compile.policy.model import save_policy

    d = save_policy(model, tokenizer, directory)
    sd = optimizer.state_dict()
    tensors = {}
    scalars = {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{pid}.{k}"] = v.detach().contiguous().cpu()
            else:
                scalars[f"{pid}.{k}"] = v
    save_file(tensors, str(d / OPT_FILE))
    (d / STATE_FILE).write_text(json.dumps({
        "stage": state.stage, "step": state.step, "log": state.log,
        "param_groups": sd["param_groups"], "opt_scalars": scalars,
    }, indent=1))
    return d


def load_state(directory: str | Path, optimizer) -> TrainerState:
    """Restore ``optimizer`` from ``directory`` and return the trainer state."""
    from safetensors.torch import load_file

    d = Path(directory)
    meta = json.loads((d / STATE_FILE).read_text())
    tensors = load_file(str(d / OPT_FILE)) if (d / OPT_FILE).is_file() else {}
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    for key, v in meta.get("opt_scalars", {}).items():
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    return TrainerState(meta["stage"], int(meta["step"]), meta.get("log", []))
