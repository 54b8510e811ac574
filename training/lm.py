"""Causal-LM batches and loss shared by pretraining and SFT.

An example is prompt tokens (not trained on), target tokens (trained on) and, for SFT, the
matrix structure whose prefix the model sees first. Batches are right-padded; labels are -100
on the prompt and padding, so the loss is the mean cross-entropy of the target tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparserl_compile.policy.encoder import PreparedStructure, StructureBatch


@dataclass
class LMExample:
    prompt_ids: list[int]
    target_ids: list[int]
    structure: PreparedStructure | None = None


@dataclass
class LMBatch:
    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T), -100 where not trained
    structure: StructureBatch | None

    def to(self, device) -> "LMBatch":
        return LMBatch(self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device),
                       self.structure.to(device) if self.structure is not None else None)


def collate(examples: list[LMExample], pad_id: int, max_len: int) -> LMBatch:
    seqs = [(e.prompt_ids + e.target_ids)[:max_len] for e in examples]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), T), dtype=torch.long)
    lab = torch.full((len(seqs), T), -100, dtype=torch.long)
    for i, (e, s) in enumerate(zip(examples, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
        lab[i, len(e.prompt_ids): len(s)] = torch.tensor(s[len(e.prompt_ids):], dtype=torch.long)
    structs = [e.structure for e in examples]
    if any(s is None for s in structs) and not all(s is None for s in structs):
        raise ValueError("a batch mixes examples with and without a structure prefix")
    sb = StructureBatch.collate(structs) if structs[0] is not None else None
    return LMBatch(ids, att, lab, sb)


def _next_token_ce(logits: torch.Tensor, batch: LMBatch, reduction: str) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token, on target tokens only."""
    logits, labels = logits[:, :-1], batch.labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction=reduction)


def lm_loss(model, batch: LMBatch) -> torch.Tensor:
    out = model(batch.input_ids, batch.structure, attention_mask=batch.attention_mask)
    return _next_token_ce(out.logits, batch, "mean")


def target_count(batch: LMBatch) -> int:
    """Trained tokens of a batch: the denominator of ``lm_loss``."""
    return int((batch.labels[:, 1:] != -100).sum())


class _LogitsOnly(torch.nn.Module):
    """The policy returning only its logits: what DDP wraps for the LM stages, so that the value
    head (and, without a structure prefix, the encoder) is not reachable from the output and
    DDP's unused-parameter search marks it ready instead of waiting for its gradient."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, input_ids, structure=None, attention_mask=None):
        return self.policy(input_ids, structure, attention_mask=attention_mask).logits


def lm_loss_sum(logits_fn, batch: LMBatch) -> torch.Tensor:
    """Summed cross-entropy of the target tokens; ``logits_fn`` returns logits (``_LogitsOnly``)."""
    logits = logits_fn(batch.input_ids, batch.structure, attention_mask=batch.attention_mask)
    return _next_token_ce(logits, batch, "sum")


@dataclass
class FitResult:
    """What a pretraining or SFT run did."""

    out_dir: str
    start_step: int  # > 0 when the run resumed a checkpoint
    step: int  # step reached
    losses: list[float]  # training loss per step of this run
    eval_loss: float | None = None  # mean loss on held-out examples, when given


def fit(model, tokenizer, make_batch, *, out_dir, stage: str, steps: int, lr: float,
        weight_decay: float = 0.01, warmup: int = 10, log_every: int = 10, save_every: int = 100,
        resume: bool = True, eval_batches=None, log=print, device: str = "cpu",
        time_budget_s: float = 0.0, ctx=None) -> FitResult:
    """AdamW with linear warm-up and cosine decay over ``steps``; resumable (``checkpoint.py``).

    ``device``: where the model and batches live ("cpu", "cuda"). ``time_budget_s`` (> 0): after
    a few steps, the step time measured caps ``steps`` so that this run ends within the budget,
    and the cosine schedule is laid over the capped count (a run cut by a clock instead would
    stop at a high learning rate). The cap is logged and kept in the checkpoint's log.

    ``ctx`` (``training.dist.DistContext``, several ranks): ``make_batch(step)`` returns this
    rank's shard of the step's global batch; the model is wrapped in DDP and each rank's loss is
    its summed token loss over the all-reduced global token count (times the world size, which
    DDP's gradient average divides out), so the gradient is that of the global batch's mean
    token loss, exactly as on one process. ``eval_batches`` are split over the ranks. Only rank
    0 logs and writes checkpoints; the time-budget cap is rank 0's, broadcast to all ranks.

    Longer than the house's 80 lines on purpose: the set-up, the step, the budget cap, the
    evaluation and the checkpointing share the optimizer, the schedule and the rank context,
    and read top to bottom as one training loop (as nanochat's and nanoGPT's do).
    """
    import math
    import time

    from sparserl_compile.training import dist as tdist
    from sparserl_compile.training.checkpoint import TrainerState, has_state, load_state, save_state

    ctx = ctx or tdist.DistContext(device=device)
    device = ctx.device if ctx.distributed else device
    log = tdist.quiet_unless_main(log, ctx)
    model.to(device)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # the trained parameters only: a pretrained-base policy's frozen base stays out of the optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    state = TrainerState(stage)
    if resume and has_state(out_dir):
        state = load_state(out_dir, opt)
        if state.stage != stage:
            state = TrainerState(stage)  # a previous stage's output used as init: fresh optimizer
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    start = state.step
    ddp = None
    if ctx.distributed:
        from torch.nn.parallel import DistributedDataParallel

        cuda = device.startswith("cuda")
        ddp = DistributedDataParallel(_LogitsOnly(model), device_ids=[torch.device(device).index] if cuda else None,
                                      find_unused_parameters=True)

    def lr_at(s):
        if s < warmup:
            return lr * (s + 1) / warmup
        return lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, steps - warmup))))

    losses = []
    model.train()
    t0, probe = time.perf_counter(), min(start + 5, steps)
    s = start
    while s < steps:
        if time_budget_s > 0 and s == probe and s > start:
            per_step = (time.perf_counter() - t0) / (s - start)
            if ctx.distributed:
                per_step = tdist.broadcast_scalar(per_step)  # rank 0's clock: every rank caps alike
            cap = max(s + 1, start + int(time_budget_s / per_step))  # at least the step that saves
            if cap < steps:
                log(f"[{stage}] {per_step * 1e3:.0f} ms/step: the {time_budget_s:.0f} s budget caps "
                    f"the run at {cap} of {steps} steps")
                state.log.append({"step": s, "capped_steps": cap, "requested_steps": steps,
                                  "ms_per_step": per_step * 1e3})
                steps = cap
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        opt.zero_grad(set_to_none=True)
        if ddp is None:
            loss = lm_loss(model, make_batch(s).to(device))
            loss.backward()
            losses.append(loss.item())
        else:
            batch = make_batch(s).to(device)
            tok_sum = lm_loss_sum(ddp, batch)
            all_sum, n_tok = tdist.sum_scalars(tok_sum.item(), target_count(batch))
            n_tok = max(1.0, n_tok)
            (tok_sum * (ctx.world_size / n_tok)).backward()  # DDP averages: the global mean's gradient
            losses.append(all_sum / n_tok)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state.step = s + 1
        if (s + 1) % log_every == 0 or s + 1 == steps:
            state.log.append({"step": s + 1, "loss": losses[-1], "lr": lr_at(s)})
            log(f"[{stage}] step {s + 1}/{steps} loss {losses[-1]:.4f}")
        if ((s + 1) % save_every == 0 or s + 1 == steps) and ctx.is_main:
            save_state(out_dir, model, tokenizer, opt, state)
        s += 1
    eval_loss = None
    if eval_batches:
        model.eval()
        with torch.no_grad():
            mine = eval_batches[ctx.rank::ctx.world_size]  # the mean of per-batch means, split over ranks
            total = sum(float(lm_loss(model, b.to(device))) for b in mine)
            if ctx.distributed:
                total = tdist.sum_scalars(total)[0]
            eval_loss = float(total / len(eval_batches))
        log(f"[{stage}] held-out loss {eval_loss:.4f}")
    model.eval()
    if ctx.distributed:
        tdist.barrier()  # rank 0's checkpoint is complete before any rank moves on (e.g. to load it)
    return FitResult(str(out_dir), start, state.step, losses, eval_loss)
