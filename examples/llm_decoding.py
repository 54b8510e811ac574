"""Measuring a pruned decoder for ``pruned_llm.py``: perplexity, greedy decoding timed with and
without its prefill, compiled decoding with a static KV cache, whether two models decode the same
tokens (and why not, where they do not), and the first call's kernel selection.

A module of the ``pruned_llm.py`` example (imported from beside it), not a script of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from llm_models import PROMPTS
from llm_pruning import eval_device
from torch import nn

import sparserl_compile as sr


def perplexity(model: nn.Module, ids: torch.Tensor) -> float:
    """exp(mean next-token cross entropy) of ``ids`` [1, T] in one forward pass."""
    ids = ids.to(eval_device(model))
    with torch.no_grad():
        return float(torch.exp(model(ids, labels=ids).loss.float()))


def batch_prompts(tok, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` for ``prompts``."""
    enc = [tok.encode(p) for p in prompts]
    width = max(map(len, enc))
    ids = torch.full((len(enc), width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros((len(enc), width), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, width - len(e):] = torch.tensor(e)
        mask[i, width - len(e):] = 1
    return ids, mask


def prompts_for(tok, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``batch`` built-in prompts (cycled), left-padded, on ``device``."""
    ids, mask = batch_prompts(tok, [PROMPTS[i % len(PROMPTS)] for i in range(batch)])
    return ids.to(device), mask.to(device)


@dataclass
class Generation:
    tokens: torch.Tensor  # [batch, new_tokens], from the timed run
    seconds: float  # the timed generation of new_tokens per sequence, prefill included
    prefill_seconds: float | None = None  # the same prompts, one token each: the prefill alone

    @property
    def end_to_end_tokens_per_s(self) -> float:
        return self.tokens.numel() / self.seconds

    @property
    def decode_only(self) -> bool:
        """Whether the prefill could be taken out: more than one new token, and the decoding
        steps took a measurable share (5 %) of the run."""
        p = self.prefill_seconds
        return p is not None and self.tokens.shape[1] > 1 and self.seconds - p > 0.05 * self.seconds

    @property
    def tokens_per_s(self) -> float:
        """Decoding speed: tokens of the steps after the first over their time (``decode_only``),
        else tokens over the whole generation."""
        if not self.decode_only:
            return self.end_to_end_tokens_per_s
        b, n = self.tokens.shape
        return b * (n - 1) / (self.seconds - self.prefill_seconds)


def _generate(model, ids, mask, tok, n: int, static_cache: bool):
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=tok.pad_id)
    if static_cache:
        kw["cache_implementation"] = "static"
    else:  # a dynamic cache is never compiled: say so, or transformers warns that it cannot
        kw["disable_compile"] = True
    with torch.no_grad():
        return model.generate(ids, **kw)


def timed_generate(model: nn.Module, tok, batch: int, new_tokens: int, static_cache: bool = False) -> float:
    """Seconds of one greedy generation (synchronized): on a new structure this first call is the
    one that pays for kernel selection (``on_miss="search"``) or starts it (``"background"``)."""
    dev = eval_device(model)
    ids, mask = prompts_for(tok, batch, dev)
    _sync(dev)
    t0 = time.perf_counter()
    _generate(model, ids, mask, tok, new_tokens, static_cache)
    _sync(dev)
    return time.perf_counter() - t0


def greedy(model: nn.Module, tok, batch: int, new_tokens: int, warmup_tokens: int = 2,
           static_cache: bool = False, prefill: bool = True) -> Generation:
    """Greedy decoding of exactly ``new_tokens`` per sequence for the first ``batch`` prompts,
    timed after a warm-up generation of ``warmup_tokens``; with ``prefill``, also one token per
    sequence, timed, so that ``Generation.tokens_per_s`` counts the decoding steps alone.
    ``static_cache``: a fixed-size KV cache (``cache_implementation="static"``); with a
    ``generation_config.compile_config`` set (``compile_for_decoding``) transformers then
    compiles the decoding step, one shape per batch size, which ``reduce-overhead`` replays as a
    CUDA graph. The warm-up then runs the full length (the compile and the graph recording
    happen there, not in the timed run); the one-token run reuses that cache and never reaches
    the compiled step (the prefill is eager)."""
    dev = eval_device(model)
    ids, mask = prompts_for(tok, batch, dev)
    if static_cache:
        warmup_tokens = new_tokens
    _generate(model, ids, mask, tok, warmup_tokens, static_cache)
    _sync(dev)
    t0 = time.perf_counter()
    out = _generate(model, ids, mask, tok, new_tokens, static_cache)
    _sync(dev)
    seconds = time.perf_counter() - t0
    pre = None
    if prefill and new_tokens > 1:
        t0 = time.perf_counter()
        _generate(model, ids, mask, tok, 1, static_cache)
        _sync(dev)
        pre = time.perf_counter() - t0
    return Generation(out[:, ids.shape[1]:].cpu(), seconds, pre)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def compile_for_decoding(model: nn.Module, backend: str, mode: str | None) -> nn.Module:
    """Have ``model.generate`` (with a static KV cache) compile its decoding step with
    ``torch.compile(backend=backend, mode=mode, dynamic=False)``: transformers' own path for
    compiled decoding. The prefill stays eager, and it is what allocates the static cache and
    marks its tensors as static addresses, without which CUDA graphs are skipped (the cache is
    mutated in place) or replay over their own outputs; compiling ``model.forward`` whole
    instead traces the prefill too and fails that way under ``reduce-overhead``. Also on the CPU
    (transformers compiles only on accelerators unless told to), so the path is testable there.
    Generation with the default dynamic cache stays eager."""
    from transformers import CompileConfig

    cfg = CompileConfig(backend=backend, mode=mode or "default", fullgraph=False, dynamic=False)
    cfg._compile_all_devices = True
    model.generation_config.compile_config = cfg
    return model


# ------------------------------------------------------------------------- the same tokens


@dataclass
class TokenMatch:
    """How one model's greedy tokens compare with a reference model's, for the same prompts.

    Greedy decoding follows its own tokens, so after the first difference a sequence goes its own
    way: ``sequences_same`` and ``first_difference`` say more than ``same``. At the first
    difference both models are run (eager, no cache) on the common prefix: if the reference
    model's two best logits there were closer than the two models' logits differ
    (``explained``), the tokens differ by a near tie that a different accumulation order (a
    sparse kernel sums the kept products in another order than a dense GEMM, and in another
    precision) decides either way, not by a wrong product."""

    same: float  # fraction of generated tokens equal, position by position
    sequences_same: int  # sequences identical over every generated token
    sequences: int
    first_difference: tuple[int, int] | None = None  # (sequence, step) of the earliest difference
    reference_margin: float | None = None  # reference model's top-1 minus top-2 logit there
    logit_diff: float | None = None  # max |logit difference| of the two models there
    explained: bool | None = None  # reference_margin <= logit_diff: a near tie

    def describe(self) -> str:
        if self.first_difference is None:
            return "identical"
        s, t = self.first_difference
        why = ("a near tie: accumulation order decides it" if self.explained else
               "NOT a near tie: the products differ beyond rounding")
        return (f"{self.sequences_same}/{self.sequences} sequences identical; first difference at step {t} of "
                f"sequence {s}, where the pruned dense model's top two logits were {self.reference_margin:.3g} apart "
                f"and the two models' logits differ by up to {self.logit_diff:.3g} ({why})")


def compare_tokens(reference: nn.Module, other: nn.Module, tok, ref_tokens: torch.Tensor,
                   other_tokens: torch.Tensor) -> TokenMatch:
    """``TokenMatch`` of ``other_tokens`` against ``ref_tokens`` ([batch, new], from ``greedy``
    on the built-in prompts), diagnosing the earliest difference (class doc)."""
    eq = ref_tokens == other_tokens
    b = ref_tokens.shape[0]
    m = TokenMatch(float(eq.float().mean()), int(eq.all(1).sum()), b)
    if bool(eq.all()):
        return m
    first = torch.where(eq.all(1), eq.shape[1], (~eq).int().argmax(1))  # first differing step per sequence
    t, s = int(first.min()), int(first.argmin())
    dev = eval_device(reference)
    ids, mask = prompts_for(tok, b, dev)
    prefix = ref_tokens[:, :t].to(dev)
    ids = torch.cat([ids, prefix], 1)
    mask = torch.cat([mask, torch.ones_like(prefix)], 1)
    with torch.no_grad():
        lr = reference(ids, attention_mask=mask).logits[s, -1].float()
        lo = other(ids, attention_mask=mask).logits[s, -1].float()
    top2 = lr.topk(2).values
    m.first_difference = (s, t)
    m.reference_margin = float(top2[0] - top2[1])
    m.logit_diff = float((lr - lo).abs().max())
    m.explained = m.reference_margin <= m.logit_diff
    return m


# ------------------------------------------------------------------------- kernel selection


def sparse_weights(model: nn.Module) -> dict[str, sr.SparseRLTensor]:
    """The ``SparseRLTensor`` weights of ``model`` by module name."""
    return {n: m.weight for n, m in model.named_modules()
            if isinstance(getattr(m, "weight", None), sr.SparseRLTensor)}


def pregenerate_weights(model: nn.Module, widths: list[int], share: int, *, target=None,
                        executor: str | None = None) -> dict:
    """``sparserl pregen`` for every sparse weight of ``model`` at ``widths`` (decoding one token
    per sequence, a product's width is the batch size), into the runtime's kernel cache, in the
    weights' dtype; alike weights share their exploration (``pregen --share K``: the first of a
    group of same-shape, same-row-length weights is searched in full, every other one gets the
    group's K best kernels as its only candidates, each still verified and timed on its own
    pattern). Returns counts and seconds, split by full and shared searches."""
    import numpy as np
    import scipy.sparse as sp

    from sparserl_compile import cache, contract, pregen

    items, dtypes = [], set()
    for name, w in sparse_weights(model).items():
        ip, ix = w.crow.cpu().numpy(), w.col.cpu().numpy()
        items.append(pregen.Item(name, sp.csr_matrix((np.ones(ix.size, np.float32), ix, ip),
                                                     shape=(w.n_rows, w.n_cols))))
        dtypes.add(contract.TORCH_DTYPES[str(w.val.dtype).removeprefix("torch.")])
    if len(dtypes) > 1:
        raise ValueError(f"pregenerate_weights: the sparse weights mix dtypes {sorted(dtypes)}; convert the model "
                         "to one dtype first (model.to(torch.bfloat16))")
    t0 = time.perf_counter()
    rows = pregen.pregenerate(items, cache_dir=cache.default_dir(), ops=("spmm",), widths=tuple(widths),
                              dtype=dtypes.pop() if dtypes else "f32", progress=False, share=share,
                              target=target, executor=executor)
    out = {k: sum(r.outcome == k for r in rows) for k in ("kernel", "reference", "dense", "cached", "failed")}
    shared = [r for r in rows if r.detail.startswith("shared")]
    full = [r for r in rows if r.outcome != "cached" and not r.detail.startswith("shared")]
    out.update(products=len(rows), matrices=len(items), widths=list(widths), share=share, shared=len(shared),
               full=len(full), seconds=round(time.perf_counter() - t0, 1),
               full_seconds=round(sum(r.seconds for r in full), 1),
               shared_seconds=round(sum(r.seconds for r in shared), 1),
               families=sorted({r.detail.split(": ")[-1].split("[")[0] for r in rows if r.outcome == "kernel"}),
               speedups=[round(r.reference_us / r.kernel_us, 3) for r in rows
                         if r.outcome == "kernel" and r.kernel_us and r.reference_us])
    return out


if __name__ == "__main__":
    raise SystemExit(f"{__file__} is a module of the pruned-LLM example, not a script: run "
                     "python examples/pruned_llm.py (--help lists its options)")
