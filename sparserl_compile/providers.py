"""Where kernel candidates come from: the ``Problem`` a provider sees and the active provider.

On a miss in the runtime's plan table (and in the disk cache) the runtime describes the call
as a ``Problem`` -- op, dtype, dense width, the CSR pattern on the host, its fingerprint and
the GPU arch -- and asks the active ``Provider`` for up to ``k`` candidate kernels
(``contract.Candidate``). ``select.choose`` then compiles, verifies and times them against
the reference; the provider only proposes.

Providers, by name for ``set_provider``:

* ``"reference"`` (``ReferenceProvider``): proposes nothing, so every call uses the reference
  (torch.sparse / cuSPARSE). What a machine without the search installed gets.
* ``"search"``: ``sparserl_compile.search.SearchProvider``, the hand-written kernel families
  searched by heuristics: every pruned point (27-60) is compiled, verified and timed.
* ``"policy"``: ``policy.provider.PolicyProvider``, the trained language model (the shipped
  checkpoint, version 5: its greedy kernel and three most likely departures).
* ``"nearest"``: ``sparserl_compile.nearest.NearestProvider``, the winners of the most alike
  matrices measured on the H200 (a few candidates instead of the whole space; the search's own
  order fills in where the table has nothing alike).

Until one is set, the runtime asks a ``DefaultProvider`` (by name ``"default"``,
``DEFAULT_PROVIDER``): the policy where the ``train`` extra (transformers, tokenizers,
safetensors, llguidance) and the shipped checkpoint are installed, else the nearest-neighbour
proposals, else the reference.
It loads the model only when first asked for candidates (or by ``runtime.prewarm``), so a
process served from a pre-generated cache never loads it, and the runtime never waits for it:
until the model is loaded and warmed up (on a background thread, started once the process's
first search has built its plan) the lookup proposes (``DefaultProvider.propose``). Measured end to end on
held-out matrices (docs/benchmarks.md): the policy's kernels reach 0.99 of the whole space's
best and its first product on a new structure of <= 10^6 nonzeros takes a median 0.4-0.5 s
(the lookup's 0.2 s), never a wrong result.

The last three are imported lazily on first use, so ``import sparserl_compile`` never imports
the policy (transformers) or the search. Any object with a ``name`` and a
``candidates(problem, k)`` method may be set as well.

This module holds no kernels and does no compiling, verifying or caching.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from sparserl_compile import contract
from sparserl_compile.problem import Problem

#: provider name -> (module, class) imported on first use
_LAZY = {
    "search": ("sparserl_compile.search", "SearchProvider"),
    "policy": ("sparserl_compile.policy.provider", "PolicyProvider"),
    "nearest": ("sparserl_compile.nearest", "NearestProvider"),
}


@runtime_checkable
class Provider(Protocol):
    """Proposes candidate kernels for a problem; an empty list means "use the reference"."""

    name: str

    def candidates(self, problem: Problem, k: int) -> list[contract.Candidate]: ...


class ReferenceProvider:
    """Proposes no kernels: every product runs on the reference (torch.sparse / cuSPARSE)."""

    name = "reference"

    def candidates(self, problem: Problem, k: int) -> list[contract.Candidate]:
        return []


_lock = threading.Lock()
#: the provider the runtime asks until one is set, by name: ``"default"``, a ``DefaultProvider``
#: (the trained policy, falling back to the nearest-neighbour proposals and then to the
#: reference where it cannot load)
DEFAULT_PROVIDER = "default"
#: what ``DefaultProvider`` tries, in order
DEFAULT_CHAIN = ("policy", "nearest", "reference")
#: the modules the policy needs beyond the base install (``pip install 'sparserl[train]'``)
POLICY_MODULES = ("transformers", "tokenizers", "safetensors", "llguidance")
_active: Provider | None = None
log = logging.getLogger("sparserl_compile.providers")


def policy_available() -> str | None:
    """None when the default policy can be loaded here, else why not (a missing module of the
    ``train`` extra, or no shipped checkpoint). Looks, imports nothing heavy."""
    missing = [m for m in POLICY_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return (f"the policy needs {', '.join(missing)} (pip install 'sparserl[train]')")
    from sparserl_compile.policy.provider import DEFAULT_CHECKPOINT

    if not (DEFAULT_CHECKPOINT / "model.safetensors").is_file():
        return f"no policy checkpoint at {DEFAULT_CHECKPOINT}"
    return None


_shipped_hash: list[str | None] = []


def shipped_policy_hash() -> str | None:
    """The sha256 of the shipped default checkpoint's weights (``policy/checkpoints/default``;
    package data, there with or without the ``train`` extra), None where it is absent. Read
    once per process (a 16 MiB file: ~15 ms)."""
    if not _shipped_hash:
        try:
            from sparserl_compile.policy.provider import DEFAULT_CHECKPOINT, weights_sha256

            f = DEFAULT_CHECKPOINT / "model.safetensors"
            digest = weights_sha256(f) if f.is_file() else None
        except (ImportError, OSError):  # no policy package or an unreadable file: no such entries
            digest = None
        _shipped_hash.append(digest)
    return _shipped_hash[0]


class DefaultProvider:
    """The runtime's provider until one is set: the first of ``DEFAULT_CHAIN`` that loads.

    Which one is decided when constructed, without loading anything (``policy_available``);
    the policy's model is loaded on the first ``candidates`` call, ``load()`` or ``warm_up()``
    (which ``runtime.prewarm`` calls), so reading a pre-generated cache never loads it. Its
    ``checkpoint_hash`` (the cache key's policy hash) is the shipped weights' sha256, read from
    the file. Should loading fail even so, it logs why, falls back to the next of the chain
    (``fallback_reason`` says why) and proposes from that one.

    The runtime asks through ``propose``, which never waits for the model: until the policy is
    loaded and warmed up the next provider of the chain (the lookup) proposes, and once its
    first search has built its plan the runtime starts the load on a background thread
    (``load_in_background``). ``candidates`` (pre-generation, the demo) waits for the model.
    """

    def __init__(self, chain: tuple[str, ...] = DEFAULT_CHAIN):
        self._lock = threading.Lock()
        self._inner: Provider | None = None
        self.fallback_reason: str | None = None
        chain = tuple(chain)
        if not chain:
            raise ValueError("DefaultProvider(chain=()): name at least one provider")
        if chain[0] == "policy":
            why = policy_available()
            if why is not None:
                self.fallback_reason = why
                chain = chain[1:]
        self._chain = chain
        self._ready = threading.Event()  # built (and warmed up, when asked): proposals wait on nothing
        self._side = threading.Lock()  # the background load and the standby provider
        self._loader: threading.Thread | None = None
        self._standby: Provider | None = None
        self._warm_lock = threading.Lock()
        self._warmed = False

    @property
    def name(self) -> str:
        """The name of the provider that proposes (or will): ``"policy"``, ``"nearest"``, ..."""
        return self._inner.name if self._inner is not None else self._chain[0]

    @property
    def checkpoint_hash(self) -> str | None:
        if self._inner is not None:
            return getattr(self._inner, "checkpoint_hash", None)
        return shipped_policy_hash() if self._chain[0] == "policy" else None

    @property
    def sandbox_spare(self) -> int:
        """The loaded provider's wish (``PolicyProvider.sandbox_spare``: one spare, its departures
        fail now and then); none before it is loaded, while the lookup proposes (its points are
        measured ones, and a fresh process's first search then starts one worker, not two)."""
        if self._inner is not None:
            return getattr(self._inner, "sandbox_spare", 0)
        return 0

    def ready(self) -> bool:
        """Whether the provider is built (and warmed up, when ``warm_up`` was called)."""
        return self._ready.is_set()

    @property
    def loading(self) -> bool:
        """Whether the background load (``load_in_background``) is still running."""
        return self._loader is not None and self._loader.is_alive()

    def load(self) -> Provider:
        """Build the provider (loading the policy's model); on any failure the next in the chain
        (a broken install must not cost every new structure a retry, nor any product its answer)."""
        p = self._load()
        self._ready.set()
        return p

    def _load(self) -> Provider:
        with self._lock:
            while self._inner is None:
                name = self._chain[0]
                try:
                    self._inner = resolve(name)
                except Exception as e:  # noqa: BLE001 - whatever failed, the next one serves
                    if len(self._chain) == 1:
                        raise
                    self.fallback_reason = f"{name}: {type(e).__name__}: {e}"
                    log.warning("sparserl: the default provider %r could not be loaded (%s); using %r",
                                name, e, self._chain[1])
                    self._chain = self._chain[1:]
            return self._inner

    def warm_up(self) -> None:
        """Build the provider, then its own ``warm_up`` where it has one (the policy: its first
        decoding costs); ``ready()`` once done. Once per provider: a second caller (``prewarm``
        beside ``load_in_background``) waits for the first. ``runtime.prewarm`` calls it."""
        with self._warm_lock:
            if self._warmed:
                return
            try:
                warm = getattr(self._load(), "warm_up", None)
                if callable(warm):
                    warm()
            finally:
                self._warmed = True
                self._ready.set()

    def candidates(self, problem: Problem, k: int) -> list[contract.Candidate]:
        return self.load().candidates(problem, k)

    def propose(self, problem: Problem, k: int) -> tuple[list[contract.Candidate], str]:
        """``(candidates, name of the provider that proposed them)`` without waiting for the
        policy's model: when the chain starts with the policy and it is not ``ready()``, the next
        provider of the chain (the lookup) proposes. The runtime starts the model's load once its
        first search has built its plan (``load_in_background``, ``runtime._load_provider_later``),
        so that search's sandbox worker start, timing and plan do not share the process and
        the GPU with it. Otherwise the provider
        proposes (the lookup and the reference build in milliseconds)."""
        if not self._ready.is_set() and self._chain[0] == "policy" and len(self._chain) > 1:
            with self._side:
                if self._standby is None:  # the rest of the chain, with its own fallback
                    self._standby = DefaultProvider(self._chain[1:]).load()
            return self._standby.candidates(problem, k), self._standby.name
        p = self.load()
        return p.candidates(problem, k), p.name

    def load_in_background(self) -> None:
        """Start ``warm_up`` on a background thread, once, unless the provider is ready (what the
        runtime calls after a search's plan: later searches get the policy once it is ready)."""
        if self._ready.is_set():
            return
        with self._side:
            if self._loader is None:
                self._loader = threading.Thread(target=self._warm_in_background, daemon=True,
                                                name="sparserl-policy-load")
                self._loader.start()

    def _warm_in_background(self) -> None:
        try:
            self.warm_up()
        except Exception as e:  # noqa: BLE001 - the next proposal loads in line and reports it
            log.warning("sparserl: loading the default provider in the background failed: %s", e)


def resolve(obj_or_name: "Provider | str") -> Provider:
    """A provider object from a name (``default``, ``reference``, ``search``, ``policy``,
    ``nearest``) or an object."""
    if isinstance(obj_or_name, str):
        name = obj_or_name
        if name == "reference":
            return ReferenceProvider()
        if name == "default":
            return DefaultProvider()
        if name not in _LAZY:
            raise ValueError(
                f"unknown provider {name!r}; use one of {('default', 'reference', *_LAZY)} or pass an object "
                "with .name and .candidates(problem, k)"
            )
        mod, cls = _LAZY[name]
        try:
            factory = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError) as e:
            raise ImportError(
                f"provider {name!r} needs {mod}.{cls}, which could not be imported ({e}); "
                "install the missing part (e.g. pip install 'sparserl[train]' for the policy) "
                "or use set_provider('reference')"
            ) from e
        return factory()
    if not isinstance(obj_or_name, Provider):
        raise TypeError(
            f"{type(obj_or_name).__name__} is not a provider: it needs a 'name' attribute and a "
            "'candidates(problem, k)' method returning a list of contract.Candidate"
        )
    return obj_or_name


def set_provider(obj_or_name: "Provider | str") -> Provider:
    """Make ``obj_or_name`` the active provider and return it.

    Plans already in the runtime's table stay; ``runtime.configure(provider=...)`` also clears
    them so the next call of every structure asks the new provider.
    """
    global _active
    p = resolve(obj_or_name)
    with _lock:
        _active = p
    return p


def get_provider() -> Provider:
    """The active provider (a ``DefaultProvider`` until one is set)."""
    global _active
    if _active is None:
        with _lock:
            if _active is None:
                _active = DefaultProvider()
    return _active
