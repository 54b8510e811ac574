"""Data-parallel training under ``torchrun --nproc-per-node N``: the few helpers the stages share.

``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``;
``setup(device)`` sees ``WORLD_SIZE > 1`` and starts the process group (gloo for the CPU, NCCL
for CUDA, through ``sparserl_compile.distributed.init_process_group``, which keeps NVLink
multicast off) and returns a ``DistContext`` with this rank's device (``cuda:{LOCAL_RANK}``
when the stage asked for CUDA). Without those variables -- or with ``WORLD_SIZE=1`` -- nothing
starts and every helper is the identity of one process, so the stages run unchanged.

The process group is left running after a stage (a script may run several stages in one
launch); ``cleanup()`` ends it (the CLI calls it after the stage).

What the stages do with it (``lm.fit``, ``pretrain.py``, ``sft.py``, ``rl.py``, ``ppo.py``):
each step draws the same global batch on every rank (same rng as one process) and keeps its
slice (``shard``); losses are sums over this rank's tokens divided by the all-reduced global
count, so the summed gradient is the gradient of the global mean; only rank 0 logs and
writes checkpoints; decisions taken from the clock (time budgets) are rank 0's, broadcast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparserl_compile.distributed import comm_device


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched() -> bool:
    """True inside a multi-process launch (``torchrun`` with ``--nproc-per-node`` > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank() -> int:
    return dist.get_rank() if _active() else 0


def world_size() -> int:
    return dist.get_world_size() if _active() else 1


def is_main() -> bool:
    return rank() == 0


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_device(device: str) -> str:
    """This rank's device: ``cuda`` (any index) becomes ``cuda:{LOCAL_RANK}`` in a launch."""
    if launched() and device.startswith("cuda"):
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return device


def setup(device: str = "cpu") -> DistContext:
    """Start the process group when launched by ``torchrun`` (idempotent); the rank's context.

    ``device``: the stage's resolved device ("cpu", "cuda", "cuda:0", ...). Backend: NCCL when
    it is CUDA, gloo otherwise. Without a launch: ``DistContext(device=device)``.
    """
    if not launched() and not _active():
        return DistContext(device=device)
    dev = rank_device(device)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not _active():
        from sparserl_compile.distributed import init_process_group

        if dev.startswith("cuda"):
            torch.cuda.set_device(torch.device(dev))
            init_process_group("nccl")
        else:
            init_process_group("gloo")
    elif dev.startswith("cuda"):
        torch.cuda.set_device(torch.device(dev))
    return DistContext(dist.get_rank(), dist.get_world_size(), local, dev)


def cleanup() -> None:
    """End the process group if one is running."""
    if _active():
        dist.destroy_process_group()


def barrier() -> None:
    if _active() and dist.get_world_size() > 1:
        dist.barrier()


def shard_bounds(n: int, ctx: DistContext, what: str = "items") -> tuple[int, int]:
    """``[start, stop)`` of this rank's equal share of ``n`` items; ``n`` must divide evenly."""
    if n % ctx.world_size:
        raise ValueError(f"{n} {what} do not split evenly over {ctx.world_size} ranks: use a multiple "
                         f"of the world size ({ctx.world_size})")
    per = n // ctx.world_size
    return ctx.rank * per, (ctx.rank + 1) * per


def shard(items, ctx: DistContext, what: str = "items"):
    """This rank's contiguous equal slice of a sequence (the global order is kept)."""
    a, b = shard_bounds(len(items), ctx, what)
    return items[a:b]


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of ``x`` (a new tensor; no autograd); ``x`` itself on one process."""
    if not _active() or dist.get_world_size() == 1:
        return x
    y = x.detach().clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    return y


def sum_scalars(*values: float) -> list[float]:
    """Python floats summed over ranks (one all-reduce)."""
    if not _active() or dist.get_world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(v) for v in t.cpu()]


def broadcast_scalar(value, src: int = 0):
    """Rank ``src``'s python scalar (int, float or bool) on every rank; same type back."""
    if not _active() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=comm_device())
    dist.broadcast(t, src=src)
    return type(value)(t.item()) if not isinstance(value, bool) else bool(t.item())


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s picklable object on every rank (others pass anything, e.g. None)."""
    if not _active() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=comm_device())
    return box[0]


def all_reduce_grads(params, ctx: DistContext) -> None:
    """Sum the gradients of ``params`` over ranks, in place, in one flat all-reduce.

    A parameter without a gradient on every rank keeps ``None`` (the optimizer skips it, as
    on one process); one with a gradient on some ranks gets the others' zeros added.
    """
    if not ctx.distributed:
        return
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    dev = params[0].device
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=dev)
    dist.all_reduce(has)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in params])
    dist.all_reduce(flat)
    at = 0
    for p, h in zip(params, has.tolist()):
        n = p.numel()
        if h > 0:
            p.grad = flat[at: at + n].view_as(p).to(p.dtype).clone()
        at += n


def quiet_unless_main(log, ctx: DistContext):
    """``log`` on rank 0, a no-op elsewhere."""
    return log if ctx.is_main else (lambda *a, **k: None)
