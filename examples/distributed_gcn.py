"""A 2-layer GCN trained on a row-partitioned graph: each rank holds a block of the adjacency.

Each of N processes keeps the rows ``[r0, r1)`` of the normalized adjacency
``A = D^-1/2 (G + I) D^-1/2`` (balanced by nonzeros, ``sparserl_compile.distributed``) and the
same rows of the node features. A layer is ``A (H W)``: ``H W`` is row-local, then one
``DistributedSparseMatrix`` product exchanges the halo rows of ``H W`` (the neighbours other
ranks own) and runs the local block through sparserl. Weights are replicated; after the
backward (which sends halo gradients back to their owners) the weight gradients are summed
with ``all_reduce``, so every rank takes the same Adam step -- the result equals one-process
training up to float32 rounding.

The script checks the first forward against a one-process float64 scipy computation (exit 1
if it differs beyond float32 rounding) and prints, on rank 0, the time per epoch, the halo
sizes, the share of product time spent exchanging halos (max over ranks) and the accuracy.

    torchrun --nproc-per-node 2 examples/distributed_gcn.py                  # gloo, CPU, Cora
    torchrun --nproc-per-node 4 examples/distributed_gcn.py --graph rmat:16:8
    torchrun --nproc-per-node 8 examples/distributed_gcn.py --backend nccl --graph rmat:20:16 --timed
    python examples/distributed_gcn.py                                       # one process

Graphs: ``cora`` / ``citeseer`` (``../shared/matrices``, real features and labels) or
``rmat:SCALE:EDGE_FACTOR`` / ``rgg:N:DEGREE`` (generated, symmetrized; random features and
labels planted by a random teacher GCN, so there is something to learn). On CPU the sparserl
products run the reference; with ``--backend nccl`` each rank uses GPU ``LOCAL_RANK`` and the
products run generated kernels. NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` etc., set
by ``distributed.init_process_group`` unless already set). The NCCL path was written for, not
yet run on, a multi-GPU machine. On a busy CPU machine keep ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist
import torch.nn.functional as F

from sparserl_compile import matrices
from sparserl_compile.distributed import DistributedSparseMatrix, init_process_group


def normalized_adjacency(g: sp.csr_matrix) -> sp.csr_matrix:
    """D^-1/2 (G + I) D^-1/2 of the symmetrized pattern of ``g``."""
    a = sp.csr_matrix(g, dtype=np.float64)
    a.data[:] = 1.0
    a = ((a + a.T) > 0).astype(np.float64) + sp.identity(a.shape[0], format="csr")
    d = np.asarray(a.sum(axis=1)).ravel()
    dinv = sp.diags(1.0 / np.sqrt(d))
    return matrices.canonical(dinv @ a @ dinv)


def load_graph(spec: str, n_features: int, n_classes: int, seed: int = 0):
    """(A_hat float64 CSR, features float32 [n, f], labels int64 [n]); identical on every rank."""
    kind, *params = spec.split(":")
    rng = np.random.default_rng(seed)
    if kind in ("cora", "citeseer"):
        d = matrices.shared_matrices_dir()
        if d is None:
            raise SystemExit(f"--graph {kind} needs ../shared/matrices; use --graph rmat:14:8 instead")
        a_hat = normalized_adjacency(matrices.load_npz(d / f"{kind}_adj.npz"))
        x = matrices.load_npz(d / f"{kind}_features.npz").toarray().astype(np.float32)
        x /= np.maximum(x.sum(axis=1, keepdims=True), 1.0)
        y = np.load(d / f"{kind}_labels.npy", allow_pickle=False).astype(np.int64)
        return a_hat, x, y
    if kind not in ("rmat", "rgg"):
        raise SystemExit(f"unknown graph {spec!r}: cora, citeseer, rmat:SCALE:EF or rgg:N:DEGREE")
    try:
        a, b = params
        g = (matrices.rmat(int(a), int(b), seed=seed) if kind == "rmat"
             else matrices.random_geometric(int(a), float(b), seed=seed))
    except ValueError as e:
        raise SystemExit(f"--graph {spec!r}: {e}; give rmat:SCALE:EF or rgg:N:DEGREE (two numbers, "
                         "e.g. rmat:14:8)") from None
    a_hat = normalized_adjacency(g)
    x = rng.standard_normal((a_hat.shape[0], n_features)).astype(np.float32)
    w1 = rng.standard_normal((n_features, 32)) / np.sqrt(n_features)
    w2 = rng.standard_normal((32, n_classes))
    y = np.argmax(a_hat @ np.maximum(a_hat @ (x @ w1), 0) @ w2, axis=1).astype(np.int64)
    return a_hat, x, y


def forward(A: DistributedSparseMatrix, x_local: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor):
    """This rank's logits of ``A relu(A X W1) W2``."""
    h = torch.relu(A @ (x_local @ w1))
    return A @ (h @ w2)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--graph", default="cora", help="cora | citeseer | rmat:SCALE:EF | rgg:N:DEGREE")
    p.add_argument("--features", type=int, default=64, help="feature width of generated graphs")
    p.add_argument("--classes", type=int, default=8, help="classes of generated graphs")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--timed", action="store_true", help="time exchange vs product on CUDA too (synchronizes)")
    return p


def _start(backend: str) -> tuple[torch.device, bool]:
    """This rank's device, and whether torchrun launched it (then the process group is up)."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise SystemExit("--backend nccl needs CUDA GPUs; use the default gloo backend on CPU")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if launched:
        init_process_group(backend)
    return device, launched


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    device, launched = _start(args.backend)
    rank = dist.get_rank() if launched else 0
    ws = dist.get_world_size() if launched else 1

    a_hat, x, y = load_graph(args.graph, args.features, args.classes)
    n, n_classes = a_hat.shape[0], int(y.max()) + 1
    split = np.random.default_rng(1).random(n)
    train, test = split < 0.5, split >= 0.8
    t0 = time.perf_counter()
    A = DistributedSparseMatrix.from_scipy(a_hat.astype(np.float32), device=device,
                                           timed=True if args.timed or device.type == "cpu" else None)
    setup_s = time.perf_counter() - t0
    rows = A.plan.rows
    x_local = torch.from_numpy(x[rows.start:rows.stop]).to(device)
    y_local = torch.from_numpy(y[rows.start:rows.stop]).to(device)
    tr_local = torch.from_numpy(train[rows.start:rows.stop]).to(device)
    te_local = torch.from_numpy(test[rows.start:rows.stop]).to(device)

    g = torch.Generator().manual_seed(0)  # identical initial weights on every rank
    w1 = (torch.randn(x.shape[1], args.hidden, generator=g) / x.shape[1] ** 0.5).to(device).requires_grad_()
    w2 = (torch.randn(args.hidden, n_classes, generator=g) / args.hidden ** 0.5).to(device).requires_grad_()

    # check: the distributed forward equals one process in float64
    with torch.no_grad():
        logits = A.gather(forward(A, x_local, w1, w2)).double().cpu().numpy()
    W1, W2 = w1.detach().double().cpu().numpy(), w2.detach().double().cpu().numpy()
    want = a_hat @ np.maximum(a_hat @ (x.astype(np.float64) @ W1), 0) @ W2
    err = float(np.max(np.abs(logits - want)) / max(np.max(np.abs(want)), 1e-30))
    ok = err < 1e-4

    opt = torch.optim.Adam([w1, w2], lr=args.lr)
    n_train = int(train.sum())
    A.stats = type(A.stats)()  # time the training only
    t0 = time.perf_counter()
    for _ in range(args.epochs):
        opt.zero_grad()
        out = forward(A, x_local, w1, w2)
        loss = F.cross_entropy(out[tr_local], y_local[tr_local], reduction="sum") / n_train
        loss.backward()
        if ws > 1:
            for w in (w1, w2):
                dist.all_reduce(w.grad)
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    epoch_s = (time.perf_counter() - t0) / max(args.epochs, 1)

    with torch.no_grad():
        pred = forward(A, x_local, w1, w2).argmax(dim=1)
    counts = torch.tensor([float((pred[tr_local] == y_local[tr_local]).sum()), float(tr_local.sum()),
                           float((pred[te_local] == y_local[te_local]).sum()), float(te_local.sum()),
                           float(not ok), loss.item()], dtype=torch.float64, device=device)
    share = torch.tensor([A.stats.comm_share, A.stats.exchange_s, float(A.plan.n_halo)],
                         dtype=torch.float64, device=device)
    if ws > 1:
        dist.all_reduce(counts)
        dist.all_reduce(share, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"graph {args.graph}: {n} nodes, {a_hat.nnz} nonzeros, {ws} ranks ({args.backend}, {device.type}); "
              f"setup {setup_s * 1e3:.0f} ms; largest halo {int(share[2])} rows")
        print(f"first forward vs float64 scipy: max rel err {err:.2e} on rank 0 ({'ok' if ok else 'MISMATCH'})")
        timed = A.timed and A.stats.calls > 0
        print(f"{args.epochs} epochs, {epoch_s * 1e3:.1f} ms/epoch; halo exchange "
              + (f"{100 * share[0]:.0f} % of the sparse product time (max over ranks)" if timed else
                 "not timed (pass --timed on CUDA)"))
        print(f"train acc {counts[0] / counts[1]:.3f}  test acc {counts[2] / max(float(counts[3]), 1):.3f}  "
              f"final train loss {float(counts[5]):.3f}")
    failed = counts[4] > 0
    if launched:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
