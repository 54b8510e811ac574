"""``sparserl cache merge SRC... --into DST``: one kernel cache from the caches of several ranks.

Sharded pre-generation (``sparserl pregen --rank R --world-size W``) or several build
machines leave one cache folder each; this copies their entries into one folder, entry by
entry (the file name is the key's digest, so entries of different keys never collide):

* every source entry is read and checked by ``KernelCache`` itself, exactly as the runtime
  would before serving it (``ls``: the folder's owner and modes, no symlink, the entry's HMAC
  under the source folder's own key, its sha256, and that its digest names its key); an entry
  that fails is skipped with a message and never copied -- the runtime would regenerate that
  kernel;
* what is copied is written with ``KernelCache.put`` into the destination, and so signed
  with the destination's key (temp file, fsync, atomic rename): a copied folder's entries
  (another machine's ``pregen --out``, copied whole with its ``.key``) become this folder's;
* a key the destination already holds: identical entries are left alone; different ones keep
  the existing entry, unless ``prefer_faster`` and both entries carry a time, in which case
  the faster one stays (``entry_time_us``: a kernel entry's ``kernel_us``; an entry where the
  reference won, its ``reference_us``; where the dense product won, its ``dense_us``).
  Untimed entries (built by a CPU-only machine) never replace anything.

Sources are processed in the order given, so among sources, the first one's entry wins a
conflict (without ``prefer_faster``). A source folder is only read, never created or
repaired (run ``sparserl cache verify --dir SRC`` for that). A source the cache would refuse
to read (owned by another user, writable by group or others, a symlink) is refused here too,
with the reason: its entries cannot be authenticated, and naming it does not make them so.
The destination must pass the same rules and be writable. Safe to run while the runtime
reads the destination.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

from sparserl_compile.cache import CacheEntry, CacheWarning, KernelCache

OUTCOMES = ("copied", "identical", "kept", "replaced", "corrupt", "failed")


@dataclass(frozen=True)
class MergeAction:
    """What happened to one source entry."""

    digest: str
    source: str  # the source folder
    outcome: str  # one of OUTCOMES
    detail: str = ""


@dataclass(frozen=True)
class MergeReport:
    into: str
    actions: tuple[MergeAction, ...]
    warnings: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()  # "SRC: why" of source folders not read at all

    def count(self, outcome: str) -> int:
        return sum(a.outcome == outcome for a in self.actions)

    def summary(self) -> str:
        return ", ".join(f"{o} {self.count(o)}" for o in OUTCOMES)


def entry_time_us(entry: CacheEntry) -> float | None:
    """The time a call takes with this entry: the time of what its outcome keeps (the kernel,
    the reference or the dense product)."""
    v = entry.times.get({"kernel": "kernel_us", "reference": "reference_us", "dense": "dense_us"}[entry.outcome])
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        return None
    return float(v)


def merge_caches(sources, into, *, prefer_faster: bool = False) -> MergeReport:
    """Merge the cache folders ``sources`` into the folder ``into`` (created 0700 if absent)."""
    into = Path(into)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        dst = KernelCache(into)
    if not dst.on_disk:
        raise ValueError(f"cannot merge into {into}: {dst.disabled_reason or dst.read_only_reason}")
    actions: list[MergeAction] = []
    notes: list[str] = []
    refused: list[str] = []
    for src in map(Path, sources):
        if not src.is_dir():
            raise ValueError(f"source cache {src} is not a folder; pass the --out folder of a pregen run")
        if src.resolve() == into.resolve():
            notes.append(f"{src}: is the destination itself, skipped")
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheWarning)
            store = KernelCache(src, create=False)
        if not store.readable:
            refused.append(f"{src}: {store.disabled_reason}")
            continue
        for x in store.ls():
            actions.append(_merge_one(dst, str(src), x.digest, x.entry, x.problem, prefer_faster))
    return MergeReport(str(into), tuple(actions), tuple(notes), tuple(refused))


def _merge_one(dst: KernelCache, src: str, digest: str, entry: CacheEntry | None, problem: str,
               prefer_faster: bool) -> MergeAction:
    if entry is None:
        return MergeAction(digest, src, "corrupt", problem)
    have = dst.get(entry.key)  # hash-checked; a corrupt destination file reads as a miss
    if have is None:
        ok = dst.put(entry)
        return MergeAction(digest, src, "copied" if ok else "failed", "" if ok else "write failed")
    if have == entry:
        return MergeAction(digest, src, "identical")
    t_new, t_old = entry_time_us(entry), entry_time_us(have)
    if prefer_faster and t_new is not None and t_old is not None and t_new < t_old:
        ok = dst.put(entry)
        return MergeAction(digest, src, "replaced" if ok else "failed",
                           f"{t_new:.2f} us < {t_old:.2f} us" if ok else "write failed")
    if not prefer_faster:
        why = "existing entry kept (--prefer-faster compares times)"
    elif t_new is None or t_old is None:
        why = "existing entry kept: " + ("untimed source entry" if t_new is None else "untimed existing entry")
    else:
        why = f"existing entry kept: {t_old:.2f} us <= {t_new:.2f} us"
    return MergeAction(digest, src, "kept", why)


# -------------------------------------------------------------------- CLI
