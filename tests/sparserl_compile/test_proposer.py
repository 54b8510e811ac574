"""proposer.ProcessProvider: a provider built and asked in a worker process of its own."""

from __future__ import annotations

import os

import pytest

from sparserl_compile import matrices, providers
from sparserl_compile.problem import make_problem
from sparserl_compile.proposer import ProcessProvider
from sparserl_compile.structure import fingerprint


def _problem(n=32):
    m = matrices.generate("banded", n=n, half_bandwidth=1, seed=0)
    return make_problem("spmv", "f32", 1, m.indptr, m.indices, m.shape,
                        fingerprint(m.indptr, m.indices, m.shape), "sm_90")


@pytest.fixture
def echo():
    p = ProcessProvider("proposer_fixtures:EchoProvider", name="echo?", checkpoint_hash=None)
    yield p
    p.close()


def test_candidates_come_from_another_process(echo):
    cands = echo.candidates(_problem(), 3)
    assert len(cands) == 3 and all(c.header.op == "spmv" for c in cands)
    assert echo.pid is not None and echo.pid != os.getpid()


def test_warm_up_takes_the_workers_own_name_hash_and_spare(echo):
    assert (echo.name, echo.checkpoint_hash, echo.sandbox_spare) == ("echo?", None, 0)
    echo.warm_up()
    assert echo.ready() and (echo.name, echo.checkpoint_hash, echo.sandbox_spare) == ("echo", "feedface", 1)


def test_a_failure_in_the_worker_raises_with_its_message_and_the_worker_serves_on(echo):
    with pytest.raises(RuntimeError, match="ValueError: thirteen rows are unlucky"):
        echo.candidates(_problem(13), 2)
    assert len(echo.candidates(_problem(), 2)) == 2


def test_a_worker_that_dies_is_started_again(echo):
    echo.candidates(_problem(), 1)
    first = echo.pid
    with pytest.raises(RuntimeError, match="ended during 'candidates'"):
        echo.candidates(_problem(7), 1)
    assert len(echo.candidates(_problem(), 1)) == 1 and echo.pid != first


def test_the_default_provider_falls_back_when_the_policy_worker_cannot_build(monkeypatch):
    monkeypatch.setattr(providers, "policy_available", lambda: None)
    monkeypatch.setattr(providers, "policy_in_process_worker",
                        lambda: ProcessProvider("proposer_fixtures:BrokenProvider", name="policy"))
    d = providers.DefaultProvider(("policy", "reference"))
    d.warm_up()
    assert d.ready() and d.name == "reference"
    assert "OSError: the model file is unreadable" in d.fallback_reason
    assert d.propose(_problem(), 4) == ([], "reference")


def test_a_bad_factory_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="'package.module:Class'"):
        ProcessProvider("no_colon_here", name="x")


_DIRECT = """
p = ProcessProvider("proposer_fixtures:SlowProvider", name="slow")
p.load_in_background()
"""
#: the runtime's way: the default provider's policy loading on its background thread, logging on
_DEFAULT = """
import logging
from sparserl_compile import providers
logging.basicConfig()
providers.policy_available = lambda: None
providers.policy_in_process_worker = lambda: ProcessProvider("proposer_fixtures:SlowProvider", name="policy")
d = providers.DefaultProvider(providers.POLICY_CHAIN)
d.load_in_background()
p = d.load()
"""


@pytest.mark.parametrize("start", [_DIRECT, _DEFAULT], ids=["process_provider", "default_provider"])
def test_exit_while_the_worker_warms_up_stops_it_without_waiting_for_the_warm_up(start):
    """A script that ends while the provider loads in the background (a prewarm, a first
    search) exits at once and quietly: the worker is stopped, its request not waited for, and
    no fallback is reported."""
    import subprocess
    import sys
    import textwrap
    import time
    from pathlib import Path

    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from sparserl_compile.proposer import ProcessProvider
    """) + start + textwrap.dedent("""
        while p.pid is None:
            time.sleep(0.05)
        time.sleep(1.0)  # the warm-up request is in flight
        print(p.pid, flush=True)
    """)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    assert time.monotonic() - t0 < 120  # not the warm-up's ten minutes
    pid = int(r.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the worker {pid} outlived its parent")


def test_a_request_stopped_by_close_is_no_failure_to_report(monkeypatch, caplog):
    import time

    slow = ProcessProvider("proposer_fixtures:SlowProvider", name="policy")
    monkeypatch.setattr(providers, "policy_available", lambda: None)
    monkeypatch.setattr(providers, "policy_in_process_worker", lambda: slow)
    d = providers.DefaultProvider(providers.POLICY_CHAIN)
    d.load_in_background()
    while slow.pid is None:
        time.sleep(0.05)
    time.sleep(1.0)  # the warm-up request is in flight
    t0 = time.monotonic()
    slow.close()
    d._loader.join(30)
    assert time.monotonic() - t0 < 30 and not d._loader.is_alive()
    assert "ProviderClosed" in d.fallback_reason
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
