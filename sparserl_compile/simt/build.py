"""Build a prepared kernel into a shared library with the system C++ compiler, cached.

The translation unit is ``runtime.h`` + the rewritten kernel (``rewrite.prepare``) + a
generated ``simt_entry`` that unpacks the launch record into the contract's parameter list.
Libraries are cached by the SHA-256 of everything that changes the binary (runtime header,
translation unit, flags, compiler version) under ``$SPARSERL_CACHE_DIR/simt`` or
``~/.cache/sparserl/simt``: written to a temporary file in that folder and renamed, so a
concurrent or interrupted build never leaves a partial library under a final name.

This module does not run anything; ``launch.py`` loads and launches the library.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from sparserl_compile.simt.errors import SimtCompileError, SimtUnavailable
from sparserl_compile.simt.rewrite import Prepared

RUNTIME_H = Path(__file__).with_name("runtime.h")
#: every header the translation unit includes (all part of the cache key)
HEADERS = (RUNTIME_H, Path(__file__).with_name("guard.h"))

FLAGS = (
    "-std=gnu++17", "-O2", "-fPIC", "-shared", "-pthread",
    "-fno-exceptions", "-fno-rtti", "-fno-strict-aliasing", "-fwrapv",
    "-ffp-contract=off",     # one rounding per operation, as the C source says
    "-U_FORTIFY_SOURCE",     # fibers switch stacks; fortified longjmp checks would misfire
    "-fvisibility=hidden", "-w", "-fmax-errors=20",
)


def cache_dir() -> Path:
    """``$SPARSERL_CACHE_DIR/simt`` or ``~/.cache/sparserl/simt``, created 0700.

    Refused when another user could write it: a library from there is loaded into the process.
    """
    root = os.environ.get("SPARSERL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sparserl")
    d = Path(root) / "simt"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.stat()
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        raise SimtUnavailable(
            f"{d} is writable by other users or not owned by you; a shared library loaded from "
            f"there could be replaced. Fix with: chmod 700 {d} (or set SPARSERL_CACHE_DIR)"
        )
    return d


def compiler() -> list[str]:
    """The C++ compiler command: ``$CXX`` or ``g++``."""
    cmd = shlex.split(os.environ.get("CXX", "g++"))
    if not cmd or shutil.which(cmd[0]) is None:
        raise SimtUnavailable(
            f"no C++ compiler {cmd[0] if cmd else ''!r} on PATH: the CPU executor builds kernels "
            f"with g++ (install it, e.g. apt-get install g++) or the compiler named by $CXX"
        )
    return cmd


@functools.lru_cache(maxsize=8)
def compiler_version(cmd: tuple[str, ...]) -> str:
    out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, check=False)
    return (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else "unknown"


def _entry(prep: Prepared) -> str:
    args = []
    for k, (ctype, _name) in enumerate(prep.params):
        if ctype == "int":
            args.append(f"(int)L->ival[{k}]")
            continue
        base = ctype.replace("__restrict__", "").strip()  # e.g. "const float*"
        elem = base[:-1].strip()
        if prep.guarded:
            args.append(
                f"GPtr<{elem}>(({base})L->ptr[{k}], (const char*)L->ptr[{k}], "
                f"(const char*)L->ptr[{k}] + L->nbytes[{k}], {k})"
            )
        else:
            args.append(f"({base})L->ptr[{k}]")
    sep = ",\n        "
    return f"static void simt_entry(const SimtLaunch* L) {{\n    sparserl_kernel(\n        {sep.join(args)});\n}}\n"


def translation_unit(prep: Prepared) -> str:
    """The complete C++ source g++ compiles for ``prep``."""
    return (
        f"#define SIMT_GUARDED {int(prep.guarded)}\n"
        f"#define SIMT_FIBERS {int(prep.uses_fibers)}\n"
        '#include "runtime.h"\n'
        '#line 1 "kernel.cu"\n'
        f"{prep.body}\n"
        '#line 1 "simt_entry.cpp"\n'
        f"{_entry(prep)}"
    )


def build(prep: Prepared) -> Path:
    """Compile ``prep`` (or find it in the cache); returns the shared library's path."""
    cmd = compiler()
    tu = translation_unit(prep)
    h = hashlib.sha256()
    for part in (*(p.read_bytes() for p in HEADERS), tu.encode(), " ".join(FLAGS).encode(),
                 compiler_version(tuple(cmd)).encode()):
        h.update(hashlib.sha256(part).digest())
    d = cache_dir()
    lib = d / f"{h.hexdigest()[:40]}.so"
    if lib.is_file():
        return lib
    with tempfile.TemporaryDirectory(dir=d, prefix=".build-") as tmp:
        src = Path(tmp) / "kernel.cpp"
        src.write_text(tu)
        out = Path(tmp) / "kernel.so"
        full = [*cmd, *FLAGS, "-I", str(RUNTIME_H.parent), str(src), "-o", str(out)]
        res = subprocess.run(full, capture_output=True, text=True, check=False)
        if res.returncode != 0 or not out.is_file():
            raise SimtCompileError(
                f"g++ could not build the kernel for the CPU executor (exit {res.returncode}); "
                f"line numbers in 'kernel.cu' are the kernel's own",
                res.stderr or res.stdout, prep.source, full,
            )
        fd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(out, lib)
    return lib
