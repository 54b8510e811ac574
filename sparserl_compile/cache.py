"""The on-disk kernel cache: verified cubins (or the verdict "the reference wins") by key.

A ``CacheKey`` holds everything that changes which kernel is right for a call: the
structure fingerprint, op, value dtype, dense width bucket, GPU arch and name, driver and
NVRTC versions, package and kernel-space versions and the policy checkpoint hash. A
``CacheEntry`` is what a search found for that key: the cubin bytes with the source and
launch header, or ``cubin=None`` when no candidate beat the reference (cached too, so the
search is not repeated), plus measured times and the verification record.

Layout, one self-contained JSON file per entry (one file, so one atomic rename publishes it
and no half-written pair can exist)::

    <dir>/<digest[:2]>/<digest>.json     {"format": 1, "key": {...}, "cubin_b64": ...,
                                          "source": ..., "header": ..., "times": {...},
                                          "verification": {...}, "created": ..., "sha256": ...}

``sha256`` covers the canonical JSON of every other field (sorted keys, no spaces). Reads
check it and that the stored key equals the requested one; anything that does not parse,
does not match or does not hash is a miss, the file is removed and a warning logged -- never
an exception. Writes go to a temp file in the same folder, are fsynced and ``os.replace``d,
so readers see the old entry or the new one and concurrent writers of one key are safe (the
last rename wins; both wrote valid entries). No pickle: JSON and base64 only.

The folder is ``$SPARSERL_CACHE_DIR`` or ``~/.cache/sparserl``, created 0700. If it cannot be
created, is owned by neither this user nor root, or group/others can write it (or the entry's
subfolder), the cache warns once (``CacheWarning``) and runs memory-only: a kernel planted by
another user must never be loaded, and an unusable cache must never stop a product from being
computed. A folder this user may read but not write (a pre-generated cache deployed read-only:
a baked image, a read-only mount, a root-owned 0755 folder) is read; new entries then stay in
memory, with one warning.

``KernelCache`` puts an in-memory dict in front of the disk. ``sparserl cache ls | show |
clear | verify`` inspects and repairs a cache folder; ``sparserl cache merge`` (``merge.py``)
combines the folders of several ranks or machines.
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
from typing import TYPE_CHECKING

from sparserl_compile.fileio import write_atomic

if TYPE_CHECKING:
    import torch

log = logging.getLogger("sparserl.cache")

#: bump when the entry file layout changes (old entries then read as misses)
ENTRY_FORMAT = 1
#: temp files older than this are debris of a crashed writer; ``verify`` removes them
STALE_TEMP_S = 3600.0


class CacheWarning(UserWarning):
    """The kernel cache cannot be used as configured and runs memory-only."""


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


@dataclass(frozen=True)
class CacheEntry:
    """One search result. ``cubin is None`` records that the reference (cuSPARSE) won."""

    key: CacheKey
    cubin: bytes | None
    source: str = ""  # the winning kernel's CUDA C (empty when the reference won)
    header: str = ""  # its two header lines (launch configuration)
    times: dict = field(default_factory=dict)  # measured medians, e.g. {"kernel_us":..., "reference_us":...}
    verification: dict = field(default_factory=dict)  # verify.py's record, JSON-able
    created: float = field(default_factory=time.time)  # unix time of the search

    @property
    def reference_wins(self) -> bool:
        return self.cubin is None

    def to_json_dict(self) -> dict:
        d = {
            "format": ENTRY_FORMAT,
            "key": dataclasses.asdict(self.key),
            "cubin_b64": None if self.cubin is None else base64.b64encode(self.cubin).decode("ascii"),
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
        want = body.pop("sha256", None)
        if hashlib.sha256(_canonical(body)).hexdigest() != want:
            raise ValueError("sha256 mismatch: the entry is corrupt or was edited")
        b64 = body["cubin_b64"]
        try:
            cubin = None if b64 is None else base64.b64decode(b64, validate=True)
        except (binascii.Error, TypeError) as e:
            raise ValueError(f"cubin is not valid base64: {e}") from None
        return cls(CacheKey.from_dict(body["key"]), cubin, str(body["source"]), str(body["header"]),
                   dict(body["times"]), dict(body["verification"]), float(body["created"]))


def _json_default(o):
    """numpy scalars and arrays (common in timing and verification records) as plain JSON."""
    if hasattr(o, "tolist") and type(o).__module__ == "numpy":
        return o.tolist()
    raise TypeError(f"cache entries hold JSON only; cannot store {type(o).__name__} {o!r}")


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      default=_json_default).encode("ascii")


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


def _unsafe(path: Path, st: os.stat_result) -> str | None:
    """Why another user could have written into the folder ``path``, or None."""
    if hasattr(os, "getuid") and st.st_uid not in (os.getuid(), 0):
        return f"{path} is owned by uid {st.st_uid}, neither this user (uid {os.getuid()}) nor root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                f"another user could plant kernels: run `chmod 700 {path}`")
    return None


def check_dir(path: Path, create: bool = True) -> str | None:
    """Create ``path`` (0700) if needed (and ``create``); return why its entries may not be read,
    or None if they may. Whether it may also be written is ``writable(path)``."""
    try:
        if create:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as e:
        return f"cannot create {path}: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    why = _unsafe(path, st)
    if why:
        return why
    if not os.access(path, os.R_OK | os.X_OK):
        return f"{path} is not readable by this user"
    return None


def writable(path: Path) -> bool:
    """May this user add entries to the (usable) cache folder ``path``?"""
    return os.access(path, os.W_OK | os.X_OK)


class KernelCache:
    """In-memory dict in front of the on-disk entry files of one folder."""

    def __init__(self, directory: str | os.PathLike | None = None, create: bool = True):
        self.directory = Path(directory) if directory is not None else default_dir()
        self._mem: dict[str, CacheEntry] = {}
        self._safe_subdirs: dict[str, str | None] = {}
        self.disabled_reason = check_dir(self.directory, create)
        #: the folder is read but not written (``None`` when it is also written, or not used)
        self.read_only_reason = None
        self._warned = False
        if self.disabled_reason:
            self._warn(self.disabled_reason)
        elif not writable(self.directory):
            self.read_only_reason = f"{self.directory} is not writable by this user"
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

    def path_of(self, digest: str) -> Path:
        return self.directory / digest[:2] / f"{digest}.json"

    # ---------------------------------------------------------------- read

    def get(self, key: CacheKey) -> CacheEntry | None:
        """The entry for ``key``, or None (a miss, also for any unreadable or corrupt file)."""
        digest = key.digest()
        hit = self._mem.get(digest)
        if hit is not None or not self.readable:
            return hit
        path = self.path_of(digest)
        if self.read_only_reason is not None and self._subdir_unsafe(path.parent):
            return None
        entry = self._load(path, expect=key)
        if entry is not None:
            self._mem[digest] = entry
        return entry

    def _subdir_unsafe(self, d: Path) -> str | None:
        """In a folder this process did not write: why the subfolder ``d`` may hold a planted
        entry (its owner or mode), remembered per subfolder; None if it may be read."""
        if d.name not in self._safe_subdirs:
            try:
                why = _unsafe(d, os.stat(d))
            except OSError:
                why = None  # absent: every entry in it is a miss anyway
            if why:
                log.warning("kernel cache: not reading %s: %s", d, why)
            self._safe_subdirs[d.name] = why
        return self._safe_subdirs[d.name]

    def _load(self, path: Path, expect: CacheKey | None = None) -> CacheEntry | None:
        try:
            with open(path, "rb") as fh:
                st = os.fstat(fh.fileno())
                raw = fh.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("kernel cache: cannot read %s (%s): treated as a miss", path, e)
            return None
        try:
            return _parse(raw, path, expect)
        except ValueError as e:
            self._discard(path, st, str(e))
            return None

    def _discard(self, path: Path, st: os.stat_result, why: str) -> None:
        """Remove a corrupt entry unless a writer replaced it since we read it."""
        if self.read_only_reason is not None:
            log.warning("kernel cache: corrupt entry %s (%s): a miss; the folder is read-only, so it stays", path, why)
            return
        log.warning("kernel cache: removing corrupt entry %s: %s", path, why)
        try:
            now = os.stat(path)
            if (now.st_ino, now.st_mtime_ns, now.st_size) == (st.st_ino, st.st_mtime_ns, st.st_size):
                os.unlink(path)
        except OSError:
            pass

    # ---------------------------------------------------------------- write

    def put(self, entry: CacheEntry) -> bool:
        """Store ``entry`` (memory always, disk when usable); True if it reached the disk."""
        digest = entry.key.digest()
        self._mem[digest] = entry
        if not self.on_disk:
            return False
        path = self.path_of(digest)
        data = json.dumps(entry.to_json_dict(), sort_keys=True, indent=1,
                          default=_json_default).encode("utf-8")
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            write_atomic(path, data, private=True, sync_dir=True)
            return True
        except OSError as e:
            self._warn(f"cannot write {path}: {e}")
            return False

    # ---------------------------------------------------------------- manage

    def _files(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.glob("??/*.json") if not p.name.startswith(".tmp-"))

    def ls(self) -> list[Listing]:
        """Every entry file, parsed and hash-checked (corrupt ones listed with the problem)."""
        out = []
        for p in self._files():
            try:
                raw = p.read_bytes()
                out.append(Listing(p.stem, p, len(raw), _parse(raw, p)))
            except (OSError, ValueError) as e:
                out.append(Listing(p.stem, p, p.stat().st_size if p.exists() else 0, None, str(e)))
        return out

    def find(self, prefix: str) -> list[Listing]:
        """Entries whose digest starts with ``prefix``."""
        return [x for x in self.ls() if x.digest.startswith(prefix.lower())]

    def remove(self, key: CacheKey | str) -> bool:
        """Forget one entry (a key or a full digest); True if a file was removed."""
        digest = key.digest() if isinstance(key, CacheKey) else key
        self._mem.pop(digest, None)
        try:
            os.unlink(self.path_of(digest))
            return True
        except OSError:
            return False

    def clear(self) -> int:
        """Remove every entry (and temp file); returns the number of entries removed."""
        self._mem.clear()
        n = 0
        if not self.directory.is_dir():
            return 0
        for p in self.directory.glob("??/*.json"):
            try:
                if not p.is_file():
                    continue
                os.unlink(p)
                n += 0 if p.name.startswith(".tmp-") else 1
            except OSError:
                pass
        return n

    def verify(self) -> VerifyReport:
        """Re-hash every entry; remove corrupt ones and temp files older than STALE_TEMP_S."""
        removed, failed, valid = [], [], 0
        for x in self.ls():
            if x.entry is None:
                log.warning("kernel cache: removing corrupt entry %s: %s", x.path, x.problem)
                try:
                    os.unlink(x.path)
                    removed.append(str(x.path))
                except OSError as e:
                    failed.append(f"{x.path}: corrupt ({x.problem}), and cannot be removed: {e.strerror or e}")
                self._mem.pop(x.digest, None)
            else:
                valid += 1
        now = time.time()
        for p in self.directory.glob("??/.tmp-*") if self.directory.is_dir() else ():
            try:
                if now - p.stat().st_mtime > STALE_TEMP_S:
                    os.unlink(p)
                    removed.append(str(p))
            except OSError:
                pass
        return VerifyReport(valid, tuple(removed), tuple(failed))


def _parse(raw: bytes, path: Path, expect: CacheKey | None = None) -> CacheEntry:
    """An entry file's bytes as its entry, checked against the requested key (if any) and the
    file name; ``ValueError`` naming the problem for anything corrupt (``get`` and ``ls``)."""
    try:
        entry = CacheEntry.from_json_dict(json.loads(raw.decode("utf-8")))
    except RecursionError:
        raise ValueError("JSON nested too deep") from None
    except (KeyError, TypeError) as e:
        raise ValueError(str(e)) from None
    if expect is not None and entry.key != expect:
        raise ValueError("the stored key differs from the requested one")
    if entry.key.digest() != path.stem:
        raise ValueError("the file name does not match the stored key")
    return entry


# -------------------------------------------------------------------- keys for a machine


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
