"""How the runtime serves products: ``RuntimeConfig`` and the counters behind ``stats()``.

The settings live here; ``plans.configure`` changes them (and clears the plan table, so every
structure is planned again under the new settings). The counters are plain ints bumped on
the hot path by ``plans`` and ``miss``; ``stats()`` copies them into a ``RuntimeStats``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

#: what a CUDA product whose structure is in neither the plan table nor the disk cache does
ON_MISS = {
    "search": "search now (provider, compile, sandboxed verify, time) and wait for the verdict",
    "reference": "run the reference and keep it (serving from a pre-generated cache, never a stall)",
    "background": "run the reference now, search in the background, switch when verified",
}


@dataclass(frozen=True)
class RuntimeConfig:
    """How misses are served. Change with ``sparserl_compile.configure(**fields)``.

    The active provider is not a field: ``configure(provider=...)`` sets it
    (``providers.set_provider``), and ``providers.get_provider().name`` tells which it is."""

    k: int = 0  # candidates asked from the provider per miss (0: the provider's own default)
    cache: bool = True  # read and write the on-disk kernel cache
    kernels: bool = True  # False: every product uses the reference (torch.sparse / cuSPARSE)
    on_miss: str = "search"  # a structure the disk cache cannot serve: see ON_MISS
    #: idle sandbox workers kept started beside the one that verifies (``SandboxPool.spare``): a
    #: candidate that fails replaces its worker, and without a spare the next job waits for that
    #: start, seconds on a GPU. Each spare is a process with its own CUDA context. None
    #: (default): what the active provider asks for (``Provider.sandbox_spare``)
    sandbox_spare: int | None = None

    def __post_init__(self) -> None:
        if self.on_miss not in ON_MISS:
            raise ValueError(f"RuntimeConfig.on_miss={self.on_miss!r}: use one of {sorted(ON_MISS)} "
                             f"({'; '.join(f'{k}: {v}' for k, v in ON_MISS.items())})")
        spare = self.sandbox_spare
        if spare is not None and (not isinstance(spare, int) or isinstance(spare, bool) or spare < 0):
            raise ValueError(f"RuntimeConfig.sandbox_spare={spare!r}: the number of idle sandbox "
                             "workers kept ready must be an int >= 0, or None for the provider's own")
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 0:
            raise ValueError(f"RuntimeConfig.k={self.k!r}: the number of candidates must be an int >= 0 "
                             "(0 = the provider's default)")
        for name in ("cache", "kernels"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"RuntimeConfig.{name} must be True or False, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class RuntimeStats:
    """Counters since the last ``reset_stats()``."""

    calls: int = 0  # products run
    hits: int = 0  # plan-table hits
    misses: int = 0  # plan-table misses (each builds a plan)
    kernel_calls: int = 0  # products run by a generated kernel
    reference_calls: int = 0  # products run by the reference
    fallbacks: int = 0  # kernel-path failures that fell back to the reference
    cache_hits: int = 0  # misses served by the disk cache
    searches: int = 0  # misses that asked the provider
    background: int = 0  # searches queued in the background (on_miss="background")


#: the current settings (replaced whole by ``plans.configure``)
current = RuntimeConfig()
#: the counters, bumped in place on the hot path
counts: dict[str, int] = {f.name: 0 for f in fields(RuntimeStats)}


def get_config() -> RuntimeConfig:
    """The current settings."""
    return current


def stats() -> RuntimeStats:
    """A snapshot of the counters."""
    return RuntimeStats(**counts)


def reset_counts() -> None:
    for k in counts:
        counts[k] = 0
