"""The on-disk kernel cache: verified cubins (or the verdict "the reference wins") by key.

A ``CacheKey`` (``cache_keys.py``, re-exported here with ``Target``, ``cache_key``,
``local_target`` and ``width_bucket``) holds everything that changes which kernel is right for
a call: the structure fingerprint, op, value dtype, dense width bucket, GPU arch and name,
driver and NVRTC versions, package and kernel-space versions and the policy checkpoint hash. A
``CacheEntry`` is what a search found for that key, its ``outcome``: ``"kernel"``, the cubin
bytes with the source and launch header; ``"reference"``, no candidate beat the reference
(cached too, so the search is not repeated); ``"dense"``, the dense product beat both (no
cubin: the runtime keeps the matrix stored dense); plus measured times and the verification
record. Entries written before the dense outcome existed have no ``outcome`` field and read
as "kernel" or "reference" by their cubin.

Layout, one self-contained JSON file per entry (one file, so one atomic rename publishes it
and no half-written pair can exist), and the folder's key::

    <dir>/.key                           32 random bytes, mode 0600 (see "Trust" below)
    <dir>/<digest[:2]>/<digest>.json     {"format": 2, "key": {...}, "cubin_b64": ...,
                                          "outcome": ..., "source": ..., "header": ..., "times": {...},
                                          "verification": {...}, "created": ...,
                                          "sha256": ..., "hmac_sha256": ...}

``sha256`` covers the canonical JSON of every other field but the HMAC (sorted keys, no
spaces): integrity. ``hmac_sha256`` is an HMAC-SHA256 under the folder's key over the same
JSON with ``sha256``: authenticity. Reads check both, that the stored key equals the requested
one and that the file name is its digest; anything that does not parse, match, hash or
authenticate is a miss, logged (logger ``sparserl.cache``), the file removed where the folder
is writable -- never an exception. Writes go to a temp file created exclusively in the same
folder, are fsynced and renamed, so readers see the old entry or the new one and concurrent
writers of one key are safe (the last rename wins; both wrote valid entries). No pickle: JSON
and base64 only.

Trust: what authenticates an entry, against what
-------------------------------------------------
The runtime launches a cached cubin without verifying it again, so an entry must come from a
process that verified it. Every folder and file read is checked on its open descriptor
(``secure_dir``): owned by this user (effective uid) or root, not writable by group or others,
no symlink followed anywhere (the cache folder itself included), regular files with one link,
opened non-blocking (a FIFO cannot hang a reader). Then, by who owns the cache folder:

* **This user's folder** (the usual case, ``~/.cache/sparserl``, a ``pregen --out`` folder):
  an entry is served only if its HMAC verifies under ``<dir>/.key``, a 0600 file of this user
  created by the first write. Only a process that can read the key -- this user's -- can
  have written it, so an entry edited with a recomputed sha256, copied in from another folder,
  or planted while a mode was loose is a miss. A key file that others could have read, that
  another user owns or that is a symlink is replaced on the next write (its entries become
  misses); where the folder is read-only, no entry is served until the owner fixes it.
* **A folder owned by root, read by another user** (a pre-generated cache deployed into an
  image or a root-owned 0755 folder, read-only to the serving user): the reader cannot hold a
  secret the builder signed with -- a key file the reader can read is readable by every local
  user, so an HMAC under it would authenticate nothing. There the authority is the file
  system: only root can have written a folder, subfolder and file that root owns and nobody
  else can write, and the checks above establish exactly that on every read. Entries are
  checked for integrity (sha256, key, name), their HMAC is not. Root is trusted anyway: it can
  replace the package itself. Deploy with ``cp -r kernels /opt/kernels && chown -R root:
  /opt/kernels && chmod -R go-w /opt/kernels`` (the builder's ``.key`` may stay 0600 or go).
* **A folder owned by any other user** is refused: its owner could rewrite it at will. Copy
  the entries into a folder of your own with ``sparserl cache merge THEIRS --into MINE`` run by
  its owner, or have root own the folder.

If the folder cannot be created, or fails these rules, the cache warns once (``CacheWarning``)
and runs memory-only: an unusable cache must never stop a product from being computed. A
folder this user owns but may not write (a read-only mount) is read under its key; new entries
then stay in memory, with one warning. What this does not protect against: root, and other
processes of this same user (who can read the key and write the folder).

``KernelCache`` puts an in-memory dict in front of the disk. ``sparserl cache ls | show |
clear | verify`` inspects and repairs a cache folder; ``sparserl cache merge`` (``merge.py``)
combines the folders of several ranks or machines, re-signing what it copies.

This module is just over 600 lines: the store and the trust rules it enforces on every read
and write (the keys are in ``cache_keys.py``).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import json
import logging
import os
import stat
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from sparserl_compile import secure_dir
from sparserl_compile.cache_keys import (  # noqa: F401  (the keys are part of this module's API)
    CacheKey,
    Target,
    _canonical,
    _json_default,
    cache_key,
    local_target,
    package_version,
    width_bucket,
)
from sparserl_compile.secure_dir import Folder, Key, Unsafe

log = logging.getLogger("sparserl.cache")

#: bump when the entry file layout changes (old entries then read as misses); 2: signed
ENTRY_FORMAT = 2
#: the largest entry file read (a cubin of a few MB, base64): anything bigger is not an entry
MAX_ENTRY_BYTES = 64 << 20
#: temp files older than this are debris of a crashed writer; ``verify`` removes them
STALE_TEMP_S = 3600.0


class CacheWarning(UserWarning):
    """The kernel cache cannot be used as configured and runs memory-only."""


#: what a selection kept: a generated kernel, the reference (cuSPARSE) or the dense product
OUTCOMES = ("kernel", "reference", "dense")


@dataclass(frozen=True)
class CacheEntry:
    """One search result: a kernel (``cubin``), or with ``cubin=None`` the verdict that the
    reference (cuSPARSE) or, with ``outcome="dense"``, the dense product won."""

    key: CacheKey
    cubin: bytes | None
    source: str = ""  # the winning kernel's CUDA C (empty when the reference won)
    header: str = ""  # its two header lines (launch configuration)
    times: dict = field(default_factory=dict)  # measured medians, e.g. {"kernel_us":..., "reference_us":...}
    verification: dict = field(default_factory=dict)  # verify.py's record, JSON-able
    created: float = field(default_factory=time.time)  # unix time of the search
    #: one of ``OUTCOMES``; None: "kernel" where there is a cubin, else "reference" (as entries
    #: written before the dense outcome are read)
    outcome: str | None = None

    def __post_init__(self) -> None:
        if self.outcome is None:
            object.__setattr__(self, "outcome", "reference" if self.cubin is None else "kernel")
        if self.outcome not in OUTCOMES:
            raise ValueError(f"cache entry outcome {self.outcome!r}: expected one of {OUTCOMES}")
        if (self.outcome == "kernel") != (self.cubin is not None):
            raise ValueError(f"a cache entry of outcome {self.outcome!r} "
                             + ("needs a cubin" if self.outcome == "kernel" else "holds no cubin"))

    @property
    def reference_wins(self) -> bool:
        return self.outcome == "reference"

    @property
    def dense_wins(self) -> bool:
        return self.outcome == "dense"

    def to_json_dict(self) -> dict:
        d = {
            "format": ENTRY_FORMAT,
            "key": dataclasses.asdict(self.key),
            "cubin_b64": None if self.cubin is None else base64.b64encode(self.cubin).decode("ascii"),
            "outcome": self.outcome,
            "source": self.source,
            "header": self.header,
            "times": self.times,
            "verification": self.verification,
            "created": self.created,
        }
        d["sha256"] = hashlib.sha256(_canonical(d)).hexdigest()
        return d

    @classmethod
    def from_json_dict(cls, d: dict) -> "CacheEntry":
        """Parse and check an entry; raises ``ValueError`` on any inconsistency."""
        if not isinstance(d, dict) or d.get("format") != ENTRY_FORMAT:
            raise ValueError(f"not a format-{ENTRY_FORMAT} cache entry")
        body = dict(d)
        body.pop(_HMAC, None)
        want = body.pop("sha256", None)
        if hashlib.sha256(_canonical(body)).hexdigest() != want:
            raise ValueError("sha256 mismatch: the entry is corrupt or was edited")
        b64 = body["cubin_b64"]
        try:
            cubin = None if b64 is None else base64.b64decode(b64, validate=True)
        except (binascii.Error, TypeError) as e:
            raise ValueError(f"cubin is not valid base64: {e}") from None
        outcome = body.get("outcome")  # absent from entries written before the dense outcome
        if outcome is not None and outcome not in OUTCOMES:
            raise ValueError(f"outcome {outcome!r} is none of {OUTCOMES}")
        return cls(CacheKey.from_dict(body["key"]), cubin, str(body["source"]), str(body["header"]),
                   dict(body["times"]), dict(body["verification"]), float(body["created"]), outcome)


_HMAC = "hmac_sha256"
_SIGNED = b"sparserl kernel cache entry\0"  # domain separation: this key signs nothing else


def _signed_bytes(d: dict) -> bytes:
    """What an entry's HMAC covers: its canonical JSON without the HMAC (with the sha256)."""
    return _SIGNED + _canonical({k: v for k, v in d.items() if k != _HMAC})


@dataclass(frozen=True)
class Listing:
    """One entry file as ``ls`` sees it."""

    digest: str
    path: Path
    size: int
    entry: CacheEntry | None  # None: the file is corrupt
    problem: str = ""


@dataclass(frozen=True)
class VerifyReport:
    valid: int
    removed: tuple[str, ...]  # paths of corrupt entries and stale temp files removed
    failed: tuple[str, ...] = ()  # "path: why" of corrupt entries that could not be removed


def default_dir() -> Path:
    """``$SPARSERL_CACHE_DIR`` if set, else ``~/.cache/sparserl`` (read at call time)."""
    env = os.environ.get("SPARSERL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sparserl"


def _inspect(path: Path, create: bool) -> tuple[str | None, os.stat_result | None]:
    """(why the folder's entries may not be read, or None; its status when they may)."""
    try:
        if create:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create {path}: {e.strerror or e}", None
    try:
        with Folder.open(path) as f:
            st = f.st
    except FileNotFoundError:
        return f"{path} does not exist", None
    except Unsafe as e:
        return str(e), None
    if not os.access(path, os.R_OK | os.X_OK):
        return f"{path} is not readable by this user", None
    return None, st


def check_dir(path: Path, create: bool = True) -> str | None:
    """Create ``path`` (0700) if needed (and ``create``); return why its entries may not be read,
    or None if they may. Whether it may also be written is ``writable(path)``."""
    return _inspect(Path(path), create)[0]


def writable(path: Path) -> bool:
    """May this user add entries to the (usable) cache folder ``path``?"""
    return os.access(path, os.W_OK | os.X_OK)


def _is_subdir_name(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


class KernelCache:
    """In-memory dict in front of the on-disk entry files of one folder (see the module
    docstring for what is served from it and why)."""

    def __init__(self, directory: str | os.PathLike | None = None, create: bool = True):
        self.directory = Path(directory) if directory is not None else default_dir()
        self._mem: dict[str, CacheEntry] = {}
        self._key: Key | None = None
        self._logged: set[str] = set()
        self.disabled_reason, st = _inspect(self.directory, create)
        #: "key": entries must carry this folder's HMAC (this user's folder); "owner": root's
        #: folder read by another user, entries authenticated by ownership alone; None: unused
        self.trust: str | None = None
        #: the folder is read but not written (``None`` when it is also written, or not used)
        self.read_only_reason = None
        self._warned = False
        if self.disabled_reason:
            self._warn(self.disabled_reason)
            return
        if st.st_uid == secure_dir.euid() or secure_dir.euid() < 0:
            self.trust = "key"
            if not writable(self.directory):
                self.read_only_reason = f"{self.directory} is not writable by this user"
        else:
            self.trust = "owner"
            self.read_only_reason = (f"{self.directory} belongs to root and is not writable by this user "
                                     "(entries are trusted as root's)")
        if self.read_only_reason:
            self._warn(self.read_only_reason, "sparserl kernel cache is read-only (its entries are served; "
                                              "new kernels stay in memory)")

    _defaults: dict[str, "KernelCache"] = {}

    @classmethod
    def default(cls) -> "KernelCache":
        """The process-wide cache of ``default_dir()`` as the environment says now."""
        d = str(default_dir())
        if d not in cls._defaults:
            cls._defaults[d] = cls(d)
        return cls._defaults[d]

    @property
    def on_disk(self) -> bool:
        """Entries are read from and written to the folder."""
        return self.disabled_reason is None and self.read_only_reason is None

    @property
    def readable(self) -> bool:
        """Entries are read from the folder (``on_disk``, or a read-only folder)."""
        return self.disabled_reason is None

    def _warn(self, why: str, what: str = "sparserl kernel cache runs memory-only") -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"{what}: {why}", CacheWarning, stacklevel=3)

    def _log_once(self, what: str) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning("kernel cache: %s", what)

    def path_of(self, digest: str) -> Path:
        return self.directory / digest[:2] / f"{digest}.json"

    def _open(self) -> Folder:
        return Folder.open(self.directory)

    def _verifier(self, root: Folder) -> Key | None:
        """The key entries must be signed with (None: root's folder, trusted by ownership);
        ``_NoKey`` when this user's folder has no usable key."""
        if self.trust == "owner":
            return None
        if self._key is None:
            key, why = secure_dir.read_key(root)
            if key is None:
                raise _NoKey(why or f"{self.directory} has no key ({secure_dir.KEY_NAME}) yet: no entry in it was "
                                    "written by this user's sparserl")
            self._key = key
        return self._key

    # ---------------------------------------------------------------- read

    def get(self, key: CacheKey) -> CacheEntry | None:
        """The entry for ``key``, or None (a miss, also for any unreadable, unsafe, unsigned or
        corrupt file)."""
        digest = key.digest()
        hit = self._mem.get(digest)
        if hit is not None or not self.readable:
            return hit
        entry = self._load(digest, expect=key)
        if entry is not None:
            self._mem[digest] = entry
        return entry

    def _load(self, digest: str, expect: CacheKey | None = None) -> CacheEntry | None:
        path = self.path_of(digest)
        try:
            with self._open() as root, root.sub(digest[:2]) as sub:
                raw, st = sub.read(path.name, MAX_ENTRY_BYTES)  # before the key: see put
                try:
                    return _parse(raw, path, expect, self._verifier(root))
                except _NoKey as e:  # no entry here can be authenticated: each is a bad one
                    self._log_once(f"{e}: every entry is a miss")
                    self._discard(sub, path, st, str(e))
                except ValueError as e:
                    self._discard(sub, path, st, str(e))
        except FileNotFoundError:
            pass
        except Unsafe as e:
            log.warning("kernel cache: not reading %s: %s: a miss", path, e)
        except OSError as e:
            log.warning("kernel cache: cannot read %s (%s): a miss", path, e)
        return None

    def _discard(self, sub: Folder, path: Path, st: os.stat_result, why: str) -> None:
        """Remove a bad entry unless a writer replaced it since we read it."""
        if not self.on_disk:
            log.warning("kernel cache: bad entry %s (%s): a miss; the folder is read-only, so it stays", path, why)
            return
        log.warning("kernel cache: removing bad entry %s: %s", path, why)
        try:
            now = sub.lstat(path.name)
            if (now.st_ino, now.st_mtime_ns, now.st_size) == (st.st_ino, st.st_mtime_ns, st.st_size):
                sub.unlink(path.name)
        except OSError:
            pass

    # ---------------------------------------------------------------- write

    def put(self, entry: CacheEntry) -> bool:
        """Store ``entry`` (memory always, disk when usable, signed with the folder's key); True
        if it reached the disk."""
        digest = entry.key.digest()
        self._mem[digest] = entry
        if not self.on_disk:
            return False
        doc = entry.to_json_dict()  # raises TypeError for a record that is not JSON, before any write
        path = self.path_of(digest)
        try:
            with self._open() as root:
                if self._key is None:
                    self._key, replaced = secure_dir.ensure_key(root)
                    if replaced:
                        self._log_once(f"replaced the unusable key: {replaced}; entries signed with it are misses")
                doc[_HMAC] = self._key.sign(_signed_bytes(doc))
                data = json.dumps(doc, sort_keys=True, indent=1, default=_json_default).encode("utf-8")
                with root.sub(digest[:2], create=True) as sub:
                    sub.write_atomic(path.name, data)
            return True
        except (OSError, Unsafe) as e:
            self._warn(f"cannot write {path}: {e}")
            return False

    # ---------------------------------------------------------------- manage

    def _walk(self):
        """(subfolder name, open subfolder or None, its problem) for every two-hex-digit
        subfolder; the caller closes the folders. Nothing is followed."""
        if not self.readable:
            return []
        out = []
        try:
            with self._open() as root:
                for name in root.names():
                    if not _is_subdir_name(name):
                        continue
                    try:
                        out.append((name, root.sub(name), ""))
                    except (Unsafe, FileNotFoundError) as e:
                        out.append((name, None, str(e)))
        except (Unsafe, FileNotFoundError, OSError):
            for _, sub, _ in out:
                if sub is not None:
                    sub.close()
            return []
        return out

    def ls(self) -> list[Listing]:
        """Every entry file, checked as ``get`` checks it (bad ones listed with the problem); an
        unsafe subfolder is listed as one bad item."""
        out: list[Listing] = []
        try:
            with self._open() as root:
                try:
                    key, no_key = self._verifier(root), ""
                except _NoKey as e:
                    key, no_key = None, str(e)
        except (Unsafe, FileNotFoundError, OSError):
            return []
        for name, sub, problem in self._walk():
            if sub is None:
                out.append(Listing(name, self.directory / name, 0, None, problem))
                continue
            with sub:
                for fname in sub.names():
                    if not fname.endswith(".json") or fname.startswith(".tmp-"):
                        continue
                    path = self.directory / name / fname
                    try:
                        raw, st = sub.read(fname, MAX_ENTRY_BYTES)
                        if no_key:
                            raise ValueError(no_key)
                        out.append(Listing(path.stem, path, len(raw), _parse(raw, path, None, key)))
                    except (OSError, ValueError, Unsafe) as e:
                        size = _size(sub, fname)
                        out.append(Listing(path.stem, path, size, None, str(e)))
        return out

    def find(self, prefix: str) -> list[Listing]:
        """Entries whose digest starts with ``prefix``."""
        return [x for x in self.ls() if x.digest.startswith(prefix.lower()) and len(x.digest) == 64]

    def remove(self, key: CacheKey | str) -> bool:
        """Forget one entry (a key or a full digest); True if a file was removed."""
        digest = key.digest() if isinstance(key, CacheKey) else key
        self._mem.pop(digest, None)
        try:
            with self._open() as root, root.sub(digest[:2]) as sub:
                return sub.unlink(f"{digest}.json")
        except (Unsafe, OSError):
            return False

    def count_files(self) -> int:
        """Entry files (regular files named like entries) that ``clear`` would remove."""
        n = 0
        for _, sub, _ in self._walk():
            if sub is not None:
                with sub:
                    n += sum(_kind(sub, f) == "entry" for f in sub.names())
        return n

    def clear(self) -> int:
        """Remove every entry file, temp file and symlink named like one from the safe
        subfolders, following nothing; returns the number of entries (regular files) removed."""
        self._mem.clear()
        n = 0
        for _, sub, _ in self._walk():
            if sub is None:
                continue
            with sub:
                for f in sub.names():
                    kind = _kind(sub, f)
                    if kind and sub.unlink(f):
                        n += kind == "entry"
        return n

    def verify(self) -> VerifyReport:
        """Check every entry as ``get`` would; remove bad ones, symlinks in the tree and temp files
        older than STALE_TEMP_S; report what cannot be removed (e.g. a subfolder others can write)."""
        removed, failed, valid = [], [], 0
        for x in self.ls():
            if x.entry is not None:
                valid += 1
                continue
            self._mem.pop(x.digest, None)
            log.warning("kernel cache: removing bad entry %s: %s", x.path, x.problem)
            if self._unlink_listed(x.path):
                removed.append(str(x.path))
            else:
                failed.append(f"{x.path}: {x.problem}, and it cannot be removed")
        now = time.time()
        for _, sub, _ in self._walk():
            if sub is None:
                continue
            with sub:
                for f in sub.names():
                    try:
                        if f.startswith(".tmp-") and now - sub.lstat(f).st_mtime > STALE_TEMP_S and sub.unlink(f):
                            removed.append(str(Path(sub.path) / f))
                    except OSError:
                        pass
        return VerifyReport(valid, tuple(removed), tuple(failed))

    def _unlink_listed(self, path: Path) -> bool:
        """Remove a listed bad item: an entry file (or symlink, FIFO) or a symlinked subfolder."""
        try:
            with self._open() as root:
                if path.parent == self.directory:  # a subfolder: only a symlink is removed
                    return stat.S_ISLNK(root.lstat(path.name).st_mode) and root.unlink(path.name)
                with root.sub(path.parent.name) as sub:
                    return not stat.S_ISDIR(sub.lstat(path.name).st_mode) and sub.unlink(path.name)
        except (Unsafe, OSError):
            return False


class _NoKey(Exception):
    """This user's folder has no usable key: none of its entries can be authenticated."""


def _kind(sub: Folder, name: str) -> str:
    """What ``clear`` makes of a name in a subfolder: "entry" (a regular entry file), "other"
    (a temp file, or a symlink, FIFO... named like an entry: removed, not counted) or ""
    (left alone: not named like an entry, or a folder)."""
    if not name.endswith(".json"):
        return ""
    try:
        mode = sub.lstat(name).st_mode
    except OSError:
        return ""
    if stat.S_ISDIR(mode):
        return ""
    return "entry" if stat.S_ISREG(mode) and not name.startswith(".tmp-") else "other"


def _size(sub: Folder, name: str) -> int:
    try:
        return sub.lstat(name).st_size
    except OSError:
        return 0


def _parse(raw: bytes, path: Path, expect: CacheKey | None, key: Key | None) -> CacheEntry:
    """An entry file's bytes as its entry: parsed, authenticated under ``key`` (None: the
    folder is trusted by ownership), hash-checked, and checked against the requested key (if
    any) and the file name; ``ValueError`` naming the problem otherwise (``get`` and ``ls``)."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError("JSON nested too deep") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"not a format-{ENTRY_FORMAT} cache entry")
    try:
        entry = CacheEntry.from_json_dict(doc)
    except (KeyError, TypeError) as e:
        raise ValueError(f"a field is missing or malformed: {e}") from None
    if key is not None and not key.verify(_signed_bytes(doc), doc.get(_HMAC)):
        raise ValueError(f"not signed with this folder's key ({secure_dir.KEY_NAME}): written by another "
                         "user's process, edited (its sha256 recomputed) or copied in; `sparserl cache merge` "
                         "copies entries between folders")
    if expect is not None and entry.key != expect:
        raise ValueError("the stored key differs from the requested one")
    if entry.key.digest() != path.stem:
        raise ValueError("the file name does not match the stored key")
    return entry


def lookup(store: "KernelCache", key: CacheKey, fallback_hashes=()) -> "CacheEntry | None":
    """``store``'s entry for ``key``, else the same problem and target's entry built under
    each of ``fallback_hashes`` in order (the runtime passes ``"none"``, the families-only
    entries of the search and the lookup, then the shipped default policy's hash). A kernel
    verified and timed on this GPU kind is as valid whoever proposed it, so a cache built with
    the search serves a process running the policy, and one built with the default policy
    serves a process without the ``train`` extra. Entries built by any other checkpoint are
    keyed to it and only a process running it finds them: a new policy is asked again instead
    of being served an old one's verdicts."""
    for h in dict.fromkeys((key.policy_hash, *fallback_hashes)):  # in order, once each
        if h is None:
            continue
        entry = store.get(key if h == key.policy_hash else dataclasses.replace(key, policy_hash=h))
        if entry is not None:
            return entry
    return None
