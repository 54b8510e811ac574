"""What a cached kernel is keyed by: ``CacheKey``, the dense width bucket, the GPU ``Target``.

A ``CacheKey`` holds everything that changes which kernel is right (and valid) for one call:
the structure fingerprint, op, value dtype, dense width bucket, GPU arch and name, driver and
NVRTC versions, package and kernel-space versions and the policy checkpoint hash. Its
``digest`` (sha256 of its canonical JSON) names the entry file. ``cache.py`` re-exports all
of this; it is here so that the store and its trust rules read on their own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def package_version() -> str:
    """The package version in every key (``version.version()``)."""
    from sparserl_compile.version import version

    return version()


def width_bucket(n: int) -> int:
    """The dense width bucket of a call: 1 for SpMV (n <= 1), else the next power of two >= n.

    Kernels tuned for width 33..64 share a key; the kernel itself takes the exact ``n``.
    """
    n = int(n)
    if n < 0:
        raise ValueError(f"dense width n={n} must be >= 0")
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class CacheKey:
    """Everything that changes which kernel is right (and valid) for one call."""

    fingerprint: str  # structure.fingerprint of the pattern
    op: str  # "spmv" | "spmm"
    dtype: str  # contract value dtype: "f32" | "f16" | "bf16" (indices are always i32)
    width: int  # width_bucket(n): 1 for spmv
    arch: str  # e.g. "sm_90"
    gpu_name: str  # e.g. "NVIDIA H200"
    driver_version: str  # CUDA driver version, e.g. "13000"
    nvrtc_version: str  # e.g. "13.0"
    package_version: str = field(default_factory=package_version)
    kernel_space_version: str = "1"  # bump when families or the contract change
    policy_hash: str = "none"  # sha256 of the policy checkpoint, "none" = families only

    def digest(self) -> str:
        """64 hex chars: sha256 of the key's canonical JSON; names the entry file."""
        return hashlib.sha256(_canonical(dataclasses.asdict(self))).hexdigest()

    @classmethod
    def from_dict(cls, d: dict) -> "CacheKey":
        names = {f.name for f in dataclasses.fields(cls)}
        if set(d) != names:
            raise ValueError(f"cache key fields {sorted(d)} differ from {sorted(names)}")
        return cls(**d)


def _json_default(o):
    """numpy scalars and arrays (common in timing and verification records) as plain JSON."""
    if hasattr(o, "tolist") and type(o).__module__ == "numpy":
        return o.tolist()
    raise TypeError(f"cache entries hold JSON only; cannot store {type(o).__name__} {o!r}")


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      default=_json_default).encode("ascii")


@dataclass(frozen=True)
class Target:
    """The GPU a kernel is generated for: the machine-dependent fields of the cache key."""

    arch: str  # "sm_90"
    gpu_name: str  # "NVIDIA H200"
    driver_version: str  # cuDriverGetVersion, e.g. "13000"
    nvrtc_version: str  # "13.0"


def local_target(device: "torch.device | None" = None) -> Target:
    """The ``Target`` of this machine's current (or given) CUDA device."""
    import torch

    from sparserl_compile.problem import device_arch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here: name the target GPU (sparserl pregen --target-gpu ...)")
    device = device or torch.device("cuda", torch.cuda.current_device())
    driver = "unknown"
    try:
        from cuda.bindings import driver as drv

        _, v = drv.cuDriverGetVersion()
        driver = str(v)
    except Exception:
        pass
    try:
        from sparserl_compile.compiler import nvrtc_version

        nv = ".".join(str(p) for p in nvrtc_version())
    except Exception:
        nv = "unknown"
    return Target(device_arch(device), torch.cuda.get_device_name(device), driver, nv)


def cache_key(problem, target: Target, policy_hash: str = "none") -> CacheKey:
    """The key of ``problem`` (a ``problem.Problem``) on ``target`` for kernels proposed under a
    policy checkpoint of ``policy_hash`` (``"none"``: the hand-written families only)."""
    from sparserl_compile.kernels import KERNEL_SPACE_VERSION

    return CacheKey(
        fingerprint=problem.fingerprint, op=problem.op, dtype=problem.dtype,
        width=width_bucket(problem.n), arch=target.arch, gpu_name=target.gpu_name,
        driver_version=target.driver_version, nvrtc_version=target.nvrtc_version,
        kernel_space_version=KERNEL_SPACE_VERSION, policy_hash=policy_hash,
    )
