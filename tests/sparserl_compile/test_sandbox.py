"""sandbox: typed failures, killed hangs, dead workers replaced, the parent untouched."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from faults import FAULTS, GOOD, candidate
from sparserl_compile import matrices
from sparserl_compile.sandbox import SandboxJob, SandboxPool
from test_verify import needs_simt

M = matrices.stencil2d(10)


def _job(src, executor="cpu", **kw):
    return SandboxJob(candidate(src), "spmv", executor=executor, **kw)


def _parent_still_computes():
    x = np.ones(M.shape[1], np.float32)
    np.testing.assert_allclose(M @ x, np.asarray(M.sum(axis=1)).ravel(), rtol=1e-5)


def test_compile_error_is_typed_and_the_worker_is_reused():
    with SandboxPool(1, timeout_s=60) as pool:
        r1 = pool.run(_job(FAULTS["compile_error"].source), M)
        r2 = pool.run(_job(FAULTS["compile_error"].source), M)
    assert r1.kind == "compile_error" and "undeclared_scale" in r1.error
    assert not r1.compile_ok and r1.verify is not None and r1.verify.failed == "compile"
    assert r1.worker_pid == r2.worker_pid != os.getpid()
    _parent_still_computes()


def test_workers_follow_the_parents_cuda_device(monkeypatch):
    import torch

    from sparserl_compile import sandbox

    with SandboxPool(1) as pool:  # no GPU here: workers keep their default device
        assert pool.device is None
        assert pool.run(_job(FAULTS["compile_error"].source), M).kind == "compile_error"
    assert SandboxPool(1, device=3).device == 3  # explicit wins; no worker is started until a job
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert sandbox.parent_device() == 2  # torchrun, CUDA not touched yet
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert sandbox.parent_device() == 1  # the device the process chose wins


@needs_simt
def test_hang_is_killed_and_the_next_job_runs():
    with SandboxPool(1, timeout_s=60) as pool:
        t0 = time.perf_counter()
        r = pool.run(_job(FAULTS["infinite_loop"].source), M, timeout_s=5)
        assert r.kind == "timeout" and time.perf_counter() - t0 < 30
        good = pool.run(_job(GOOD), M)
    assert good.kind == "ok" and good.verify.ok
    assert good.worker_pid != r.worker_pid
    _parent_still_computes()


@needs_simt
@pytest.mark.parametrize("name", [k for k in FAULTS if k not in ("infinite_loop",)])
def test_each_fault_gets_its_kind(name):
    f = FAULTS[name]
    with SandboxPool(1, timeout_s=60) as pool:
        r = pool.run(_job(f.source, static=f.static), M)
        good = pool.run(_job(GOOD), M)  # the fallback still answers after the failure
    assert r.kind in f.kinds, (name, r.kind, r.error)
    assert good.ok
    _parent_still_computes()


@needs_simt
def test_restart_on_keeps_the_worker_after_a_wrong_kernel_but_not_after_a_hang():
    """``restart_on`` names the result kinds after which a worker is replaced: a pool that keeps
    its workers after a wrong kernel (``policy.screen``) runs the next job on the same worker;
    a hang is still killed and replaced. Unknown kinds are refused."""
    with SandboxPool(1, timeout_s=60, restart_on={"internal"}) as pool:
        bad = pool.run(_job(FAULTS["wrong_answer"].source), M)
        good = pool.run(_job(GOOD), M)
        assert bad.kind == "wrong" and good.ok and good.worker_pid == bad.worker_pid and pool.restarts == 0
        hang = pool.run(_job(FAULTS["infinite_loop"].source), M, timeout_s=5)
        after = pool.run(_job(GOOD), M)
    assert hang.kind == "timeout" and after.ok and after.worker_pid != hang.worker_pid
    with pytest.raises(ValueError, match="restart_on"):
        SandboxPool(1, restart_on={"slow"})


@needs_simt
def test_a_failed_workers_replacement_starts_in_the_background():
    """After a wrong kernel the worker is replaced at once, not when the next job comes: the
    next job runs on the worker already started (a GPU worker's start is seconds)."""
    with SandboxPool(1, timeout_s=60) as pool:
        bad = pool.run(_job(FAULTS["wrong_answer"].source), M)
        assert bad.kind == "wrong" and pool.restarts == 1
        deadline = time.monotonic() + 60
        while not pool._free and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pool._free) == 1 and pool._free[0].alive()
        spare = pool._free[0].proc.pid
        assert spare != bad.worker_pid
        good = pool.run(_job(GOOD), M)
    assert good.ok and good.worker_pid == spare


@needs_simt
def test_a_spare_worker_takes_the_job_after_a_failure():
    """spare=1: a worker beside the one a job takes is started ahead, so the job after a wrong
    kernel runs on a worker started before that kernel failed, not on its replacement."""
    with pytest.raises(ValueError, match="spare=-1"):
        SandboxPool(1, spare=-1)
    with SandboxPool(1, timeout_s=60, spare=1) as pool:
        pool.start(wait=True)
        deadline = time.monotonic() + 60
        while (len(pool._free) < 2 or pool._spawning) and time.monotonic() < deadline:
            time.sleep(0.05)
        ready = {w.proc.pid for w in pool._free}
        assert len(ready) == 2
        bad = pool.run(_job(FAULTS["wrong_answer"].source), M)
        good = pool.run(_job(GOOD), M)
    assert bad.kind == "wrong" and good.ok
    assert bad.worker_pid in ready and good.worker_pid in ready and good.worker_pid != bad.worker_pid


@needs_simt
def test_a_failed_worker_stops_off_the_jobs_path_and_close_waits_for_it(monkeypatch):
    """The worker of a wrong kernel is stopped on a background thread: ``run`` returns its
    result while that stop is still under way (a GPU worker's exit is about a second), and
    ``close`` waits for the stop, leaving no worker behind."""
    from sparserl_compile import sandbox

    release, stopping = threading.Event(), threading.Event()
    stop = sandbox._Worker.stop

    def slow_stop(w):
        stopping.set()
        release.wait(60)
        stop(w)

    monkeypatch.setattr(sandbox._Worker, "stop", slow_stop)
    pool = SandboxPool(1, timeout_s=60)
    try:
        bad = pool.run(_job(FAULTS["wrong_answer"].source), M)
        assert bad.kind == "wrong" and pool.restarts == 1
        assert stopping.wait(60) and not release.is_set()  # run returned, the stop still waits
        retired = [w for w in sandbox._LIVE if w.proc.pid == bad.worker_pid]
        assert retired and retired[0].alive()
    finally:
        release.set()
        pool.close()
    assert not retired[0].alive() and not pool._retiring


def test_start_readies_one_worker_and_close_stops_it():
    pool = SandboxPool(1)
    pool.start()
    pool.start()  # one is already starting: no second
    w = pool._take()  # waits for the background start
    assert w.alive() and not pool._free and pool._spawning == 0
    pool._give(w)
    pool.close()
    assert not w.alive()


def test_start_readies_the_pools_workers_and_the_first_map_runs_on_them():
    """start(count=n) before a first map: n workers start in the background, start(wait=True)
    returns once they are up, and the map's jobs run on them, none started for it."""
    with SandboxPool(2, timeout_s=60) as pool:
        pool.start(count=2)
        pool.start(count=2)  # two are already starting: no more
        assert len(pool._free) + pool._spawning == 2
        pool.start(wait=True, count=2)
        assert len(pool._free) == 2 and pool._spawning == 0
        started = {w.proc.pid for w in pool._free}
        res = pool.map([_job(GOOD), _job(GOOD), _job(GOOD)], M)
        assert all(r.ok for r in res) and {r.worker_pid for r in res} <= started
        assert len(pool._free) == 2


@needs_simt
def test_a_worker_killed_mid_job_is_a_crash():
    with SandboxPool(1, timeout_s=60) as pool:
        warm = pool.run(_job(FAULTS["compile_error"].source), M)
        threading.Timer(2.0, os.kill, (warm.worker_pid, signal.SIGKILL)).start()
        r = pool.run(_job(FAULTS["infinite_loop"].source), M, timeout_s=30)
        after = pool.run(_job(GOOD), M)
    assert r.kind == "crash" and "exit code" in r.error
    assert after.ok


@pytest.mark.gpu
def test_illegal_address_in_the_worker_does_not_poison_the_parent():
    import torch

    bad = GOOD.replace("y[row] = acc;", "y[row] = acc; if (row == 0) { y[1 << 30] = acc; }")
    a = torch.ones(1000, device="cuda")
    with SandboxPool(1, timeout_s=120) as pool:
        r = pool.run(_job(bad, executor="gpu"), M)
        good = pool.run(_job(GOOD, executor="gpu", time=True), M)
    assert r.kind in ("cuda_error", "wrong"), r.error
    assert good.ok and good.kernel_us and good.kernel_us > 0
    assert float((a * 2).sum()) == 2000.0  # the parent's context is healthy


def test_a_script_without_a_main_guard_runs_once(tmp_path):
    """Workers do not import the parent's main script again (multiprocessing's "spawn" would:
    a script that works at top level would run once more in each worker, which there would try
    to start workers of its own while it is still starting)."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "print('top level ran', flush=True)\n"
        "from faults import FAULTS, GOOD, candidate\n"
        "from sparserl_compile import matrices\n"
        "from sparserl_compile.sandbox import SandboxJob, SandboxPool\n"
        "with SandboxPool(2, start_timeout_s=60) as pool:\n"
        "    jobs = [SandboxJob(candidate(s), 'spmv') for s in (GOOD, FAULTS['wrong_answer'].source)]\n"
        "    print('kinds', *[r.kind for r in pool.map(jobs, matrices.stencil2d(10))], flush=True)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("top level ran") == 1
    assert "kinds ok wrong" in out.stdout, out.stdout + out.stderr[-2000:]


def test_a_worker_that_cannot_start_is_reported(monkeypatch):
    """A worker whose interpreter dies at start gives an error that says so, at once."""
    import sys

    monkeypatch.setattr(sys, "path", [])  # the worker cannot import sparserl_compile
    with SandboxPool(1, start_timeout_s=60) as pool:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="exited while starting"):
            pool.run(_job(GOOD), M)
    assert time.monotonic() - t0 < 30


def test_a_worker_stuck_before_it_starts_prints_where(tmp_path, monkeypatch, capfd):
    """A worker that never says it is ready prints its stacks before the parent gives up on it,
    so the "did not start" error has the place it hung beside it on stderr."""
    import sys

    stuck = tmp_path / "sparserl_compile"
    stuck.mkdir()
    (stuck / "__init__.py").write_text("")
    (stuck / "sandbox.py").write_text("import time\ntime.sleep(60)  # stuck on import\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])  # the worker imports this package
    with SandboxPool(1, start_timeout_s=6) as pool:
        with pytest.raises(RuntimeError, match="did not start within 6 s"):
            pool.run(_job(GOOD), M)
    err = capfd.readouterr().err
    assert "Timeout" in err and f"{stuck / 'sandbox.py'}\", line 2" in err, err[-2000:]


def _gone(pid: int) -> bool:
    """No such process, or a zombie (its parent died; whoever adopted it may not reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@needs_simt
def test_a_worker_in_a_hung_kernel_ends_when_its_parent_is_killed(tmp_path):
    """A parent killed outright runs no exit handler, and a worker in a hung kernel never reads
    its closed pipe: the worker watches its parent and ends anyway, instead of running on."""
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(
        "import threading, time\n"
        "from faults import FAULTS, candidate\n"
        "from sparserl_compile import matrices\n"
        "from sparserl_compile.sandbox import SandboxJob, SandboxPool\n"
        "M = matrices.stencil2d(10)\n"
        "pool = SandboxPool(1, timeout_s=600)\n"
        "r = pool.run(SandboxJob(candidate(FAULTS['compile_error'].source), 'spmv'), M)\n"
        "print(r.worker_pid, flush=True)\n"
        "job = SandboxJob(candidate(FAULTS['infinite_loop'].source), 'spmv')\n"
        "threading.Thread(target=pool.run, args=(job, M)).start()\n"
        "time.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    try:
        worker = int(parent.stdout.readline())
        time.sleep(3)  # the hung kernel is running
        assert not _gone(worker)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 5  # the CPU executor's step limit ends the loop later
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(worker), "the worker outlived its killed parent"
    finally:
        parent.kill()
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.gpu
def test_a_gpu_worker_warms_up_by_verifying_a_small_product_of_each_op():
    """The warm-up a GPU worker runs while it waits: a built-in CSR kernel, SpMV and SpMM,
    verified against cuSPARSE through the job path (not timed), leaving no operands cached."""
    import gc

    from sparserl_compile import sandbox, verify

    try:
        done = sandbox._warm_up(gpu=True)
    finally:
        gc.unfreeze()  # the warm-up freezes what survives a collection: not this process's business
    assert done["jobs"] == {"spmv": "ok", "spmm": "ok"}
    assert done["formats"] >= 0 and done["cuda"] >= 0
    assert verify._VALUE_SETS["key"] is None and not verify._VALUE_SETS["sets"]


def test_a_workers_warm_up_freezes_what_it_loaded():
    """The warm-up ends with a full collection and ``gc.freeze`` (``_release_memory``), so the
    collection at each pattern change walks only the objects made since, not torch's and numba's."""
    import gc

    from sparserl_compile import sandbox

    gc.unfreeze()
    try:
        done = sandbox._warm_up(gpu=False)
        assert done["formats"] >= 0 and "jobs" not in done
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_a_results_overhead_says_where_time_outside_its_job_went():
    """Each result carries the seconds around its job: "take" (waiting for a worker) and
    "outside" (the rest of the round trip) always, and "pattern" on the first job after the
    worker took in a new pattern; none of it is in ``wall_s`` or ``phases``."""
    other = matrices.stencil2d(12)
    with SandboxPool(1, timeout_s=60) as pool:
        first = pool.run(_job(FAULTS["compile_error"].source), M)
        again = pool.run(_job(FAULTS["compile_error"].source), M)
        moved = pool.run(_job(FAULTS["compile_error"].source), other)
    for r in (first, again, moved):
        assert r.overhead["take"] >= 0 and r.overhead["outside"] >= 0
        assert not set(r.overhead) & set(r.phases) and r.to_dict()["overhead"] == r.overhead
    assert first.overhead["pattern"] >= 0 and moved.overhead["pattern"] >= 0 and "pattern" not in again.overhead
