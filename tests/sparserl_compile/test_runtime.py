"""The runtime's path of one call: plan table, counters, providers, cache verdicts, fallbacks."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F

import sparserl_compile as S
from sparserl_compile import cache, config, contract, miss, plans, problem, providers, reference, transpose
from sparserl_compile.structure import fingerprint
from sparserl_compile.problem import Problem


@pytest.fixture(autouse=True)
def fresh_runtime():
    plans.configure(provider="reference", k=4, cache=True, kernels=True, on_miss="search")
    plans.clear()
    plans.reset_stats()
    yield  # tests/conftest.py puts the test run's first settings back
    plans.clear()


def matrix(n_rows=30, n_cols=20, seed=0):
    m = sp.random(n_rows, n_cols, density=0.2, format="csr", random_state=seed, dtype=np.float32)
    m.sort_indices()
    return m


class RecordingProvider:
    name = "recording"

    def __init__(self, cands=()):
        self.problems = []
        self.cands = list(cands)

    def candidates(self, problem, k):
        self.problems.append((problem, k))
        return self.cands[:k]


def a_candidate() -> contract.Candidate:
    src = ("// sparserl op=spmm format=csr dtype=f32 index=i32\n"
           "// launch block=128 work=rows per_block=1 tile_n=0 smem=0 zero_output=0 n_align=1\n"
           + contract.signature_c("spmm", "csr", "f32") + " {}\n")
    return contract.Candidate(src, contract.parse_header(src), family="test")


def test_table_hits_and_misses_are_counted():
    a = S.sparsify(matrix())
    x = torch.randn(20, 8)
    for _ in range(3):
        a @ x
    a @ torch.randn(20, 5)  # width 5 -> bucket 8: the same plan
    a @ torch.randn(20, 9)  # bucket 16: a new plan
    a @ torch.randn(20)  # spmv: a new plan
    st = config.stats()
    assert (st.calls, st.misses, st.hits) == (6, 3, 3)
    assert st.reference_calls == 6 and st.kernel_calls == 0 and st.fallbacks == 0
    keys = set(plans.plans())
    assert {(k[1], k[2]) for k in keys} == {("spmm", 8), ("spmm", 16), ("spmv", 1)}
    assert all(k[0] == a.fingerprint and k[4] == "cpu" for k in keys)
    assert all("GPU-only" in p.reason for p in plans.plans().values())


def test_cpu_never_asks_the_provider():
    rec = RecordingProvider([a_candidate()])
    plans.configure(provider=rec)
    S.sparsify(matrix()) @ torch.randn(20, 4)
    assert rec.problems == [] and config.stats().searches == 0


def test_configure_validates_and_clears_the_table():
    S.sparsify(matrix()) @ torch.randn(20, 4)
    assert plans.plans()
    cfg = plans.configure(k=2)
    assert cfg.k == 2 and config.get_config().k == 2 and not plans.plans()
    with pytest.raises(ValueError, match="number of candidates"):
        plans.configure(k=-1)
    with pytest.raises(TypeError, match=r"unknown settings \['bogus'\]"):
        plans.configure(bogus=1)
    with pytest.raises(TypeError, match="True or False"):
        plans.configure(cache="yes")
    with pytest.raises(ValueError, match="sandbox_spare=-1: the number of idle sandbox workers"):
        plans.configure(sandbox_spare=-1)


def test_the_sandbox_spare_setting_reaches_the_runtimes_pool(monkeypatch):
    """configure(sandbox_spare=N) is the runtime pool's ``spare`` from the next product on;
    unset (None, the default) the pool keeps what the provider asks for (its ``sandbox_spare``,
    0 without one)."""
    monkeypatch.setattr(miss, "_pool", None)

    class FakePool:  # no worker process started
        def __init__(self, workers):
            self.spare = 0

        def close(self):
            pass

    class Asks(providers.Provider):  # a provider whose candidates often fail
        sandbox_spare = 1

    import sparserl_compile.sandbox as sandbox

    monkeypatch.setattr(sandbox, "SandboxPool", FakePool)
    assert config.get_config().sandbox_spare is None
    assert miss.sandbox_pool().spare == 0
    assert miss.sandbox_pool(Asks()).spare == 1 and miss.sandbox_pool(providers.ReferenceProvider()).spare == 0
    plans.configure(sandbox_spare=2)
    try:
        assert miss.sandbox_pool().spare == 2 and miss.sandbox_pool(Asks()).spare == 2
        plans.configure(sandbox_spare=0)  # set: the provider's wish does not count
        assert miss.sandbox_pool(Asks()).spare == 0
    finally:
        plans.configure(sandbox_spare=None)


def test_provider_resolution():
    assert providers.set_provider("reference").name == "reference"
    assert providers.get_provider().candidates(None, 3) == []
    with pytest.raises(ValueError, match="unknown provider 'nope'"):
        providers.set_provider("nope")
    with pytest.raises(TypeError, match="is not a provider"):
        providers.set_provider(object())
    for name in ("search", "policy"):
        try:
            p = providers.resolve(name)
        except ImportError as e:  # not installed here: the message says what to do
            assert name in str(e) and "set_provider('reference')" in str(e)
        except OSError as e:  # installed, but e.g. no trained checkpoint: its own message
            assert "checkpoint" in str(e)
        else:
            assert hasattr(p, "candidates")


def test_problem_validation():
    m = matrix()
    kw = dict(op="spmm", dtype="f32", n=4, n_rows=30, n_cols=20, nnz=m.nnz,
              indptr=m.indptr.astype(np.int32), indices=m.indices.astype(np.int32),
              fingerprint="x", arch="sm_90")
    assert Problem(**kw).nnz == m.nnz
    with pytest.raises(ValueError, match="float64 products always use the reference"):
        Problem(**{**kw, "dtype": "f64"})
    with pytest.raises(ValueError, match="do not match its shape"):
        Problem(**{**kw, "n_rows": 31})
    with pytest.raises(ValueError, match="int32"):
        Problem(**{**kw, "indptr": m.indptr.astype(np.int64)})


def test_transposed_pattern_is_memoized_with_its_own_fingerprint():
    m = matrix(7, 5, seed=3)
    a = S.sparsify(m)
    tp = transpose.transpose_pattern(a.crow, a.col, 7, 5, a.fingerprint)
    mt = m.T.tocsr()
    mt.sort_indices()
    assert tp.fingerprint == fingerprint(mt.indptr, mt.indices, (5, 7))
    assert tp.crow.tolist() == mt.indptr.tolist() and tp.col.tolist() == mt.indices.tolist()
    np.testing.assert_array_equal(tp.values(a.val).numpy(), mt.data)
    assert transpose.transpose_pattern(a.crow, a.col, 7, 5, a.fingerprint) is tp
    v = tp.values(a.val)
    assert tp.values(a.val) is v  # same tensor, same version: no re-gather
    a.val.mul_(2)
    np.testing.assert_array_equal(tp.values(a.val).numpy(), 2 * mt.data)  # in place -> re-gathered


# ------------------------------------------------------------- the kernel path, forced on CPU


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    monkeypatch.setattr(plans, "kernels_possible", lambda device: True)
    monkeypatch.setattr(plans, "device_arch", lambda device: "sm_test")
    monkeypatch.setattr(miss, "device_arch", lambda device: "sm_test")


def test_failure_in_the_kernel_path_falls_back_and_logs_once(kernels_on_cpu, monkeypatch, caplog):
    rec = RecordingProvider([a_candidate()])
    plans.configure(provider=rec, cache=False, k=3)
    import sparserl_compile as pkg

    class Boom:
        @staticmethod
        def choose(problem, candidates, **kw):
            raise RuntimeError("nvrtc exploded")

    monkeypatch.setattr(miss, "sandbox_pool", lambda provider=None: None)
    monkeypatch.setattr(pkg, "select", Boom, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "sparserl_compile.select", Boom)
    m = matrix()
    a = S.sparsify(m)
    x = torch.randn(20, 4)
    with caplog.at_level(logging.WARNING, logger="sparserl_compile.miss"):
        y1 = a @ x
        y2 = a @ x
    np.testing.assert_allclose(y1.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y1, y2)
    p, k = rec.problems[0]
    assert k == 3 and p.op == "spmm" and p.n == 4 and p.dtype == "f32" and p.arch == "sm_test"
    assert p.fingerprint == a.fingerprint and np.array_equal(p.indices, m.indices)
    st = config.stats()
    assert st.fallbacks == 1 and st.searches == 1 and st.reference_calls == 2
    assert len([r for r in caplog.records if "nvrtc exploded" in r.getMessage()]) == 1


def test_empty_candidate_list_means_reference(kernels_on_cpu):
    rec = RecordingProvider([])
    plans.configure(provider=rec, cache=False)
    S.sparsify(matrix()) @ torch.randn(20, 2)
    (plan,) = plans.plans().values()
    assert plan.kind == "reference" and "proposed no candidates" in plan.reason
    assert config.stats().fallbacks == 0


def test_first_uses_log_where_a_new_structure_s_time_went(kernels_on_cpu):
    plans.configure(provider=RecordingProvider([]), cache=False)
    a = S.sparsify(matrix())
    a @ torch.randn(20, 2)
    a @ torch.randn(20, 2)  # a plan-table hit: not logged
    (row,) = miss.first_uses()
    assert row["fingerprint"] == a.fingerprint and (row["op"], row["n"], row["nnz"]) == ("spmm", 2, a.nnz)
    assert row["source"] == "search" and row["plan"] == "reference"
    assert "proposed no candidates" in row["verification"]["why"]
    parts = [row[k] for k in ("problem_s", "cache_s", "propose_s", "select_s", "plan_s")]
    assert all(t >= 0 for t in parts) and row["total_s"] >= sum(parts) - 1e-6
    plans.reset_stats()
    assert miss.first_uses() == []


def test_float64_and_disabled_kernels_skip_the_search(kernels_on_cpu):
    rec = RecordingProvider([a_candidate()])
    plans.configure(provider=rec, cache=False)
    S.sparsify(matrix()).double() @ torch.randn(20, 2, dtype=torch.float64)
    plans.configure(kernels=False)
    S.sparsify(matrix()) @ torch.randn(20, 2)
    assert rec.problems == []
    reasons = sorted(p.reason for p in plans.plans().values())
    assert any("kernels disabled" in r for r in reasons)


def _cached_problem(monkeypatch):
    """A matrix and the disk-cache key of its width-4 SpMM, with the runtime's cache key made
    device-free (a test GPU name, driver and NVRTC "0") so entries can be planted on the CPU."""
    from sparserl_compile import cache

    def key_for(problem, device):
        return cache.CacheKey(problem.fingerprint, problem.op, problem.dtype, cache.width_bucket(problem.n),
                              problem.arch, "test-gpu", "0", "0")

    monkeypatch.setattr(miss, "cache_key_for", key_for)
    a = S.sparsify(matrix())
    return a, key_for(miss.problem_of("spmm", a.crow, a.col, a.val, torch.empty(20, 4), 30, 20, a.fingerprint), None)


def test_cached_reference_verdict_is_used_without_a_search(kernels_on_cpu, monkeypatch):
    from sparserl_compile import cache

    a, key = _cached_problem(monkeypatch)
    cache.KernelCache.default().put(cache.CacheEntry(key=key, cubin=None))
    rec = RecordingProvider([a_candidate()])
    plans.configure(provider=rec)
    a @ torch.randn(20, 4)
    (plan,) = plans.plans().values()
    assert "cached verdict" in plan.reason
    assert rec.problems == [] and config.stats().cache_hits == 1


@pytest.mark.parametrize("record, kernel_us, retimed", [
    ({}, 5.0, True), ({"reference_graph_us": 4.0}, 5.0, False), ({"reference_graph_us": None}, 5.0, False),
    ({}, 80.0, False)])  # a long product: both rules decide it alike
def test_a_cached_short_kernel_chosen_before_the_hot_l2_rule_is_timed_again(kernels_on_cpu, monkeypatch,
                                                                           record, kernel_us, retimed):
    """A kernel verdict for a short product whose record has no ``reference_graph_us`` was chosen
    on flushed time alone: it is timed again against cuSPARSE (one candidate, the cached kernel)
    under the current rule, and the new verdict replaces it; a verdict of the current rule is served."""
    from sparserl_compile import cache

    a, key = _cached_problem(monkeypatch)
    cand = a_candidate()
    old = cache.CacheEntry(key=key, cubin=b"cubin", source=cand.source, header=cand.header.render(),
                           times={"kernel_us": kernel_us, "reference_us": 99.0}, verification=dict(record))
    cache.KernelCache.default().put(old)
    asked = []

    def search_entry(problem, key, *, candidates=None, executor=None):
        asked.append(candidates)
        return cache.CacheEntry(key=key, cubin=None, times={"kernel_us": 5.0, "reference_us": 9.0},
                                verification={"why": "reference wins with a hot L2: ...", "reference_graph_us": 4.0})

    monkeypatch.setattr(miss, "search_entry", search_entry)
    monkeypatch.setattr(plans, "kernel_plan", lambda *args: plans.ReferencePlan("the cached kernel, served"))
    rec = RecordingProvider([a_candidate()])
    plans.configure(provider=rec)
    a @ torch.randn(20, 4)
    (plan,) = plans.plans().values()
    assert rec.problems == []  # the provider is never asked
    if retimed:
        assert [c.source for c in asked[0]] == [cand.source] and "hot L2" in plan.reason
        assert miss.first_uses()[-1]["source"] == "cache+timing"
        assert cache.KernelCache.default().get(old.key).reference_wins  # the new verdict replaced it
    else:
        assert asked == [] and plan.reason == "the cached kernel, served"
    assert miss.timed_before_hot_rule(old) is retimed


class FakeKernel:
    """Stands in for launcher.LoadedKernel: computes CSR SpMM on the CPU, or fails."""

    def __init__(self, fail=False):
        self.fail = fail
        self.launches = 0

    def launch(self, args, grid, block, smem):
        self.launches += 1
        if self.fail:
            raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED")
        n_rows, n_cols, n, row_ptr, col_idx, vals, x, y = args
        y.copy_(reference.reference_product(row_ptr, col_idx, vals, x, int(n_rows), int(n_cols)))


def install_kernel_plan(a, width, kernel):
    from sparserl_compile import formats

    cand = a_candidate()
    m_ip, m_ix = a.crow.numpy(), a.col.numpy()
    fd = formats.convert(m_ip, m_ix, (a.n_rows, a.n_cols), "csr")
    plan = plans.KernelPlan(cand.header, kernel, fd, formats.to_device(fd, "cpu"), cand.source)
    key = (a.fingerprint, "spmm", cache.width_bucket(width), a.dtype, plans.device_arch(a.device))
    plans._table[key] = plan
    return key


class BindingKernel(FakeKernel):
    """A ``FakeKernel`` with launcher.LoadedKernel's prepared launch (``bind``)."""

    def bind(self, fixed, grid):
        return lambda x, y: self.launch((*fixed, x, y), grid, None, None)


def test_a_kernel_plan_keeps_no_binding_made_inside_a_cuda_graph_capture(kernels_on_cpu, monkeypatch):
    """A binding keeps its values tensor alive; inside a capture that may be a CUDA graph
    tree's copy in its pool, so the launch is bound for that call only."""
    m = matrix()
    a = S.sparsify(m)
    plan = plans._table[install_kernel_plan(a, 4, BindingKernel())]
    x = torch.randn(20, 4)
    monkeypatch.setattr(plans, "capturing", lambda t: True)
    y = plan.run("spmm", a.crow, a.col, a.val, x, a.n_rows, a.n_cols)
    np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    assert plan._bound == {} and plan.kernel.launches == 1
    monkeypatch.undo()
    plan.run("spmm", a.crow, a.col, a.val, x, a.n_rows, a.n_cols)
    assert list(plan._bound) == [4]


def test_kernel_plan_runs_the_kernel(kernels_on_cpu):
    m = matrix()
    a = S.sparsify(m)
    k = FakeKernel()
    install_kernel_plan(a, 4, k)
    x = torch.randn(20, 4)
    y = a @ x
    assert k.launches == 1 and config.stats().kernel_calls == 1
    np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------- a tensor's routes to the reference


def test_a_reference_plan_is_served_by_the_tensors_route_with_the_same_results_and_counts(monkeypatch):
    m = matrix()
    a = S.sparsify(m)
    x, x1 = torch.randn(20, 4), torch.randn(20)
    first = (a @ x, a @ x1)  # misses: plans made, no route yet
    second = (a @ x, a @ x1)  # hits: the routes are stored
    monkeypatch.setattr(plans, "product", lambda *args, **kw: pytest.fail("the route was not taken"))
    third = (a @ x, a @ x1, F.linear(x.t(), a).t())  # served by the routes (F.linear: y^T = A x^T, width 4)
    for y in first + second + third:
        np.testing.assert_allclose(y.numpy(), m @ (x if y.dim() == 2 else x1).numpy(), rtol=1e-5, atol=1e-6)
    st = config.stats()
    assert (st.calls, st.misses, st.hits, st.reference_calls) == (7, 2, 5, 7)


def test_at_a_reference_route_matmul_goes_to_torch_at_once(monkeypatch):
    """``A @ x`` at a width whose route is the reference calls torch with no sparserl check in
    between (torch checks the operands itself) and counts the hit."""
    m = matrix()
    a = S.sparsify(m)
    x, x1 = torch.randn(20, 4), torch.randn(20)
    for _ in range(2):
        a @ x, a @ x1  # a miss plans each, a hit stores each route
    from sparserl_compile import tensor as T

    monkeypatch.setattr(T, "_product", lambda *args: pytest.fail("the checked path was taken"))
    config.reset_counts()
    for y, v in ((a @ x, x), (a @ x1, x1), (a @ x.t().contiguous().t(), x)):  # (a strided view too)
        np.testing.assert_allclose(y.numpy(), m @ v.numpy(), rtol=1e-5, atol=1e-6)
    st = config.stats()
    assert (st.calls, st.hits, st.reference_calls) == (3, 3, 3)


def test_at_a_reference_route_bad_operands_still_get_sparserls_errors():
    """Torch refusing an operand at the route sends the call down the checked path, whose error
    names the problem and the fix."""
    a = S.sparsify(matrix())
    x, x1 = torch.randn(20, 4), torch.randn(20)
    for _ in range(2):
        a @ x, a @ x1
    assert a._routes.get(4) is not None and a._routes.get(plans.Routes.SPMV) is not None
    with pytest.raises(ValueError, match="dtype mismatch.*x.to"):
        a @ x1.double()
    with pytest.raises(ValueError, match="shape mismatch.*needs 20 rows"):
        a @ torch.randn(21)
    with pytest.raises(ValueError, match="dtype mismatch"):
        a @ x.double()
    with pytest.raises(NotImplementedError, match="dense strided tensor only"):
        a @ x1.to_sparse()


def test_at_a_reference_route_autograd_modes_and_autocast_take_the_checked_path():
    """What must see the product (autograd for x, values that require grad, a dispatch mode,
    autocast) is not short-cut by the route: gradients flow as before, values requiring grad
    get sparserl's error, and under autocast the product runs in the operands' dtype."""
    from torch.utils._python_dispatch import TorchDispatchMode

    m = matrix()
    a = S.sparsify(m)
    x = torch.randn(20)
    a @ x, a @ x
    xg = x.clone().requires_grad_()
    (a @ xg).sum().backward()
    np.testing.assert_allclose(xg.grad.numpy(), m.T @ np.ones(30, np.float32), rtol=1e-5, atol=1e-6)
    b = S.SparseRLTensor(a.crow, a.col, a.val.clone().requires_grad_(), a.n_rows, a.n_cols, a.fingerprint)
    b._routes = a._routes  # a reference route, values that require grad
    with pytest.raises(RuntimeError, match="does not differentiate w.r.t. sparse values"):
        b @ x

    class Seen(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Seen.ops.append(func)
            return func(*args, **(kwargs or {}))

    with Seen():
        y = a @ x
    assert any("sparserl" in str(f) for f in Seen.ops)
    np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = a @ x
    assert y.dtype == torch.float32


def test_transposed_products_go_by_the_routes_of_the_transposed_values(monkeypatch):
    """A^T @ X, x @ A and the adjoint in backward use the routes of A^T's values (memoized per
    values tensor and version): past the plan key once planned, and an in-place update of A's
    values is seen."""
    m = matrix()
    a = S.sparsify(m)
    x, r = torch.randn(30, 4), torch.randn(3, 30)
    for _ in range(2):  # a miss plans each product (a new plan voids every route), a hit stores its route
        a.t() @ x, r @ a, a @ torch.randn(20, 4)
    keyed, real_key = [], plans.width_bucket
    monkeypatch.setattr(plans, "width_bucket", lambda n: keyed.append(n) or real_key(n))
    np.testing.assert_allclose((a.t() @ x).numpy(), m.T @ x.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose((r @ a).numpy(), r.numpy() @ m, rtol=1e-5, atol=1e-5)
    xg = torch.randn(20, 4, requires_grad=True)
    (a @ xg).sum().backward()  # the adjoint A^T @ G, width 4: the route A^T @ x stored
    np.testing.assert_allclose(xg.grad.numpy(), m.T @ np.ones((30, 4), np.float32), rtol=1e-5, atol=1e-5)
    assert keyed == []
    monkeypatch.undo()
    a.val.mul_(2)
    np.testing.assert_allclose((a.t() @ x).numpy(), 2 * (m.T @ x.numpy()), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose((r @ a).numpy(), 2 * (r.numpy() @ m), rtol=1e-5, atol=1e-5)


def test_a_route_sees_in_place_value_updates_and_is_never_copied():
    import copy

    m = matrix()
    a = S.sparsify(m)
    x = torch.randn(20, 3)  # float32 sums in another order than scipy's: atol at float32 rounding of O(1) sums
    a @ x, a @ x  # the route is stored
    a.val.mul_(2)  # the torch CSR tensor behind the route aliases the values
    np.testing.assert_allclose((a @ x).numpy(), 2 * (m @ x.numpy()), rtol=1e-5, atol=1e-5)
    b = copy.deepcopy(a)
    assert b._routes.native == {}  # a copied route would alias a's values, not b's
    b.val.mul_(3)
    np.testing.assert_allclose((b @ x).numpy(), 6 * (m @ x.numpy()), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose((a @ x).numpy(), 2 * (m @ x.numpy()), rtol=1e-5, atol=1e-5)


def test_no_route_outlives_a_change_of_plans(kernels_on_cpu):
    m = matrix()
    a = S.sparsify(m)
    x = torch.randn(20, 4)
    a @ x, a @ x  # the reference (the provider proposes nothing), then its route
    assert a._routes.get(4) is not None
    k = FakeKernel()
    install_kernel_plan(a, 4, k)  # any change of the table voids every route
    assert a._routes.get(4) is None
    y = a @ x
    assert k.launches == 1
    np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-6)
    plans.clear()
    a @ x, a @ x
    assert a._routes.get(4) is not None
    plans.configure(k=2)
    assert a._routes.get(4) is None


def test_an_spmv_route_never_serves_an_spmm_of_width_one(kernels_on_cpu):
    m = matrix()
    a = S.sparsify(m)
    k = FakeKernel()
    install_kernel_plan(a, 1, k)  # SpMM of width 1: a kernel
    x1 = torch.randn(20)
    a @ x1, a @ x1  # SpMV: the reference (the provider proposes nothing), then its route
    assert a._routes.get(plans.Routes.SPMV) is not None and a._routes.get(1) is None
    y = a @ x1[:, None]
    assert k.launches == 1
    np.testing.assert_allclose(y.numpy()[:, 0], m @ x1.numpy(), rtol=1e-5, atol=1e-6)


def test_half_and_empty_products_take_no_route():
    a = S.sparsify(matrix()).to(torch.float16)
    x = torch.randn(20, 4, dtype=torch.float16)
    for _ in range(2):
        y = a @ x  # half on the CPU accumulates in float32 in the reference: no shortcut past it
    assert a._routes.native == {} and y.dtype == torch.float16
    e = S.sparsify(sp.csr_matrix((30, 20), dtype=np.float32))
    for _ in range(2):
        assert (e @ torch.randn(20, 4)).abs().sum() == 0
    assert e._routes.native == {}


# ------------------------------------------------------------- on_miss: reference, background


def test_on_miss_is_validated():
    with pytest.raises(ValueError, match="on_miss='later'.*background.*reference.*search"):
        plans.configure(on_miss="later")


def test_on_miss_reference_never_searches(kernels_on_cpu):
    rec = RecordingProvider([a_candidate()])
    plans.configure(provider=rec, on_miss="reference")
    m = matrix()
    x = torch.randn(20, 4)
    y = S.sparsify(m) @ x
    np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    (plan,) = plans.plans().values()
    assert plan.kind == "reference" and "not in the kernel cache" in plan.reason
    assert rec.problems == [] and config.stats().searches == 0


@pytest.fixture
def gated_search(kernels_on_cpu, monkeypatch):
    """search_entry waits for ``gate`` (or raises ``error``); verdicts load as FakeKernel plans."""
    import threading

    from sparserl_compile import cache, formats

    state = {"gate": threading.Event(), "error": None, "kernel": FakeKernel(), "calls": 0}

    def search_entry(problem, key, *, candidates=None, executor=None):
        state["calls"] += 1
        assert state["gate"].wait(10)
        if state["error"]:
            raise state["error"]
        c = a_candidate()
        return cache.CacheEntry(key=key, cubin=b"cubin", source=c.source, header=c.header.render(),
                                times={"kernel_us": 1.0, "reference_us": 2.0})

    def kernel_plan(problem, device, cubin, header, source, key=None):
        header = contract.parse_header(header)
        fd = formats.convert(problem.indptr, problem.indices, (problem.n_rows, problem.n_cols), "csr")
        return plans.KernelPlan(header, state["kernel"], fd, formats.to_device(fd, "cpu"), source)

    monkeypatch.setattr(miss, "search_entry", search_entry)
    monkeypatch.setattr(plans, "kernel_plan", kernel_plan)
    plans.configure(cache=False, on_miss="background")
    return state


def test_on_miss_background_serves_the_reference_then_swaps_the_kernel_in(gated_search):
    m = matrix()
    a = S.sparsify(m)
    x = torch.randn(20, 4)
    y = a @ x  # the search is queued and waits: this call runs the reference
    np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    (plan,) = plans.plans().values()
    assert plan.kind == "pending"
    st = config.stats()
    assert st.background == 1 and st.reference_calls == 1 and st.kernel_calls == 0
    a @ x  # still searching: the reference again, and no second search is queued
    assert config.stats().background == 1 and not plans.wait_for_searches(timeout=0.05)
    gated_search["gate"].set()
    assert plans.wait_for_searches(timeout=10)
    y = a @ x  # the first product after the verdict: the verified kernel (first-use checked)
    np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    (plan,) = plans.plans().values()
    assert plan.kind == "kernel" and plan.checked
    assert gated_search["kernel"].launches == 1 and gated_search["calls"] == 1
    assert config.stats().kernel_calls == 1


def test_on_miss_background_failure_falls_back_and_logs_once(gated_search, caplog):
    gated_search["error"] = RuntimeError("sandbox worker died")
    gated_search["gate"].set()
    m = matrix()
    a = S.sparsify(m)
    x = torch.randn(20, 4)
    a @ x
    assert plans.wait_for_searches(timeout=10)
    with caplog.at_level(logging.WARNING, logger="sparserl_compile.miss"):
        y = a @ x
        a @ x
    np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    (plan,) = plans.plans().values()
    assert plan.kind == "reference" and "sandbox worker died" in plan.reason
    assert config.stats().fallbacks == 1 and config.stats().kernel_calls == 0
    assert len([r for r in caplog.records if "sandbox worker died" in r.getMessage()]) == 1


def test_an_empty_dense_operand_neither_launches_nor_spoils_the_plan(kernels_on_cpu):
    m = matrix()
    a = S.sparsify(m)
    k = FakeKernel(fail=True)  # a launch would fail, and a failure replaces the plan for good
    key = install_kernel_plan(a, 1, k)
    y = a @ torch.empty(20, 0)  # width 0 shares the width-1 bucket
    assert y.shape == (30, 0) and k.launches == 0
    assert plans.plans()[key].kind == "kernel" and config.stats().fallbacks == 0


@pytest.mark.gpu
def test_cuda_reference_and_plan_key():
    m = matrix(200, 150, seed=2)
    a = S.sparsify(m, device="cuda")
    x = torch.randn(150, 16, device="cuda")
    y = a @ x
    np.testing.assert_allclose(y.cpu().numpy(), m @ x.cpu().numpy(), rtol=1e-4, atol=1e-4)
    (key,) = plans.plans()
    assert key[4].startswith("sm_")
    assert config.stats().fallbacks == 0 or config.stats().reference_calls == 1
    if isinstance(plans.plans()[key], plans.ReferencePlan):  # (the reference provider: it is)
        a @ x  # a hit: the tensor's route to cuSPARSE is stored
        assert a._routes.get(16) is not None
        np.testing.assert_allclose((a @ x).cpu().numpy(), m @ x.cpu().numpy(), rtol=1e-4, atol=1e-4)
        assert config.stats().reference_calls == 3


@pytest.mark.gpu
def test_cuda_search_end_to_end_is_correct_and_cached():
    """provider=search on the GPU: candidates -> select -> kernel (or reference) -> disk cache."""
    plans.configure(provider="search", k=2)
    m = matrix(2000, 2000, seed=5)
    a = S.sparsify(m, device="cuda")
    x = torch.randn(2000, 8, device="cuda")
    y = a @ x
    np.testing.assert_allclose(y.cpu().numpy(), m @ x.cpu().numpy(), rtol=1e-4, atol=1e-4)
    st = config.stats()
    assert st.searches == 1 and st.fallbacks == 0, plans.plans()
    (first,) = miss.first_uses()
    assert first["source"] == "search" and first["verification"]["candidates"]
    assert first["select_s"] > 0 and first["total_s"] >= first["select_s"]
    plans.clear()
    plans.reset_stats()
    y2 = a @ x
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-5)
    assert config.stats().cache_hits == 1 and config.stats().searches == 0
    if first["plan"] == "kernel":  # a cached kernel is logged as served by the cache
        assert [r["source"] for r in miss.first_uses()] == ["cache"]


@pytest.mark.gpu
def test_cuda_a_cached_kernel_chosen_before_the_hot_l2_rule_is_timed_again_once():
    """A real short-product kernel verdict, aged to what the cache held before the hot-L2 rule
    (no ``reference_graph_us`` in its record), is timed again on its first use in a process:
    the new verdict carries the reference's graph figure, the product is right, and the next
    process serves it without timing."""
    import dataclasses

    from sparserl_compile import cache
    from sparserl_compile.sandbox import GRAPH_BELOW_US

    from sparserl_compile import matrices

    plans.configure(provider="nearest", k=4)
    m = matrices.stencil2d(300)  # SpMV: a DIA kernel of a few us beats cuSPARSE on the H100 and H200
    a = S.sparsify(m, device="cuda")
    x = torch.randn(m.shape[1], device="cuda")
    a @ x
    (first,) = miss.first_uses()
    key = miss.cache_key_for(miss.problem_of("spmv", a.crow, a.col, a.val, x, *m.shape, a.fingerprint), x.device)
    store = cache.KernelCache.default()
    entry = store.get(key)
    if entry is None or entry.reference_wins or entry.times.get("kernel_us", GRAPH_BELOW_US) >= GRAPH_BELOW_US:
        pytest.skip("no short kernel verdict for this product on this GPU")
    aged = {k: v for k, v in entry.verification.items() if k not in ("reference_graph_us", "best_graph_us")}
    store.put(dataclasses.replace(entry, verification=aged))
    for again in (True, False):
        plans.clear()
        plans.reset_stats()
        y = a @ x
        np.testing.assert_allclose(y.cpu().numpy(), m @ x.cpu().numpy(), rtol=1e-4, atol=1e-4)
        logged = [r["source"] for r in miss.first_uses()]
        if again:  # timed against cuSPARSE under the current rule, whatever it then decides
            assert logged == ["cache+timing"]
            assert "reference_graph_us" in store.get(key).verification
        else:  # the new verdict is served as it is (a reference verdict logs no first use)
            assert logged in (["cache"], []) and config.stats().cache_hits == 1


@pytest.mark.gpu
def test_cuda_background_search_then_kernel_and_nearest_provider():
    """on_miss="background" on the GPU: the first products run cuSPARSE while the search runs;
    after it, the verdict (here from the "nearest" provider's few candidates) serves the
    products, each right; a fresh plan table then finds it in the disk cache."""
    plans.configure(provider="nearest", k=2, on_miss="background")
    m = matrix(3000, 3000, seed=6)
    a = S.sparsify(m, device="cuda")
    x = torch.randn(3000, 16, device="cuda")
    want = m @ x.cpu().numpy()
    np.testing.assert_allclose((a @ x).cpu().numpy(), want, rtol=1e-4, atol=1e-4)
    assert config.stats().background == 1
    assert plans.wait_for_searches(timeout=300)
    for _ in range(2):
        np.testing.assert_allclose((a @ x).cpu().numpy(), want, rtol=1e-4, atol=1e-4)
    (plan,) = plans.plans().values()
    assert plan.kind in ("kernel", "reference", "dense") and config.stats().fallbacks == 0
    if plan.kind == "kernel":
        assert plan.checked and config.stats().kernel_calls == 2
    if plan.kind == "dense":  # a 20 %-full matrix at width 16: the dense product may be fastest
        assert config.stats().dense_calls == 2
    plans.clear()
    plans.reset_stats()
    a @ x
    assert config.stats().cache_hits == 1 and config.stats().background == 0


class WrongKernel(FakeKernel):
    """Launches fine but writes a wrong answer (as a miscompiled or stale cached kernel would)."""

    def launch(self, args, grid, block, smem):
        super().launch(args, grid, block, smem)
        args[-1].mul_(1.5)


@pytest.mark.parametrize("make_kernel, reason, logged", [
    (lambda: FakeKernel(fail=True), "launch failed", "CUDA_ERROR_LAUNCH_FAILED"),
    (WrongKernel, "first-use check failed", "entries outside the error bound"),
], ids=["launch_error", "wrong_answer"])
def test_failing_kernel_plan_falls_back_and_is_replaced(kernels_on_cpu, caplog, make_kernel, reason, logged):
    m = matrix()
    a = S.sparsify(m)
    k = make_kernel()
    key = install_kernel_plan(a, 4, k)
    x = torch.randn(20, 4)
    with caplog.at_level(logging.WARNING, logger="sparserl_compile.miss"):
        y = a @ x
        a @ x
    np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    assert k.launches == 1  # the failed plan is gone after the first failure
    plan = plans.plans()[key]
    assert plan.kind == "reference" and reason in plan.reason
    assert config.stats().fallbacks == 1
    assert sum(logged in r.getMessage() for r in caplog.records) == 1


def test_first_use_check_passes_a_right_kernel_once(kernels_on_cpu):
    a = S.sparsify(matrix())
    k = FakeKernel()
    key = install_kernel_plan(a, 4, k)
    x = torch.randn(20, 4)
    a @ x
    a @ x
    assert k.launches == 2 and plans.plans()[key].checked and config.stats().fallbacks == 0


def test_reference_is_out_of_reach_of_torch_function_modes():
    """The runtime is called directly by the eager fast paths, possibly inside a user's (or
    dispatch.enable()'s) TorchFunctionMode: its own native CSR product must not be seen there."""
    from torch.overrides import TorchFunctionMode

    class Record(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.sparse = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.sparse += any(getattr(a, "layout", None) == torch.sparse_csr for a in args)
            return func(*args, **(kwargs or {}))

    a = S.sparsify(matrix())
    x = torch.randn(20, 3)
    with Record() as rec:
        y = plans.spmm(a.crow, a.col, a.val, x, 30, 20, a.fingerprint)
        yh = reference.reference_product(a.crow, a.col, a.val.half(), x.half(), 30, 20)
    assert rec.sparse == 0
    np.testing.assert_allclose(y.numpy(), matrix() @ x.numpy(), rtol=1e-5, atol=1e-5)
    assert yh.dtype == torch.float16


def test_device_arch_is_memoized_per_device():
    problem._arch_of.clear()
    assert problem.device_arch(torch.device("cpu")) == "cpu"
    assert list(problem._arch_of) == [torch.device("cpu")]
    assert problem.device_arch(torch.empty(0).device) == "cpu" and len(problem._arch_of) == 1


def test_prewarm_starts_the_sandbox_worker_in_the_background():
    t = S.prewarm(provider=False)
    t.join(120)
    assert not t.is_alive()
    pool = miss.sandbox_pool()
    assert pool._free and pool._free[0].alive()


# ------------------------------------------------------------- the dense product


def _dense_entry(key, **verification):
    return cache.CacheEntry(key=key, cubin=None, times={"reference_us": 9.0, "dense_us": 2.0}, outcome="dense",
                            verification={"why": "the dense product wins: ...", "dense_us": 2.0, **verification})


def test_a_cached_dense_verdict_runs_the_dense_product_and_keeps_one_copy(kernels_on_cpu, monkeypatch):
    a, key = _cached_problem(monkeypatch)
    cache.KernelCache.default().put(_dense_entry(key))
    rec = RecordingProvider([a_candidate()])
    plans.configure(provider=rec)
    m = matrix()
    x = torch.randn(20, 4)
    y = a @ x
    (plan,) = plans.plans().values()
    assert isinstance(plan, plans.DensePlan) and "dense product wins" in plan.reason
    assert rec.problems == [] and config.stats().cache_hits == 1 and config.stats().dense_calls == 1
    np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    assert plan.nbytes == 30 * 20 * 4  # one float32 copy of the matrix
    a @ x  # a hit: the route is stored
    monkeypatch.setattr(plans, "product", lambda *args, **kw: pytest.fail("the route was not taken"))
    y = F.linear(x.t(), a).t()  # F.linear's eager path, y^T = A x^T: the same plan, by the route
    np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    a.val.mul_(2)  # an in-place update of the values: the dense copy is built again
    np.testing.assert_allclose((a @ x).numpy(), 2 * (m @ x.numpy()), rtol=1e-5, atol=1e-5)
    assert plan.nbytes == 30 * 20 * 4 and config.stats().dense_calls == 4


def test_a_linear_layer_the_dense_product_serves_is_one_f_linear_on_the_input_as_given(kernels_on_cpu, monkeypatch):
    """Where the route at a layer's batch is the dense product, ``F.linear`` runs on ``x`` as the
    user passed it, bias fused: no transposes of ``x`` or ``y``, no separate addition. A bias
    the shortcut cannot take (wrong shape) still meets the sparse route's clear error."""
    a, key = _cached_problem(monkeypatch)
    cache.KernelCache.default().put(_dense_entry(key))
    plans.configure(provider=RecordingProvider([]))
    want = torch.from_numpy(matrix().toarray())
    x, bias = torch.randn(4, 20), torch.randn(30)
    F.linear(x, a)  # the first product at batch 4 makes the plan
    F.linear(x, a)  # a hit: the route is stored
    calls = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *args: calls.append(args) or real(*args))
    monkeypatch.setattr(plans, "product", lambda *args, **kw: pytest.fail("the route was not taken"))
    y = F.linear(x, a, bias)
    outer, args = calls  # the user's call, then the one it became
    assert outer[1] is a and args[0] is x and args[2] is bias and args[1].shape == (30, 20)  # the user's x, the dense weight
    torch.testing.assert_close(y, x @ want.t() + bias)
    torch.testing.assert_close(F.linear(x.reshape(2, 2, 20), a), (x @ want.t()).reshape(2, 2, 30))
    assert config.stats().dense_calls == 4
    with pytest.raises(ValueError, match="bias"):
        F.linear(x, a, torch.randn(7))


@pytest.mark.parametrize("name", ["spmm", "spmm_graph"])
def test_the_ops_go_by_a_dense_or_kernel_plan_route_of_their_values(kernels_on_cpu, monkeypatch, name):
    """A compiled graph calls the ops with the same values tensor each time: from the second
    product on they go by that tensor's route (no plan key), and an in-place update is seen."""
    a, key = _cached_problem(monkeypatch)
    cache.KernelCache.default().put(_dense_entry(key))
    plans.configure(provider=RecordingProvider([]))
    op = getattr(torch.ops.sparserl, name)
    want, x = torch.from_numpy(matrix().toarray()), torch.randn(20, 4)
    for _ in range(2):  # the plan, then a hit that stores the route
        op(a.crow, a.col, a.val, x, 30, 20, a.fingerprint)
    monkeypatch.setattr(plans, "product", lambda *args, **kw: pytest.fail("the route was not taken"))
    torch.testing.assert_close(op(a.crow, a.col, a.val, x, 30, 20, a.fingerprint), want @ x)
    a.val.mul_(2)  # the dense copy is built again
    torch.testing.assert_close(op(a.crow, a.col, a.val, x, 30, 20, a.fingerprint), 2 * want @ x)
    assert config.stats().dense_calls == 4


def test_entry_plan_builds_a_dense_plan_that_multiplies_right_including_the_transposed_pattern():
    m = matrix()
    a = S.sparsify(m).to(torch.bfloat16)
    entry = _dense_entry(None)
    plan = plans.entry_plan(entry, None, torch.device("cpu"), None)
    assert plan.kind == "dense" and plan.nbytes == 0  # nothing built before the first product
    x, x1 = torch.randn(20, 3, dtype=torch.bfloat16), torch.randn(20, dtype=torch.bfloat16)
    want = torch.from_numpy(m.toarray()).to(torch.bfloat16)
    torch.testing.assert_close(plan.run("spmm", a.crow, a.col, a.val, x, 30, 20), want @ x)
    torch.testing.assert_close(plan.run("spmv", a.crow, a.col, a.val, x1, 30, 20), want @ x1)
    assert plan.nbytes == 30 * 20 * 2  # one bfloat16 copy, shared by both ops
    tp = transpose.transpose_pattern(a.crow, a.col, 30, 20, a.fingerprint)  # what x @ A and autograd multiply by
    xt = torch.randn(30, 2, dtype=torch.bfloat16)
    torch.testing.assert_close(plan.run("spmm", tp.crow, tp.col, tp.values(a.val), xt, 20, 30), want.t() @ xt)


def test_a_dense_copy_goes_with_its_values():
    m = matrix()
    a, b = S.sparsify(m), S.sparsify(2 * m)  # one structure, so one plan key: a copy each
    plan = plans.DensePlan()
    x = torch.randn(20, 2)
    plan.run("spmm", a.crow, a.col, a.val, x, 30, 20)
    plan.run("spmm", b.crow, b.col, b.val, x, 30, 20)
    assert plan.nbytes == 2 * 30 * 20 * 4
    del b  # its values freed: its copy with them
    assert plan.nbytes == 30 * 20 * 4


def test_verdicts_reached_without_the_dense_product_are_decided_again_on_a_gpu():
    a = S.sparsify(matrix())
    prob = miss.problem_of("spmm", a.crow, a.col, a.val, torch.empty(20, 4), 30, 20, a.fingerprint)
    old_ref = cache.CacheEntry(key=None, cubin=None, verification={"why": "reference wins"})
    old_kernel = cache.CacheEntry(key=None, cubin=b"x", times={"kernel_us": 5.0})
    assert "by selection version 1" in miss.dense_stale(old_ref, prob, timed=True)
    assert "without timing the dense product" in miss.dense_stale(old_kernel, prob, timed=True)
    untimed = cache.CacheEntry(key=None, cubin=None, verification={"selection_version": 2})  # built on a CPU
    assert "(untimed)" in miss.dense_stale(untimed, prob, timed=True)
    assert miss.dense_stale(old_ref, prob, timed=False) is None  # nothing can be timed there
    considered = cache.CacheEntry(key=None, cubin=None, verification={"dense_us": 3.0})
    assert miss.dense_stale(considered, prob, timed=True) is None
    assert miss.dense_stale(_dense_entry(None), prob, timed=True) is None
    plans.configure(dense_max_bytes=100)  # the 30 x 20 float32 matrix takes 2400 bytes dense
    assert miss.dense_stale(old_ref, prob, timed=True) is None  # not a candidate now: the old verdict stands
    assert "no longer allowed" in miss.dense_stale(_dense_entry(None), prob, timed=False)


def test_a_dense_verdict_the_settings_no_longer_allow_is_searched_again(kernels_on_cpu, monkeypatch, caplog):
    a, key = _cached_problem(monkeypatch)
    cache.KernelCache.default().put(_dense_entry(key))
    rec = RecordingProvider([])
    plans.configure(provider=rec, dense_max_bytes=1000)
    with caplog.at_level(logging.WARNING, logger="sparserl_compile.miss"):
        a @ torch.randn(20, 4)
    (plan,) = plans.plans().values()
    assert plan.kind == "reference" and len(rec.problems) == 1 and config.stats().dense_calls == 0
    assert any("dense verdict is no longer allowed" in r.getMessage() for r in caplog.records)
    assert cache.KernelCache.default().get(key).reference_wins  # the new verdict replaced it


@pytest.mark.gpu
def test_cuda_sparsify_of_a_half_pruned_bf16_linear_at_batch_16_keeps_the_dense_product():
    """The behaviour, not a speed: a 4096 x 4096 bfloat16 ``nn.Linear`` pruned to 50 % and run
    at batch 16 is served by the dense product, the layer the user had, rather than cuSPARSE or
    a kernel that is slower than it (the search, two candidates, times all of them)."""
    plans.configure(provider="search", k=2)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        w = lin.weight.view(-1)
        w[w.abs().argsort()[: w.numel() // 2]] = 0  # magnitude pruning: the smaller half
    dense_w = lin.weight.detach().clone()
    S.sparsify_(lin, min_sparsity=0.5)
    assert isinstance(lin.weight, S.SparseRLTensor)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    y = lin(x)
    (plan,) = plans.plans().values()
    rec = miss.first_uses()[-1]["verification"]
    print(f"\n4096 x 4096 bf16, 50 %, batch 16: {rec.get('rule')}; reference {rec.get('reference_us')} us, "
          f"dense {rec.get('dense_us')} us")
    assert plan.kind == "dense", rec
    torch.testing.assert_close(y, x @ dense_w.t(), rtol=2e-2, atol=2e-2)
    assert plan.nbytes == 4096 * 4096 * 2 and config.stats().dense_calls == 1
    torch.testing.assert_close(lin(x), y)  # a hit (by the weight's route): the same dense copy, not built again
    assert plan.nbytes == 4096 * 4096 * 2 and config.stats().dense_calls == 2


def test_a_reference_provider_verdict_stands_beside_the_dense_product():
    """The reference provider's "reference" is a choice, not a verdict reached without the dense
    product: its entry says so, and is not searched again on a GPU."""
    a = S.sparsify(matrix())
    prob = miss.problem_of("spmm", a.crow, a.col, a.val, torch.empty(20, 4), 30, 20, a.fingerprint)
    entry = miss.search_entry(prob, None)  # the fixture's provider: "reference"
    assert entry.reference_wins and "reference provider" in entry.verification["dense_not_timed"]
    assert miss.dense_stale(entry, prob, timed=True) is None


def test_a_dense_plan_serves_values_made_under_inference_mode():
    m = matrix()
    with torch.inference_mode():
        a = S.sparsify(torch.from_numpy(m.toarray()))
        x = torch.randn(20, 3)
    plan = plans.DensePlan()
    for _ in range(2):
        y = plan.run("spmm", a.crow, a.col, a.val, x, 30, 20)
        np.testing.assert_allclose(y.numpy(), m @ x.numpy(), rtol=1e-5, atol=1e-5)
    assert plan.nbytes == 30 * 20 * 4
