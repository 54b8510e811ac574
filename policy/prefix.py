"""The decoder run over a structure prefix and tokens: what the policy models share.

``prefixed_forward`` places the structure encoder's vectors before the token embeddings in
``inputs_embeds`` (the prefix is always attended), runs a decoder with or without a KV cache and
returns ``PolicyOutput`` (logits and values of the token positions). ``model.SparseRLPolicy``
and ``basepolicy.BasePolicy`` call it with their own decoder, LM head and value head.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import LlamaModel

#: the name ``LlamaModel.forward`` takes the KV cache under, and its output returns it under:
#: ``cache`` from transformers 5.2x on (``past_key_values`` then warns that it is deprecated),
#: ``past_key_values`` before (the device image's 5.17)
_CACHE = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


@dataclass
class PolicyOutput:
    """Logits and values for the token positions (the prefix positions are cut off)."""

    logits: torch.Tensor  # (B, T, V)
    values: torch.Tensor  # (B, T)
    past_key_values: object | None = None


def prefixed_forward(decoder, lm_head, value_head, emb: torch.Tensor, prefix: torch.Tensor | None,
                     attention_mask, past_key_values, use_cache: bool, past_mask, position_ids) -> PolicyOutput:
    """The decoder over ``[prefix] + emb`` (token embeddings), as ``SparseRLPolicy.forward``
    describes; shared with the pretrained-base policy (``basepolicy.py``)."""
    n_prefix = 0
    if prefix is not None:
        prefix = prefix.to(emb.dtype)
        n_prefix = prefix.shape[1]
        emb = torch.cat([prefix, emb], dim=1)
        if attention_mask is not None:
            ones = torch.ones(attention_mask.shape[0], n_prefix, dtype=attention_mask.dtype,
                              device=attention_mask.device)
            attention_mask = torch.cat([ones, attention_mask], dim=1)
    elif attention_mask is not None and past_key_values is not None:
        if past_mask is None:
            past_mask = torch.ones(attention_mask.shape[0], past_key_values.get_seq_length(),
                                   dtype=attention_mask.dtype, device=attention_mask.device)
        attention_mask = torch.cat([past_mask.to(attention_mask.dtype), attention_mask], dim=1)
    out = decoder(inputs_embeds=emb, attention_mask=attention_mask, use_cache=use_cache,
                  position_ids=position_ids, **{_CACHE: past_key_values})
    h = out.last_hidden_state[:, n_prefix:]
    return PolicyOutput(lm_head(h).float(), value_head(h).squeeze(-1).float(),
                        out.get(_CACHE) if use_cache else None)
