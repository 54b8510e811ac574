"""GNN inference end to end: GCN, GraphSAGE (mean) and GIN through torch.sparse, PyG and sparserl.

The models are plain PyTorch over a fixed sparse adjacency held by the module (``model.adj``),
written with PyG's math (``GCNConv``, ``SAGEConv(aggr="mean")``, ``GINConv`` with eps = 0), so
their weights carry over to PyG layers and every path computes the same function:

* ``torch_sparse``: eager, ``model.adj`` a torch sparse CSR tensor (cuSPARSE on a GPU);
* ``inductor``: ``torch.compile`` of that model (Dynamo cannot trace native sparse tensors, so
  it graph-breaks around the products; whether ``fullgraph=True`` compiles is recorded);
* ``pyg_*``: PyG's layers on PyG's operands -- ``csr`` (a torch sparse CSR ``adj_t``),
  ``edge_index`` (gather/scatter messages; skipped where the messages would not fit) and
  ``EdgeIndex`` (PyG's sorted index type, where this PyG has it) -- and ``pyg_fastest``;
  ``pyg_sparserl``: the PyG model on the CSR ``adj_t`` inside ``sr.accelerate()``;
* ``sparserl_eager``: ``model.adj = sr.sparsify(A)``; ``sparserl_compiled``:
  ``torch.compile(model, backend="sparserl", fullgraph=True)``; ``sparserl_reduce_overhead``:
  the same with ``mode="reduce-overhead"`` (CUDA graphs; GPU only).

Accuracy (always run): each model is trained with torch.sparse on Cora or CiteSeer
(``../shared/matrices``: adjacency, features, labels; 20 labelled nodes per class), then the
test accuracy of that trained model is measured through every path. The exit status is 1 if a
sparserl path's accuracy differs from torch.sparse's.

``--bench``: per graph (Cora, CiteSeer with their features, generated ``rmat:SCALE:EF``,
``rgg:N:DEG``, ``community:N:DEG``; 10^4 to 10^8 edges), model and hidden size, the time per
forward of every path, warm, host time included, two ways: ``per_forward_us`` (each call
synchronized) and ``back_to_back_us`` (calls queued, one synchronize). sparserl's first call
(the search for each new product) is timed apart. On the CPU every sparserl product runs the
reference, so the CPU figures check the plumbing, not a kernel. ``--quick`` shrinks everything
to a CPU test.

    python examples/gnn_inference.py --dataset cora --device cpu --epochs 50
    python examples/gnn_inference.py --bench --graphs cora,rmat:18:8 --hidden 128 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import time

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from torch import nn

import sparserl_compile as sr
from sparserl_compile import bench, graphs, matrices, miss

MODELS = ("gcn", "sage", "gin")
# every path of a model is compiled for the same forward code; each backend and operand type is
# a cache entry of its own, and past the default limit Dynamo would quietly run eager
for _name in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, max(64, getattr(torch._dynamo.config, _name)))
SPARSERL_PATHS = ("sparserl_eager", "sparserl_compiled", "sparserl_reduce_overhead")


# ------------------------------------------------------------------ adjacencies and models


def gin_adjacency(a: sp.csr_matrix) -> sp.csr_matrix:
    """A + I over the 0/1 pattern of ``a``: GIN's sum over neighbours plus the vertex itself
    (eps = 0); a self loop already in ``a`` counts twice, as in PyG's ``GINConv``."""
    p = matrices.canonical(a).copy()
    p.data[:] = 1.0
    return matrices.canonical(p + sp.identity(a.shape[0], np.float32, format="csr"))


def normalized_adjacency(a: sp.csr_matrix, kind: str = "gcn") -> sp.csr_matrix:
    """The operand a model multiplies by: ``gcn`` D^-1/2 (A + I) D^-1/2, ``mean`` D^-1 A (rows
    without neighbours stay zero), ``gin`` A + I."""
    if kind == "gcn":
        return graphs.gcn_normalize(a)
    if kind in ("mean", "sage"):
        return graphs.mean_normalize(a)
    if kind == "gin":
        return gin_adjacency(a)
    raise ValueError(f"unknown normalization {kind!r}: use gcn, mean or gin")


def _dims(n_in: int, n_hidden: int, n_out: int, layers: int) -> list[tuple[int, int]]:
    if layers < 1:
        raise ValueError(f"layers={layers}: a model needs at least one layer")
    sizes = [n_in] + [n_hidden] * (layers - 1) + [n_out]
    return list(zip(sizes[:-1], sizes[1:]))


class GCN(nn.Module):
    """Kipf & Welling (PyG's ``GCNConv``): h' = A_hat (h W) + b, ReLU and dropout between layers."""

    def __init__(self, adj, n_in: int, n_hidden: int, n_out: int, dropout: float = 0.5, layers: int = 2):
        super().__init__()
        self.adj, self.dropout = adj, dropout
        dims = _dims(n_in, n_hidden, n_out, layers)
        self.lins = nn.ModuleList(nn.Linear(i, o, bias=False) for i, o in dims)
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(o)) for _, o in dims)

    def forward(self, x):
        for i, (lin, b) in enumerate(zip(self.lins, self.biases)):
            x = F.dropout(x, self.dropout, self.training)
            x = self.adj @ lin(x) + b
            if i < len(self.lins) - 1:
                x = torch.relu(x)
        return x


class SAGEMean(nn.Module):
    """GraphSAGE, mean aggregator (PyG's ``SAGEConv``): h' = W_l (D^-1 A h) + b + W_r h."""

    def __init__(self, adj, n_in: int, n_hidden: int, n_out: int, dropout: float = 0.5, layers: int = 2):
        super().__init__()
        self.adj, self.dropout = adj, dropout
        dims = _dims(n_in, n_hidden, n_out, layers)
        self.lin_l = nn.ModuleList(nn.Linear(i, o) for i, o in dims)
        self.lin_r = nn.ModuleList(nn.Linear(i, o, bias=False) for i, o in dims)

    def forward(self, x):
        for i, (ll, lr) in enumerate(zip(self.lin_l, self.lin_r)):
            x = F.dropout(x, self.dropout, self.training)
            x = ll(self.adj @ x) + lr(x)
            if i < len(self.lin_l) - 1:
                x = torch.relu(x)
        return x


class GIN(nn.Module):
    """GIN (PyG's ``GINConv``, eps = 0): h' = MLP((A + I) h), MLP = Linear, ReLU, Linear."""

    def __init__(self, adj, n_in: int, n_hidden: int, n_out: int, dropout: float = 0.5, layers: int = 2):
        super().__init__()
        self.adj, self.dropout = adj, dropout
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Linear(o, o))
                                  for i, o in _dims(n_in, n_hidden, n_out, layers))

    def forward(self, x):
        for i, mlp in enumerate(self.mlps):
            x = F.dropout(x, self.dropout, self.training)
            x = mlp(self.adj @ x)
            if i < len(self.mlps) - 1:
                x = torch.relu(x)
        return x


SAGE = SAGEMean
CLASSES = {"gcn": (GCN, "gcn"), "sage": (SAGEMean, "mean"), "gin": (GIN, "gin")}


def native_csr(a_hat: sp.csr_matrix, device="cpu") -> torch.Tensor:
    """The torch.sparse CSR tensor of a (canonical, float32) scipy matrix: the baseline operand."""
    return bench.csr_tensor(torch, torch.from_numpy(a_hat.indptr.astype(np.int64)),
                            torch.from_numpy(a_hat.indices.astype(np.int64)), torch.from_numpy(a_hat.data),
                            a_hat.shape).to(device)


# ------------------------------------------------------------------ PyG with the same weights


def pyg_available() -> str | None:
    """None if ``torch_geometric`` imports, else why not."""
    try:
        import torch_geometric  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means no PyG column
        return f"torch_geometric not importable: {type(e).__name__}: {e}"
    return None


class PygNet(nn.Module):
    """PyG layers applied as our models apply theirs: ``forward(x, adj, edge_weight=None)``."""

    def __init__(self, convs, weighted: bool):
        super().__init__()
        self.convs, self.weighted = nn.ModuleList(convs), weighted

    def forward(self, x, adj, edge_weight=None):
        for i, conv in enumerate(self.convs):
            x = conv(x, adj, edge_weight) if self.weighted and edge_weight is not None else conv(x, adj)
            if i < len(self.convs) - 1:
                x = torch.relu(x)
        return x


def pyg_model(model_name: str, model: nn.Module) -> PygNet:
    """The PyG equivalent of one of our trained models, with its weights (eval mode)."""
    from torch_geometric.nn import GCNConv, GINConv, SAGEConv

    convs = []
    if model_name == "gcn":
        for lin, b in zip(model.lins, model.biases):
            c = GCNConv(lin.in_features, lin.out_features, normalize=False)  # A_hat is given normalized
            c.lin.weight.data.copy_(lin.weight.data)
            c.bias.data.copy_(b.data)
            convs.append(c)
    elif model_name == "sage":
        for ll, lr in zip(model.lin_l, model.lin_r):
            c = SAGEConv(ll.in_features, ll.out_features, aggr="mean")
            c.lin_l.load_state_dict(ll.state_dict())
            c.lin_r.load_state_dict(lr.state_dict())
            convs.append(c)
    else:
        for mlp in model.mlps:
            c = GINConv(copy.deepcopy(mlp), eps=0.0)
            c.nn.load_state_dict(mlp.state_dict())  # GINConv's constructor re-initializes its nn
            convs.append(c)
    dev = next(model.parameters()).device
    return PygNet(convs, weighted=model_name == "gcn").to(dev).eval()


def pyg_operands(model_name: str, a: sp.csr_matrix, device, max_message_bytes: float, width: int) -> dict:
    """PyG's operands of graph ``a`` for one model: name -> (adj, edge_weight) or a string (why
    not). GCN takes the normalized matrix (values as edge weights), SAGE and GIN the 0/1
    pattern (PyG aggregates by mean and sum itself). ``GCNConv``/``SAGEConv``/``GINConv`` pass
    messages over an ``edge_index`` or ``EdgeIndex`` (one row of x per edge), so those two are
    skipped where the messages would exceed ``max_message_bytes``."""
    m = normalized_adjacency(a, "gcn") if model_name == "gcn" else matrices.canonical(a)
    if model_name != "gcn":
        m = m.copy()
        m.data[:] = 1.0
    out: dict = {"csr": (native_csr(m, device), None)}
    rows = np.repeat(np.arange(m.shape[0], dtype=np.int64), np.diff(m.indptr))
    # PyG's edge_index is (source, target) and aggregates at the target: row i of A gathers
    # from its columns
    ei = torch.from_numpy(np.vstack([m.indices.astype(np.int64), rows])).to(device)
    w = torch.from_numpy(m.data).to(device) if model_name == "gcn" else None
    if m.nnz * width * 4 * 2 > max_message_bytes:  # both gather x_j per edge and scatter it
        too_big = f"skipped: {m.nnz} messages of width {width} would not fit"
        out["edge_index"] = out["EdgeIndex"] = too_big
        return out
    out["edge_index"] = (ei, w)
    try:
        from torch_geometric import EdgeIndex

        out["EdgeIndex"] = (EdgeIndex(ei, sparse_size=m.shape, sort_order="col"), w)
    except Exception as e:  # noqa: BLE001 - older PyG or an EdgeIndex it refuses: reported
        out["EdgeIndex"] = f"unavailable: {type(e).__name__}: {e}"[:200]
    return out


# ------------------------------------------------------------------ the paths


def _compile_inductor(model, x):
    """``torch.compile`` of the torch.sparse model: (callable, note). Dynamo does not trace
    native sparse tensors; fullgraph=True says so, and the default mode runs with graph breaks."""
    note = "fullgraph compiles"
    try:
        torch.compile(model, fullgraph=True)(x)
    except Exception as e:  # noqa: BLE001 - the expected outcome is recorded, not raised
        note = f"fullgraph=True fails ({type(e).__name__}: {str(e).splitlines()[0][:160]}); default mode graph-breaks"
    fn = torch.compile(model)
    fn(x)
    return fn, note


def paths(model_name: str, model: nn.Module, a: sp.csr_matrix, x: torch.Tensor, *, pyg: bool = True,
          max_message_bytes: float = 8e9) -> tuple[dict, dict]:
    """Every path's forward for ``model`` on graph ``a``: (name -> callable() -> logits, notes).
    Building a path runs it once (compiles, sparserl's first calls); notes hold why a path is
    missing, what building it cost, and the inductor note."""
    device = x.device
    norm = CLASSES[model_name][1]
    torch._dynamo.reset()  # every graph and model compiles afresh
    a_hat = normalized_adjacency(a, norm)
    fns, notes = {}, {}
    model.adj = native_csr(a_hat, device)
    fns["torch_sparse"] = lambda: model(x)
    try:
        inductor, notes["inductor"] = _compile_inductor(model, x)
        fns["inductor"] = lambda: inductor(x)
    except Exception as e:  # noqa: BLE001
        notes["inductor"] = f"failed: {type(e).__name__}: {e}"[:300]
    if pyg:
        why = pyg_available()
        if why:
            notes["pyg"] = why
        else:
            net = pyg_model(model_name, model)
            for kind, op in pyg_operands(model_name, a, device, max_message_bytes, x.shape[1]).items():
                if isinstance(op, str):
                    notes[f"pyg_{kind}"] = op
                    continue
                fn = (lambda net=net, op=op: net(x, op[0], op[1]))
                try:
                    fn()
                    fns[f"pyg_{kind}"] = fn
                except Exception as e:  # noqa: BLE001 - this PyG cannot run that operand: say so
                    notes[f"pyg_{kind}"] = f"failed: {type(e).__name__}: {e}"[:300]
                if kind == "csr" and "pyg_csr" in fns:
                    fns["pyg_sparserl"] = (lambda net=net, op=op: _accelerated(net, x, op[0]))
    srm = copy.copy(model)  # the same parameters, another adjacency
    srm.adj = sr.sparsify(a_hat).to(device)
    miss.clear_first_uses()
    bench.sync(device)
    t0 = time.perf_counter()
    srm(x)  # first calls: every new product of this model is planned (searched on a GPU)
    bench.sync(device)
    notes["sparserl_first_call_s"] = round(time.perf_counter() - t0, 3)
    notes["sparserl_first_uses"] = [{k: u.get(k) for k in ("op", "n", "source", "propose_s", "select_s", "plan_s",
                                                           "total_s", "plan")} for u in miss.first_uses()]
    fns["sparserl_eager"] = lambda: srm(x)
    comp = torch.compile(srm, backend="sparserl", fullgraph=True)
    comp(x)
    fns["sparserl_compiled"] = lambda: comp(x)
    if device.type == "cuda":
        try:
            cg = torch.compile(srm, backend="sparserl", fullgraph=True, mode="reduce-overhead")
            for _ in range(3):  # CUDA graphs record on the second or third call
                cg(x)
            fns["sparserl_reduce_overhead"] = lambda: cg(x).clone()  # a replay's output is overwritten by the next
        except Exception as e:  # noqa: BLE001
            notes["sparserl_reduce_overhead"] = f"failed: {type(e).__name__}: {e}"[:300]
    else:
        notes["sparserl_reduce_overhead"] = "CUDA graphs need a GPU"
    return fns, notes


def _accelerated(net, x, adj):
    with sr.accelerate():
        return net(x, adj)


# ------------------------------------------------------------------ accuracy


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


def train(model_name: str, a: sp.csr_matrix, x, y, train_idx, n_classes: int, *, hidden: int = 16,
          layers: int = 2, epochs: int = 200, seed: int = 0) -> nn.Module:
    """Kipf & Welling's recipe (dropout 0.5, Adam lr 0.01, weight decay 5e-4) with torch.sparse."""
    torch.manual_seed(seed)
    cls, norm = CLASSES[model_name]
    model = cls(native_csr(normalized_adjacency(a, norm), x.device), x.shape[1], hidden, n_classes,
                layers=layers).to(x.device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    model.train()
    for _ in range(epochs):
        opt.zero_grad()
        F.cross_entropy(model(x)[train_idx], y[train_idx]).backward()
        opt.step()
    return model.eval()


def accuracy(dataset: str, device: str, *, models=MODELS, epochs: int = 200, hidden: int = 16, layers: int = 2,
             pyg: bool = True) -> list[dict]:
    """Train each model with torch.sparse, then its test accuracy through every path (one row
    per model: ``acc`` per path, whether each path's predictions equal torch.sparse's, and the
    largest logit difference)."""
    a, feats, labels = load_citation(dataset)
    x = torch.from_numpy(feats.toarray()).float().to(device)
    y = torch.from_numpy(labels).to(device)
    tr, _val, test = (torch.from_numpy(i).to(device) for i in planetoid_split(labels))
    rows = []
    for name in models:
        model = train(name, a, x, y, tr, int(labels.max()) + 1, hidden=hidden, layers=layers, epochs=epochs)
        with torch.no_grad():
            fns, notes = paths(name, model, a, x, pyg=pyg)
            ref = fns["torch_sparse"]()
            acc, same, diff = {}, {}, {}
            for p, fn in fns.items():
                out = fn()
                acc[p] = float((out[test].argmax(1) == y[test]).float().mean())
                same[p] = bool(torch.equal(out.argmax(1), ref.argmax(1)))
                diff[p] = float((out - ref).abs().max())
        rows.append({"dataset": dataset, "model": name, "epochs": epochs, "hidden": hidden, "layers": layers,
                     "n_test": int(test.numel()), "test_acc": acc, "same_predictions": same,
                     "max_abs_logit_diff": diff, "notes": _plain(notes)})
    return rows


def sparserl_accuracy_equal(rows: list[dict]) -> bool:
    """Every sparserl path's test accuracy equals torch.sparse's, in every row."""
    return all(r["test_acc"][p] == r["test_acc"]["torch_sparse"] for r in rows for p in SPARSERL_PATHS
               if p in r["test_acc"])


def _plain(notes: dict) -> dict:
    return {k: v for k, v in notes.items() if isinstance(v, (str, int, float, list, type(None)))}


# ------------------------------------------------------------------ timing


def make_graph(spec: str):
    """(adjacency, features or None, number of classes or None) of a graph spec."""
    kind, *args = spec.split(":")
    try:
        if kind in ("cora", "citeseer") and not args:
            a, feats, labels = load_citation(kind)
            return a, feats.toarray().astype(np.float32), int(labels.max()) + 1
        if kind == "rmat" and len(args) == 2:
            return graphs.rmat_graph(int(args[0]), float(args[1]), seed=0), None, None
        if kind == "rgg" and len(args) == 2:
            return graphs.geometric_graph(int(args[0]), float(args[1]), seed=0), None, None
        if kind == "community" and len(args) == 2:
            return graphs.community_graph(int(args[0]), float(args[1]), seed=0), None, None
    except ValueError as e:
        raise SystemExit(f"--graphs {spec!r}: {e}") from None
    raise SystemExit(f"--graphs {spec!r}: use cora, citeseer, rmat:SCALE:EDGE_FACTOR, rgg:N:DEGREE or "
                     "community:N:DEGREE")


def bench_graph(spec: str, model_name: str, hidden: int, layers: int, device: str, *, features: int | None = None,
                reps: int = 20, calls: int = 50, pyg: bool = True) -> dict:
    """Times per forward of every path for one graph, model and hidden size."""
    a, feats, n_classes = make_graph(spec)
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    x = (torch.from_numpy(feats) if feats is not None
         else torch.randn(a.shape[0], features or hidden, generator=g)).to(dev)
    torch.manual_seed(0)
    cls, _ = CLASSES[model_name]
    model = cls(None, x.shape[1], hidden, n_classes or hidden, layers=layers).to(dev).eval()
    row = {"graph": spec, "model": model_name, "hidden": hidden, "layers": layers, "n": int(a.shape[0]),
           "edges": int(a.nnz), "features": int(x.shape[1])}
    with torch.no_grad():
        free = torch.cuda.mem_get_info()[0] if dev.type == "cuda" else 16e9
        fns, notes = paths(model_name, model, a, x, pyg=pyg, max_message_bytes=free / 4)
        ref = fns["torch_sparse"]()
        scale = float(ref.abs().max().clamp_min(1e-30))
        row["max_rel_diff"] = {p: float((fn() - ref).abs().max()) / scale for p, fn in fns.items()}
        per, b2b = {}, {}
        for p, fn in fns.items():
            per[p] = bench.wall_median_us(fn, dev, reps=reps, warmup=2)
            b2b[p] = bench.stream_us(fn, dev, calls=calls, warmup=2)
    pyg_paths = [p for p in per if p.startswith("pyg_") and p != "pyg_sparserl"]
    if pyg_paths:
        best = min(pyg_paths, key=lambda p: per[p])
        row["pyg_fastest"] = best
        per["pyg_fastest"], b2b["pyg_fastest"] = per[best], b2b[best]
    row.update(per_forward_us=per, back_to_back_us=b2b, notes=_plain(notes))
    return row


COLUMNS = ("torch_sparse", "inductor", "pyg_fastest", "pyg_sparserl", "sparserl_eager", "sparserl_compiled",
           "sparserl_reduce_overhead")


def table(rows: list[dict]) -> str:
    head = "| graph | model | hidden | edges | " + " | ".join(COLUMNS) + " | first call s |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 5),
             ]
    for r in rows:
        per = r["per_forward_us"]
        cells = [f"{per[c]:.0f}" if c in per else "-" for c in COLUMNS]
        lines.append(f"| {r['graph']} | {r['model']} | {r['hidden']} | {r['edges']} | " + " | ".join(cells)
                     + f" | {r['notes'].get('sparserl_first_call_s', '-')} |")
    return "per forward, us (each call synchronized, host included):\n" + "\n".join(lines)


# ------------------------------------------------------------------ main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="cora", help="accuracy check: cora, citeseer or both (cora,citeseer)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default=",".join(MODELS), help="comma list of gcn, sage, gin")
    p.add_argument("--layers", type=int, default=2, help="layers per model (2 or 3)")
    p.add_argument("--epochs", type=int, default=200, help="training epochs for the accuracy check")
    p.add_argument("--bench", action="store_true", help="time every path per graph, model and hidden size")
    p.add_argument("--graphs", default="cora,citeseer,rmat:18:8,community:262144:16,rgg:1000000:10")
    p.add_argument("--hidden", default="128", help="hidden size(s) for --bench, a comma list, e.g. 64,256")
    p.add_argument("--features", type=int, default=0, help="--bench input width of generated graphs (0: hidden)")
    p.add_argument("--reps", type=int, default=20, help="--bench: timed forwards per path")
    p.add_argument("--no-pyg", action="store_true", help="leave PyG out")
    p.add_argument("--no-accuracy", action="store_true", help="--bench only: skip training and the accuracy check")
    p.add_argument("--quick", action="store_true", help="a CPU-sized run: 20 epochs, small graphs, few reps")
    p.add_argument("--json", help="write results to this JSON file")
    p.add_argument("--provider", default=None, help="where new structures' candidates come from (search | "
                                                    "nearest | policy; default the runtime's)")
    p.add_argument("--k", type=int, default=0, help="candidates per structure (0: the provider's default)")
    args = p.parse_args(argv)
    try:
        hiddens = [int(h) for h in str(args.hidden).split(",") if h.strip()]
    except ValueError:
        p.error(f"--hidden {args.hidden!r}: give sizes as integers, e.g. 64,256")
    if not hiddens or min(hiddens) < 1:
        p.error(f"--hidden {args.hidden!r}: give at least one positive size")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or set(models) - set(MODELS):
        p.error(f"--models {args.models!r}: use a comma list of {', '.join(MODELS)}")
    datasets = [d.strip() for d in args.dataset.split(",") if d.strip()]
    if not datasets or set(datasets) - {"cora", "citeseer"}:
        p.error(f"--dataset {args.dataset!r}: use cora, citeseer or cora,citeseer")
    if not 1 <= args.layers <= 8:
        p.error(f"--layers {args.layers}: use 1 to 8 (2 or 3 are usual)")
    if str(args.device).startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu")
    if args.provider or args.k:
        sr.configure(**({"provider": args.provider} if args.provider else {}), k=args.k)
    epochs, reps = (min(args.epochs, 20), min(args.reps, 3)) if args.quick else (args.epochs, args.reps)
    results: dict = {"device": args.device, "args": vars(args), "pyg": pyg_available() or "available"}
    if args.no_accuracy and not args.bench:
        p.error("--no-accuracy leaves nothing to do without --bench")
    rows = []
    for d in [] if args.no_accuracy else datasets:
        rows += accuracy(d, args.device, models=models, epochs=epochs, layers=args.layers, pyg=not args.no_pyg)
    results["accuracy"] = rows
    results["sparserl_accuracy_equal"] = sparserl_accuracy_equal(rows)
    for r in rows:
        print(f"{r['dataset']} {r['model']}: test accuracy " + ", ".join(f"{k} {v:.3f}" for k, v in r["test_acc"].items()))
    _write(args.json, results)
    if args.bench:
        bench_rows = []
        for spec in args.graphs.split(","):
            for model_name in models:
                for hidden in hiddens:
                    t0 = time.time()
                    bench_rows.append(bench_graph(spec, model_name, hidden, args.layers, args.device,
                                                  features=args.features or None, reps=reps,
                                                  calls=max(5, 5 * reps // 2), pyg=not args.no_pyg))
                    print(f"# {spec} {model_name} hidden {hidden}: {time.time() - t0:.1f}s", file=sys.stderr)
                    results["bench"] = bench_rows
                    _write(args.json, results)  # as it goes: a run cut short keeps what it measured
        print(table(bench_rows))
    if not results["sparserl_accuracy_equal"]:
        print("a sparserl path's test accuracy differs from torch.sparse's", file=sys.stderr)
    return 0 if results["sparserl_accuracy_equal"] else 1


def _write(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
