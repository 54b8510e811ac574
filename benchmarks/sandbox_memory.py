"""What one sandbox worker holds while it waits: the price of ``configure(sandbox_spare=N)``.

Each sandbox worker is its own interpreter with torch, the format converters and, on a GPU,
its own CUDA context, kept for the process's life (one for verification, plus the spares the
active provider asks for: one for the policy). This script starts a ``SandboxPool`` with
``--workers`` idle workers (warmed as the runtime warms them) and reports, per worker:

* ``device_mib_per_worker``: the GPU memory in use on the device (``torch.cuda.mem_get_info``,
  every process's) after the workers started, less before, divided by their number (None on
  a CPU);
* ``rss_mib``: each worker's resident host memory (``/proc/PID/status``, ``VmRSS``), and
  ``rss_mib_mean``.

    python benchmarks/sandbox_memory.py [--workers 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from sparserl_compile.fileio import write_json
from sparserl_compile.sandbox import SandboxPool

MIB = 2**20


def device_used() -> int | None:
    """Bytes in use on the current CUDA device, by every process; None without a GPU."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


def rss_mib(pid: int) -> float | None:
    """A process's resident memory in MiB (Linux ``/proc``), None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def measure(workers: int = 3, settle_s: float = 2.0) -> dict:
    """Start ``workers`` idle workers, wait until they are up, and measure what they hold."""
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # the parent's own context is not charged to the workers
    before = device_used()
    with SandboxPool(1, spare=workers - 1) as pool:
        pool.start(wait=True)
        deadline = time.monotonic() + 300
        while len(pool._free) < workers and time.monotonic() < deadline:  # the spares come up in the background
            time.sleep(0.2)
        time.sleep(settle_s)  # the warm-ups' allocations
        after = device_used()
        procs = [w.proc.pid for w in pool._free]
        rss = [rss_mib(pid) for pid in procs]
    n, read = len(procs), [r for r in rss if r is not None]
    per_device = ((after - before) / n / MIB) if (n and before is not None and after is not None) else None
    return {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "workers": n, "device_mib_per_worker": per_device, "rss_mib": rss,
            "rss_mib_mean": sum(read) / len(read) if read else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=3, help="idle workers to start (>= 1)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error("--workers must be at least 1")
    out = measure(args.workers)
    dev = out["device_mib_per_worker"]
    print(f"[sandbox_memory] {out['workers']} workers on {out['device']}: "
          f"{'%.0f MiB of GPU memory' % dev if dev is not None else 'no GPU'} and "
          f"{out['rss_mib_mean'] or 0:.0f} MiB resident host memory each", flush=True)
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
