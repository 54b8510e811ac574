"""Sampling kernels from the policy: greedy, temperature sampling, k samples at once, with or
without the grammar.

``generate(model, tokenizer, structure, op, dtype, n, k=..., config=...)`` runs k samples of
one matrix in one batch (identical prompts, so no padding; a KV cache makes each step one
token). With ``constrained=True`` (the default) every sample has its own llguidance matcher
over ``grammar.kernel_grammar()``: before each step the matcher's bitmask of allowed tokens is
applied to the logits (disallowed -> -inf), so only kernels that parse can come out, and
``<|eos|>`` is allowed only where the kernel is complete. The packed bitmasks are kept in the
``Rollout`` so that PPO recomputes log-probabilities under exactly the masks the rollout used
(``unpack_masks``); ``logprobs`` are the log-probabilities of the chosen tokens under the
masked, temperature-scaled distribution the sample was drawn from.

Generated text is the completion after ``<|kernel|>``: the two contract header lines and the
kernel, without ``<|eos|>``. With ``references`` the same samples are decoded speculatively
(``speculative.py``). The ways to spend k candidates on different kernels are
``candidates.py`` (formats, hints) and ``departures.py`` (departures from the greedy kernel).
This module does not parse headers or compile anything.
"""

from __future__ import annotations

import torch

from sparserl_compile.policy.encoder import PreparedStructure, StructureBatch
from sparserl_compile.policy.masks import apply_masks, fill_token_bitmask, make_matcher, token_bitmask
from sparserl_compile.policy.sampling import DecodeConfig, Rollout, pick_tokens, seeded_generator
from sparserl_compile.policy.speculative import generate_speculative
from sparserl_compile.policy.tokenizer import prompt_text


@torch.no_grad()
def generate(model, tokenizer, structure: PreparedStructure, op: str, dtype: str, n: int,
             k: int = 1, config: DecodeConfig = DecodeConfig(),
             grammar_text: str | None = None, forced: list[list[int]] | None = None,
             hint: str | None = None, references: list[str] | None = None,
             step_budget: int | None = None) -> list[Rollout]:
    """k completions for one matrix (see the module docstring).

    ``forced``: per sample, completion tokens to write first whatever the model prefers
    (``format_diverse`` forces each sample's format this way); their log-probabilities are
    still those of the (masked) distribution, and the grammar matcher consumes them.
    ``hint``: the retrieval hint of the prompt (``policy/retrieval.py``; policies trained with
    hints only).
    ``references``: kernel sources the samples are likely to resemble (the hinted kernel and
    its neighbours, ``retrieval.reference_sources``): decoding is then speculative
    (``generate_speculative``), same distribution, far fewer model calls when the policy
    writes what a reference says; ``forced`` prefixes too. ``step_budget``: see
    ``generate_speculative``; it counts model calls, so it applies to speculative decoding only
    (without references every sample is decoded to its end).
    """
    if forced is not None and len(forced) != k:
        raise ValueError(f"forced has {len(forced)} prefixes for k={k} samples")
    if references:
        return generate_speculative(model, tokenizer, structure, op, dtype, n, references, k=k,
                                    config=config, grammar_text=grammar_text, hint=hint, forced=forced,
                                    step_budget=step_budget)
    if k < 1:
        raise ValueError(f"k={k}: ask for at least one sample")
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    eos = tokenizer.eos_token_id
    prompt = tokenizer.encode(prompt_text(op, dtype, n, hint))
    gen = seeded_generator(config, device)
    matchers = [make_matcher(tokenizer, vocab, grammar_text, op, dtype) for _ in range(k)] if config.constrained else None
    bitmask = token_bitmask(k, vocab) if config.constrained else None
    sb = StructureBatch.collate([structure]).repeat(k).to(device)
    ids = torch.tensor([prompt] * k, device=device)
    out = model(ids, sb, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    tokens = [[] for _ in range(k)]
    logps = [[] for _ in range(k)]
    masks = [[] for _ in range(k)]
    done = [False] * k
    errors: list[str | None] = [None] * k
    for step_i in range(config.max_new_tokens):
        logits = logits.float().clone()
        if matchers is not None:
            for i, m in enumerate(matchers):
                if done[i]:
                    bitmask[i].fill_(-1)
                    continue
                fill_token_bitmask(m, bitmask, i)
            logits = apply_masks(logits, bitmask, vocab, eos)
        tok, lp = pick_tokens(logits, config, gen)
        if forced is not None:
            for i, f in enumerate(forced):
                if step_i < len(f) and not done[i]:
                    tok[i] = f[step_i]
                    lp[i] = torch.log_softmax(logits[i] / (1.0 if config.greedy else max(config.temperature, 1e-5)),
                                              -1)[f[step_i]]
        tok_list, lp_list = tok.tolist(), lp.tolist()  # one transfer per step, not two per sample
        for i in range(k):
            if done[i]:
                continue
            t = tok_list[i]
            tokens[i].append(t)
            logps[i].append(lp_list[i])
            if matchers is not None:
                masks[i].append(bitmask[i].clone())
                if not matchers[i].consume_token(t) and matchers[i].is_error():
                    errors[i] = matchers[i].get_error()
            if t == eos:
                done[i] = True
        if all(done):
            break
        step = torch.where(torch.tensor(done, device=device), torch.full_like(tok, eos), tok)
        out = model(step[:, None], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    rollouts = []
    for i in range(k):
        finished = bool(tokens[i]) and tokens[i][-1] == eos
        body = tokens[i][:-1] if finished else tokens[i]
        rollouts.append(Rollout(
            prompt_ids=list(prompt), tokens=tokens[i], text=tokenizer.decode(body),
            logprobs=logps[i], finished=finished,
            masks=torch.stack(masks[i]) if matchers is not None and masks[i] else None,
            grammar_error=errors[i]))
    return rollouts
