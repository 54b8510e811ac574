"""Weight averaging of policy checkpoints ("model soup"): ``sparserl train soup``.

RAFT runs from one SFT stage gain on some held-out records and lose on others, and the gains and
losses differ from run to run. Averaging the weights of
several fine-tuned runs of one initialisation keeps what the runs share and averages out what
each run learned alone (Wortsman et al., "Model soups", ICML 2022); averaging a fine-tuned run
with its own initialisation interpolates between them (WiSE-FT, Wortsman et al., CVPR 2022).

The inputs must be one model: the same architecture config, the same tokenizer (token ids must
mean the same thing) and the same tensors by name and shape. Floating-point tensors are averaged
in float64 and written back in their own dtype; any other tensor must be equal in every input.
The output is a plain policy folder (``config.json``, ``model.safetensors``, ``tokenizer.json``)
that every command loads like a trained one, plus ``soup.json``: the inputs, their weights and the
SHA-256 of each input's ``model.safetensors``. It holds no trainer state, so ``sparserl train rl
--init SOUP`` starts a new run from it rather than resuming one.

Written here rather than taken from a merging library: mergekit, the well-kept one, needs an
architecture definition per model type and has none for this policy (a Llama decoder plus a
structure encoder); a weighted linear average with these checks is what it would do.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

SOUP_FILE = "soup.json"
#: config keys that differ between saves of one model and do not change the computation
_VOLATILE = {"transformers_version", "_name_or_path", "_commit_hash", "torch_dtype", "dtype"}


class SoupError(ValueError):
    """The inputs cannot be averaged (the message says which input and why)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parse_inputs(spec: str) -> list[tuple[str, float]]:
    """``"DIR[=WEIGHT],DIR[=WEIGHT],..."`` -> ``[(dir, weight), ...]`` (weight 1 where omitted)."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        path, sep, w = part.rpartition("=")
        if not sep:
            path, w = part, "1"
        try:
            weight = float(w)
        except ValueError:
            raise SoupError(f"weight {w!r} of {path!r} is not a number (write DIR=WEIGHT, e.g. runs/rl=0.5)") from None
        out.append((path, weight))
    return out


def soup(inputs: list[tuple[str, float]], out_dir: str | Path) -> dict:
    """Average the checkpoints ``inputs`` (``(folder, weight)``; weights are normalised to sum 1)
    into ``out_dir``; returns the provenance written to ``soup.json``."""
    from safetensors.torch import load_file

    from sparserl_compile.policy.model import load_policy, save_policy

    if len(inputs) < 2:
        raise SoupError(f"a soup needs at least two checkpoints, got {len(inputs)}")
    weights = [w for _, w in inputs]
    if any(not (w >= 0) for w in weights) or sum(weights) <= 0:
        raise SoupError(f"weights must be >= 0 with a positive sum, got {weights}")
    total = sum(weights)
    weights = [w / total for w in weights]
    out = Path(out_dir)
    if any(out.resolve() == Path(d).resolve() for d, _ in inputs):
        raise SoupError(f"--out {out} is one of the inputs; write the soup to a new folder")
    if (out / "model.safetensors").is_file() and not (out / SOUP_FILE).is_file():
        raise SoupError(f"--out {out} holds a checkpoint that is not a soup; write the soup to a new folder "
                        "(an earlier soup there is replaced)")

    first = Path(inputs[0][0])
    ref_cfg, ref_tok = _config(first), _tokenizer(first)  # a missing or damaged file says so before loading
    model, tok = load_policy(first)  # the model to write the average back into; the others are read as files
    ref_sd = load_file(str(first / "model.safetensors"))
    acc = {k: v.to(torch.float64) * weights[0] if v.is_floating_point() else v for k, v in ref_sd.items()}
    for (d, _), w in zip(inputs[1:], weights[1:]):
        cfg = _config(Path(d))
        diff = sorted(k for k in set(cfg) | set(ref_cfg) if cfg.get(k) != ref_cfg.get(k))
        if diff:
            raise SoupError(f"{d} is another model than {first}: config differs in {diff}")
        if _tokenizer(Path(d)) != ref_tok:
            raise SoupError(f"{d} has another tokenizer than {first}: token ids would not match")
        sd = load_file(str(Path(d) / "model.safetensors"))
        if set(sd) != set(ref_sd):
            raise SoupError(f"{d} has other tensors than {first}: {sorted(set(sd) ^ set(ref_sd))[:5]}")
        for k, v in sd.items():
            if v.shape != ref_sd[k].shape:
                raise SoupError(f"{d}: tensor {k} has shape {tuple(v.shape)}, {first} {tuple(ref_sd[k].shape)}")
            if v.is_floating_point():
                acc[k] += v.to(torch.float64) * w
            elif not torch.equal(v, ref_sd[k]):
                raise SoupError(f"{d}: non-float tensor {k} differs from {first}; it cannot be averaged")
    avg = {k: v.to(ref_sd[k].dtype) for k, v in acc.items()}
    missing, unexpected = model.load_state_dict(avg, strict=False)
    if unexpected or any(k not in _tied(model) for k in missing):
        raise SoupError(f"the averaged tensors do not fit the model: missing {missing}, unexpected {unexpected}")
    save_policy(model, tok, out)
    info = {
        "inputs": [{"checkpoint": str(d), "weight": w, "model_sha256": _sha256(Path(d) / "model.safetensors")}
                   for (d, _), w in zip(inputs, weights)],
        "method": "weighted linear average of every floating-point tensor (float64 accumulation); "
                  "other tensors equal in all inputs",
    }
    (out / SOUP_FILE).write_text(json.dumps(info, indent=1))
    return info


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"no {what} in {path.parent} ({path.name} missing): not a policy checkpoint folder")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SoupError(f"{path} is not valid JSON ({e}); the checkpoint folder is damaged") from None


def _config(d: Path) -> dict:
    return {k: v for k, v in _read_json(d / "config.json", "config").items() if k not in _VOLATILE}


def _tokenizer(d: Path) -> dict:
    return _read_json(d / "tokenizer.json", "tokenizer")


def provenance(directory: str | Path) -> dict:
    """Which checkpoint a report scored: its folder, the SHA-256 of its weights, and for a soup its
    inputs (``soup.json``). ``sparserl eval`` records this per variant."""
    d = Path(directory)
    out: dict = {"path": str(d), "model_sha256": _sha256(d / "model.safetensors")}
    if (d / SOUP_FILE).is_file():
        out["soup"] = json.loads((d / SOUP_FILE).read_text())["inputs"]
    return out


AVERAGE_DIR = "average"
AVERAGE_FILE = "average.json"


class RunningAverage:
    """The uniform average of a model's weights after each update from update ``start`` on, along
    one run (stochastic weight averaging, Izmailov et al., UAI 2018): ``sparserl train rl
    --average-from N`` keeps it beside the run and writes it to ``<out>/average/`` with every
    checkpoint. Where a soup averages runs, this averages one run's last updates, at no extra
    device time. Kept on the CPU in float32, every floating-point tensor of the state dict."""

    def __init__(self, start: int):
        if start < 1:
            raise ValueError(f"--average-from {start}: the first update to average is 1 or later")
        self.start, self.count, self.last, self.sd = start, 0, 0, None

    def update(self, model, update: int) -> None:
        """Fold in the weights after update ``update`` (1-based; earlier than ``start``: nothing)."""
        if update < self.start:
            return
        with torch.no_grad():
            cur = {k: v.detach().float().cpu() for k, v in model.state_dict().items() if v.is_floating_point()}
            self.count += 1
            if self.sd is None:
                self.sd = {k: v.clone() for k, v in cur.items()}
            else:
                for k, v in cur.items():
                    self.sd[k] += (v - self.sd[k]) / self.count
        self.last = update

    def save(self, model, tokenizer, out_dir: str | Path) -> Path | None:
        """Write the average as a policy folder ``<out_dir>/average`` (None before ``start``)."""
        import copy

        from sparserl_compile.policy.model import save_policy

        if self.sd is None:
            return None
        m = copy.deepcopy(model).cpu()
        sd = m.state_dict()
        m.load_state_dict({k: self.sd[k].to(sd[k].dtype) for k in self.sd}, strict=False)
        d = save_policy(m, tokenizer, Path(out_dir) / AVERAGE_DIR)
        (d / AVERAGE_FILE).write_text(json.dumps({"from_update": self.start, "updates": self.count,
                                                  "last_update": self.last}, indent=1))
        return d

    @classmethod
    def resume(cls, out_dir: str | Path, start: int, step: int) -> "RunningAverage":
        """The average a run saved in ``out_dir`` when it stopped at update ``step`` (a new one
        where none is due yet). Raises ValueError when the saved average does not end at ``step``."""
        from sparserl_compile.policy.model import load_policy

        avg = cls(start)
        d = Path(out_dir) / AVERAGE_DIR
        if not (d / AVERAGE_FILE).is_file():
            if step >= start:
                raise ValueError(f"{out_dir}: the run is at update {step} but holds no average of updates "
                                 f"{start}-{step} ({d / AVERAGE_FILE} missing); resume it without --average-from "
                                 "changes, or start a new --out-dir")
            return avg
        meta = _read_json(d / AVERAGE_FILE, "average")
        if meta.get("from_update") != start or meta.get("last_update") != step:
            raise ValueError(f"{d} averages updates {meta.get('from_update')}-{meta.get('last_update')}, "
                             f"but the run resumes at update {step} with --average-from {start}; "
                             "start a new --out-dir")
        m = load_policy(d)[0]
        avg.sd = {k: v.float().clone() for k, v in m.state_dict().items() if v.is_floating_point()}
        avg.count, avg.last = int(meta["updates"]), step
        return avg


def _tied(model) -> set[str]:
    """Names of parameters that a checkpoint leaves out because they are tied to another."""
    keys = getattr(model, "_tied_weights_keys", None) or []
    return set(keys if not isinstance(keys, dict) else keys.keys())


def add_parser(stages) -> None:
    """``sparserl train soup``."""
    _arguments(stages.add_parser("soup", help="average the weights of checkpoints of one model (model soup, WiSE-FT)",
                                 description=__doc__.split("\n\n")[0]))


def _arguments(p) -> None:
    p.add_argument("--checkpoints", required=True,
                   help="comma-separated DIR[=WEIGHT] (weight 1 where omitted; normalised to sum 1), "
                        "e.g. runs/rl1,runs/rl2,runs/rl3 or runs/sft=0.5,runs/rl=0.5")
    p.add_argument("--out", required=True, help="new folder for the averaged checkpoint")
    p.set_defaults(func=_cli)


def _cli(a) -> int:
    try:
        info = soup(parse_inputs(a.checkpoints), a.out)
    except (SoupError, FileNotFoundError) as e:
        print(f"sparserl train soup: {e}", file=sys.stderr)
        return 2
    for i in info["inputs"]:
        print(f"{i['weight']:.4f}  {i['checkpoint']}")
    print(f"soup of {len(info['inputs'])} checkpoints in {a.out}")
    return 0


if __name__ == "__main__":  # python -m sparserl_compile.training.soup --checkpoints ... --out ...
    ap = argparse.ArgumentParser(prog="python -m sparserl_compile.training.soup", description=__doc__.split("\n\n")[0])
    _arguments(ap)
    sys.exit(_cli(ap.parse_args()))
