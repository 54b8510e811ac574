"""examples/gnn_inference.py: the models against dense math and PyG's layers, every path's accuracy
on Cora (CPU), and the --quick benchmark's JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import sparserl_compile as sr

from example_loader import load_example

gnn = load_example("gnn_inference")


def _tiny_graph() -> sp.csr_matrix:
    """A symmetric 40-node random graph with two isolated nodes (empty rows) and a hub."""
    rng = np.random.default_rng(3)
    n = 40
    a = sp.random(n, n, density=0.08, random_state=rng, format="csr")
    a = a + a.T
    a = a.tolil()
    a[0, 1:30] = 1.0  # a hub: one long row
    a[1:30, 0] = 1.0
    for i in (7, 21):  # isolated nodes
        a[i, :] = 0.0
        a[:, i] = 0.0
    a = sp.csr_matrix(a)
    a.setdiag(0)
    a.eliminate_zeros()
    return a


def test_normalized_adjacency_matches_its_definition():
    a = _tiny_graph()
    dense = (a.toarray() != 0).astype(np.float64)
    gcn = gnn.normalized_adjacency(a, "gcn").toarray()
    with_loops = dense + np.eye(a.shape[0])
    d = with_loops.sum(1)
    np.testing.assert_allclose(gcn, with_loops / np.sqrt(np.outer(d, d)), rtol=1e-6)
    mean = gnn.normalized_adjacency(a, "mean").toarray()
    deg = dense.sum(1)
    assert deg[7] == 0 and not mean[7].any()  # an isolated node aggregates nothing
    nz = deg > 0
    np.testing.assert_allclose(mean[nz], dense[nz] / deg[nz, None], rtol=1e-6)
    np.testing.assert_array_equal(gnn.normalized_adjacency(a, "gin").toarray(), with_loops)
    with pytest.raises(ValueError, match="unknown normalization"):
        gnn.normalized_adjacency(a, "sym")


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("model_name", ["gcn", "sage", "gin"])
def test_tiny_graph_forward_matches_dense(model_name, compiled, layers):
    a = _tiny_graph()
    cls, norm = gnn.CLASSES[model_name]
    a_hat = gnn.normalized_adjacency(a, norm)
    torch.manual_seed(0)
    x = torch.randn(a.shape[0], 12)
    model = cls(torch.from_numpy(a_hat.toarray()), 12, 8, 5, layers=layers).eval()
    with torch.no_grad():
        ref = model(x)  # dense adjacency: the reference
        model.adj = sr.sparsify(a_hat)
        assert isinstance(model.adj, sr.SparseRLTensor)
        if compiled:
            torch._dynamo.reset()
            out = torch.compile(model, backend="sparserl", fullgraph=True)(x)
        else:
            out = model(x)
    assert out.shape == (a.shape[0], 5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_name", ["gcn", "sage", "gin"])
def test_pyg_layers_with_our_weights_compute_our_function(model_name):
    pytest.importorskip("torch_geometric", reason="torch_geometric is not installed")
    a = _tiny_graph()
    cls, norm = gnn.CLASSES[model_name]
    torch.manual_seed(1)
    x = torch.randn(a.shape[0], 6)
    model = cls(gnn.native_csr(gnn.normalized_adjacency(a, norm)), 6, 8, 3, layers=3).eval()
    net = gnn.pyg_model(model_name, model)
    ops = gnn.pyg_operands(model_name, a, "cpu", 1e9, 6)
    with torch.no_grad():
        ref = model(x)
        for kind in ("csr", "edge_index"):
            adj, w = ops[kind]
            torch.testing.assert_close(net(x, adj, w), ref, rtol=1e-5, atol=1e-5, msg=kind)
        if not isinstance(ops["EdgeIndex"], str):
            adj, w = ops["EdgeIndex"]
            torch.testing.assert_close(net(x, adj, w), ref, rtol=1e-5, atol=1e-5)
    assert isinstance(gnn.pyg_operands(model_name, a, "cpu", 1.0, 6)["edge_index"], str)  # too big: skipped


def test_paths_compute_the_same_logits_on_a_generated_graph():
    a = gnn.graphs.community_graph(600, avg_degree=8, seed=2)
    x = torch.randn(a.shape[0], 16, generator=torch.Generator().manual_seed(0))
    model = gnn.GCN(None, 16, 16, 4).eval()
    with torch.no_grad():
        fns, notes = gnn.paths("gcn", model, a, x, pyg=False)
        ref = fns["torch_sparse"]()
        for name, fn in fns.items():
            torch.testing.assert_close(fn(), ref, rtol=1e-5, atol=1e-5, msg=name)
    assert {"torch_sparse", "inductor", "sparserl_eager", "sparserl_compiled"} <= set(fns)
    assert "fullgraph=True fails" in notes["inductor"]  # Dynamo does not trace native sparse tensors
    assert notes["sparserl_reduce_overhead"] == "CUDA graphs need a GPU"


@pytest.mark.slow
def test_cora_accuracy_is_the_same_through_every_path(shared_matrices):
    if not (shared_matrices / "cora_adj.npz").is_file():
        pytest.skip(f"{shared_matrices} has no cora_adj.npz")
    rows = gnn.accuracy("cora", "cpu", epochs=40)
    assert [r["model"] for r in rows] == ["gcn", "sage", "gin"]
    for r in rows:
        assert r["n_test"] == 1000
        assert r["test_acc"]["torch_sparse"] > 0.5, r  # trained, not a random model (chance ~0.3)
        for p in ("sparserl_eager", "sparserl_compiled"):
            assert r["test_acc"][p] == r["test_acc"]["torch_sparse"], (p, r)
            assert r["same_predictions"][p] and r["max_abs_logit_diff"][p] <= 1e-5, (p, r)
        for p in ("pyg_csr", "pyg_sparserl"):  # PyG's layers with the trained weights (where installed)
            if p in r["test_acc"]:
                assert r["max_abs_logit_diff"][p] <= 1e-4, (p, r)
    assert gnn.sparserl_accuracy_equal(rows)


def test_quick_bench_writes_json(tmp_path, shared_matrices, capsys):
    if not (shared_matrices / "cora_adj.npz").is_file():
        pytest.skip(f"{shared_matrices} has no cora_adj.npz")
    out = tmp_path / "gnn.json"
    assert gnn.main(["--device", "cpu", "--quick", "--epochs", "2", "--models", "sage", "--no-pyg", "--bench",
                     "--graphs", "rmat:9:4", "--hidden", "8", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["sparserl_accuracy_equal"] and res["accuracy"][0]["epochs"] == 2
    (row,) = res["bench"]
    assert (row["graph"], row["model"], row["hidden"], row["n"]) == ("rmat:9:4", "sage", 8, 512)
    for p in ("torch_sparse", "inductor", "sparserl_eager", "sparserl_compiled"):
        assert row["per_forward_us"][p] > 0 and row["back_to_back_us"][p] > 0, p
        assert row["max_rel_diff"][p] < 1e-5, p
    assert "| rmat:9:4 | sage | 8 |" in capsys.readouterr().out


def test_bad_arguments_say_what():
    with pytest.raises(SystemExit):
        gnn.main(["--models", "gat", "--device", "cpu"])
    with pytest.raises(SystemExit, match="rmat:SCALE:EDGE_FACTOR"):
        gnn.make_graph("rmat:9")
    with pytest.raises(SystemExit, match="scale"):
        gnn.make_graph("rmat:0:4")


def test_provider_and_k_configure_the_runtime(shared_matrices):
    if not (shared_matrices / "cora_adj.npz").is_file():
        pytest.skip(f"{shared_matrices} has no cora_adj.npz")
    assert gnn.main(["--dataset", "cora", "--device", "cpu", "--epochs", "1", "--models", "gcn", "--no-pyg",
                     "--provider", "nearest", "--k", "2"]) == 0
    assert (sr.get_provider().name, sr.get_config().k) == ("nearest", 2)


@pytest.mark.gpu
@pytest.mark.parametrize("model_name", ["gcn", "sage", "gin"])
def test_every_path_agrees_on_the_gpu(model_name):
    """The CPU test's twin: sparserl's kernels (or cuSPARSE), CUDA graphs and PyG on one graph."""
    a = gnn.graphs.rmat_graph(12, 8, seed=1)
    x = torch.randn(a.shape[0], 32, generator=torch.Generator().manual_seed(0)).cuda()
    model = gnn.CLASSES[model_name][0](None, 32, 32, 32).cuda().eval()
    with torch.no_grad():
        fns, notes = gnn.paths(model_name, model, a, x)
        ref = fns["torch_sparse"]()
        for name, fn in fns.items():
            torch.testing.assert_close(fn(), ref, rtol=1e-4, atol=1e-4, msg=name)
    assert "sparserl_reduce_overhead" in fns, notes
