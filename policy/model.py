"""The policy model: a small Llama-style causal LM with a structure prefix and a value head.

``SparseRLPolicy`` is a ``transformers.PreTrainedModel``: a ``LlamaModel`` decoder, an LM head,
the ``StructureEncoder`` (``encoder.py``) whose ``n_slots + 1`` output vectors are placed in
``inputs_embeds`` before the token embeddings, and a scalar value head (used by PPO, ignored
elsewhere). Checkpoints are written with ``save_pretrained`` as one ``model.safetensors``
plus ``config.json``, and the tokenizer beside them; loading never unpickles.

Sizes: ``PolicyHParams()`` gives about 4 M parameters (a 16-bit checkpoint well under 16 MiB);
tests use ``PolicyHParams.tiny()``.

This module builds, runs and saves the network; it does not sample (``decode.py``) or train
(``training/``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaModel, LlamaPreTrainedModel

from sparserl_compile.policy.encoder import StructureBatch, StructureEncoder, point_mlp
from sparserl_compile.policy.prefix import PolicyOutput, prefixed_forward



@dataclass
class PolicyHParams:
    """Model hyperparameters (the tokenizer fixes ``vocab_size``)."""

    vocab_size: int = 2048  # tokens, including the four special tokens
    d_model: int = 256  # width of the residual stream
    n_layers: int = 4  # decoder blocks
    n_heads: int = 4  # attention heads (head size d_model / n_heads)
    n_kv_heads: int = 2  # key/value heads (grouped-query attention)
    d_ff: int = 704  # MLP hidden width (SwiGLU)
    max_positions: int = 2048  # prefix + prompt + kernel tokens the model can attend over
    rope_theta: float = 10000.0  # rotary embedding base
    n_slots: int = 16  # structure prefix vectors from attention pooling of the nonzeros
    n_freqs: int = 12  # sinusoidal frequency banks per coordinate (row, column, diagonal)
    n_features: int = 39  # width of structure.features(...).as_vector()
    sinusoidal: bool = True  # False: raw coordinates, the no-sinusoidal-embedding ablation
    max_points: int = 1024  # nonzeros shown to the encoder (stratified sample beyond this)

    @classmethod
    def tiny(cls, vocab_size: int, n_features: int) -> "PolicyHParams":
        """A model for tests and CI: ~100k parameters, trains in seconds on a CPU."""
        return cls(vocab_size=vocab_size, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1,
                   d_ff=128, max_positions=1024, n_slots=4, n_freqs=6,
                   n_features=n_features, max_points=128)

    @classmethod
    def small(cls, vocab_size: int, n_features: int) -> "PolicyHParams":
        """~1.1M parameters: a size that trains on a few CPU cores; GPU training uses the
        default."""
        return cls(vocab_size=vocab_size, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                   d_ff=352, max_positions=1024, n_slots=8, n_freqs=8,
                   n_features=n_features, max_points=512)

    def to_config(self, **special_ids) -> "PolicyConfig":
        return PolicyConfig(
            vocab_size=self.vocab_size, hidden_size=self.d_model, num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads, num_key_value_heads=self.n_kv_heads,
            intermediate_size=self.d_ff, max_position_embeddings=self.max_positions,
            rope_theta=self.rope_theta, tie_word_embeddings=True,
            n_slots=self.n_slots, n_freqs=self.n_freqs, n_features=self.n_features,
            sinusoidal=self.sinusoidal, max_points=self.max_points, **special_ids,
        )


class PolicyConfig(LlamaConfig):
    """``LlamaConfig`` plus the structure encoder's settings."""

    model_type = "sparserl_policy"

    def __init__(self, n_slots: int = 16, n_freqs: int = 12, n_features: int = 39,
                 sinusoidal: bool = True, max_points: int = 1024, retrieval: bool = False, **kwargs):
        self.n_slots = n_slots
        self.n_freqs = n_freqs
        self.n_features = n_features
        self.sinusoidal = sinusoidal
        self.max_points = max_points
        self.retrieval = retrieval  # trained with retrieval hints in the prompt (policy/retrieval.py)
        kwargs.setdefault("pad_token_id", 0)
        kwargs.setdefault("eos_token_id", 1)
        kwargs.setdefault("bos_token_id", 2)
        super().__init__(**kwargs)


class SparseRLPolicy(LlamaPreTrainedModel):
    config_class = PolicyConfig
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: PolicyConfig):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.encoder = StructureEncoder(
            config.hidden_size, config.n_features, config.n_slots, config.n_freqs,
            n_heads=max(1, config.hidden_size // 64), sinusoidal=config.sinusoidal)
        self.value_head = nn.Linear(config.hidden_size, 1)
        self.post_init()

    def drop_sinusoidal(self) -> None:
        """The no-sinusoidal ablation: the structure encoder's point MLP is replaced by a freshly
        initialized one over the four raw coordinates (``sinusoidal=False``); the rest of the
        encoder (feature projection, pooling) and the language model are kept. Fine-tune
        afterwards (``sparserl train sft --no-sinusoidal``)."""
        self.reset_point_mlp(sinusoidal=False)

    def reset_point_mlp(self, sinusoidal: bool | None = None) -> None:
        """Replace the structure encoder's point MLP by a freshly initialized one, over the
        sinusoidal embedding (``sinusoidal=True``), the four raw coordinates (``False``) or
        whichever the checkpoint has (``None``). With the embedding kept this is the control of
        the no-sinusoidal ablation, which also starts that MLP afresh
        (``sparserl train sft --reset-point-mlp``)."""
        if sinusoidal is None:
            sinusoidal = self.config.sinusoidal
        self.config.sinusoidal = sinusoidal
        enc = self.encoder
        p = next(self.parameters())
        mlp = point_mlp(self.config.hidden_size, enc.n_freqs, sinusoidal).to(device=p.device, dtype=p.dtype)
        mlp.apply(self._init_weights)
        enc.point_mlp, enc.use_sin = mlp, sinusoidal

    @property
    def prefix_len(self) -> int:
        return self.config.n_slots + 1

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: torch.Tensor, structure: StructureBatch | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values=None,
                use_cache: bool = False, past_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **_) -> PolicyOutput:
        """Run the decoder over ``[structure prefix] + input_ids``.

        With ``structure`` the prefix is prepended (the first call of a generation or a training
        step); without it ``input_ids`` continue ``past_key_values``. ``attention_mask`` covers
        ``input_ids`` only (the prefix is always attended). ``past_mask`` (B, cache length): which
        cached positions each row attends to (default all; batched speculative decoding leaves
        holes where a row rejected draft tokens), with ``position_ids`` (B, T) the rows' own
        positions of ``input_ids`` (default: right after the cache).
        """
        emb = self.model.embed_tokens(input_ids)
        prefix = self.encoder(structure.to(emb.device)) if structure is not None else None
        return prefixed_forward(self.model, self.lm_head, self.value_head, emb, prefix, attention_mask,
                                past_key_values, use_cache, past_mask, position_ids)


class CountingPolicy(nn.Module):
    """A policy that counts its forwards (``calls``), for benchmarks and tests of decoding: on a
    GPU a forward of this small model costs about as much for one row as for several, so the
    count is what speculative and batched decoding save there."""

    def __init__(self, model: SparseRLPolicy):
        super().__init__()
        self.model, self.config, self.calls = model, model.config, 0

    def forward(self, *a, **kw):
        self.calls += 1
        return self.model(*a, **kw)


def build_policy(hp: PolicyHParams, seed: int = 0) -> SparseRLPolicy:
    """A freshly initialized policy (deterministic in ``seed``)."""
    torch.manual_seed(seed)
    return SparseRLPolicy(hp.to_config())


def save_policy(model: SparseRLPolicy, tokenizer, directory: str | Path) -> Path:
    """Write ``config.json``, ``model.safetensors`` and ``tokenizer.json`` into ``directory``."""
    from sparserl_compile.policy.tokenizer import save_tokenizer

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_checkpoint"):  # a pretrained-base policy: its tokenizer is the base's
        model.save_checkpoint(d)
        return d
    model.save_pretrained(d, safe_serialization=True)
    if tokenizer is not None:
        save_tokenizer(tokenizer, d)
    return d


def load_policy(directory: str | Path, device: str | torch.device = "cpu", base: str | Path | None = None):
    """Load a checkpoint folder: returns ``(model, tokenizer)``; safetensors only. A
    pretrained-base checkpoint (``basepolicy.py``) loads onto its base: ``base``, else
    ``$SPARSERL_BASE``, else the fetched one, refused unless its SHA-256 is the checkpoint's."""
    from sparserl_compile.policy.tokenizer import load_tokenizer

    d = Path(directory)
    from sparserl_compile.policy.basepolicy import CONFIG_FILE, load_base_policy

    if (d / CONFIG_FILE).is_file():
        return load_base_policy(d, device, base=base)
    if not (d / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"no policy checkpoint in {d} (model.safetensors missing): give a folder a `sparserl train` stage "
            "wrote (its --out-dir), or the shipped policy/checkpoints/default"
        )
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a serving process loads it on its first new structure: no bar on stderr
    try:
        model = SparseRLPolicy.from_pretrained(d, use_safetensors=True).to(device)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    model.eval()
    return model, load_tokenizer(d)


def hparams_of(model: SparseRLPolicy) -> dict:
    """The config as a plain dict (for logs and reports)."""
    return {k: v for k, v in model.config.to_dict().items() if not k.startswith("_")}


_ = asdict  # re-exported helper for callers that log PolicyHParams
