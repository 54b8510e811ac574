"""How the runtime serves products: ``RuntimeConfig`` and the counters behind ``stats()``.

The settings live here; ``plans.configure`` changes them (and clears the plan table, so every
structure is planned again under the new settings). A few have an environment variable that
sets their default when the package is imported (``SPARSERL_DENSE_MIN_DENSITY``,
``SPARSERL_DENSE_MAX_BYTES``): for processes that cannot call ``configure`` first, such as
``sparserl pregen``. The counters are plain ints bumped on the hot path by ``plans`` and
``miss``; ``stats()`` copies them into a ``RuntimeStats``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

#: what a CUDA product whose structure is in neither the plan table nor the disk cache does
ON_MISS = {
    "search": "search now (provider, compile, sandboxed verify, time) and wait for the verdict",
    "reference": "run the reference and keep it (serving from a pre-generated cache, never a stall)",
    "background": "run the reference now, search in the background, switch when verified",
}


def _env_number(name: str, default, kind):
    """The default of a setting from the environment variable ``name`` (``kind``: int or float),
    or ``default`` where it is unset or empty; a value that is not a number is an error naming it."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)  # "1e9" bytes reads as well as "1000000000"
        if kind is int and not value.is_integer():
            raise ValueError
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}; "
                         f"unset it for the default ({default})") from None
    return kind(value)


#: the dense product is a selection candidate only where at least this fraction of the matrix is stored
DENSE_MIN_DENSITY = 0.01
#: ... and where the matrix stored dense in its value dtype takes at most this many bytes
DENSE_MAX_BYTES = 1 << 30


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
    #: the dense product (the matrix stored dense in its value dtype, ``torch.mm``/``torch.mv``)
    #: is timed beside the reference and the candidates, and kept where it is faster, only for
    #: matrices at least this dense (``select.dense_unsuitable``). Default ``DENSE_MIN_DENSITY``,
    #: or ``$SPARSERL_DENSE_MIN_DENSITY``
    dense_min_density: float = field(
        default_factory=lambda: _env_number("SPARSERL_DENSE_MIN_DENSITY", DENSE_MIN_DENSITY, float))
    #: ... and whose dense copy takes at most this many bytes of device memory (0: never dense).
    #: Default ``DENSE_MAX_BYTES`` (1 GiB), or ``$SPARSERL_DENSE_MAX_BYTES``
    dense_max_bytes: int = field(default_factory=lambda: _env_number("SPARSERL_DENSE_MAX_BYTES", DENSE_MAX_BYTES, int))

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
        d = self.dense_min_density
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0:
            raise ValueError(f"RuntimeConfig.dense_min_density={d!r}: the least stored fraction of a matrix "
                             "for which the dense product is a candidate must be a number in [0, 1]")
        b = self.dense_max_bytes
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            raise ValueError(f"RuntimeConfig.dense_max_bytes={b!r}: the largest dense copy of a matrix the "
                             "runtime may keep must be an int >= 0 (bytes; 0: never the dense product)")
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
    dense_calls: int = 0  # products run by the dense matmul (where the dense product won the selection)
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
