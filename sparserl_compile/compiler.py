"""NVRTC: kernel source -> cubin for one GPU architecture, cached in memory and on disk.

``compile_cubin(source, arch)`` runs NVRTC through ``cuda.bindings.nvrtc`` (no GPU needed, so
CI tests this stage on CPU machines) and returns a ``CompileResult``; a failed compile raises
``CompileError`` carrying the NVRTC log, the options and the source, which it can print with
line numbers (as CuPy's ``CompileException`` does) -- what a compile reward and a bug report
need.

Headers. Kernel sources never ``#include`` anything (the kernel language forbids it); this
module prepends the few headers it allows: ``cuda_fp16.h`` and ``cuda_bf16.h`` always, and
``mma.h`` only for sources that use ``nvcuda::wmma``. NVRTC 13 does not ship these as built-in
headers ("could not open source file ... no directories in search list"), so they are taken
from the CUDA toolkit's include directory, found by ``cuda.pathfinder`` (the
``nvidia-cuda-runtime`` wheel, ``$CUDA_HOME``/``$CUDA_PATH``, or ``/usr/local/cuda``), else
``$SPARSERL_CUDA_INCLUDE``. Set ``SPARSERL_CUDA_INCLUDE`` to override the search.

Cache. The key is sha256 of (source, options, arch, NVRTC version, this module's
``COMPILER_VERSION``). Entries live in memory and under ``$SPARSERL_CACHE_DIR/cubin/`` (else
``~/.cache/sparserl/cubin``) as ``<key>.cubin`` files carrying a 32-byte sha256 of the cubin in
front: written to a temporary file (0600), fsynced and renamed; a short or corrupt file is a
miss. A cubin from there is loaded into a GPU process, so only this user's files are read:
the folder is opened without following symlinks and refused (a ``CubinCacheWarning``, once,
and no disk cache) when another user owns it or may write it; a file is opened with
``O_NOFOLLOW`` relative to that folder and is a miss unless it is a regular file this user
owns that no one else may write.

Dumps. With ``SPARSERL_DUMP_DIR`` set, each compile writes ``<key>.cu`` (the full source NVRTC
saw), ``<key>.log`` and ``<key>.cubin`` (on success) there, Triton-style.

This module does not load or launch cubins (``launcher.py`` does).
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

COMPILER_VERSION = "1"

#: the headers the runtime allows kernels to rely on, in include order
BASE_HEADERS = ("cuda_fp16.h", "cuda_bf16.h")
WMMA_HEADER = "mma.h"

DEFAULT_OPTIONS = ("-std=c++17",)


class CompileError(Exception):
    """NVRTC refused a kernel: carries the log, the options and the (numbered) source."""

    def __init__(self, message: str, *, log: str, source: str, options: tuple[str, ...], arch: str):
        super().__init__(message)
        self.log = log
        self.source = source
        self.options = options
        self.arch = arch

    def numbered_source(self) -> str:
        """The source NVRTC compiled, each line prefixed with its number (as the log cites them)."""
        lines = self.source.splitlines()
        w = len(str(len(lines)))
        return "\n".join(f"{i:>{w}} {ln}" for i, ln in enumerate(lines, 1))

    def dump(self, file=None) -> None:
        """Print options, numbered source and log (to stderr by default)."""
        import sys

        f = file or sys.stderr
        print(f"NVRTC compile for {self.arch} with options {list(self.options)} failed:", file=f)
        print(self.numbered_source(), file=f)
        print("---- log ----", file=f)
        print(self.log, file=f)

    def __str__(self) -> str:
        return f"{self.args[0]}\n{self.log.strip()}"


@dataclass(frozen=True)
class CompileResult:
    cubin: bytes
    log: str
    arch: str
    options: tuple[str, ...]
    nvrtc_version: tuple[int, int]
    seconds: float  # NVRTC time of this compile; 0.0 when served from a cache
    key: str
    cached: str = ""  # "", "memory" or "disk"


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:  # pragma: no cover - dependency missing
        raise RuntimeError(
            "cuda.bindings is not installed: pip install cuda-bindings nvidia-cuda-nvrtc"
        ) from e
    return nvrtc


def _check(result, what: str):
    nvrtc = _nvrtc()
    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


@lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library in use."""
    major, minor = _check(_nvrtc().nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


@lru_cache(maxsize=1)
def cuda_include_dir() -> str:
    """The CUDA toolkit include directory that holds ``cuda_fp16.h`` (see module docstring)."""
    env = os.environ.get("SPARSERL_CUDA_INCLUDE")
    cands: list[str] = [env] if env else []
    try:
        from cuda import pathfinder

        d = pathfinder.find_nvidia_header_directory("cudart")
        if d:
            cands.append(str(d))
    except Exception:  # older pathfinder or not found: fall through to the usual places
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(os.path.join(os.environ[var], "include"))
    cands.append("/usr/local/cuda/include")
    found = [c for c in cands if c and os.path.isfile(os.path.join(c, "cuda_fp16.h"))]
    # A complete toolkit include dir also has crt/mma.h, which mma.h (the wmma family) includes;
    # some wheels ship mma.h without it (seen on the H200 image's nvidia/cu13/include).
    for c in found:
        if os.path.isfile(os.path.join(c, "crt", "mma.h")):
            return c
    if found:
        return found[0]
    raise RuntimeError(
        "cannot find the CUDA headers (cuda_fp16.h) NVRTC needs; tried "
        f"{cands}. Install the CUDA toolkit or `pip install nvidia-cuda-runtime`, or set "
        "SPARSERL_CUDA_INCLUDE to the directory holding cuda_fp16.h"
    )


def default_arch() -> str:
    """The current CUDA device's ``sm_XY``, else ``sm_90`` (the H200)."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
    except Exception:  # pragma: no cover
        pass
    return "sm_90"


def full_source(source: str) -> str:
    """``source`` with the allowed headers prepended, exactly as NVRTC compiles it."""
    heads = list(BASE_HEADERS) + ([WMMA_HEADER] if "nvcuda::wmma" in source else [])
    return "".join(f"#include <{h}>\n" for h in heads) + source


def cache_key(source: str, arch: str, options: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (COMPILER_VERSION, arch, repr(nvrtc_version()), "\0".join(options), source):
        h.update(part.encode())
        h.update(b"\0\0")
    return h.hexdigest()


def cache_dir() -> Path:
    base = os.environ.get("SPARSERL_CACHE_DIR") or os.path.join(Path.home(), ".cache", "sparserl")
    return Path(base) / "cubin"


_MEMORY: dict[str, CompileResult] = {}
_LOCK = threading.Lock()


class CubinCacheWarning(RuntimeWarning):
    """The disk cache of cubins is not used: its folder is not this user's alone."""


_WARNED: set[str] = set()


def _unsafe(st: os.stat_result, what: str) -> str | None:
    """Why a folder or file another user could have written must not be trusted, or None."""
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"{what} is owned by uid {st.st_uid}, not this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _open_dir(create: bool) -> int | None:
    """A descriptor of the cubin folder if it is safe to use (module docstring), else None."""
    d = cache_dir()
    try:
        if create:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:  # a symlink (ELOOP), not a folder, no permission
        why = f"{d} cannot be opened as a folder of its own ({e.strerror or e}); a symlink is never followed"
        fd, st = None, None
    else:
        st = os.fstat(fd)
        why = _unsafe(st, str(d))
    if why is None:
        return fd
    if fd is not None:
        os.close(fd)
    if why not in _WARNED:
        _WARNED.add(why)
        warnings.warn(f"the cubin cache is not used: {why}. Another user could plant cubins there; "
                      f"run `chmod 700 {d}` if it is yours, or set SPARSERL_CACHE_DIR to a folder of your own",
                      CubinCacheWarning, stacklevel=4)
    return None


def _disk_read(key: str) -> bytes | None:
    dfd = _open_dir(create=False)
    if dfd is None:
        return None
    try:
        fd = os.open(f"{key}.cubin", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
    except OSError:
        return None  # absent, or a symlink: a miss
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or _unsafe(st, key) is not None:
            return None  # planted by someone else, or writable by them: never served
        with os.fdopen(fd, "rb") as f:
            fd = -1
            blob = f.read()
    except OSError:
        return None
    finally:
        if fd >= 0:
            os.close(fd)
    digest, cubin = blob[:32], blob[32:]
    if len(blob) <= 32 or hashlib.sha256(cubin).digest() != digest:
        return None  # partial or corrupt: a miss, never a crash
    return cubin


def _disk_write(key: str, cubin: bytes) -> None:
    """Write an entry (0600, temporary file then rename, both inside the checked folder)."""
    dfd = _open_dir(create=True)
    if dfd is None:
        return
    tmp = f".tmp-{key[:16]}-{os.getpid()}-{threading.get_ident()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(hashlib.sha256(cubin).digest() + cubin)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, f"{key}.cubin", src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    except OSError:  # a read-only cache is not an error: the memory cache still serves
        pass
    finally:
        os.close(dfd)


def _dump(key: str, src: str, log: str, cubin: bytes | None) -> None:
    d = os.environ.get("SPARSERL_DUMP_DIR")
    if not d:
        return
    p = Path(d)
    p.mkdir(parents=True, exist_ok=True)
    (p / f"{key}.cu").write_text(src)
    (p / f"{key}.log").write_text(log)
    if cubin is not None:
        (p / f"{key}.cubin").write_bytes(cubin)


def _run_nvrtc(src: str, arch: str, options: tuple[str, ...]) -> tuple[bytes | None, str]:
    nvrtc = _nvrtc()
    prog = _check(nvrtc.nvrtcCreateProgram(src.encode(), b"sparserl_kernel.cu", 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", f"-I{cuda_include_dir()}", *options]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        # bytearray, never b" " * size: for size 1 that is CPython's shared one-byte b" "
        # object, and NVRTC writing its NUL into it turns every b" " in the process into b"\0"
        buf = bytearray(size)
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = bytes(buf).rstrip(b"\0").decode(errors="replace")
        if res[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return None, log
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return bytes(cubin), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_cubin(source: str, arch: str | None = None, options: tuple[str, ...] | list[str] = ()) -> CompileResult:
    """Compile one kernel source (without includes) to a cubin for ``arch`` (``sm_90`` ...).

    ``options`` are extra NVRTC options after ``DEFAULT_OPTIONS``. Raises ``CompileError``
    when NVRTC rejects the source, ``RuntimeError`` when NVRTC or the CUDA headers are missing.
    """
    arch = arch or default_arch()
    if not arch.startswith(("sm_", "compute_")):
        raise ValueError(f"arch={arch!r}: expected 'sm_XY' (e.g. 'sm_90' for H100/H200)")
    opts = tuple(DEFAULT_OPTIONS) + tuple(options)
    key = cache_key(source, arch, opts)
    with _LOCK:
        hit = _MEMORY.get(key)
    if hit is not None:
        return CompileResult(hit.cubin, hit.log, arch, opts, hit.nvrtc_version, 0.0, key, "memory")
    cubin = _disk_read(key)
    if cubin is not None:
        res = CompileResult(cubin, "", arch, opts, nvrtc_version(), 0.0, key, "disk")
        with _LOCK:
            _MEMORY[key] = res
        return res
    src = full_source(source)
    t0 = time.perf_counter()
    cubin, log = _run_nvrtc(src, arch, opts)
    seconds = time.perf_counter() - t0
    _dump(key, src, log, cubin)
    if cubin is None:
        first = next((ln for ln in log.splitlines() if "error" in ln), "see the log")
        raise CompileError(f"NVRTC could not compile the kernel for {arch}: {first.strip()}",
                           log=log, source=src, options=opts, arch=arch)
    res = CompileResult(cubin, log, arch, opts, nvrtc_version(), seconds, key)
    _disk_write(key, cubin)
    with _LOCK:
        _MEMORY[key] = res
    return res


def precompile(sources, arch: str | None = None, options: tuple[str, ...] | list[str] = (),
               workers: int | None = None) -> dict[str, int]:
    """Compile many sources at once into the caches, in threads (NVRTC releases the GIL).

    The search compiles every candidate of a problem; done one by one inside the sandbox
    worker that is the larger part of its cost. Compiling them here first, in parallel, leaves
    the worker disk-cache hits. Rejected sources are counted, not raised: the worker compiles
    them again and reports the NVRTC log as that candidate's failure. Returns counts of
    ``compiled``, ``cached`` and ``failed``.
    """
    from concurrent.futures import ThreadPoolExecutor

    arch = arch or default_arch()
    todo = list(dict.fromkeys(sources))
    counts = {"compiled": 0, "cached": 0, "failed": 0}
    if not todo:
        return counts
    workers = workers or min(8, os.cpu_count() or 1, len(todo))

    def one(src: str) -> str:
        try:
            return "cached" if compile_cubin(src, arch, options).cached else "compiled"
        except CompileError:
            return "failed"

    if workers <= 1:
        outcomes = [one(s) for s in todo]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="nvrtc") as ex:
            outcomes = list(ex.map(one, todo))
    for o in outcomes:
        counts[o] += 1
    return counts


def clear_memory_cache() -> None:
    """Forget in-memory entries (tests; the disk cache is untouched)."""
    with _LOCK:
        _MEMORY.clear()
