"""benchmarks/device_train.sh with SEEDS: which checkpoints come back under $OUT, and when.

The training commands are replaced by a stand-in ``python3`` on PATH that makes each stage's
folder at once (or hangs for one seed, as a run cut by the device call's limit), so these tests
check the script's bookkeeping, not training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STUB = """#!/usr/bin/env bash
# stands in for python3: `-m sparserl_compile.commands.cli train STAGE ... --out-dir D|--out D --seed S --init I`
# makes D at once (hangs where S is $HANG_SEED), with I's weights, where there, copied to D/init_weights;
# `-m pip` does nothing; the rest is Python
if [ "$1 $2 $3" = "-m sparserl_compile.commands.cli train" ]; then
  stage=$4; shift 4; out=""; seed=""; init=""
  while [ $# -gt 0 ]; do case "$1" in --out-dir|--out) out="$2"; shift;; --seed) seed="$2"; shift;;
    --init) init="$2"; shift;; esac; shift; done
  [ "$stage" = rl ] && [ -n "$seed" ] && [ "$seed" = "${HANG_SEED:-}" ] && exec sleep 600
  mkdir -p "$out"; echo "$stage $seed" > "$out/model.safetensors"
  [ -f "$init/model.safetensors" ] && cat "$init/model.safetensors" > "$out/init_weights"
  # weights of STUB_MB MiB that do not compress, as real ones nearly do not, and AdamW's state
  [ -n "${STUB_MB:-}" ] && head -c $((STUB_MB * 1048576)) /dev/urandom > "$out/model.safetensors"
  [ -n "${STUB_MB:-}" ] && head -c $((2 * STUB_MB * 1048576)) /dev/zero > "$out/optimizer.safetensors"; exit 0
fi
[ "$1 $2" = "-m pip" ] && exit 0
exec "%s" "$@"
"""


def _run(tmp_path, *, seeds="1 2 3", keep=None, hang=None, ngpu=1, cut_after_s=None, stub_mb=None, rl_init=None,
         out_name="out"):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "python3"
    stub.write_text(STUB % sys.executable)
    stub.chmod(0o755)
    out, runs = tmp_path / out_name, tmp_path / "runs"  # a later call on the same machine: same RUNS, an empty OUT
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(out), "RUNS": str(runs),
           "PT_S": "0", "SFT_S": "0", "RL_INIT": str(rl_init or tmp_path / "sft"), "RL_S": "1", "SEEDS": seeds,
           "NGPU": str(ngpu), "HANG_SEED": hang or "", "DATA": "unused.jsonl", "STUB_MB": str(stub_mb or "")}
    if keep is not None:
        env["KEEP_MEMBERS"] = str(keep)
    proc = subprocess.Popen(["bash", "benchmarks/device_train.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=cut_after_s or 120)
    except subprocess.TimeoutExpired:  # the device call's limit: the whole call is killed
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
    return sorted(p.name for p in out.iterdir()), log


def _seed_of(tgz: Path) -> str:
    with tarfile.open(tgz) as t:
        return t.extractfile("./model.safetensors").read().decode().split()[1]


def test_a_call_cut_during_the_last_seed_keeps_the_seeds_that_finished(tmp_path):
    t0 = time.monotonic()
    names, log = _run(tmp_path, hang="3", cut_after_s=20)
    assert time.monotonic() - t0 < 60
    assert names == ["ckpt_rl_s1.tgz", "ckpt_rl_s2.tgz", "logs.tgz"], log
    assert _seed_of(tmp_path / "out" / "ckpt_rl_s2.tgz") == "2"


def test_finished_seeds_return_the_soup_and_at_most_keep_members_runs(tmp_path):
    names, log = _run(tmp_path, keep=2)
    assert names == ["ckpt_rl_s1.tgz", "ckpt_rl_s2.tgz", "ckpt_rl_soup.tgz", "logs.tgz"], log


@pytest.mark.parametrize("ngpu", [1, 2])
def test_the_runs_never_crowd_out_the_soup(tmp_path, ngpu):
    """At most 8 files come back: seven seeds leave room for the soup and the logs, not for
    every run (one at a time on one GPU, or at once on two)."""
    names, log = _run(tmp_path, seeds="1 2 3 4 5 6 7", keep=7, ngpu=ngpu)
    assert len(names) == 8 and "ckpt_rl_soup.tgz" in names and "logs.tgz" in names, log
    assert names[:6] == [f"ckpt_rl_s{s}.tgz" for s in range(1, 7)]


def test_the_runs_never_take_the_64_mib_a_call_returns(tmp_path):
    """Checkpoints of ~15 MiB: the soup and three runs fit in 64 MiB, a fourth run would not."""
    names, log = _run(tmp_path, seeds="1 2 3 4 5", keep=7, stub_mb=15)
    assert names == ["ckpt_rl_s1.tgz", "ckpt_rl_s2.tgz", "ckpt_rl_s3.tgz", "ckpt_rl_soup.tgz", "logs.tgz"], log
    assert sum(p.stat().st_size for p in (tmp_path / "out").iterdir()) <= 64 * 2**20


def test_a_packed_start_checkpoint_is_unpacked_once_and_trained_from(tmp_path):
    """RL_INIT may name a .tgz (python benchmarks/device_carry.py --pack): every seed starts from
    its weights, unpacked into RUNS."""
    src = tmp_path / "v1"
    src.mkdir()
    (src / "model.safetensors").write_text("version 1 weights")
    tgz = tmp_path / "v1.tgz"
    with tarfile.open(tgz, "w:gz") as t:
        t.add(src / "model.safetensors", arcname="model.safetensors")
    names, log = _run(tmp_path, seeds="1 2", rl_init=tgz)
    assert names == ["ckpt_rl_s1.tgz", "ckpt_rl_s2.tgz", "ckpt_rl_soup.tgz", "logs.tgz"], log
    for seed in "12":
        assert (tmp_path / "runs" / f"rl_s{seed}" / "init_weights").read_text() == "version 1 weights"
    assert (tmp_path / "runs" / "init_v1" / "model.safetensors").is_file()


def test_a_packed_start_that_is_not_there_stops_the_call(tmp_path):
    names, log = _run(tmp_path, seeds="1", rl_init=tmp_path / "absent.tgz")
    assert "cannot unpack" in log and "ckpt_rl_s1.tgz" not in names, log


def test_a_finished_run_left_behind_comes_back_in_the_next_call(tmp_path):
    """The first call finishes four runs but the 64 MiB return only fits three and the soup; the
    next call on the same machine (same RUNS) trains nothing again and returns the fourth."""
    names, log = _run(tmp_path, seeds="1 2 3 4", keep=7, stub_mb=15)
    assert names == ["ckpt_rl_s1.tgz", "ckpt_rl_s2.tgz", "ckpt_rl_s3.tgz", "ckpt_rl_soup.tgz", "logs.tgz"], log
    names, log = _run(tmp_path, seeds="1 2 3 4", keep=7, stub_mb=15, out_name="out2")
    assert names == ["ckpt_rl_s4.tgz", "ckpt_rl_soup.tgz", "logs.tgz"], log
    assert log.count("finished in an earlier call") == 4
    names, log = _run(tmp_path, seeds="1 2 3 4", keep=7, stub_mb=15, out_name="out3")
    assert names == ["ckpt_rl_soup.tgz", "logs.tgz"], log
