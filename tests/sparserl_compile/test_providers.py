"""The runtime's default provider: the policy where it loads, else the lookup, else the reference."""

from __future__ import annotations

import importlib.util
import logging

import pytest

from sparserl_compile import contract, miss, plans, providers
from sparserl_compile.problem import Problem


@pytest.fixture(autouse=True)
def restore_active():
    before = providers._active
    yield
    providers._active = before


def _without_module(monkeypatch, name: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == name else real(m, *a))


def _counting_resolve(monkeypatch, fail: set[str] = frozenset()) -> list[str]:
    """``providers.resolve`` recording the names it builds, raising for those in ``fail``."""
    built, real = [], providers.build_one

    def resolve(name):
        built.append(name)
        if name in fail:
            raise RuntimeError(f"{name} is broken here")
        return real(name) if name != "policy" else _SpareWish()  # no model load

    monkeypatch.setattr(providers, "build_one", resolve)
    return built


class _SpareWish(providers.ReferenceProvider):
    """Stands in for the policy: asks for a spare sandbox worker, as ``PolicyProvider`` does."""

    name = "policy"
    sandbox_spare = 1


def test_until_one_is_set_the_runtime_asks_the_default_provider():
    providers._active = None
    p = providers.get_provider()
    assert isinstance(p, providers.DefaultProvider) and providers.get_provider() is p
    assert providers.DEFAULT_PROVIDER == "default"
    assert isinstance(providers.resolve("default"), providers.DefaultProvider)


def test_the_default_is_the_policy_and_its_cache_hash_needs_no_model(monkeypatch):
    """Where the train extra and the checkpoint are installed (the dev install), the default
    names the policy and keys the cache by the shipped weights' sha256 without building
    (loading) anything; it asks for the policy's spare sandbox worker once the policy is built,
    none before (the lookup stands in until then)."""
    if providers.policy_available() is not None:
        pytest.skip(f"the policy cannot load here: {providers.policy_available()}")
    from sparserl_compile.policy.provider import DEFAULT_CHECKPOINT, weights_sha256

    built = _counting_resolve(monkeypatch)
    d = providers.DefaultProvider(providers.POLICY_CHAIN)
    assert d.name == "policy" and d.fallback_reason is None and d.sandbox_spare == 0
    assert d.checkpoint_hash == weights_sha256(DEFAULT_CHECKPOINT / "model.safetensors")
    assert providers.policy_hash(d) == d.checkpoint_hash
    assert built == []  # nothing loaded yet
    d.load()
    d.candidates(None, 4)
    assert built == ["policy"]  # built once, on first use
    assert d.sandbox_spare == 1


def test_without_the_train_extra_the_default_is_the_lookup(monkeypatch):
    _without_module(monkeypatch, "llguidance")
    why = providers.policy_available()
    assert "llguidance" in why and "sparserl[train]" in why
    d = providers.DefaultProvider(providers.POLICY_CHAIN)
    assert d.name == "nearest" and d.fallback_reason == why
    assert d.checkpoint_hash is None and d.sandbox_spare == 0
    assert providers.policy_hash(d) == "none"  # its entries serve every provider


def test_a_policy_that_fails_to_load_falls_back_once_and_says_why(monkeypatch, caplog):
    if providers.policy_available() is not None:
        pytest.skip(f"the policy cannot load here: {providers.policy_available()}")
    built = _counting_resolve(monkeypatch, fail={"policy"})
    d = providers.DefaultProvider(providers.POLICY_CHAIN)
    with caplog.at_level(logging.WARNING, logger="sparserl_compile.providers"):
        d.load()
    assert d.name == "nearest" and "policy is broken here" in d.fallback_reason
    assert "could not be loaded" in caplog.text and "using 'nearest'" in caplog.text
    d.load()
    assert built == ["policy", "nearest"]  # no retry per structure
    assert d.checkpoint_hash is None


def test_the_last_provider_of_the_chain_reports_its_own_error():
    with pytest.raises(ValueError, match="unknown provider 'nope'"):
        providers.DefaultProvider(("nope",)).load()
    with pytest.raises(ValueError, match="name at least one provider"):
        providers.DefaultProvider(())
    d = providers.DefaultProvider(("nope", "reference"))
    assert d.load().name == "reference" and "unknown provider 'nope'" in d.fallback_reason


def test_a_search_starts_the_sandbox_worker_before_the_provider_proposes(monkeypatch):
    """The first search of a process pays the worker's start (seconds on a GPU) while the
    provider proposes, not after it; the reference provider starts nothing."""
    events = []

    class FakePool:
        spare = 0

        def start(self, wait=False, count=1):
            events.append("start")

    class Proposes:
        name = "proposes"

        def candidates(self, problem, k):
            events.append("propose")
            return []

    monkeypatch.setattr(miss, "sandbox_pool", lambda provider=None: FakePool())
    for prov, expected in ((Proposes(), ["start", "propose"]), (providers.ReferenceProvider(), [])):
        events.clear()
        providers.set_provider(prov)
        entry = miss.search_entry(_problem(), None)
        assert events == expected and entry.cubin is None


def _problem():
    import numpy as np

    indptr = np.array([0, 1, 2], np.int32)
    indices = np.array([0, 1], np.int32)
    return Problem("spmv", "f32", 1, 2, 2, 2, indptr, indices, "fp", "cpu")


def test_prewarm_warms_the_provider_up(monkeypatch):
    """``prewarm`` has the active provider pay its one-time costs (the default: load the policy,
    then its ``warm_up``) before the pool's workers are counted up."""
    events = []

    class FakePool:
        spare = 0

        def start(self, wait=False, count=1):
            events.append("start-wait" if wait else "start")

    class Warms:
        name = "warms"
        sandbox_spare = 0

        def warm_up(self):
            events.append("warm_up")

        def candidates(self, problem, k):
            return []

    monkeypatch.setattr(miss, "sandbox_pool", lambda provider=None: FakePool())
    import sparserl_compile.formats as formats

    monkeypatch.setattr(formats, "warm", lambda: events.append("formats"))
    d = providers.DefaultProvider(("reference",))
    providers.set_provider(d)
    monkeypatch.setattr(providers, "build_one", lambda name: Warms())  # what d loads
    miss.prewarm().join()
    assert events == ["start", "formats", "warm_up", "start-wait"] and d.name == "warms"


class _Named:
    """A provider proposing nothing, under a name; ``gate`` holds its ``warm_up`` until set."""

    def __init__(self, name, gate=None):
        self.name, self.gate, self.asked = name, gate, 0

    def warm_up(self):
        if self.gate is not None:
            assert self.gate.wait(10)

    def candidates(self, problem, k):
        self.asked += 1
        return []


def test_the_runtime_never_waits_for_the_policy_to_load(monkeypatch):
    """``propose`` (what a search asks) before the policy is ready: the lookup proposes; the
    policy's load and warm-up start in the background, once, when asked (``load_in_background``,
    after a selection); once ready, the policy proposes."""
    import threading

    gate = threading.Event()
    built = {"policy": _Named("policy", gate), "nearest": _Named("nearest")}
    names = []
    monkeypatch.setattr(providers, "policy_available", lambda: None)
    monkeypatch.setattr(providers, "build_one", lambda name: names.append(name) or built[name])
    d = providers.DefaultProvider(providers.POLICY_CHAIN)
    assert d.propose(None, 4) == ([], "nearest") and not d.loading  # nothing loads beside a selection
    d.load_in_background()
    d.load_in_background()
    assert d.propose(None, 4) == ([], "nearest")
    assert not d.ready() and d.loading and built["nearest"].asked == 2
    gate.set()
    for _ in range(200):
        if not d.loading:
            break
        threading.Event().wait(0.05)
    assert d.ready() and d.propose(None, 4) == ([], "policy") and built["policy"].asked == 1
    assert sorted(names) == ["nearest", "policy"]  # each built once


def test_propose_builds_a_quick_provider_in_line(monkeypatch):
    """Without the policy at the head of the chain (no ``train`` extra) there is nothing to wait
    for: the lookup is built and proposes in line, no thread."""
    _without_module(monkeypatch, "llguidance")
    d = providers.DefaultProvider(providers.POLICY_CHAIN)
    cands, who = d.propose(_problem(), 2)
    assert who == "nearest" and d.ready() and not d.loading


class _LoadsLater(providers.DefaultProvider):
    """Proposes nothing (as ``nearest``) and records when the runtime asks it to load."""

    def __init__(self, events):
        super().__init__(("reference",))
        self.events = events

    def propose(self, problem, k):
        self.events.append("propose")
        return [], "nearest"

    def load_in_background(self):
        self.events.append("load")


@pytest.fixture
def product_search(monkeypatch):
    """A CPU product that takes the kernel path's search (no sandbox), its plan building recorded."""
    import numpy as np
    import scipy.sparse as sp
    import torch

    import sparserl_compile as S

    events = []

    class FakePool:
        spare = 0

        def start(self, wait=False, count=1):
            pass

    real_plan = plans.entry_plan

    def entry_plan(*a, **kw):
        events.append("plan")
        return real_plan(*a, **kw)

    monkeypatch.setattr(plans, "kernels_possible", lambda device: True)
    monkeypatch.setattr(plans, "device_arch", lambda device: "sm_test")
    monkeypatch.setattr(miss, "device_arch", lambda device: "sm_test")
    monkeypatch.setattr(miss, "sandbox_pool", lambda provider=None: FakePool())
    monkeypatch.setattr(plans, "entry_plan", entry_plan)
    plans.configure(cache=False)
    plans.clear()
    providers.set_provider(_LoadsLater(events))
    m = sp.random(30, 20, density=0.2, format="csr", random_state=0, dtype=np.float32)
    yield events, (lambda: S.sparsify(m) @ torch.randn(20, 2))
    plans.clear()  # tests/conftest.py puts the test run's first settings back


def test_a_search_records_who_proposed_and_starts_the_policys_load_after_its_plan(product_search):
    """The selection record names the provider that proposed; the runtime asks the default
    provider to load the policy in the background once the search's plan is built (here: the
    reference's, nothing proposed), not before, and a search alone does not."""
    events, product = product_search
    product()
    assert events == ["propose", "plan", "load"]
    (row,) = miss.first_uses()
    assert row["verification"]["provider"] == "nearest" and "proposed no candidates" in row["verification"]["why"]
    events.clear()
    miss.search_entry(_problem(), None)
    assert events == ["propose"]


def test_a_cached_kernels_timing_does_not_load_the_policy(product_search, monkeypatch):
    """A pre-generated entry never timed on this GPU is timed as the one candidate (no provider
    asked): the policy is not loaded for it."""
    from sparserl_compile import cache

    events, product = product_search
    src = ("// sparserl op=spmm format=csr dtype=f32 index=i32\n"
           "// launch block=128 work=rows per_block=1 tile_n=0 smem=0 zero_output=0 n_align=1\n"
           + contract.signature_c("spmm", "csr", "f32") + " {}\n")
    cand = contract.Candidate(src, contract.parse_header(src))
    untimed = cache.CacheEntry(key="k", cubin=b"cubin", source=cand.source, header=cand.header.render(), times={})
    given = []

    def search_entry(problem, key, *, candidates=None, executor=None):
        given.append(candidates)
        return cache.CacheEntry(key=key, cubin=None, times={}, verification={"why": "the reference won"})

    monkeypatch.setattr(miss, "_store", lambda: object())
    monkeypatch.setattr(miss, "cache_key_for", lambda problem, device: "k")
    monkeypatch.setattr(cache, "lookup", lambda store, key, fallback_hashes=(): untimed)
    monkeypatch.setattr(miss, "_put", lambda store, entry, fp: None)
    monkeypatch.setattr(miss, "search_entry", search_entry)
    product()
    assert [len(c) for c in given] == [1] and events == ["plan"]


def test_warm_up_runs_once_however_many_ask(monkeypatch):
    import threading

    warmed = []

    class Counts(_Named):
        def warm_up(self):
            warmed.append(1)

    monkeypatch.setattr(providers, "build_one", lambda name: Counts("counts"))
    d = providers.DefaultProvider(("counts",))
    threads = [threading.Thread(target=d.warm_up) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    d.warm_up()
    assert warmed == [1] and d.ready()


def test_a_background_search_starts_the_policys_load_when_it_is_done(product_search):
    """``on_miss="background"``: the search runs on the runtime's thread and asks for the load
    once its entry is made."""
    events, product = product_search
    plans.configure(on_miss="background")
    product()
    assert plans.wait_for_searches(timeout=10)
    assert events == ["propose", "load"]
