"""A folder whose files only their owner (or root) can have written, opened without following
a symlink, and the secret key that signs what is stored in it.

The kernel cache stores code the runtime will run, so every folder and file it reads is
checked on the open descriptor itself (``fstat`` after ``open``, never a path checked and then
reopened): a folder or file must be owned by this user (the effective uid) or root, must not
be writable by group or others, must not be a symlink (``O_NOFOLLOW`` on every component below
the cache folder, and on the cache folder itself), and a file must be a regular file with one
link (a hard link's content can change through its other name) opened with ``O_NONBLOCK`` (a
FIFO planted as an entry would otherwise block the reader forever). Everything below a checked
folder is reached through that folder's descriptor (``dir_fd``), so renaming a parent after the
check cannot redirect a read or a write.

``Key`` is the folder's HMAC key: 32 random bytes in ``<folder>/.key``, a regular file of mode
0600 owned by this user, created on first write (written to a temp file, fsynced, and published
with ``link``, which fails if another process published one first: both then use the first).
A key file that anyone else could have read (group/other bits), that another user owns, that
is a symlink or of the wrong size is not a key: it is replaced where the folder is writable
(entries signed with it then read as misses) and otherwise no entry of the folder is served.

What this does not do: decide which folders are trusted (``cache.py`` says who may have written
a folder and what that means for its entries) or protect against root or this user's own
processes, who may write anything these checks accept.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from dataclasses import dataclass

#: bytes of a folder's HMAC key
KEY_BYTES = 32
#: the key's file name inside the folder
KEY_NAME = ".key"

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class Unsafe(Exception):
    """A folder or file that another user could have written, or one that is not what it
    should be (a symlink, a FIFO, a hard link); the message says which and why."""


def euid() -> int:
    """This process's effective uid (the owner its files get); -1 where there are no uids."""
    return os.geteuid() if hasattr(os, "geteuid") else -1


def why_unsafe(what: str, st: os.stat_result) -> str | None:
    """Why another user could have written ``what`` (a folder or file with status ``st``), or None."""
    me = euid()
    if me >= 0 and st.st_uid not in (me, 0):
        return f"{what} is owned by uid {st.st_uid}, neither this user (uid {me}) nor root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                f"another user could plant kernels: run `chmod 700 {what}`" if stat.S_ISDIR(st.st_mode) else
                f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")
    return None


def _errno_why(path, e: OSError, name: str, parent: "Folder | None") -> str:
    """Why ``open`` failed, in words; a symlink (ELOOP, or ENOTDIR for a folder) named as one."""
    import errno

    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        try:
            link = stat.S_ISLNK(os.stat(name, dir_fd=None if parent is None else parent.fd,
                                        follow_symlinks=False).st_mode)
        except OSError:
            link = e.errno == errno.ELOOP
        if link and parent is None:
            return f"{path} is a symlink: the cache follows none; point SPARSERL_CACHE_DIR at the real folder"
        if link:
            return f"{path} is a symlink: the cache follows none (`sparserl cache verify` removes it)"
        return f"{path} is not a directory"
    if e.errno == errno.ENOENT:
        return f"{path} does not exist"
    return f"cannot open {path}: {e.strerror or e}"


class Folder:
    """An open, checked folder: its descriptor, path and status. Use as a context manager."""

    def __init__(self, path, fd: int, st: os.stat_result):
        self.path, self.fd, self.st = path, fd, st

    @classmethod
    def open(cls, path, parent: "Folder | None" = None) -> "Folder":
        """Open ``path`` (a name inside ``parent`` when given) as a folder without following a
        symlink, and check it; ``Unsafe`` (with the reason) otherwise."""
        shown = path if parent is None else os.path.join(parent.path, path)
        try:
            fd = os.open(path, _DIR_FLAGS, dir_fd=None if parent is None else parent.fd)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise Unsafe(_errno_why(shown, e, path, parent)) from None
        st = os.fstat(fd)
        why = why_unsafe(str(shown), st)
        if why:
            os.close(fd)
            raise Unsafe(why)
        return cls(shown, fd, st)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Folder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sub(self, name: str, create: bool = False) -> "Folder":
        """The checked subfolder ``name`` (created 0700 if ``create`` and absent)."""
        if create:
            try:
                os.mkdir(name, 0o700, dir_fd=self.fd)
            except FileExistsError:
                pass
        return Folder.open(name, self)

    def names(self) -> list[str]:
        """The names in this folder (not followed, not checked)."""
        with os.scandir(self.fd) as it:
            return sorted(e.name for e in it)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def read(self, name: str, max_bytes: int, links_ok: bool = False) -> tuple[bytes, os.stat_result]:
        """The bytes of the regular file ``name``, checked on its descriptor; ``FileNotFoundError``
        if absent, ``Unsafe`` for a symlink, a FIFO or other non-regular file, a hard link
        (unless ``links_ok``; a file renamed over since the open has no link and is read), a
        file another user could have written, or one over ``max_bytes``."""
        shown = os.path.join(self.path, name)
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=self.fd)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise Unsafe(_errno_why(shown, e, name, self)) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Unsafe(f"{shown} is not a regular file")
            why = why_unsafe(shown, st)
            if why:
                raise Unsafe(why)
            # 0 links: a writer replaced the name after this open; the bytes are still the
            # complete file that was there, and no name can change them any more
            if st.st_nlink > 1 and not links_ok:
                raise Unsafe(f"{shown} has {st.st_nlink} hard links: its content can change through another name")
            if st.st_size > max_bytes:
                raise Unsafe(f"{shown} is {st.st_size} bytes, more than any entry ({max_bytes})")
            chunks, left = [], max_bytes + 1
            while left > 0:
                b = os.read(fd, min(left, 1 << 20))
                if not b:
                    break
                chunks.append(b)
                left -= len(b)
            data = b"".join(chunks)
            if len(data) > max_bytes:
                raise Unsafe(f"{shown} grew past {max_bytes} bytes while being read")
            return data, st
        finally:
            os.close(fd)

    def write_atomic(self, name: str, data: bytes) -> None:
        """Replace ``name`` with ``data`` (mode 0600) in one rename: a temp file created
        exclusively (never through a symlink), fsynced, renamed, the folder fsynced."""
        tmp = self._write_temp(data)
        try:
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            self.unlink(tmp)
            raise
        self.sync()

    def publish_once(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data`` (0600) unless it exists: True if this call created it."""
        tmp = self._write_temp(data)
        try:
            os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
            created = True
        except FileExistsError:
            created = False
        finally:
            self.unlink(tmp)
        self.sync()
        return created

    def _write_temp(self, data: bytes) -> str:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        for _ in range(100):
            tmp = f".tmp-{secrets.token_hex(8)}"
            try:
                fd = os.open(tmp, flags, 0o600, dir_fd=self.fd)
                break
            except FileExistsError:
                continue
        else:  # pragma: no cover - 100 collisions of 64 random bits
            raise OSError(f"cannot create a temp file in {self.path}")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            self.unlink(tmp)
            raise
        return tmp

    def unlink(self, name: str) -> bool:
        """Remove ``name`` (a symlink itself, never its target); True if it was removed."""
        try:
            os.unlink(name, dir_fd=self.fd)
            return True
        except OSError:
            return False

    def sync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError:  # pragma: no cover - file systems without directory fsync
            pass


@dataclass(frozen=True)
class Key:
    """A folder's HMAC-SHA256 key."""

    secret: bytes

    def sign(self, message: bytes) -> str:
        return hmac.new(self.secret, message, "sha256").hexdigest()

    def verify(self, message: bytes, tag) -> bool:
        return isinstance(tag, str) and hmac.compare_digest(self.sign(message), tag)


def read_key(folder: Folder) -> tuple[Key | None, str]:
    """The folder's key, or None and why there is none usable ("" when the file is absent).
    A second link is allowed: ``publish_once`` links the key into place before it removes its
    temp name, and a reader in between must not take the key for a bad one."""
    try:
        data, st = folder.read(KEY_NAME, KEY_BYTES, links_ok=True)
    except FileNotFoundError:
        return None, ""
    except Unsafe as e:
        return None, str(e)
    shown = os.path.join(folder.path, KEY_NAME)
    if st.st_uid != euid() and euid() >= 0:
        return None, f"{shown} is owned by uid {st.st_uid}, not this user (uid {euid()}): not this user's key"
    if st.st_mode & 0o077:
        return None, (f"{shown} has mode {stat.S_IMODE(st.st_mode):o}: others could have read it, so it "
                      "proves nothing")
    if len(data) != KEY_BYTES:
        return None, f"{shown} holds {len(data)} bytes, not a {KEY_BYTES}-byte key"
    return Key(data), ""


def ensure_key(folder: Folder) -> tuple[Key, str]:
    """The folder's key, created if absent and replaced if unusable (the folder must be
    writable); the second value says what was wrong with a replaced key ("" otherwise)."""
    key, why = read_key(folder)
    if key is not None:
        return key, ""
    if not why:  # absent: the first writer creates it; a concurrent first writer's key wins
        folder.publish_once(KEY_NAME, secrets.token_bytes(KEY_BYTES))
        key, why = read_key(folder)
        if key is not None:
            return key, ""
    folder.unlink(KEY_NAME)  # a symlink or a foreign file goes, never its target
    folder.publish_once(KEY_NAME, secrets.token_bytes(KEY_BYTES))
    key, again = read_key(folder)
    if key is None:
        raise OSError(f"cannot create a usable key in {folder.path}: {again}")
    return key, why
