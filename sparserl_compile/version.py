"""Which sparserl, on which machine: the package version and the stamp of a result file.

``version()`` is part of every disk-cache key (``cache.CacheKey.package_version``), so a
checkout run without installing it still says which version it is, not "unknown".
``run_stamp()`` and ``versions()`` record where and with what a measurement ran.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def version() -> str:
    """``sparserl``'s version, e.g. ``"0.2.0"``."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    if pyproject.is_file():  # a checkout (installed editable or not): its own pyproject is the truth
        m = re.search(r'(?m)^version\s*=\s*"([^"]+)"', pyproject.read_text())
        if m:
            return m.group(1)
    try:
        from importlib.metadata import version as dist_version

        return dist_version("sparserl")
    except Exception:  # noqa: BLE001 - neither installed nor a checkout
        return "0+unknown"


def machine_info() -> dict:
    info: dict = {"host": os.uname().nodename}
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(gpu=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
                        sms=p.multi_processor_count, l2_bytes=getattr(p, "L2_cache_size", None),
                        memory_bytes=p.total_memory)
    except Exception as e:  # noqa: BLE001
        info["gpu_error"] = str(e)[:200]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            sm, sm_max, mem, drv = [s.strip() for s in out.stdout.splitlines()[0].split(",")]
            info.update(sm_clock=sm, sm_clock_max=sm_max, mem_clock=mem, driver=drv)
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return info


def run_stamp() -> dict:
    """Where and when a measurement ran, for a result file: ``machine_info()`` and the UTC start."""
    return {"machine": machine_info(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def versions() -> dict:
    import importlib.metadata as md

    v: dict = {}
    for dist in ("torch", "cuda-core", "cuda-bindings", "numpy", "scipy", "sparserl"):
        try:
            v[dist] = md.version(dist)
        except md.PackageNotFoundError:
            v[dist] = None
    try:
        import torch

        v["cuda"] = torch.version.cuda
    except ImportError:
        pass
    try:
        from sparserl_compile import compiler

        v["nvrtc"] = ".".join(map(str, compiler.nvrtc_version()))
    except Exception:  # noqa: BLE001
        v["nvrtc"] = None
    try:
        from sparserl_compile import kernels

        v["kernel_space"] = getattr(kernels, "KERNEL_SPACE_VERSION", None)
    except Exception:  # noqa: BLE001
        v["kernel_space"] = None
    return v


# ------------------------------------------------------------------ one matrix
