"""Row-partitioned SpMM/SpMV over ``torch.distributed``: each rank multiplies its block of rows.

The matrix ``A`` (``m x k``) is split into contiguous row ranges balanced by nonzeros
(``partition_rows``); rank ``r`` holds rows ``[r0, r1)`` as a ``SparseRLTensor``, so its local
product runs through sparserl like any other (generated kernel on a GPU, reference
elsewhere). The dense operand ``X`` (``k x n``, or ``k`` for SpMV) is row-partitioned too:
rank ``r`` owns the rows ``col_ranges[r]`` of ``X`` -- for a square matrix, by default, the
same ranges as ``A``'s rows, so ``Y = A @ X`` comes out partitioned like ``X`` and layers
chain (GCN). A rank's rows reference columns owned by other ranks: those rows of ``X`` are
its *halo*.

Setup (``DistributedSparseMatrix.from_scipy`` / ``from_local_rows``, collective) computes
the halo plan once: which ``X`` rows each rank needs from each peer, exchanged as requests
with ``all_to_all_single``, and remaps the block's column indices into a compacted index
space ``[own X rows | halo rows grouped by owner, ascending column]``. Each product then:

1. gathers the requested rows of ``x_local`` and exchanges them with ONE
   ``all_to_all_single`` with uneven split sizes (``dist.all_to_all_single``, supported by
   both gloo -- CPU tensors -- and NCCL -- CUDA tensors; the collective is skipped entirely
   when no rank needs a halo);
2. runs ``local_block @ cat([x_local, halo])`` through sparserl.

The exchange is an ``autograd.Function``: its backward sends the halo gradients back to their
owners with the reverse ``all_to_all_single`` and adds them in (``index_add_``), so
gradients w.r.t. ``x_local`` are exact (``A^T G`` restricted to the owned rows). Like any
collective inside autograd, every rank must run the backward.

Timings: each call adds to ``stats`` (``CommStats``: seconds in the exchange vs the
product, rows and bytes sent/received, ``comm_share``). On CUDA, honest timings need a
device synchronization around each phase, which stalls the stream; that happens only when
``timed=True`` (the default on CPU, off on CUDA). The backward's exchange is not timed.

Backends: gloo on CPU is what CI runs (``tests/sparserl_compile/test_distributed.py``).
With gloo and CUDA tensors, the exchange stages through host memory (correct, slow). NCCL
needs CUDA tensors on the rank's current device; that path is written against the documented
API but was not run here (no multi-GPU machine). ``init_process_group`` below sets
``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1``
(``setdefault``: NVLink multicast stays off unless the user asked for it).

Not done: 2-D (row and column) partitions, overlapping the exchange with the product of the
rows that need no halo, and repartitioning when the structure changes (build a new object).
``split_by_cost`` (greedy cost balancing of whole work items, used by ``sparserl pregen
--rank/--world-size``) lives here too: the same question -- what each rank does -- for items
that cannot be split.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist

from sparserl_compile.tensor import SparseRLTensor

#: environment defaults set before any process group starts: NVLink multicast (NVLS) off
MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def multicast_off() -> None:
    """``os.environ.setdefault`` the three variables that keep NVLink multicast off."""
    for k, v in MULTICAST_OFF_ENV.items():
        os.environ.setdefault(k, v)


def init_process_group(backend: str = "gloo", *, init_method: str | None = None,
                       rank: int | None = None, world_size: int | None = None, **kw) -> None:
    """``dist.init_process_group`` with multicast off (see ``multicast_off``).

    Without ``rank``/``world_size`` torch reads ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``
    (what ``torchrun`` sets). For NCCL, set the rank's device first
    (``torch.cuda.set_device(local_rank)``).
    """
    multicast_off()
    if rank is not None:
        kw["rank"] = rank
    if world_size is not None:
        kw["world_size"] = world_size
    dist.init_process_group(backend, init_method=init_method, **kw)


# ------------------------------------------------------------------------ partitions


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, stop)`` of a matrix (or of the dense operand), and their nonzeros."""

    start: int
    stop: int
    nnz: int = 0

    @property
    def n_rows(self) -> int:
        return self.stop - self.start


def partition_rows(indptr, world_size: int, *, row_weight: float = 1.0) -> list[RowRange]:
    """``world_size`` contiguous row ranges of a CSR matrix with balanced cost.

    The cost of a row is its nonzeros plus ``row_weight`` (the output row a rank writes; it
    also makes a matrix without nonzeros split evenly by rows). Each boundary is the row
    boundary nearest to its share ``r * total / world_size`` of the cost prefix sum, so every
    range costs at most ``total / world_size + max row cost``. Ranges may be empty (more
    ranks than rows).
    """
    indptr = np.asarray(indptr, dtype=np.int64)
    if indptr.ndim != 1 or indptr.size == 0 or indptr[0] != 0 or np.any(np.diff(indptr) < 0):
        raise ValueError("indptr must be a 1-D non-decreasing CSR row pointer starting at 0 "
                         f"(got shape {indptr.shape}); pass matrix.indptr of a scipy CSR matrix")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if row_weight < 0:
        raise ValueError(f"row_weight={row_weight} must be >= 0")
    n = indptr.size - 1
    cost = indptr.astype(np.float64) + row_weight * np.arange(n + 1, dtype=np.float64)
    total = cost[-1]
    bounds = [0]
    for r in range(1, world_size):
        target = total * r / world_size
        i = int(np.searchsorted(cost, target, side="left"))
        if i > 0 and target - cost[i - 1] <= cost[i] - target:
            i -= 1
        bounds.append(max(bounds[-1], i))
    bounds.append(n)
    return [RowRange(a, b, int(indptr[b] - indptr[a])) for a, b in zip(bounds[:-1], bounds[1:])]


def even_ranges(n: int, world_size: int) -> list[RowRange]:
    """``world_size`` contiguous ranges of ``n`` rows, sizes differing by at most one."""
    if n < 0 or world_size < 1:
        raise ValueError(f"need n >= 0 and world_size >= 1, got n={n}, world_size={world_size}")
    b = [n * r // world_size for r in range(world_size + 1)]
    return [RowRange(b[r], b[r + 1]) for r in range(world_size)]


def split_by_cost(costs, world_size: int) -> list[list[int]]:
    """Assign whole items to ranks: greedy longest-processing-time (costliest first, to the
    least-loaded rank; ties: lower item index first, lower rank first). Deterministic, so every
    rank computes the same split from the same list. Returns each rank's item indices, sorted."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    costs = [float(c) for c in costs]
    if any(not np.isfinite(c) or c < 0 for c in costs):
        raise ValueError("costs must be finite and >= 0")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, r) for r in range(world_size)]
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + costs[i], r))
    return [sorted(x) for x in out]


# ------------------------------------------------------------------------ the halo plan


@dataclass(frozen=True)
class HaloPlan:
    """What one rank exchanges in each product (computed once, at setup)."""

    rank: int
    world_size: int
    rows: RowRange  # the matrix rows this rank holds (and the output rows it produces)
    cols: RowRange  # the rows of the dense operand X this rank owns
    halo_cols: np.ndarray  # global X rows received, ordered by owner then row (int64)
    recv_counts: tuple[int, ...]  # rows received from each peer
    send_index: torch.Tensor  # local X rows sent, concatenated by destination peer (int64)
    send_counts: tuple[int, ...]  # rows sent to each peer
    any_exchange: bool  # False when no rank needs a halo: the collective is skipped

    @property
    def n_halo(self) -> int:
        return int(sum(self.recv_counts))

    @property
    def n_send(self) -> int:
        return int(sum(self.send_counts))


@dataclass
class CommStats:
    """Accumulated over ``spmm`` calls with ``timed`` on."""

    calls: int = 0
    exchange_s: float = 0.0  # gathering the send buffer + all_to_all_single + concatenation
    product_s: float = 0.0  # the local sparserl product
    rows_sent: int = 0
    rows_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    @property
    def comm_share(self) -> float:
        """Fraction of the timed time spent exchanging halos (0 when nothing was timed)."""
        t = self.exchange_s + self.product_s
        return self.exchange_s / t if t > 0 else 0.0


def _backend(group) -> str:
    return str(dist.get_backend(group)).lower() if dist.is_initialized() else "none"


def comm_device(group=None) -> torch.device:
    """Where setup messages live: the current CUDA device for NCCL, else the CPU."""
    if _backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group) -> None:
    """``all_to_all_single`` along dim 0 with uneven splits; gloo+CUDA stages through the host."""
    if _backend(group) == "gloo" and inp.is_cuda:
        host_out = torch.empty(out.shape, dtype=out.dtype)
        dist.all_to_all_single(host_out, inp.cpu(), list(out_splits), list(in_splits), group=group)
        out.copy_(host_out)
        return
    dist.all_to_all_single(out, inp.contiguous(), list(out_splits), list(in_splits), group=group)


class _HaloExchange(torch.autograd.Function):
    """Forward: receive the halo rows of X. Backward: return their gradients to the owners."""

    @staticmethod
    def forward(ctx, x_local: torch.Tensor, plan: HaloPlan, group):
        send = x_local.index_select(0, plan.send_index.to(x_local.device))
        recv = x_local.new_empty((plan.n_halo, *x_local.shape[1:]))
        _all_to_all(recv, send, plan.recv_counts, plan.send_counts, group)
        ctx.plan, ctx.group, ctx.local_shape = plan, group, x_local.shape
        return recv

    @staticmethod
    def backward(ctx, grad_recv: torch.Tensor):
        plan = ctx.plan
        back = grad_recv.new_empty((plan.n_send, *grad_recv.shape[1:]))
        _all_to_all(back, grad_recv.contiguous(), plan.send_counts, plan.recv_counts, ctx.group)
        grad = grad_recv.new_zeros(ctx.local_shape)
        grad.index_add_(0, plan.send_index.to(grad.device), back)
        return grad, None, None


# ------------------------------------------------------------------------ the matrix


class DistributedSparseMatrix:
    """This rank's block of rows of a row-partitioned sparse matrix, and its halo plan.

    Build it collectively on every rank with ``from_scipy`` (every rank has the whole matrix)
    or ``from_local_rows`` (every rank has only its block). ``A @ x_local`` (or ``spmm``)
    returns this rank's rows of ``A @ X``.
    """

    def __init__(self, local: SparseRLTensor, plan: HaloPlan, row_ranges: list[RowRange],
                 col_ranges: list[RowRange], shape: tuple[int, int], group=None,
                 timed: bool | None = None):
        self.local = local
        self.plan = plan
        self.row_ranges = list(row_ranges)
        self.col_ranges = list(col_ranges)
        self.shape = shape
        self.group = group
        self.timed = (local.device.type != "cuda") if timed is None else bool(timed)
        self.stats = CommStats()

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_scipy(cls, A, *, row_ranges: list[RowRange] | None = None,
                   col_ranges: list[RowRange] | None = None, group=None, device=None,
                   dtype: torch.dtype = torch.float32, timed: bool | None = None,
                   ) -> "DistributedSparseMatrix":
        """Every rank passes the same whole matrix; each keeps its own block (collective).

        ``row_ranges`` default: ``partition_rows(A.indptr, world_size)``. ``col_ranges`` (how
        X's rows are owned) default: ``row_ranges`` for a square matrix; a rectangular one must
        pass them (e.g. ``even_ranges(A.shape[1], world_size)``).
        """
        rank, ws = _rank_world(group)
        A = sp.csr_matrix(A)
        A.sum_duplicates()
        if row_ranges is None:
            row_ranges = partition_rows(A.indptr, ws)
        if row_ranges and row_ranges[-1].stop != A.shape[0]:
            raise ValueError(f"row_ranges cover {row_ranges[-1].stop} rows but the matrix has {A.shape[0]}")
        rr = row_ranges[rank] if len(row_ranges) == ws else None
        if rr is None:
            raise ValueError(f"row_ranges has {len(row_ranges)} ranges for world_size={ws}")
        block = A[rr.start:rr.stop]
        return cls.from_local_rows(block, row_ranges, n_cols=A.shape[1], col_ranges=col_ranges,
                                   group=group, device=device, dtype=dtype, timed=timed)

    @classmethod
    def from_local_rows(cls, block, row_ranges: list[RowRange], *, n_cols: int,
                        col_ranges: list[RowRange] | None = None, group=None, device=None,
                        dtype: torch.dtype = torch.float32, timed: bool | None = None,
                        ) -> "DistributedSparseMatrix":
        """Every rank passes only its block (rows ``row_ranges[rank]``, GLOBAL column ids).

        Collective: ranks exchange their halo requests with two ``all_to_all_single`` calls.
        """
        rank, ws = _rank_world(group)
        row_ranges = _check_ranges(row_ranges, ws, "row_ranges")
        n_rows = row_ranges[-1].stop
        if col_ranges is None:
            if n_rows != n_cols:
                raise ValueError(
                    f"the matrix is {n_rows} x {n_cols} (rectangular): pass col_ranges= to say which "
                    f"rank owns which rows of the dense operand, e.g. even_ranges({n_cols}, {ws})")
            col_ranges = row_ranges
        col_ranges = _check_ranges(col_ranges, ws, "col_ranges")
        if col_ranges[-1].stop != n_cols:
            raise ValueError(f"col_ranges cover {col_ranges[-1].stop} rows of X but the matrix has {n_cols} columns")
        rows, cols = row_ranges[rank], col_ranges[rank]
        block = sp.csr_matrix(block)
        block.sum_duplicates()
        if block.shape[0] != rows.n_rows:
            raise ValueError(f"rank {rank}: the local block has {block.shape[0]} rows but row_ranges[{rank}] = "
                             f"[{rows.start}, {rows.stop}) has {rows.n_rows}")
        idx = block.indices.astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= n_cols):
            raise ValueError(f"rank {rank}: column index {int(idx.max())} out of range for n_cols={n_cols}; "
                             "the block must use global column ids")

        # which X rows this rank needs from whom
        needed = np.unique(idx)
        starts = np.array([c.start for c in col_ranges], dtype=np.int64)
        owner = np.searchsorted(starts, needed, side="right") - 1
        halo = owner != rank
        halo_cols = needed[halo]
        recv_counts = np.bincount(owner[halo], minlength=ws).astype(np.int64)

        # tell each owner what to send: counts, then the global row ids
        dev = comm_device(group)
        send_counts_t = torch.zeros(ws, dtype=torch.int64, device=dev)
        if ws > 1:
            _all_to_all(send_counts_t, torch.from_numpy(recv_counts).to(dev), [1] * ws, [1] * ws, group)
        send_counts = send_counts_t.cpu().numpy()
        requested = torch.zeros(int(send_counts.sum()), dtype=torch.int64, device=dev)
        if ws > 1:
            _all_to_all(requested, torch.from_numpy(halo_cols).to(dev), send_counts.tolist(),
                        recv_counts.tolist(), group)
        send_index = requested.cpu() - cols.start
        if send_index.numel() and (send_index.min() < 0 or send_index.max() >= cols.n_rows):
            raise RuntimeError(f"rank {rank}: a peer asked for X rows outside [{cols.start}, {cols.stop}); "
                               "the ranks disagree on col_ranges (pass the same ranges everywhere)")
        total = torch.tensor([len(halo_cols)], dtype=torch.int64, device=dev)
        if ws > 1:
            dist.all_reduce(total, group=group)
        plan = HaloPlan(rank, ws, rows, cols, halo_cols, tuple(int(c) for c in recv_counts), send_index,
                        tuple(int(c) for c in send_counts), bool(total.item() > 0))

        # compacted column space: [own X rows | halo rows in plan order]
        own = (idx >= cols.start) & (idx < cols.stop)
        local_idx = np.where(own, idx - cols.start, cols.n_rows + np.searchsorted(halo_cols, idx))
        vals = torch.from_numpy(np.ascontiguousarray(block.data)).to(dtype)
        local = SparseRLTensor.from_csr(block.indptr, local_idx, vals,
                                        (rows.n_rows, cols.n_rows + len(halo_cols)), device=device)
        plan = dataclasses.replace(plan, send_index=send_index.to(local.device))  # no copy per call
        return cls(local, plan, row_ranges, col_ranges, (n_rows, n_cols), group, timed)

    # ---------------------------------------------------------------- products

    def exchange(self, x_local: torch.Tensor) -> torch.Tensor:
        """``cat([x_local, halo rows])``: the operand of the local block (differentiable)."""
        self._check_operand(x_local)
        if not self.plan.any_exchange:
            return x_local
        recv = _HaloExchange.apply(x_local, self.plan, self.group)
        return torch.cat([x_local, recv], dim=0)

    def spmm(self, x_local: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``A @ X`` from this rank's rows of ``X`` (1-D: SpMV). Collective."""
        timed = self.timed
        cuda = x_local.is_cuda
        if timed and cuda:
            torch.cuda.synchronize(x_local.device)
        t0 = time.perf_counter()
        x_ext = self.exchange(x_local)
        if timed and cuda:
            torch.cuda.synchronize(x_local.device)
        t1 = time.perf_counter()
        y = self.local @ x_ext
        if timed and cuda:
            torch.cuda.synchronize(x_local.device)
        t2 = time.perf_counter()
        if timed:
            s, p, row_bytes = self.stats, self.plan, x_local[:1].numel() * x_local.element_size()
            s.calls += 1
            s.exchange_s += t1 - t0
            s.product_s += t2 - t1
            if p.any_exchange:
                s.rows_sent += p.n_send
                s.rows_received += p.n_halo
                s.bytes_sent += p.n_send * row_bytes
                s.bytes_received += p.n_halo * row_bytes
        return y

    __matmul__ = spmm

    def _check_operand(self, x: torch.Tensor) -> None:
        own = self.plan.cols.n_rows
        if not isinstance(x, torch.Tensor) or x.dim() not in (1, 2):
            raise ValueError("the dense operand must be a 1-D or 2-D tensor of this rank's rows of X")
        if x.shape[0] != own:
            raise ValueError(f"rank {self.plan.rank}: x_local has {x.shape[0]} rows but this rank owns "
                             f"X rows [{self.plan.cols.start}, {self.plan.cols.stop}) ({own} rows); "
                             "slice it with local_rows(X)")
        if x.dtype != self.local.dtype or x.device != self.local.device:
            raise ValueError(f"x_local is {x.dtype} on {x.device} but the matrix is {self.local.dtype} on "
                             f"{self.local.device}; convert with x.to(device, dtype)")
        if _backend(self.group) == "nccl" and not x.is_cuda and self.plan.any_exchange:
            raise ValueError("the NCCL backend exchanges CUDA tensors only: move x_local to this rank's GPU "
                             "(or use the gloo backend for CPU tensors)")

    # ---------------------------------------------------------------- helpers

    def local_rows(self, x_full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full dense operand X."""
        c = self.plan.cols
        return x_full[c.start:c.stop]

    def gather(self, y_local: torch.Tensor) -> torch.Tensor:
        """The full ``A @ X`` on every rank, from each rank's rows (collective, all_gather of
        padded tensors: equal sizes work on gloo and NCCL alike)."""
        ws = self.plan.world_size
        if ws == 1:
            return y_local
        width = max(r.n_rows for r in self.row_ranges)
        pad = y_local.new_zeros((width, *y_local.shape[1:]))
        pad[: y_local.shape[0]] = y_local
        parts = [torch.empty_like(pad) for _ in range(ws)]
        if _backend(self.group) == "gloo" and pad.is_cuda:
            host = [p.cpu() for p in parts]
            dist.all_gather(host, pad.cpu(), group=self.group)
            parts = [h.to(pad.device) for h in host]
        else:
            dist.all_gather(parts, pad, group=self.group)
        return torch.cat([p[: r.n_rows] for p, r in zip(parts, self.row_ranges)], dim=0)

    def __repr__(self) -> str:
        p = self.plan
        return (f"DistributedSparseMatrix(shape={self.shape}, rank={p.rank}/{p.world_size}, "
                f"rows=[{p.rows.start}, {p.rows.stop}), nnz={self.local.nnz}, halo={p.n_halo}, "
                f"send={p.n_send})")


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1  # one process, no process group: the whole matrix is local
    return dist.get_rank(group), dist.get_world_size(group)


def _check_ranges(ranges, ws: int, name: str) -> list[RowRange]:
    ranges = list(ranges)
    if len(ranges) != ws:
        raise ValueError(f"{name} has {len(ranges)} ranges for world_size={ws}; give one per rank")
    at = 0
    for i, r in enumerate(ranges):
        if r.start != at or r.stop < r.start:
            raise ValueError(f"{name}[{i}] = [{r.start}, {r.stop}) does not continue at row {at}: ranges must "
                             "be contiguous, ordered and cover 0..n")
        at = r.stop
    return ranges
