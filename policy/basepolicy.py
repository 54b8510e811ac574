"""The policy on a pretrained base: SmolLM2-135M (``base.py``) with LoRA adapters, the structure
encoder's prefix projected into its embedding space, and its own tokenizer.

``BasePolicy`` has the interface of ``model.SparseRLPolicy`` that decoding and training use
(``forward(input_ids, structure, ...)`` returning ``PolicyOutput`` with logits, values and the
KV cache; ``config.vocab_size``, ``config.max_points``, ``config.retrieval``), so ``decode.py``,
the grammar masks and ``training/lm.py``'s loop run it unchanged:

- the structure encoder (``encoder.StructureEncoder``: the sinusoidal embeddings of the sampled
  nonzeros' row, column and diagonal offset, attention-pooled into ``n_slots`` vectors, and the
  structure features projected to one more) at width ``d_encoder``, then a linear projection to
  the base's hidden size, placed before the token embeddings in ``inputs_embeds``; the
  projection starts at the scale of the base's token embeddings;
- LoRA adapters (``peft``) on the base's attention and MLP projections; the base's own weights
  stay frozen and are not trained;
- the base's tokenizer (SmolLM2's byte-level BPE, 49152 tokens): the prompt's ``<|structure|>``
  and ``<|kernel|>`` are plain text to it, ``<|eos|>`` is its end-of-text token; a value head
  for PPO.

A checkpoint folder holds ``base_policy.json`` (this config, naming the base's SHA-256) and
``model.safetensors`` with only the trained tensors: the adapters, the encoder, the projection
and the value head. Loading finds the base (``base.resolve_base``) and refuses one whose SHA-256
differs. ``write_tiny_base`` saves a tiny random Llama with a small tokenizer as a base folder:
the same code on a CPU in seconds (tests and CI).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn

from sparserl_compile.policy.base import BaseInfo, BaseUnavailable, resolve_base, weights_file
from sparserl_compile.policy.encoder import StructureBatch, StructureEncoder, point_mlp
from sparserl_compile.policy.prefix import PolicyOutput, prefixed_forward

CONFIG_FILE = "base_policy.json"
WEIGHTS_FILE = "model.safetensors"
KIND = "sparserl-pretrained-base-policy"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class BaseMismatch(ValueError):
    """The base found is not the one the checkpoint was trained on."""


@dataclass
class BasePolicyConfig:
    """What a checkpoint needs to be rebuilt on its base (``base_policy.json``)."""

    base_sha256: str = ""  # of the base's weights file (``base.weights_file``)
    base_name: str = ""  # its file name, for messages
    vocab_size: int = 0  # the base's (the logits' width, the grammar masks' width)
    hidden_size: int = 0  # the base's embedding width
    d_encoder: int = 256  # the structure encoder's width, projected to hidden_size
    n_slots: int = 16
    n_freqs: int = 12
    n_features: int = 39
    sinusoidal: bool = True
    max_points: int = 1024
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_targets: tuple = LORA_TARGETS
    retrieval: bool = False  # trained with retrieval hints in the prompt
    retrieval_hints: int = 1
    kind: str = KIND

    @classmethod
    def tiny(cls, n_features: int) -> "BasePolicyConfig":
        """The encoder and adapters of the CI configuration (with ``write_tiny_base``)."""
        return cls(d_encoder=32, n_slots=4, n_freqs=6, n_features=n_features, max_points=128, lora_r=8,
                   lora_alpha=16, lora_dropout=0.0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["lora_targets"] = list(self.lora_targets)
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "BasePolicyConfig":
        if d.get("kind") != KIND:
            raise ValueError(f"{where}: kind {d.get('kind')!r} is not {KIND!r}; not a pretrained-base checkpoint")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown settings {unknown}: written by a newer sparserl; upgrade it")
        d = dict(d)
        d["lora_targets"] = tuple(d.get("lora_targets", LORA_TARGETS))
        return cls(**d)


def load_base(info: BaseInfo, dtype: torch.dtype = torch.float32):
    """The base's causal LM and tokenizer (transformers; a GGUF file is dequantized to ``dtype``
    by its GGUF reader, which needs the ``gguf`` package of the ``llm`` extra)."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    p = Path(info.path)
    if p.is_dir():
        where, kw = str(p), {}
    else:
        if importlib.util.find_spec("gguf") is None:
            raise BaseUnavailable(f"reading the base {p.name} needs the gguf package: pip install 'sparserl[llm]'")
        where, kw = str(p.parent), {"gguf_file": p.name}
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        lm = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kw)
        tok = AutoTokenizer.from_pretrained(where, **kw)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    if tok.eos_token_id is None:
        raise ValueError(f"the base {p.name}'s tokenizer has no end-of-text token; the policy ends kernels with it")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # padding is masked out of attention and loss
    if len(tok) > lm.config.vocab_size:
        raise ValueError(f"the base {p.name}'s tokenizer has {len(tok)} tokens, more than its model's "
                         f"{lm.config.vocab_size} embeddings")
    return lm, tok


class BasePolicy(nn.Module):
    """A frozen base causal LM with LoRA adapters, a projected structure prefix and a value head."""

    def __init__(self, lm, config: BasePolicyConfig):
        super().__init__()
        try:
            from peft import LoraConfig, inject_adapter_in_model
        except ImportError as e:
            raise ImportError(f"the pretrained-base policy's adapters need peft ({e}): pip install 'sparserl[train]'") from e

        self.config = config
        lm.requires_grad_(False)
        lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                          target_modules=list(config.lora_targets), bias="none")
        self.lm = inject_adapter_in_model(lora, lm)
        for name, p in self.lm.named_parameters():
            p.requires_grad_("lora_" in name)
        d, hidden = config.d_encoder, config.hidden_size
        self.encoder = StructureEncoder(d, config.n_features, config.n_slots, config.n_freqs,
                                        n_heads=max(1, d // 64), sinusoidal=config.sinusoidal)
        self.proj = nn.Linear(d, hidden, bias=False)
        # the encoder's output is layer-normed (about unit scale per channel): the projection
        # starts at the root-mean-square of the base's token embeddings
        emb_rms = float(self.lm.get_input_embeddings().weight.detach().float().pow(2).mean().sqrt())
        nn.init.normal_(self.proj.weight, std=emb_rms / math.sqrt(d))
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def prefix_len(self) -> int:
        return self.config.n_slots + 1

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def n_trained(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def reset_point_mlp(self, sinusoidal: bool | None = None) -> None:
        """A freshly initialized point MLP for the structure encoder (``SparseRLPolicy.reset_point_mlp``)."""
        if sinusoidal is None:
            sinusoidal = self.config.sinusoidal
        self.config.sinusoidal = sinusoidal
        p = self.proj.weight
        mlp = point_mlp(self.config.d_encoder, self.encoder.n_freqs, sinusoidal).to(device=p.device, dtype=p.dtype)
        self.encoder.point_mlp, self.encoder.use_sin = mlp, sinusoidal

    def drop_sinusoidal(self) -> None:
        """The no-sinusoidal ablation (``SparseRLPolicy.drop_sinusoidal``)."""
        self.reset_point_mlp(sinusoidal=False)

    def forward(self, input_ids: torch.Tensor, structure: StructureBatch | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values=None,
                use_cache: bool = False, past_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **_) -> PolicyOutput:
        """``SparseRLPolicy.forward``'s contract, on the base's decoder and LM head."""
        emb = self.lm.get_input_embeddings()(input_ids)
        prefix = self.proj(self.encoder(structure.to(emb.device))) if structure is not None else None
        return prefixed_forward(self.lm.get_decoder(), self.lm.get_output_embeddings(), self.value_head, emb,
                                prefix, attention_mask, past_key_values, use_cache, past_mask, position_ids)

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint ships: everything but the base's own weights."""
        return {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()
                if not k.startswith("lm.") or "lora_" in k}

    def save_checkpoint(self, directory: str | Path) -> Path:
        """``model.safetensors`` (``trained_state``) and ``base_policy.json`` into ``directory``."""
        from safetensors.torch import save_file

        from sparserl_compile.fileio import write_atomic

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_file(self.trained_state(), str(d / WEIGHTS_FILE), metadata={"base_sha256": self.config.base_sha256})
        write_atomic(d / CONFIG_FILE, json.dumps(self.config.to_dict(), indent=1))
        return d


def build_base_policy(base: str | Path | None = None, config: BasePolicyConfig | None = None, seed: int = 0,
                      device: str | torch.device = "cpu"):
    """A new policy on the base (``base.resolve_base(base)``): adapters at zero (the model is the
    base's until trained), encoder and projection drawn from ``seed``. Returns ``(model, tokenizer)``."""
    from sparserl_compile.policy.encoder import structure_features
    import numpy as np

    info = resolve_base(base)
    lm, tok = load_base(info)
    cfg = config or BasePolicyConfig(n_features=len(structure_features(np.array([0, 1]), np.array([0]), (1, 1))))
    cfg.base_sha256, cfg.base_name = info.sha256, weights_file(info.path).name
    cfg.vocab_size, cfg.hidden_size = int(lm.config.vocab_size), int(lm.config.hidden_size)
    torch.manual_seed(seed)
    return BasePolicy(lm, cfg).to(device), tok


def read_config(directory: str | Path) -> BasePolicyConfig:
    p = Path(directory) / CONFIG_FILE
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{p} is unreadable ({e}); the checkpoint is damaged") from e
    return BasePolicyConfig.from_dict(d, str(p))


def load_base_policy(directory: str | Path, device: str | torch.device = "cpu", base: str | Path | None = None):
    """A pretrained-base checkpoint on its base: ``(model, tokenizer)``. ``BaseUnavailable`` when
    no base is found, ``BaseMismatch`` when the base found has another SHA-256."""
    from safetensors.torch import load_file

    d = Path(directory)
    cfg = read_config(d)
    if not (d / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{d / WEIGHTS_FILE} is missing: the checkpoint has its config but not its weights")
    info = resolve_base(base)
    if info.sha256 != cfg.base_sha256:
        raise BaseMismatch(
            f"{d} was trained on the base {cfg.base_name} with sha256 {cfg.base_sha256}, but the base found at "
            f"{info.path} has sha256 {info.sha256}; its adapters would run on other weights. Fetch the "
            "checkpoint's base (python -m sparserl_compile.policy.base fetch) or point $SPARSERL_BASE to it")
    lm, tok = load_base(info)
    model = BasePolicy(lm, cfg)
    state = load_file(str(d / WEIGHTS_FILE))
    missing, unexpected = model.load_state_dict(state, strict=False)
    lost = [k for k in missing if not k.startswith("lm.") or "lora_" in k]
    if unexpected or lost:
        raise ValueError(f"{d / WEIGHTS_FILE} does not fit its config: {len(unexpected)} unexpected tensors "
                         f"{unexpected[:3]}, {len(lost)} missing {lost[:3]}")
    return model.to(device).eval(), tok


def write_tiny_base(directory: str | Path, tokenizer, seed: int = 0, hidden: int = 64, layers: int = 2) -> BaseInfo:
    """A tiny random Llama (``hidden`` wide, ``layers`` blocks, 2 heads / 1 KV head) with
    ``tokenizer`` saved as a base folder: the pretrained-base policy's code without a download
    (tests, CI). Its weights are drawn ten times wider than Llama's default (std 0.2), so that
    its logits span a range the adapters can move within a few steps, as a trained base's do.
    Returns its ``BaseInfo``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from sparserl_compile.fileio import file_sha256

    d = Path(directory)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=2 * hidden, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, initializer_range=0.2)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(d)
    return BaseInfo(d, file_sha256(d / "model.safetensors"))
