"""Weight memory of a sparsified model, counted from the runtime's plans (``pruned_llm.py``).

A module of the ``pruned_llm.py`` example (imported from beside it), not a script of its own.

Two figures, per model:

* **read** at each decoding width: the bytes of the weights as the plan chosen for that width
  stores them, i.e. what one product reads. A generated kernel: its format's structure arrays
  plus its value array (padding included) in the weight's dtype; cuSPARSE (the reference plan; torch CSR on the CPU):
  the CSR arrays (int32 row pointers and columns, values); the dense product (a ``DensePlan``,
  kept where it beat the sparse ones): the weight stored dense in its dtype. Any other kind of
  plan: the device tensors the plan holds.
* **held**: every distinct device buffer reachable from the sparse weights and all their plans
  (every width): the ``SparseRLTensor``'s own CSR arrays, which it keeps whatever the plans
  are, plus each plan's converted arrays, gathered values and gather maps, and the dense copies
  of the weights whose plans are dense (``DensePlan.nbytes``; none where no plan is). This is what the
  model costs in device memory today, and it is more than what any one product reads.

Both are compared with the same weights stored dense in their dtype.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

import sparserl_compile as sr

CUSPARSE = "cuSPARSE (CSR)"
TORCH_CSR = "torch CSR"  # the reference of a weight on the CPU


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _held_tensors(obj, depth: int = 0, seen: set | None = None):
    """Torch tensors reachable from ``obj`` through attributes, dicts, lists and tuples (5 levels;
    modules, types and functions are not entered)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth >= 5 or isinstance(obj, (str, bytes, int, float, type, nn.Module)) or callable(obj):
        return
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif hasattr(obj, "__dict__"):
        children = list(vars(obj).values())
    elif hasattr(obj, "__slots__"):
        children = [getattr(obj, s, None) for s in obj.__slots__]
    else:
        return
    for c in children:
        yield from _held_tensors(c, depth + 1, seen)


def plan_read_bytes(plan, w: sr.SparseRLTensor) -> tuple[str, int]:
    """(what stores the weight, bytes one product reads) for ``w`` under ``plan`` (module doc)."""
    if plan.kind == "kernel":
        values = plan.fdata.padded_size * w.val.element_size()
        return plan.header.format, sum(_nbytes(t) for t in plan.arrays.values()) + values
    if plan.kind in ("reference", "pending"):  # a pending plan runs the reference until its search ends
        return (CUSPARSE if w.val.is_cuda else TORCH_CSR), _nbytes(w.crow) + _nbytes(w.col) + _nbytes(w.val)
    if plan.kind == "dense":
        return "dense", w.n_rows * w.n_cols * w.val.element_size()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _held_tensors(plan)
                if t.device == w.val.device}
    return plan.kind, sum(storages.values())


@dataclass
class WidthMemory:
    batch: int
    dense_bytes: int  # the sparsified weights stored dense, in their dtype
    read_bytes: int  # what the plans at this width read (module doc)
    formats: dict[str, int]  # weights per storage of their plan at this width
    unplanned: int = 0  # weights never multiplied at this width (no plan to count)
    read_over_dense: float = field(init=False)

    def __post_init__(self):
        self.read_over_dense = self.read_bytes / self.dense_bytes if self.dense_bytes else float("nan")


@dataclass
class WeightMemory:
    weights: int  # sparse weights counted
    dense_bytes: int
    held_bytes: int  # distinct device buffers of the sparse weights and all their plans
    csr_bytes: int  # of which the sparse weights' own CSR arrays
    widths: list[WidthMemory]
    held_over_dense: float = field(init=False)

    def __post_init__(self):
        self.held_over_dense = self.held_bytes / self.dense_bytes if self.dense_bytes else float("nan")


def weight_memory(model: nn.Module, batches: list[int]) -> WeightMemory:
    """Count the sparse weights of ``model`` against their dense size, from the plans the runtime
    holds for them (``sparserl_compile.plans.plans()``); call it after decoding at ``batches``
    (a width never run has no plan, and is reported as unplanned)."""
    from sparserl_compile import plans
    from sparserl_compile.cache import width_bucket
    from sparserl_compile.problem import device_arch

    table = plans.plans()
    by_fp: dict[str, list] = {}
    for key, plan in table.items():
        by_fp.setdefault(key[0], []).append((key, plan))
    weights = [m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), sr.SparseRLTensor)]
    dense = sum(w.n_rows * w.n_cols * w.val.element_size() for w in weights)
    held: dict[int, int] = {}
    csr = 0
    for w in weights:
        for t in (w.crow, w.col, w.val):
            s = t.untyped_storage()
            if s.data_ptr() not in held:
                csr += s.nbytes()
            held[s.data_ptr()] = s.nbytes()
        for _key, plan in by_fp.get(w.fingerprint, []):
            for t in _held_tensors(plan):
                if t.device == w.val.device:
                    held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    rows = []
    for b in batches:
        read, formats, unplanned = 0, Counter(), 0
        for w in weights:
            plan = table.get((w.fingerprint, "spmm", width_bucket(b), w.val.dtype, device_arch(w.val.device)))
            if plan is None:
                unplanned += 1
                continue
            what, n = plan_read_bytes(plan, w)
            formats[what] += 1
            read += n
        rows.append(WidthMemory(b, dense, read, dict(formats), unplanned))
    return WeightMemory(len(weights), dense, sum(held.values()), csr, rows)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


if __name__ == "__main__":
    raise SystemExit(f"{__file__} is a module of the pruned-LLM example, not a script: run "
                     "python examples/pruned_llm.py (--help lists its options)")
