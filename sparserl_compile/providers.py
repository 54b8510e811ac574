"""Where kernel candidates come from: the ``Problem`` a provider sees and the active provider.

On a miss in the runtime's plan table (and in the disk cache) the runtime describes the call
as a ``Problem`` -- op, dtype, dense width, the CSR pattern on the host, its fingerprint and
the GPU arch -- and asks the active ``Provider`` for up to ``k`` candidate kernels
(``contract.Candidate``). ``select.choose`` then compiles, verifies and times them against
the reference; the provider only proposes.

Providers, by name for ``set_provider``:

* ``"reference"`` (``ReferenceProvider``): proposes nothing, so every call uses the reference
  (torch.sparse / cuSPARSE).
* ``"search"``: ``sparserl_compile.search.SearchProvider``, the hand-written kernel families
  searched by heuristics: every point the structure rules keep is compiled, verified and timed.
* ``"nearest"``: ``sparserl_compile.nearest.NearestProvider``, the winners of the most alike
  matrices measured on the H200 (a few candidates instead of the whole space; the search's own
  order fills in where the table has nothing alike).
* ``"policy"``: the trained language model (the shipped checkpoint), run in a worker process of
  its own (``proposer.ProcessProvider``) so that neither its load nor its decoding holds the
  user's interpreter; while it loads, and should it fail, the lookup proposes
  (``DefaultProvider(POLICY_CHAIN)``). Needs the ``train`` extra.

Until one is set, the runtime asks a ``DefaultProvider`` (by name ``"default"``,
``DEFAULT_PROVIDER``) over ``DEFAULT_CHAIN``: the lookup, else the reference. The policy is not
the default because, measured end to end through the runtime at the same number of candidates,
it is level with the lookup while its first call on a new structure costs more
(docs/benchmarks.md); it becomes the default only once it beats the lookup there.

The last three are imported lazily on first use, so ``import sparserl_compile`` never imports
the policy (transformers) or the search. Every provider is a ``problem.Provider`` (the base
class declares what the runtime may ask of one); any object with a ``name`` and a
``candidates(problem, k)`` method may be set as well and gets the base class's defaults.

This module holds no kernels and does no compiling, verifying or caching.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
from pathlib import Path
from sparserl_compile import contract
from sparserl_compile.fileio import file_sha256
from sparserl_compile.problem import Problem, Provider
from sparserl_compile.proposer import ProviderClosed

#: provider name -> (module, class) imported on first use
_LAZY = {
    "search": ("sparserl_compile.search", "SearchProvider"),
    "nearest": ("sparserl_compile.nearest", "NearestProvider"),
}


class ReferenceProvider(Provider):
    """Proposes no kernels: every product runs on the reference (torch.sparse / cuSPARSE)."""

    name = "reference"

    def candidates(self, problem: Problem, k: int) -> list[contract.Candidate]:
        return []


_lock = threading.Lock()
#: the provider the runtime asks until one is set, by name: ``"default"``, a ``DefaultProvider``
#: over ``DEFAULT_CHAIN``
DEFAULT_PROVIDER = "default"
#: what the runtime's ``DefaultProvider`` tries, in order: the lookup of measured winners. The
#: policy is not the default: through the runtime at the same k it is level with the lookup
#: (docs/benchmarks.md, "The policy through the runtime") and its first call costs more
DEFAULT_CHAIN = ("nearest", "reference")
#: ``set_provider("policy")``: the policy, the lookup standing in while it loads and taking
#: over should it fail
POLICY_CHAIN = ("policy", "nearest", "reference")
#: the modules the policy needs beyond the base install (``pip install 'sparserl[train]'``)
POLICY_MODULES = ("transformers", "tokenizers", "safetensors", "llguidance")
_active: Provider | None = None
log = logging.getLogger("sparserl_compile.providers")


def _policy_dir() -> Path | None:
    """Where the ``sparserl_compile.policy`` package lives, found without importing it (its
    modules import transformers, which the user's process never needs: the policy runs in a
    worker process of its own)."""
    spec = importlib.util.find_spec("sparserl_compile.policy")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def default_checkpoint() -> Path | None:
    """The shipped policy checkpoint's folder (package data), None without the policy package."""
    d = _policy_dir()
    return None if d is None else d / "checkpoints" / "default"


def policy_available() -> str | None:
    """None when the default policy can be loaded here, else why not (a missing module of the
    ``train`` extra, or no shipped checkpoint). Looks, imports nothing heavy."""
    missing = [m for m in POLICY_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return (f"the policy needs {', '.join(missing)} (pip install 'sparserl[train]')")
    ckpt = default_checkpoint()
    if ckpt is None or not (ckpt / "model.safetensors").is_file():
        return f"no policy checkpoint at {ckpt}"
    return None


_shipped_hash: list[str | None] = []


def shipped_policy_hash() -> str | None:
    """The sha256 of the shipped default checkpoint's weights (package data, there with or
    without the ``train`` extra), None where it is absent. Read once per process."""
    if not _shipped_hash:
        ckpt = default_checkpoint()
        f = None if ckpt is None else ckpt / "model.safetensors"
        try:
            digest = file_sha256(f) if f is not None and f.is_file() else None
        except OSError:  # an unreadable file: no such entries
            digest = None
        _shipped_hash.append(digest)
    return _shipped_hash[0]


def policy_in_process_worker() -> Provider:
    """The shipped policy as the runtime asks it: a ``ProcessProvider`` (its model loads and
    decodes in a worker process, never on the user's interpreter). Keyed by the shipped
    weights' hash before it is built; one spare sandbox worker (its departures from the greedy
    kernel fail verification now and then)."""
    from sparserl_compile.proposer import ProcessProvider

    return ProcessProvider("sparserl_compile.policy.provider:PolicyProvider", name="policy",
                           checkpoint_hash=shipped_policy_hash(), sandbox_spare=1)


class DefaultProvider(Provider):
    """The runtime's provider until one is set: the first of ``DEFAULT_CHAIN`` that works.

    Which one heads the chain is decided when constructed, without loading anything
    (``policy_available``). The policy runs in a worker process (``proposer.ProcessProvider``),
    started by ``warm_up`` (which ``prewarm`` calls) or ``load_in_background`` (which the runtime
    calls once a process's first search has built its plan), so reading a pre-generated cache
    never starts it. Its ``checkpoint_hash`` (the cache key's policy hash) is the shipped
    weights' sha256, read from the file. Should the policy fail to load or to propose, it logs
    why, falls back to the next of the chain (``fallback_reason`` says why) and proposes from that.

    The runtime asks through ``propose``, which never waits for the model: until the policy is
    loaded and warmed up the next provider of the chain (the lookup) proposes. ``candidates``
    (pre-generation, the demo) waits for the model.
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
        self._ready = threading.Event()  # built and warmed up: proposals wait on nothing
        self._side = threading.Lock()  # the standby provider
        self._standby: Provider | None = None
        self._warm_lock = threading.Lock()
        self._loader: threading.Thread | None = None

    @property
    def name(self) -> str:
        """The name of the provider that proposes (or will): ``"policy"``, ``"nearest"``, ..."""
        return self._inner.name if self._inner is not None else self._chain[0]

    @property
    def checkpoint_hash(self) -> str | None:
        if self._inner is not None:
            return self._inner.checkpoint_hash
        return shipped_policy_hash() if self._chain[0] == "policy" else None

    @property
    def sandbox_spare(self) -> int:
        """The ready provider's wish (the policy: one spare, its departures fail now and then);
        none while the lookup stands in (its points are measured ones)."""
        return self._inner.sandbox_spare if self._inner is not None and self._ready.is_set() else 0

    def ready(self) -> bool:
        """Whether the provider is built and warmed up."""
        return self._ready.is_set()

    @property
    def loading(self) -> bool:
        """Whether a background load is running."""
        return self._loader is not None and self._loader.is_alive()

    def load(self) -> Provider:
        """The provider of the chain's head, built (for the policy: the worker's handle; the
        model loads on its first request)."""
        with self._lock:
            while self._inner is None:
                name = self._chain[0]
                try:
                    self._inner = self._build(name)
                except Exception as e:  # noqa: BLE001 - whatever failed, the next one serves
                    if len(self._chain) == 1:
                        raise
                    self.fallback_reason = f"{name}: {type(e).__name__}: {e}"
                    log.warning("sparserl: the default provider %r could not be loaded (%s); using %r",
                                name, e, self._chain[1])
                    self._chain = self._chain[1:]
            return self._inner

    @staticmethod
    def _build(name: str) -> Provider:
        return build_one(name)

    def _fall_back(self, failed: Provider, e: Exception) -> Provider:
        """Replace ``failed`` (the chain's head) by the next of the chain, once."""
        with self._lock:
            if self._inner is failed and len(self._chain) > 1:
                self.fallback_reason = f"{self._chain[0]}: {type(e).__name__}: {e}"
                closed = isinstance(e, ProviderClosed)  # stopped on purpose (at exit): no failure
                (log.debug if closed else log.warning)("sparserl: the default provider %r failed (%s); using %r",
                                                       self._chain[0], e, self._chain[1])
                close = getattr(failed, "close", None)
                if callable(close):
                    close()
                self._chain = self._chain[1:]
                self._inner = self._build(self._chain[0])
            elif self._inner is failed:
                raise e
            return self._inner

    def warm_up(self) -> None:
        """Build the provider and pay its one-time costs (the policy: its worker's start, the
        model's load, its first decodings); ``ready()`` once done. On failure, the next of the
        chain is built and warmed up instead."""
        with self._warm_lock:
            if self._ready.is_set():
                return
            while True:
                p = self.load()
                try:
                    p.warm_up()
                    break
                except Exception as e:  # noqa: BLE001 - the next of the chain serves
                    self._fall_back(p, e)
            self._ready.set()

    def candidates(self, problem: Problem, k: int) -> list[contract.Candidate]:
        self.warm_up()
        p = self.load()
        try:
            return p.candidates(problem, k)
        except Exception as e:  # noqa: BLE001 - the next of the chain serves
            return self._fall_back(p, e).candidates(problem, k)

    def propose(self, problem: Problem, k: int) -> tuple[list[contract.Candidate], str]:
        """``(candidates, name of the provider that proposed them)`` without waiting for the
        policy's model: when the chain starts with the policy and it is not ``ready()``, the next
        provider of the chain (the lookup) proposes. The runtime starts the model's load once its
        first search has built its plan (``load_in_background``). Otherwise the provider
        proposes (the lookup and the reference build in milliseconds)."""
        if not self._ready.is_set() and self._chain[0] == "policy" and len(self._chain) > 1:
            with self._side:
                if self._standby is None:  # the rest of the chain, with its own fallback
                    self._standby = DefaultProvider(self._chain[1:])
                    self._standby.warm_up()
            return self._standby.candidates(problem, k), self._standby.name
        self.warm_up()  # a quick provider (the lookup, the reference) builds in line
        p = self.load()
        try:
            return p.candidates(problem, k), p.name
        except Exception as e:  # noqa: BLE001 - the next of the chain serves
            q = self._fall_back(p, e)
            return q.candidates(problem, k), q.name

    def load_in_background(self) -> None:
        """Start ``warm_up`` on a background thread, once, unless the provider is ready (what the
        runtime calls after a search's plan: later searches get the policy once it is ready).
        The thread only waits: the policy loads in its worker process."""
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
        except Exception as e:  # noqa: BLE001 - the next proposal reports it
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
        if name == "policy":  # in a worker process: its model never holds the user's interpreter
            why = policy_available()
            if why is not None:
                raise ImportError(f"provider 'policy' cannot run here: {why}; or use set_provider('nearest')")
            return DefaultProvider(POLICY_CHAIN)
        if name not in _LAZY:
            raise ValueError(
                f"unknown provider {name!r}; use one of {('default', 'reference', 'policy', *_LAZY)} or pass an object "
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
    if isinstance(obj_or_name, Provider):
        return obj_or_name
    if not isinstance(getattr(obj_or_name, "name", None), str) or not callable(getattr(obj_or_name, "candidates", None)):
        raise TypeError(
            f"{type(obj_or_name).__name__} is not a provider: it needs a 'name' attribute and a "
            "'candidates(problem, k)' method returning a list of contract.Candidate"
        )
    return _Adapted(obj_or_name)


def build_one(name: str) -> Provider:
    """One provider of a ``DefaultProvider``'s chain, built: the policy as its worker process's
    handle (``policy_in_process_worker``), the others by name."""
    if name == "policy":
        return policy_in_process_worker()
    p = resolve(name)
    return p if isinstance(p, Provider) else _Adapted(p)


class _Adapted(Provider):
    """A foreign provider object (a ``name`` and ``candidates``) with the ``Provider``
    defaults for whatever else it does not define."""

    def __init__(self, obj):
        self.inner = obj
        self.name = obj.name

    def candidates(self, problem, k):
        return self.inner.candidates(problem, k)

    @property
    def checkpoint_hash(self):
        return getattr(self.inner, "checkpoint_hash", None)

    @property
    def sandbox_spare(self):
        return getattr(self.inner, "sandbox_spare", 0)

    def warm_up(self) -> None:
        warm = getattr(self.inner, "warm_up", None)
        if callable(warm):
            warm()


def policy_hash(provider: Provider) -> str:
    """The cache key's ``policy_hash`` for entries ``provider`` proposes: its checkpoint's
    sha256 (the policy), or ``"none"`` (search, nearest: the hand-written families only)."""
    return str(provider.checkpoint_hash or "none")


def set_provider(obj_or_name: "Provider | str") -> Provider:
    """Make ``obj_or_name`` the active provider and return it.

    Plans already in the runtime's table stay; ``plans.configure(provider=...)`` also clears
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
