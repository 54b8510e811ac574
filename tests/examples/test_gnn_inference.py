"""examples/gnn_inference.py: Cora accuracy through sparserl (CPU) and tiny-graph forwards vs dense."""

from __future__ import annotations

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
    with pytest.raises(ValueError, match="unknown normalization"):
        gnn.normalized_adjacency(a, "sym")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("model_name", ["gcn", "sage_mean"])
def test_tiny_graph_forward_matches_dense(model_name, compiled):
    a = _tiny_graph()
    a_hat = gnn.normalized_adjacency(a, "gcn" if model_name == "gcn" else "mean")
    torch.manual_seed(0)
    x = torch.randn(a.shape[0], 12)
    cls = gnn.GCN if model_name == "gcn" else gnn.SAGEMean
    model = cls(torch.from_numpy(a_hat.toarray()), 12, 8, 5).eval()
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


@pytest.mark.slow
def test_cora_accuracy_through_sparserl_equals_torch_sparse(shared_matrices):
    if not (shared_matrices / "cora_adj.npz").is_file():
        pytest.skip(f"{shared_matrices} has no cora_adj.npz")
    # 100 epochs (one thread) keep this well under a minute on a busy CPU; the GCN is trained by then
    report = gnn.accuracy_check("cora", "cpu", epochs=100)
    assert report.n_test == 1000
    assert report.test_acc_torch_sparse > 0.7, report  # trained, not a random model (chance ~0.3)
    assert report.accuracies_equal, report
    assert report.same_predictions, report
    # on the CPU both run torch's CSR kernel on the same float32 values
    assert report.max_abs_logit_diff <= 1e-5, report


def test_provider_and_k_configure_the_runtime(shared_matrices, capsys):
    if not (shared_matrices / "cora_adj.npz").is_file():
        pytest.skip(f"{shared_matrices} has no cora_adj.npz")
    before = sr.get_config()
    try:
        assert gnn.main(["--dataset", "cora", "--device", "cpu", "--epochs", "1", "--provider", "nearest",
                         "--k", "2"]) == 0
        assert (sr.get_provider().name, sr.get_config().k) == ("nearest", 2)
    finally:
        sr.configure(provider=before.provider, k=before.k)
    assert '"accuracies_equal": true' in capsys.readouterr().out
