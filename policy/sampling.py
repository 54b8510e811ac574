"""What one sample of the policy is: how it is drawn (``DecodeConfig``), what it holds
(``Rollout``), how a token is chosen from masked logits (``pick_tokens``), and the text helpers
that read a sample's contract header while it is still being written (``header_of``,
``format_of``, ``header_prefix``) or turn a kernel into a training target (``completion_ids``).

The decoding loops are ``decode.py`` (plain) and ``speculative.py`` (against drafts); the
grammar masks are ``masks.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DecodeConfig:
    """How to sample."""

    greedy: bool = False  # argmax at each step (k identical samples; use k=1)
    temperature: float = 1.0  # softmax temperature when sampling
    top_k: int = 0  # keep only the k most likely allowed tokens (0 = all)
    max_new_tokens: int = 1024  # a sample not finished by then is returned with finished=False
    constrained: bool = True  # llguidance grammar masks; False is the unconstrained ablation
    seed: int | None = None  # torch generator seed for reproducible samples
    #: record each token's grammar mask and log-probability (PPO needs them). False, with
    #: speculative decoding: greedy, where the model's top token is grammatical it is the masked
    #: argmax too, so the mask is not computed there (same tokens); sampling without top-k, each
    #: forward's positions are drawn unmasked at once and a draw the grammar rejects is drawn
    #: again under its mask (the masked distribution; other draws than traced). ``logprobs`` NaN
    #: there, ``masks`` None
    trace: bool = True
    #: speculative decoding (``references`` given): the longest draft one forward checks. Longer
    #: drafts cost little more per forward (the model is small; a step is mostly host work) and
    #: save forwards where the model writes what a reference says (``benchmarks/decode_speed.py``
    #: compares lengths). Never changes a sample.
    draft_len: int = 128
    #: speculative decoding of k > 1 samples: all in one batch, each with its own drafts, instead
    #: of one after another (``generate_speculative``). The same distribution; about as many
    #: forwards as the slowest sample takes instead of their sum
    batch_drafts: bool = False

@dataclass
class Rollout:
    """One sample: what was written and everything PPO needs to score it again."""

    prompt_ids: list[int]
    tokens: list[int]  # completion tokens, including the final <|eos|> if finished
    text: str  # completion text without <|eos|>
    logprobs: list[float]  # per token, under the (masked) sampling distribution
    finished: bool  # ended with <|eos|> (not cut by max_new_tokens)
    masks: torch.Tensor | None = None  # (len(tokens), ceil(V/32)) int32 packed allowed-token bitmask
    grammar_error: str | None = None  # llguidance's message if the matcher failed
    extra: dict = field(default_factory=dict)

def seeded_generator(cfg: "DecodeConfig", device) -> torch.Generator | None:
    """The seeded sampling generator of ``cfg`` (None: torch's global one)."""
    if cfg.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(cfg.seed)
    return gen

def pick_tokens(logits: torch.Tensor, cfg: DecodeConfig, gen: torch.Generator | None):
    """Choose one token per row; returns (tokens, logprobs of the chosen tokens)."""
    if cfg.greedy:
        logp = torch.log_softmax(logits, -1)
        tok = logits.argmax(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    scaled = logits / max(cfg.temperature, 1e-5)
    if cfg.top_k:
        kth = scaled.topk(min(cfg.top_k, scaled.shape[-1]), -1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    logp = torch.log_softmax(scaled, -1)
    tok = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)

def header_prefix(op: str, fmt: str) -> str:
    """The start of a kernel up to and including its format choice (header line 1) and the next
    key, ``dtype``, which closes the format's name: forced or scored without it, ``format=csr``
    would go on as ``csr_split`` (a format whose name extends another's)."""
    return f"// sparserl op={op} format={fmt} dtype"

def format_of(source: str) -> str | None:
    """The format named in a kernel's first line (``header_prefix``), None without one. Unlike
    ``contract.parse_header`` it checks nothing, so it reads unfinished samples too."""
    first = source.lstrip().split("\n", 1)[0]
    return first.split("format=", 1)[1].split()[0] if "format=" in first else None

def header_of(text: str) -> str | None:
    """The two header lines of a generated kernel once both are written, else None."""
    lines = text.split("\n", 2)
    return "\n".join(lines[:2]) if len(lines) == 3 else None

def completion_ids(tokenizer, source: str) -> list[int]:
    """Token ids of a training target: the kernel (trailing whitespace stripped) and <|eos|>.

    The grammar ends at the kernel's closing brace, so targets must not end in whitespace.
    """
    return tokenizer.encode(source.rstrip()) + [tokenizer.eos_token_id]
