"""GNN inference on a sparserl adjacency: a 2-layer GCN and a GraphSAGE-style mean aggregator.

Both models are plain PyTorch over a ``SparseRLTensor`` adjacency. The script

1. trains the GCN on Cora or CiteSeer (``../shared/matrices``) with torch.sparse, then checks that
   inference through sparserl (eager and ``torch.compile(backend="sparserl", fullgraph=True)``)
   gives the same predictions and test accuracy; the exit status is 1 if the accuracies differ;
2. with ``--bench`` on a GPU, times inference of each model against eager torch.sparse,
   ``torch.compile`` with the default backend, and PyG (when ``torch_geometric`` is installed),
   on the citation graphs and on generated graphs (R-MAT, random geometric); sparserl eager,
   compiled, and compiled with ``mode="reduce-overhead"`` (CUDA graphs: no per-call host work,
   so the gap to plain compiled is the host cost per forward).

On the CPU every sparserl product runs the reference (torch's CPU CSR kernels; generated
kernels are GPU-only), so the check there shows that the plumbing (tensor subclass, custom
ops, compile backend) changes nothing, not that a kernel is right; on a GPU the products run
verified generated kernels or cuSPARSE and the logits differ by float32 rounding only.
Training 200 epochs of Cora takes about 30 s on one busy CPU core (``OMP_NUM_THREADS=1``: on a
loaded machine more OpenMP threads than free cores make small matmuls many times slower);
``--epochs`` shortens it.

    python examples/gnn_inference.py --dataset cora --device cpu
    python examples/gnn_inference.py --bench --graphs rmat:18:8,rgg:1000000:10 --hidden 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn

import sparserl_compile as sr
from sparserl_compile import matrices, miss, plans


def normalized_adjacency(a: sp.csr_matrix, kind: str = "gcn") -> sp.csr_matrix:
    """GCN: D^-1/2 (A + I) D^-1/2.  mean: D^-1 A (rows with no neighbours stay zero)."""
    a = sp.csr_matrix(a, dtype=np.float64)
    a.data[:] = 1.0
    if kind == "gcn":
        a = a + sp.identity(a.shape[0], format="csr")
        d = np.asarray(a.sum(axis=1)).ravel()
        dinv = 1.0 / np.sqrt(np.maximum(d, 1e-12))
        out = sp.diags(dinv) @ a @ sp.diags(dinv)
    elif kind == "mean":
        d = np.asarray(a.sum(axis=1)).ravel()
        out = sp.diags(np.where(d > 0, 1.0 / np.maximum(d, 1), 0.0)) @ a
    else:
        raise ValueError(f"unknown normalization {kind!r}")
    return matrices.canonical(out)


class GCN(nn.Module):
    """Kipf & Welling: logits = A relu(A X W1) W2 (A fixed, sparse)."""

    def __init__(self, adj, n_in: int, n_hidden: int, n_out: int, dropout: float = 0.5):
        super().__init__()
        self.adj = adj
        self.lin1 = nn.Linear(n_in, n_hidden)
        self.lin2 = nn.Linear(n_hidden, n_out)
        self.dropout = dropout

    def forward(self, x):
        x = F.dropout(x, self.dropout, self.training)
        x = torch.relu(self.adj @ self.lin1(x))
        x = F.dropout(x, self.dropout, self.training)
        return self.adj @ self.lin2(x)


class SAGEMean(nn.Module):
    """GraphSAGE with the mean aggregator: h' = relu(W_self h + W_neigh (D^-1 A) h), two layers."""

    def __init__(self, adj_mean, n_in: int, n_hidden: int, n_out: int):
        super().__init__()
        self.adj = adj_mean
        self.self1, self.neigh1 = nn.Linear(n_in, n_hidden), nn.Linear(n_in, n_hidden, bias=False)
        self.self2, self.neigh2 = nn.Linear(n_hidden, n_out), nn.Linear(n_hidden, n_out, bias=False)

    def forward(self, x):
        h = torch.relu(self.self1(x) + self.neigh1(self.adj @ x))
        return self.self2(h) + self.neigh2(self.adj @ h)


def native_csr(a_hat: sp.csr_matrix, device="cpu") -> torch.Tensor:
    """The torch.sparse CSR tensor of a (canonical, float32) scipy matrix: the baseline operand."""
    return torch.sparse_csr_tensor(torch.from_numpy(a_hat.indptr.astype(np.int64)),
                                   torch.from_numpy(a_hat.indices.astype(np.int64)),
                                   torch.from_numpy(a_hat.data), size=a_hat.shape,
                                   check_invariants=False).to(device)


def load_citation(name: str):
    d = matrices.shared_matrices_dir()
    if d is None:
        raise SystemExit("the citation graphs need ../shared/matrices (or SPARSERL_SHARED_MATRICES)")
    adj = matrices.load_npz(d / f"{name}_adj.npz")
    feats = matrices.load_npz(d / f"{name}_features.npz")
    labels = np.load(d / f"{name}_labels.npy", allow_pickle=False)
    return adj, feats, labels


def planetoid_split(labels: np.ndarray, seed: int = 0):
    """20 labelled nodes per class for training, 500 for validation, 1000 for testing."""
    rng = np.random.default_rng(seed)
    labelled = np.flatnonzero(labels >= 0)
    train = np.concatenate([rng.permutation(labelled[labels[labelled] == c])[:20]
                            for c in np.unique(labels[labelled])])
    rest = rng.permutation(np.setdiff1d(labelled, train))
    return train, rest[:500], rest[500:1500]


def train_gcn(adj_t, x, y, train_idx, n_classes: int, epochs: int = 200, seed: int = 0) -> GCN:
    """Kipf & Welling's recipe (hidden 16, dropout 0.5, Adam lr 0.01, weight decay 5e-4)."""
    torch.manual_seed(seed)
    model = GCN(adj_t, x.shape[1], 16, n_classes).to(x.device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    model.train()
    for _ in range(epochs):
        opt.zero_grad()
        F.cross_entropy(model(x)[train_idx], y[train_idx]).backward()
        opt.step()
    return model.eval()


@dataclass
class AccuracyReport:
    dataset: str
    device: str
    epochs: int
    n_test: int
    test_acc_torch_sparse: float
    test_acc_sparserl_eager: float
    test_acc_sparserl_compiled: float
    same_predictions: bool  # argmax of every node, eager and compiled vs torch.sparse
    max_abs_logit_diff: float

    @property
    def accuracies_equal(self) -> bool:
        return self.test_acc_torch_sparse == self.test_acc_sparserl_eager == self.test_acc_sparserl_compiled


def accuracy_check(dataset: str, device: str, epochs: int = 200) -> AccuracyReport:
    """Train on ``dataset`` with torch.sparse, then infer with torch.sparse and with sparserl."""
    adj, feats, labels = load_citation(dataset)
    a_hat = normalized_adjacency(adj, "gcn")
    x = torch.from_numpy(feats.toarray()).float().to(device)
    y = torch.from_numpy(labels).to(device)
    train, _val, test = (torch.from_numpy(i).to(device) for i in planetoid_split(labels))
    model = train_gcn(native_csr(a_hat, device), x, y, train, int(labels.max()) + 1, epochs=epochs)
    with torch.no_grad():
        ref = model(x)
        model.adj = sr.sparsify(a_hat).to(device)
        eager = model(x)
        torch._dynamo.reset()  # a fresh compile for this model and adjacency
        compiled = torch.compile(model, backend="sparserl", fullgraph=True)(x)

    def acc(logits: torch.Tensor) -> float:
        return float((logits[test].argmax(1) == y[test]).float().mean())

    pred = ref.argmax(1)
    return AccuracyReport(
        dataset, str(device), epochs, int(test.numel()), acc(ref), acc(eager), acc(compiled),
        bool(torch.equal(pred, eager.argmax(1)) and torch.equal(pred, compiled.argmax(1))),
        float(max((ref - eager).abs().max(), (ref - compiled).abs().max())),
    )


def make_graph(spec: str) -> tuple[str, sp.csr_matrix]:
    kind, *args = spec.split(":")
    if kind == "rmat":
        return spec, matrices.rmat(int(args[0]), int(args[1]), seed=0)
    if kind == "rgg":
        return spec, matrices.random_geometric(int(args[0]), float(args[1]), seed=0)
    if kind in ("cora", "citeseer"):
        return spec, load_citation(kind)[0]
    raise ValueError(f"unknown graph {spec!r}: use rmat:SCALE:EDGE_FACTOR, rgg:N:DEGREE, cora, citeseer")


def _time(fn, reps=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return float(np.median(times))


def profile_table(fn, calls: int = 5, rows: int = 14) -> str:
    """torch.profiler's table (CPU and CUDA activities) of ``calls`` calls of ``fn``, sorted by
    self CPU time: where a forward's host and device time go."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def plan_summary() -> list[str]:
    """The runtime's plans, one line each: (op, width bucket) -> kernel format or reference."""
    return sorted({f"{k[1]} n~{k[2]}: {getattr(p, 'header', None) and p.header.format or repr(p)[:80]}"
                   for k, p in plans.plans().items()})


def bench_graph(spec: str, hidden: int, n_features: int, profile: bool = False) -> list[dict]:
    name, a = make_graph(spec)
    dev = "cuda"
    rows = []
    for model_name, norm in (("gcn", "gcn"), ("sage_mean", "mean")):
        a_hat = normalized_adjacency(a, norm)
        native = native_csr(a_hat, dev)
        srt = sr.sparsify(a_hat).to(dev)
        x = torch.randn(a.shape[0], n_features, device=dev)
        cls = GCN if model_name == "gcn" else SAGEMean
        torch.manual_seed(0)
        m = cls(native, n_features, hidden, hidden).to(dev).eval()
        timings = {}
        with torch.no_grad():
            ref = m(x)
            timings["torch_sparse_eager_us"] = _time(lambda: m(x))
            try:
                # reset: each graph and model compiles afresh (never hits dynamo's recompile limit)
                torch._dynamo.reset()
                comp_default = torch.compile(m)
                comp_default(x)
                timings["torch_compile_default_us"] = _time(lambda: comp_default(x))
            except Exception as e:  # noqa: BLE001 - report, keep going
                timings["torch_compile_default_us"] = None
                timings["torch_compile_default_error"] = repr(e)[:200]
            m.adj = srt
            torch.cuda.synchronize()
            plans.reset_stats()
            t_first = time.perf_counter()
            m(x)  # first call: search/verify/cache for this structure (a one-off, kept apart)
            torch.cuda.synchronize()
            timings["sparserl_first_call_s"] = time.perf_counter() - t_first
            # where it went: one row per product planned (provider, compile + sandboxed
            # verification + timing, conversion and upload of the winner)
            timings["sparserl_first_uses"] = miss.first_uses()
            timings["sparserl_eager_us"] = _time(lambda: m(x))
            torch._dynamo.reset()
            comp = torch.compile(m, backend="sparserl", fullgraph=True)
            out = comp(x)
            err = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            timings["sparserl_compiled_us"] = _time(lambda: comp(x))
            if profile:
                timings["sparserl_compiled_profile"] = profile_table(lambda: comp(x))
                timings["sparserl_eager_profile"] = profile_table(lambda: m(x))
                timings["plans"] = plan_summary()
            try:
                # CUDA graphs replay the whole forward with no per-call host work: what is left
                # is GPU time, so the gap to sparserl_compiled_us is the per-call host cost
                torch._dynamo.reset()
                comp_cg = torch.compile(m, backend="sparserl", fullgraph=True, mode="reduce-overhead")
                comp_cg(x)
                timings["sparserl_compiled_cudagraphs_us"] = _time(lambda: comp_cg(x))
            except Exception as e:  # noqa: BLE001 - report, keep going
                timings["sparserl_compiled_cudagraphs_us"] = None
                timings["sparserl_compiled_cudagraphs_error"] = repr(e)[:200]
            timings["pyg_us"] = _bench_pyg(model_name, a_hat, x, hidden)
        rows.append({"graph": name, "model": model_name, "n": a.shape[0], "nnz": int(a_hat.nnz),
                     "hidden": hidden, "rel_err": err, **timings})
    return rows


def _bench_pyg(model_name: str, a_hat: sp.csr_matrix, x: torch.Tensor, hidden: int):
    try:
        from torch_geometric.nn import GCNConv, SAGEConv
    except ImportError:
        return None
    coo = a_hat.tocoo()
    ei = torch.from_numpy(np.vstack([coo.col, coo.row]).astype(np.int64)).to(x.device)
    if model_name == "gcn":
        # PyG normalizes the raw graph itself; cached=True keeps that out of the timed loop, as
        # inference on a fixed graph would (a_hat already has self loops; PyG adds its own)
        l1 = GCNConv(x.shape[1], hidden, cached=True).to(x.device)
        l2 = GCNConv(hidden, hidden, cached=True).to(x.device)
        fn = lambda: l2(torch.relu(l1(x, ei)), ei)  # noqa: E731
    else:
        l1, l2 = SAGEConv(x.shape[1], hidden).to(x.device), SAGEConv(hidden, hidden).to(x.device)
        fn = lambda: l2(torch.relu(l1(x, ei)), ei)  # noqa: E731
    with torch.no_grad():
        return _time(fn)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="cora", choices=["cora", "citeseer"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bench", action="store_true", help="time inference (needs a GPU)")
    p.add_argument("--graphs", default="cora,citeseer,rmat:18:8,rgg:1000000:10")
    p.add_argument("--hidden", default="128", help="hidden size(s), a comma list, e.g. 64,256 (--bench)")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--epochs", type=int, default=200, help="GCN training epochs for the accuracy check")
    p.add_argument("--json", help="write results to this JSON file")
    p.add_argument("--provider", default=None,
                   help="--bench: where new structures' candidates come from (search | nearest | policy; "
                        "default the runtime's, search); 'nearest' times 4 instead of 27-60 per structure")
    p.add_argument("--k", type=int, default=0, help="--bench: candidates per structure (0: the provider's default)")
    p.add_argument("--profile", action="store_true",
                   help="--bench: also keep torch.profiler tables of the sparserl forwards and the plans")
    args = p.parse_args(argv)
    try:
        hiddens = [int(h) for h in str(args.hidden).split(",") if h.strip()]
    except ValueError:
        p.error(f"--hidden {args.hidden!r}: give sizes as integers, e.g. 64,256")
    if not hiddens or min(hiddens) < 1:
        p.error(f"--hidden {args.hidden!r}: give at least one positive size")
    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu")
    if args.bench and not torch.cuda.is_available():
        p.error("--bench times GPU inference and needs a CUDA device")
    if args.provider or args.k:
        sr.configure(**({"provider": args.provider} if args.provider else {}), k=args.k)
    report = accuracy_check(args.dataset, args.device, args.epochs)
    results = {"accuracy": {**asdict(report), "accuracies_equal": report.accuracies_equal}}
    print(json.dumps(results["accuracy"], indent=1))
    if not report.accuracies_equal:
        print("sparserl's test accuracy differs from torch.sparse's", file=sys.stderr)
    if args.bench:
        rows = []
        for g in args.graphs.split(","):
            for hidden in hiddens:
                t0 = time.time()
                rows.extend(bench_graph(g, hidden, args.features, args.profile))
                print(f"# {g} hidden {hidden}: {time.time() - t0:.1f}s", file=sys.stderr)
                results["bench"] = rows
                _write(args.json, results)  # as it goes: a run cut short keeps what it measured
        keys = ["graph", "model", "hidden", "nnz", "torch_sparse_eager_us", "torch_compile_default_us",
                "pyg_us", "sparserl_eager_us", "sparserl_compiled_us", "sparserl_compiled_cudagraphs_us"]
        print(" | ".join(keys))
        for r in rows:
            print(" | ".join(f"{r.get(k):.1f}" if isinstance(r.get(k), float) else str(r.get(k)) for k in keys))
        for r in rows:  # where each first call went (miss.first_uses())
            parts = {k: sum(u.get(k) or 0.0 for u in r.get("sparserl_first_uses", [])) for k in
                     ("problem_s", "propose_s", "select_s", "plan_s")}
            print(f"first call {r['graph']} {r['model']} {r['hidden']}: {r.get('sparserl_first_call_s', 0):.2f}s over "
                  f"{len(r.get('sparserl_first_uses', []))} products: "
                  + ", ".join(f"{k[:-2]} {v:.2f}s" for k, v in parts.items()))
        for r in rows if args.profile else ():
            print(f"\n## {r['graph']} {r['model']}: plans {r.get('plans')}")
            print(r.get("sparserl_compiled_profile", ""))
    _write(args.json, results)
    return 0 if report.accuracies_equal else 1


def _write(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
