"""PyG's layers given a torch sparse CSR ``adj_t`` run through sparserl under ``sr.accelerate()``,
with PyG's own results.

What PyG calls (torch_geometric.utils.spmm, PyG 2.8): ``GCNConv``/``GINConv`` (sum) call
``torch.sparse.mm(adj_t, x)``; ``SAGEConv`` (mean) calls ``torch.sparse.mm(adj_t, x, "mean")`` on
the CPU and ``torch.sparse.mm(adj_t, x) / deg`` on CUDA; the dispatch hook routes all three.
An ``EdgeIndex`` reaches a sparse product only in layers that fuse it (``GraphConv``:
``EdgeIndex.matmul`` builds a CSR and calls ``torch.sparse.mm``, routed too); ``GCNConv``,
``SAGEConv`` and ``GINConv`` given an ``EdgeIndex`` gather and scatter messages, with no sparse
product for a hook to see, so PyG computes those itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparserl_compile as sr
from sparserl_compile import graphs

pyg_nn = pytest.importorskip("torch_geometric.nn", reason="torch_geometric is not installed "
                                                          "(pip install torch-geometric)")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _graph():
    return graphs.community_graph(300, avg_degree=8, min_community=20, max_community=60, seed=1)


def _csr(m, device) -> torch.Tensor:
    from sparserl_compile.bench import csr_tensor

    return csr_tensor(torch, torch.from_numpy(m.indptr.astype(np.int64)), torch.from_numpy(m.indices.astype(np.int64)),
                      torch.from_numpy(m.data), m.shape).to(device)


def _layer(kind: str, n_in: int):
    if kind == "gcn":  # PyG normalizes the raw graph once (cached) and multiplies by it
        return pyg_nn.GCNConv(n_in, 8, cached=True), "raw"
    if kind == "gcn_prenormalized":
        return pyg_nn.GCNConv(n_in, 8, normalize=False), "gcn"
    if kind == "sage":
        return pyg_nn.SAGEConv(n_in, 8, aggr="mean"), "raw"
    return pyg_nn.GINConv(torch.nn.Sequential(torch.nn.Linear(n_in, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))), "raw"


def _tol(device):
    # on a GPU a generated kernel sums in another order than cuSPARSE
    return dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["gcn", "gcn_prenormalized", "sage", "gin"])
def test_pyg_layer_on_csr_runs_through_sparserl(kind, device):
    a = _graph()
    torch.manual_seed(0)
    layer, operand = _layer(kind, 16)
    layer = layer.to(device).eval()
    adj = _csr(graphs.gcn_normalize(a) if operand == "gcn" else a, device)
    x = torch.randn(a.shape[0], 16, device=device)
    with torch.no_grad():
        ref = layer(x, adj)  # PyG's own
        before = sr.stats().calls
        with sr.accelerate():
            out = layer(x, adj)
            out2 = layer(x, adj)  # the structure is memoized: the same plan serves again
    assert sr.stats().calls - before >= 2, "the dispatch hook did not see PyG's sparse product"
    torch.testing.assert_close(out, ref, **_tol(device))
    torch.testing.assert_close(out2, out)


@pytest.mark.parametrize("device", DEVICES)
def test_two_layer_pyg_model_trains_the_same_under_accelerate(device):
    a = _graph()
    adj = _csr(a, device)
    x = torch.randn(a.shape[0], 16, device=device)
    y = torch.randint(0, 4, (a.shape[0],), device=device)

    def grads(accelerated: bool):
        torch.manual_seed(0)
        l1, l2 = pyg_nn.GCNConv(16, 16, cached=True).to(device), pyg_nn.SAGEConv(16, 4).to(device)
        ctx = sr.accelerate() if accelerated else torch.enable_grad()
        with ctx:
            loss = torch.nn.functional.cross_entropy(l2(torch.relu(l1(x, adj)), adj), y)
            loss.backward()
        return loss.detach(), [p.grad for p in (*l1.parameters(), *l2.parameters())]

    loss_ref, g_ref = grads(False)
    before = sr.stats().calls
    loss, g = grads(True)
    assert sr.stats().calls - before >= 2  # forward products (backward: A^T G through the custom op)
    torch.testing.assert_close(loss, loss_ref, **_tol(device))
    for got, want in zip(g, g_ref):
        torch.testing.assert_close(got, want, **_tol(device))


@pytest.mark.parametrize("aggr", ["add", "mean"])
def test_edge_index_is_routed_where_pyg_fuses_it(aggr):
    from torch_geometric import EdgeIndex

    a = _graph()
    rows = np.repeat(np.arange(a.shape[0]), np.diff(a.indptr))
    ei = EdgeIndex(torch.from_numpy(np.vstack([a.indices, rows]).astype(np.int64)), sparse_size=a.shape,
                   sort_order="col")
    torch.manual_seed(0)
    layer = pyg_nn.GraphConv(16, 8, aggr=aggr).eval()
    x = torch.randn(a.shape[0], 16)
    with torch.no_grad():
        ref = layer(x, ei)
        before = sr.stats().calls
        with sr.accelerate():
            out = layer(x, ei)
    assert sr.stats().calls - before == 1
    torch.testing.assert_close(out, ref, **_tol("cpu"))


def test_edge_index_in_message_passing_layers_stays_with_pyg():
    from torch_geometric import EdgeIndex

    a = _graph()
    rows = np.repeat(np.arange(a.shape[0]), np.diff(a.indptr))
    ei = EdgeIndex(torch.from_numpy(np.vstack([a.indices, rows]).astype(np.int64)), sparse_size=a.shape,
                   sort_order="col")
    layer = pyg_nn.SAGEConv(16, 8).eval()
    x = torch.randn(a.shape[0], 16)
    with torch.no_grad():
        ref = layer(x, ei)
        before = sr.stats().calls
        with sr.accelerate():
            out = layer(x, ei)
    assert sr.stats().calls == before  # gather/scatter: no sparse product to route
    torch.testing.assert_close(out, ref)
