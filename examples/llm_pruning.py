"""Unstructured pruning of a decoder LM's linear layers, per output row, for ``pruned_llm.py``.

A module of the ``pruned_llm.py`` example (imported from beside it), not a script of its own.

``prune_`` zeroes exactly ``ceil(sparsity * in_features)`` weights of every output row of every
decoder ``nn.Linear`` (the output head, tied to the embedding, stays dense), by score:

* ``magnitude``: ``|W_ij|``;
* ``wanda`` (Sun et al. 2023): ``|W_ij| * ||X_j||_2``, with ``||X_j||`` the norm of input feature
  ``j`` over calibration tokens. With real weights the norms are measured in one pass of the
  *dense* model over a calibration text (``input_feature_norms``: a one-shot simplification of
  Wanda's layer-by-layer pass). Random weights have no outlier features, which is what makes
  Wanda's masks differ from magnitude's in a real LLM (the columns of large-norm features keep
  more of their weights), so for them ``random_feature_norms`` draws calibration activations
  whose per-feature scales are log-normal, one draw per input site (the q/k/v projections of a
  block share their input and so their norms, as gate/up do).

Every pruned model is pruned from the same kept dense weights (``DenseWeights``), in place, so
one model object serves every sparsity level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

METHODS = ("magnitude", "wanda")


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` layers to prune: all but the output head (tied to the embedding)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}


def eval_device(model: nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


def input_feature_norms(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``||X_j||_2`` over all calibration tokens, per input feature of every decoder linear."""
    sq: dict[str, torch.Tensor] = {}
    hooks = []
    ids = ids.to(eval_device(model))
    for name, lin in decoder_linears(model).items():
        def hook(_mod, args, _out, name=name):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            sq[name] = sq.get(name, 0) + x.pow(2).sum(0)
        hooks.append(lin.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return {n: v.sqrt() for n, v in sq.items()}


#: module-name suffixes that read the same input (their Wanda norms are one draw)
_SHARED_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "gate_proj": "mlp_in",
                 "up_proj": "mlp_in"}


def random_feature_norms(model: nn.Module, tokens: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    """Wanda's ``||X_j||_2`` from random calibration activations, per decoder linear: ``tokens``
    rows of ``N(0, 1) * s_j`` with per-feature scales ``s_j ~ LogNormal(0, 1)``, one draw per input
    site (module doc), on the CPU from ``seed`` (the same masks on every device)."""
    g = torch.Generator().manual_seed(seed)
    drawn: dict[str, torch.Tensor] = {}
    out = {}
    for name, lin in decoder_linears(model).items():
        parent, _, leaf = name.rpartition(".")
        site = f"{parent}.{_SHARED_INPUT.get(leaf, leaf)}"
        if site not in drawn:
            scale = torch.randn(lin.in_features, generator=g).exp()
            x = torch.randn(tokens, lin.in_features, generator=g) * scale
            drawn[site] = x.norm(dim=0)
        out[name] = drawn[site].to(lin.weight.device)
    return out


@dataclass
class PruneReport:
    method: str
    sparsity: float  # requested fraction of zeros per output row
    layers: int  # linears pruned
    zeros: int
    weights: int

    @property
    def achieved(self) -> float:
        return self.zeros / max(self.weights, 1)


def prune_(model: nn.Module, sparsity: float, method: str = "wanda", calib_ids: torch.Tensor | None = None,
           masks_out: dict[str, torch.Tensor] | None = None, *,
           norms: dict[str, torch.Tensor] | None = None) -> PruneReport:
    """Zero the ``ceil(sparsity * in_features)`` lowest-scoring weights of every output row of
    every decoder linear, in place (module doc). ``wanda`` takes its feature norms from ``norms``
    if given, else measures them on ``calib_ids``. With ``masks_out`` (a dict) also record each
    layer's boolean keep-mask (False: pruned), on the CPU."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity={sparsity}: a fraction of zeros in [0, 1)")
    if method not in METHODS:
        raise ValueError(f"unknown pruning method {method!r}: use magnitude or wanda")
    if method == "wanda" and norms is None:
        if calib_ids is None:
            raise ValueError("wanda pruning needs calibration token ids (calib_ids) or feature norms (norms)")
        norms = input_feature_norms(model, calib_ids)
    zeros = weights = 0
    layers = decoder_linears(model)
    with torch.no_grad():
        for name, lin in layers.items():
            w = lin.weight
            score = w.abs().float()
            if method == "wanda":
                score = score * norms[name].to(score.device)[None, :]
            k = math.ceil(sparsity * w.shape[1])
            keep = torch.ones(w.shape, dtype=torch.bool, device=w.device)
            if k:
                idx = torch.topk(score, k, dim=1, largest=False).indices
                w.scatter_(1, idx, 0.0)
                keep.scatter_(1, idx, False)
            if masks_out is not None:
                masks_out[name] = keep.cpu()
            zeros += int((w == 0).sum())
            weights += w.numel()
    return PruneReport(method, sparsity, len(layers), zeros, weights)


def apply_masks_(model: nn.Module, masks: dict[str, torch.Tensor], sparsity: float, method: str) -> PruneReport:
    """Zero, in place, every decoder-linear weight whose keep-mask is False (``--patterns``)."""
    layers = decoder_linears(model)
    if set(masks) != set(layers):
        raise ValueError(f"the masks name other layers than the model's: missing {sorted(set(layers) - set(masks))[:3]}, "
                         f"extra {sorted(set(masks) - set(layers))[:3]}")
    zeros = weights = 0
    with torch.no_grad():
        for name, lin in layers.items():
            keep = masks[name]
            if tuple(keep.shape) != tuple(lin.weight.shape):
                raise ValueError(f"{name}: mask {tuple(keep.shape)} vs weight {tuple(lin.weight.shape)}")
            lin.weight.masked_fill_(~keep.to(lin.weight.device), 0.0)
            zeros += int((lin.weight == 0).sum())
            weights += lin.weight.numel()
    return PruneReport(method, sparsity, len(layers), zeros, weights)


class DenseWeights:
    """The unpruned weights of a model's decoder linears, kept so that every sparsity level is
    pruned from them, in place, in the same model object (whose compiled decoding step, traced
    once, then serves every level: compiled graphs read the parameters where they live)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.saved = {n: m.weight.detach().clone() for n, m in decoder_linears(model).items()}

    def restore(self) -> nn.Module:
        with torch.no_grad():
            for name, lin in decoder_linears(self.model).items():
                lin.weight.copy_(self.saved[name])
        return self.model


if __name__ == "__main__":
    raise SystemExit(f"{__file__} is a module of the pruned-LLM example, not a script: run "
                     "python examples/pruned_llm.py (--help lists its options)")
