"""Training curves of a shipped checkpoint, drawn from its ``training_log.json``.

    python -m sparserl_compile.training.curves policy/checkpoints/retrieval --out docs/img/training_retrieval.png

A checkpoint's ``training_log.json`` holds each stage's config and logged points (the
trainer's ``trainer_state.json`` log, copied when the checkpoint was shipped): LM stages log
``loss`` every ``log_every`` steps, RL stages log ``mean_reward`` per update (PPO/GRPO with
``kl``, ``entropy`` and ``clip_frac``, and every RL update with ``novel_rate``, RAFT with
``best_reward``). One panel per stage: the loss (log scale) for LM stages; for RL stages the
mean reward, with the KL to the reference model on a second axis (PPO/GRPO) or the best
candidate's reward (RAFT), and a second panel of the exploration measures the stage logged: the
clip fraction, the novel-kernel rate (correct samples that are no kernel-space point) and the
mean token entropy (second axis). Stages are found by their logs: the top-level
entries with a ``log`` list, in file order; ``previous_version_*`` entries (the provenance of
the checkpoint it was fine-tuned from) are left out unless ``--history``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def stages(log: dict, history: bool = False, prefix: str = "") -> list[tuple[str, list[dict]]]:
    """(name, logged points) for every stage in a ``training_log.json`` dict, in file order."""
    out = []
    for name, entry in log.items():
        if not isinstance(entry, dict):
            continue
        if name.startswith("previous_version"):
            if history:
                out += stages(entry, True, f"{prefix}{name}/")
            continue
        points = entry.get("log")
        if isinstance(points, list) and any("loss" in p or "mean_reward" in p for p in points):
            out.append((prefix + name, points))
    return out


def plot(checkpoint: str | Path, out: str | Path, history: bool = False, columns: int = 4) -> Path:
    """Draw the stages of ``checkpoint``'s ``training_log.json`` into ``out`` (PNG), ``columns``
    panels a row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(checkpoint) / "training_log.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training log (a shipped checkpoint keeps one beside its weights)")
    found = stages(json.loads(path.read_text()), history)
    if not found:
        raise ValueError(f"{path}: no stage with logged loss or reward")
    found = [(n + suffix, pts) for n, pts in found
             for suffix in ("", " (exploration)") if not suffix or _explores(pts)]
    if columns < 1:
        raise ValueError(f"columns={columns}: at least one panel a row")
    cols = min(columns, len(found))
    rows = -(-len(found) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[len(found):]:
        ax.set_visible(False)
    for ax, (name, points) in zip(axes.flat, found):
        if name.endswith(" (exploration)"):
            _exploration_panel(ax, points)
        elif any("mean_reward" in p for p in points):
            pts = [p for p in points if "mean_reward" in p]
            steps = [p["step"] for p in pts]
            ax.plot(steps, [p["mean_reward"] for p in pts], "o-", color="tab:green", label="mean reward")
            ax.set_ylabel("mean reward")
            if any("kl" in p for p in pts):  # PPO/GRPO; RAFT has no KL term
                kl = ax.twinx()
                kl.plot(steps, [p.get("kl", 0.0) for p in pts], "s--", color="tab:gray", label="KL to SFT")
                kl.set_ylabel("KL to the reference")
            if any("best_reward" in p for p in pts):  # RAFT: the best candidate's reward per problem, averaged
                ax.plot(steps, [p["best_reward"] for p in pts], "^:", color="tab:orange", label="best of k")
                ax.legend(fontsize=7)
            ax.set_xlabel("RL update")
        else:
            pts = [p for p in points if "loss" in p]
            ax.plot([p["step"] for p in pts], [p["loss"] for p in pts], "o-", color="tab:blue")
            ax.set_yscale("log")
            ax.set_ylabel("training loss (nats/token)")
            ax.set_xlabel("step")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{path.parent}", fontsize=9)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


_EXPLORATION = {"clip_frac": ("clip fraction", "tab:red"), "novel_rate": ("novel-kernel rate", "tab:purple")}


def _explores(points: list[dict]) -> bool:
    """Whether an RL stage logged exploration measures (clip fraction, novel rate, entropy)."""
    return any("mean_reward" in p and (set(_EXPLORATION) | {"entropy"}) & set(p) for p in points)


def _exploration_panel(ax, points: list[dict]) -> None:
    pts = [p for p in points if "mean_reward" in p]
    steps = [p["step"] for p in pts]
    for key, (label, color) in _EXPLORATION.items():
        if any(key in p for p in pts):
            ax.plot(steps, [p.get(key, float("nan")) for p in pts], "o-", color=color, label=label)
    ax.set_ylabel("fraction")
    ax.set_xlabel("RL update")
    if any("entropy" in p for p in pts):
        ent = ax.twinx()
        ent.plot(steps, [p.get("entropy", float("nan")) for p in pts], "s--", color="tab:gray", label="entropy")
        ent.set_ylabel("entropy (nats/token)")
    ax.legend(fontsize=7)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a checkpoint folder holding training_log.json")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--history", action="store_true", help="also the stages of the versions it was fine-tuned from")
    p.add_argument("--columns", type=int, default=4, help="panels a row")
    args = p.parse_args(argv)
    try:
        print(plot(args.checkpoint, args.out, args.history, args.columns))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
