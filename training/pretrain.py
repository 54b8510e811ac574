"""Stage 1: causal language modelling on the CUDA corpus (``corpus.py``).

Trains the tokenizer on the corpus (unless the output folder already holds one), builds a
fresh policy, and trains it on random windows of ``block_size`` tokens of the concatenated
corpus. No structure prefix is used in this stage. Resumes from ``out_dir`` if it holds a
pretraining state. Output: a policy checkpoint folder for ``sft.py``.

With ``--base`` the model is instead a pretrained base with LoRA adapters
(``policy/basepolicy.py``), whose own tokenizer reads the corpus; only the adapters are trained
here (the structure encoder first sees a matrix in SFT).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from sparserl_compile.training.config import check_resume, opt, resolve_device, save_config


@dataclass
class PretrainConfig:
    out_dir: str = opt("runs/pretrain", "output checkpoint folder (resumed if it holds a state)")
    size: str = opt("default", "model size: 'default' (~4M parameters), 'small' (~1.1M, the CPU-trained shipped checkpoint) or 'tiny' (CI)")
    vocab_size: int = opt(2048, "BPE vocabulary size")
    max_corpus_bytes: int = opt(32_000_000, "cap on the corpus text collected at run time")
    corpus_sources: str = opt("kernel_space,cuda_toolkit,nvidia_wheels,torch,cupy",
                              "comma-separated corpus sources (training/corpus.py)")
    steps: int = opt(2000, "optimizer steps (total, across resumed runs)")
    batch_size: int = opt(16, "sequences per step")
    block_size: int = opt(512, "tokens per sequence")
    lr: float = opt(1e-3, "peak learning rate (AdamW, cosine decay)")
    seed: int = opt(0, "seed for initialization and window sampling")
    log_every: int = opt(20, "log the loss every this many steps")
    save_every: int = opt(200, "checkpoint every this many steps")
    device: str = opt("auto", "'auto' (cuda when torch sees a GPU), 'cpu' or 'cuda'")
    time_budget_s: float = opt(0.0, "cap the steps so this run takes about this long (0 = no cap)")
    base: str = opt("", "continue pretraining a pretrained base instead of a fresh model (policy/basepolicy.py: "
                        "LoRA adapters and the structure encoder are trained, the base's tokenizer is used, "
                        "--vocab-size is ignored): 'fetched' (the base `sparserl train fetch-base` keeps), or a "
                        "GGUF file or save_pretrained folder; --size tiny picks the CI encoder and adapters")

    @classmethod
    def tiny(cls, out_dir: str) -> "PretrainConfig":
        return cls(out_dir=out_dir, size="tiny", vocab_size=400, max_corpus_bytes=400_000,
                   steps=30, batch_size=4, block_size=128, lr=3e-3, log_every=10, save_every=15)


def hparams_for(size: str, vocab_size: int):
    from sparserl_compile.policy.encoder import structure_features
    from sparserl_compile.policy.model import PolicyHParams

    n_feat = len(structure_features(np.array([0, 1]), np.array([0]), (1, 1)))
    if size == "tiny":
        return PolicyHParams.tiny(vocab_size, n_feat)
    if size == "small":
        return PolicyHParams.small(vocab_size, n_feat)
    if size == "default":
        return PolicyHParams(vocab_size=vocab_size, n_features=n_feat)
    raise ValueError(f"size={size!r}: choose 'default', 'small' or 'tiny'")


def pretrain(cfg: PretrainConfig, texts: list[str] | None = None, log=print):
    """Run stage 1; ``texts`` overrides the corpus (tests). Returns ``lm.FitResult``.

    Under ``torchrun`` (``training/dist.py``): ``batch_size`` is the global batch (a multiple
    of the world size); rank 0 collects the corpus and trains the tokenizer, every rank gets
    them by broadcast, draws the step's windows with the one-process rng and trains on its
    slice (DDP, ``lm.fit``).
    """
    from sparserl_compile.policy.model import build_policy, load_policy
    from sparserl_compile.policy.tokenizer import TokenizerSpec, train_tokenizer, wrap
    from sparserl_compile.training import dist as tdist
    from sparserl_compile.training.checkpoint import has_state
    from sparserl_compile.training.corpus import build_corpus
    from sparserl_compile.training.lm import LMExample, collate, fit

    ctx = tdist.setup(resolve_device(cfg.device))
    tdist.shard_bounds(cfg.batch_size, ctx, "sequences per step (--batch-size, the global batch)")
    log = tdist.quiet_unless_main(log, ctx)
    out = Path(cfg.out_dir)
    if has_state(out):
        check_resume(cfg, out, "pretrain")
    elif cfg.base:  # a wrong --base is named now, not after the corpus is collected
        from sparserl_compile.policy.base import resolve_base

        resolve_base(None if cfg.base == "fetched" else cfg.base)
    if ctx.is_main:
        save_config(cfg, out, "pretrain")
    if texts is None:
        if ctx.is_main:
            corpus = build_corpus(cfg.max_corpus_bytes, sources=tuple(cfg.corpus_sources.split(",")))
            log(corpus.stats.summary())
            texts = corpus.texts()
        if ctx.distributed:
            texts = tdist.broadcast_object(texts)  # one corpus for all ranks
    if not texts:
        raise ValueError("the pretraining corpus is empty: no CUDA sources were found "
                         "(set CUDA_HOME or install the nvidia-* / cupy wheels)")
    base = None if cfg.base in ("", "fetched") else cfg.base
    if has_state(out):
        model, tok = load_policy(out, base=base)
        log(f"[pretrain] resuming from {out}")
    elif cfg.base:
        from sparserl_compile.policy.basepolicy import BasePolicyConfig, build_base_policy

        n_feat = hparams_for("tiny", 260).n_features
        bcfg = BasePolicyConfig.tiny(n_feat) if cfg.size == "tiny" else BasePolicyConfig(n_features=n_feat)
        model, tok = build_base_policy(base, bcfg, seed=cfg.seed)
        log(f"[pretrain] on the base {model.config.base_name} (sha256 {model.config.base_sha256[:12]}): "
            f"{model.n_trained() / 1e6:.2f}M trained parameters (LoRA r={bcfg.lora_r}, structure encoder)")
    else:
        from tokenizers import Tokenizer

        tok = train_tokenizer(texts, TokenizerSpec(vocab_size=cfg.vocab_size)) if ctx.is_main else None
        if ctx.distributed:  # rank 0's tokenizer everywhere
            tok_json = tdist.broadcast_object(tok.backend_tokenizer.to_str() if ctx.is_main else None)
            tok = tok if ctx.is_main else wrap(Tokenizer.from_str(tok_json))
        model = build_policy(hparams_for(cfg.size, len(tok)), seed=cfg.seed)
    log(f"[pretrain] {model.n_params() / 1e6:.2f}M parameters, vocab {len(tok)}")
    ids = np.fromiter((t for txt in texts for t in tok.encode(txt) + [tok.eos_token_id]), dtype=np.int64)
    if ids.size <= cfg.block_size + 1:
        raise ValueError(f"corpus has {ids.size} tokens, fewer than one block of {cfg.block_size}")

    def make_batch(step: int):
        rng = np.random.default_rng(cfg.seed * 1_000_003 + step)
        starts = rng.integers(0, ids.size - cfg.block_size - 1, size=cfg.batch_size)
        starts = tdist.shard(starts, ctx, "sequences per step")  # this rank's slice of the global batch
        ex = [LMExample([int(ids[s])], ids[s + 1: s + cfg.block_size].tolist()) for s in starts]
        return collate(ex, tok.pad_token_id, cfg.block_size)

    torch.manual_seed(cfg.seed)
    return fit(model, tok, make_batch, out_dir=out, stage="pretrain", steps=cfg.steps, lr=cfg.lr,
               device=resolve_device(cfg.device), time_budget_s=cfg.time_budget_s,
               log_every=cfg.log_every, save_every=cfg.save_every, log=log, ctx=ctx)


_ = asdict
