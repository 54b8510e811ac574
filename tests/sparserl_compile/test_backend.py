"""torch.compile(backend="sparserl"): entry-point lookup, graphs with sparserl ops, guards, Inductor."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch._dynamo.backends.common import aot_autograd

import sparserl_compile as S
from sparserl_compile import backend

warnings.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def mat(n=40, m=30, seed=0, density=0.15):
    a = sp.random(n, m, density=density, format="csr", random_state=seed, dtype=np.float32)
    a.sort_indices()
    return a


def gcn_step_losses(adj, feats, labels, steps, forward=None):
    torch.manual_seed(0)
    w1 = torch.nn.Parameter(torch.randn(feats.shape[1], 16) * 0.1)
    w2 = torch.nn.Parameter(torch.randn(16, 3) * 0.1)
    opt = torch.optim.Adam([w1, w2], lr=0.05)

    def fwd(adj, feats, w1, w2):
        return adj @ (torch.relu(adj @ (feats @ w1)) @ w2)

    fwd = forward(fwd) if forward else fwd
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(fwd(adj, feats, w1, w2), labels)
        loss.backward()
        assert torch.isfinite(w1.grad).all() and w1.grad.abs().sum() > 0
        opt.step()
        losses.append(float(loss))
    return losses


class Capture:
    """An AOT backend that records the forward/backward graphs and counts compilations."""

    def __init__(self):
        self.fw, self.bw, self.frames = [], [], 0

    def backend(self):
        def fw(gm, ex):
            self.fw.append(gm)
            return gm

        def bw(gm, ex):
            self.bw.append(gm)
            return gm

        inner = aot_autograd(fw_compiler=fw, bw_compiler=bw)

        def count(gm, ex):
            self.frames += 1
            return inner(gm, ex)

        return count


def test_backend_resolves_by_name_without_importing_sparserl():
    code = textwrap.dedent("""
        import sys, torch
        assert not any(m.startswith("sparserl_compile") for m in sys.modules)
        assert "sparserl" in torch._dynamo.list_backends()
        f = torch.compile(lambda x: x * 2, backend="sparserl")
        from torch._dynamo import lookup_backend
        fn = lookup_backend("sparserl")
        print(fn.__module__, fn.__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sparserl_compile.backend", "sparserl_backend"]


class Model(torch.nn.Module):
    """A SparseRLTensor as a parameter (sparsified linear) and as a buffer (adjacency)."""

    def __init__(self, adj: S.SparseRLTensor):
        super().__init__()
        self.register_buffer("adj", adj)
        self.lin = torch.nn.Linear(30, 40)
        with torch.no_grad():
            self.lin.weight.mul_((torch.rand_like(self.lin.weight) > 0.8).float())
        S.sparsify_(self.lin)
        self.head = torch.nn.Linear(40, 3)

    def forward(self, x):
        h = torch.relu(self.lin(x))  # sparse weight: x @ W^T
        return self.head(self.adj @ h)


def test_fullgraph_graphs_contain_the_sparserl_ops_and_match_eager():
    torch.manual_seed(0)
    model = Model(S.sparsify(mat(50, 50, density=0.1)))
    x = torch.randn(50, 30)
    cap = Capture()
    compiled = torch.compile(model, backend=cap.backend(), fullgraph=True)
    y = compiled(x)
    torch.testing.assert_close(y, model(x), rtol=1e-5, atol=1e-5)
    code = cap.fw[0].code
    assert code.count("torch.ops.sparserl.") == 2, code
    y.sum().backward()
    assert "torch.ops.sparserl.spmm_t" in cap.bw[0].code
    assert torch.isfinite(model.head.weight.grad).all()


def test_new_values_do_not_recompile_and_a_new_structure_does():
    cap = Capture()
    f = torch.compile(lambda A, x: torch.tanh(A @ x), backend=cap.backend(), fullgraph=True)
    a = S.sparsify(mat())
    x = torch.randn(30, 4)
    f(a, x)
    b = a.with_values(torch.randn_like(a.values()))
    torch.testing.assert_close(f(b, x), torch.tanh(b.to_dense() @ x))
    a.values().mul_(3)
    torch.testing.assert_close(f(a, x), torch.tanh(a.to_dense() @ x))
    assert cap.frames == 1
    c = S.sparsify(mat(seed=1))
    torch.testing.assert_close(f(c, x), torch.tanh(c.to_dense() @ x))
    assert cap.frames == 2


def test_torch_sparse_mm_and_scaling_compile_into_the_sparserl_ops():
    cap = Capture()
    f = torch.compile(lambda A, x: torch.sparse.mm(A, x, "mean") + torch.sparse.mm(A * 2, x), backend=cap.backend(),
                      fullgraph=True)
    a, x = S.sparsify(mat()), torch.randn(30, 4)
    d = a.to_dense()
    counts = (d != 0).sum(1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(f(a, x), (d @ x) / counts + 2 * d @ x)


def test_mode_and_options_become_inductor_config_patches(monkeypatch):
    seen = {}

    def fake_compile_fx(gm, ex, config_patches=None):
        seen["patches"] = config_patches
        return gm

    import torch._inductor.compile_fx as cfx

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    backend.sparserl_backend(gm, [torch.ones(2)], mode="max-autotune", options={"epilogue_fusion": False})
    assert seen["patches"]["max_autotune"] is True and seen["patches"]["epilogue_fusion"] is False
    backend.sparserl_backend(gm, [torch.ones(2)])
    (name, twin_pass), = seen["patches"].items()  # only the graph-twin pass
    assert name == "post_grad_custom_post_pass" and isinstance(twin_pass, backend.GraphTwinPass)
    assert twin_pass.inner is None
    with pytest.raises(TypeError, match="unknown arguments"):
        backend.sparserl_backend(gm, [torch.ones(2)], bogus=1)
    with pytest.raises(TypeError, match="options must be a dict"):
        backend.sparserl_backend(gm, [torch.ones(2)], options=["x"])


def test_inductor_gcn_training_step():
    """The real backend (Inductor around the sparserl ops): loss falls, matches eager."""
    m = mat(40, 40, density=0.1) + sp.eye(40, dtype=np.float32)
    m.data[:] = 1.0
    d = sp.diags(np.asarray(m.sum(1)).ravel() ** -0.5)
    adj = S.sparsify(sp.csr_matrix(d @ m @ d).astype(np.float32))
    feats = torch.randn(40, 8)
    labels = torch.randint(0, 3, (40,))
    eager = gcn_step_losses(adj, feats, labels, steps=4)
    compiled = gcn_step_losses(adj, feats, labels, steps=4,
                               forward=lambda f: torch.compile(f, backend="sparserl", fullgraph=True))
    np.testing.assert_allclose(compiled, eager, rtol=1e-4)
    assert compiled[-1] < compiled[0]


@pytest.mark.gpu
def test_compiled_on_cuda_matches_eager():
    torch.manual_seed(0)
    model = Model(S.sparsify(mat(50, 50, density=0.1))).cuda()
    x = torch.randn(50, 30, device="cuda")
    compiled = torch.compile(model, backend="sparserl", fullgraph=True)
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


def _spmm_graph():
    """An FX graph (make_fx) with one ``sparserl::spmm`` call, and its inputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    a = S.sparsify(mat())
    x = torch.randn(30, 4)

    def f(crow, col, val, x):
        return torch.relu(torch.ops.sparserl.spmm(crow, col, val, x, 40, 30, a.fingerprint))

    return make_fx(f)(a.crow, a.col, a.val, x), (a.crow, a.col, a.val, x)


def test_lowering_swaps_each_op_for_its_graph_twin_with_the_same_result():
    gm, args = _spmm_graph()
    want = gm(*args)
    assert backend.lower_to_graph_twins(gm) == 1
    gm.recompile()
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.sparserl.spmm_graph.default in targets
    assert torch.ops.sparserl.spmm.default not in targets
    torch.testing.assert_close(gm(*args), want, rtol=0, atol=0)
    assert backend.lower_to_graph_twins(gm) == 0  # idempotent


def test_graph_twin_pass_chains_the_users_pass_and_keys_the_caches():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class Theirs(CustomGraphPass):
        def __call__(self, graph):
            seen.append(sum(n.target == torch.ops.sparserl.spmm.default for n in graph.nodes))

        def uuid(self):
            return "theirs-v1"

    gm, _ = _spmm_graph()
    backend.GraphTwinPass(Theirs())(gm.graph)
    assert seen == [1]  # the user's pass ran first, on the graph as AOTAutograd gave it
    assert any(n.target == torch.ops.sparserl.spmm_graph.default for n in gm.graph.nodes)
    ours = backend.GraphTwinPass().uuid()
    assert ours and ours == backend.GraphTwinPass().uuid()
    assert backend.GraphTwinPass(Theirs()).uuid() == (ours, "theirs-v1")
    assert backend.GraphTwinPass(lambda g: None).uuid() is None  # no uuid: Inductor bypasses its cache


def test_compiled_forward_and_backward_call_the_products_directly():
    """The real backend: Inductor's code calls each product's Python function directly
    (``extern_kernels.sparserl_*``: neither the custom ops and their autograd layer nor the
    dispatcher's trip into the twins) in the forward and the backward, and the results match
    eager."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = Model(S.sparsify(mat(50, 50, density=0.1)))
    x = torch.randn(50, 30)
    compiled = torch.compile(model, backend="sparserl", fullgraph=True)
    with inductor_config.patch(force_disable_caches=True):
        y, fw = run_and_get_code(compiled, x)
        _, bw = run_and_get_code(lambda: y.sum().backward())
    torch.testing.assert_close(y, model(x), rtol=1e-5, atol=1e-5)
    fw, bw = "\n".join(fw), "\n".join(bw)
    assert fw.count("extern_kernels.sparserl_spmm(") == 2, fw  # (W x^T)^T and adj @ h
    assert "extern_kernels.sparserl_spmm_t(" in bw, bw  # adj^T @ grad, W^T @ grad
    assert not re.search(r"torch\.ops\.sparserl\.\w+\.default\(", fw + bw)  # no op is called (asserts name them)
    grads = [p.grad.clone() for p in (model.lin.bias, model.head.weight)]
    model.zero_grad()
    model(x).sum().backward()
    for g, p in zip(grads, (model.lin.bias, model.head.weight)):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-5)


def test_compiled_out_argument_is_written():
    """``out=`` inside a compiled function writes the caller's tensor, as eager does."""
    A, X = S.sparsify(mat()), torch.randn(30, 4)
    o = torch.zeros(40, 4)
    f = torch.compile(lambda A, x, o: torch.mm(A, x, out=o), backend="sparserl")
    got = f(A, X, o)
    torch.testing.assert_close(o, A.to_dense() @ X, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, o)


def test_the_cache_key_covers_the_file_that_lowers_products():
    """``SparseRLTensor.__torch_function__`` (tensor.py) decides what a product becomes when
    AOTAutograd traces a graph Dynamo recorded with ``out=``; a cached graph from another
    version of it must not be handed back, so the twins' uuid hashes it."""
    import hashlib
    from pathlib import Path

    here = Path(backend.__file__).resolve().parent
    h = hashlib.sha256()
    for name in ("backend.py", "ops.py", "tensor.py"):
        h.update((here / name).read_bytes())
    assert backend.GraphTwinPass().uuid() == "sparserl-graph-twins-" + h.hexdigest() + "-calls"


@pytest.mark.parametrize("name", ["spmv", "spmm", "spmv_t", "spmm_t"])
def test_every_product_compiles_to_a_direct_call_with_dynamic_shapes(name):
    """Each op, traced with dynamic shapes (a symbolic dense width and batch), lowers to its
    direct call and computes what eager does at sizes the graph was not traced at; a dense
    operand the graph made non-contiguous is made contiguous first."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    A = S.sparsify(mat(40, 30, density=0.2))
    t = name.endswith("_t")
    k = 40 if t else 30
    op = (lambda a: a.t()) if t else (lambda a: a)
    if name.startswith("spmv"):
        f = torch.compile(lambda A, x: op(A) @ torch.relu(x), backend="sparserl", fullgraph=True, dynamic=True)
        args = [torch.randn(k)]
    else:
        f = torch.compile(lambda A, x: op(A) @ x.t(), backend="sparserl", fullgraph=True, dynamic=True)
        args = [torch.randn(5, k), torch.randn(3, k)]
    with inductor_config.patch(force_disable_caches=True):
        for i, x in enumerate(args):
            got, code = run_and_get_code(f, A, x)
            want = op(A).to_dense() @ (torch.relu(x) if x.dim() == 1 else x.t())
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if i == 0:
                assert f"extern_kernels.sparserl_{name}(" in "\n".join(code)


def test_the_cpp_wrapper_keeps_the_graph_twin():
    """Inductor's C++ wrapper calls no Python function: there the product stays the twin's
    fallback kernel, and computes the same."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    A, x = S.sparsify(mat(40, 30, density=0.2)), torch.randn(30, 4)
    f = torch.compile(lambda A, x: torch.relu(A @ x), backend="sparserl", fullgraph=True,
                      options={"cpp_wrapper": True})
    with inductor_config.patch(force_disable_caches=True):
        got, code = run_and_get_code(f, A, x)
    torch.testing.assert_close(got, torch.relu(A.to_dense() @ x), rtol=1e-5, atol=1e-5)
    assert "extern_kernels.sparserl_" not in "\n".join(code)
