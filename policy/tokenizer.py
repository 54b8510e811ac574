"""The policy's tokenizer: byte-level BPE trained on the CUDA corpus, plus four special tokens.

A prompt the policy reads and a completion it writes look like this (the structure prefix,
a block of embedding vectors from ``encoder.py``, is placed by the model in front of the
token embeddings and is not text)::

    [P structure vectors] <|structure|>op=spmv dtype=f32 n=1<|kernel|>// sparserl op=... <|eos|>

``<|pad|>`` fills batches. The tokenizer is byte-level, so every byte string -- including any
kernel the grammar allows -- has an encoding; nothing maps to an unknown token.

This module trains, loads and memoizes tokenizers; it does not know about the model or the grammar.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

STRUCTURE = "<|structure|>"
KERNEL = "<|kernel|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (PAD, EOS, STRUCTURE, KERNEL)  # ids 0..3 in this order

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class TokenizerSpec:
    """How to train the BPE."""

    vocab_size: int = 2048  # merges + 256 bytes + 4 specials; small because the corpus is narrow
    min_frequency: int = 2  # a pair must occur this often to be merged


def prompt_text(op: str, dtype: str, n: int, hint: str | None = None) -> str:
    """The text part of the prompt (after the structure prefix), ending with ``<|kernel|>``;
    ``hint``: the nearest measured matrix's winning kernel (``policy/retrieval.py``), for
    policies trained with hints."""
    near = f" near={hint}" if hint else ""
    return f"{STRUCTURE}op={op} dtype={dtype} n={int(n)}{near}{KERNEL}"


def train_tokenizer(texts: Iterable[str], spec: TokenizerSpec = TokenizerSpec()):
    """Train a byte-level BPE on ``texts``; returns a ``transformers.PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if spec.vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={spec.vocab_size} is below 256 bytes + {len(SPECIAL_TOKENS)} special "
            "tokens; use at least 260"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=spec.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap(tok)


def wrap(tok):
    """Wrap a ``tokenizers.Tokenizer`` as a ``PreTrainedTokenizerFast`` with our specials."""
    from transformers import PreTrainedTokenizerFast

    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise ValueError(f"tokenizer has {s!r} at id {tok.token_to_id(s)}, expected {i}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[STRUCTURE, KERNEL],
    )


def save_tokenizer(tokenizer, directory: str | Path) -> Path:
    """Write ``tokenizer.json`` (the only file needed to load it again)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / TOKENIZER_FILE
    tokenizer.backend_tokenizer.save(str(path))
    return path


def load_tokenizer(directory: str | Path):
    """Load ``tokenizer.json`` from ``directory`` (a checkpoint folder)."""
    from tokenizers import Tokenizer

    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: a policy checkpoint folder holds tokenizer.json next to "
            "model.safetensors; train one with `sparserl train pretrain`"
        )
    return wrap(Tokenizer.from_file(str(path)))


def tokenizer_key(tokenizer) -> str:
    """A content hash of the tokenizer, memoized on the object (ids can be reused after GC)."""
    key = getattr(tokenizer, "_sparserl_key", None)
    if key is None:
        key = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
        tokenizer._sparserl_key = key
    return key


_ENCODED: dict[tuple, list[int]] = {}


def encode_cached(tokenizer, text: str) -> list[int]:
    """``tokenizer.encode(text)``, remembered per tokenizer: the drafts (rendered kernel-space
    kernels) and prompts repeat across a proposal's decoding calls and across proposals, and
    encoding each anew is a noticeable part of a proposal's host time.
    A fresh list each call; at most 4096 texts are kept (then the memo starts over)."""
    try:
        key = (tokenizer_key(tokenizer), text)
    except AttributeError:  # not a fast (Rust-backed) tokenizer: nothing to key it by
        return tokenizer.encode(text)
    ids = _ENCODED.get(key)
    if ids is None:
        if len(_ENCODED) >= 4096:
            _ENCODED.clear()
        ids = _ENCODED[key] = tokenizer.encode(text)
    return list(ids)
