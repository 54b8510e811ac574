"""Writing a file whole or not at all.

The kernel cache, NVRTC's cubin cache, result files (``write_json``) and the training stages'
config files are read by other processes while they are written (a second Python process, the
other ranks under torchrun, a crash halfway). ``write_atomic`` writes to a temporary file in the
same folder, flushes it to disk and renames it over the target, so a reader sees the old file or
the new one, never a part; the temporary file does not outlive a failure. The standard library
has no such call and the packages that do (``atomicwrites``) are unmaintained, so it lives here.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, data: bytes | str, *, private: bool = False, sync_dir: bool = False) -> None:
    """Replace ``path`` with ``data`` (text is UTF-8) in one rename. The folder must exist.

    ``private``: the file keeps the owner-only mode 0600 (the caches); otherwise it gets 0644
    like a file opened for writing. ``sync_dir``: the folder is fsynced too, so the rename
    itself survives a power loss. Raises OSError as ``open`` would; the target is then unchanged.
    """
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            if not private:
                os.fchmod(f.fileno(), 0o644)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if sync_dir:
        fsync_dir(path.parent)


def write_json(path: str | Path, doc, default=None) -> None:
    """``doc`` as compact JSON (``default`` as ``json.dumps``'s), atomically. The result files
    (``sparserl bench``, ``sparserl eval``, ``training.validation``, ``training.compare``, the
    scripts under ``benchmarks/``, ``training.neighbours``) are
    committed and every device call carries the tree, 64 MiB at most, so they carry no indentation."""
    write_atomic(path, json.dumps(doc, separators=(",", ":"), default=default) + "\n")


def fsync_dir(d: str | Path) -> None:
    """fsync a folder (its entries' renames), where the platform allows it."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks (a checkpoint's or a base's weights: the
    cache key's policy hash, the base's identity)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
