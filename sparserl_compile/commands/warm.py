"""sparserl warm: compile sparserl's numba code into its disk cache once per install, instead
of in the first process that uses it.

The format converters (``formats``) and the structure statistics (``structure``) run under numba
with ``cache=True``: the first process after an install compiles them (seconds) and writes
numba's disk cache; every later process loads it. Until then the cost lands on a user's first
product on a new structure, in the process and in its sandbox worker; ``miss.prewarm`` hides it
only in processes that call it.

Where numba keeps the cache: ``NUMBA_CACHE_DIR`` when set, else a ``__pycache__`` beside the
sources when writable, else a per-user directory. An image whose package directory the
serving user cannot write would have each fresh container compile again into that user's own
cache: set ``NUMBA_CACHE_DIR`` to a directory the serving user can write and run
``sparserl warm`` once at build time (numba also needs to write there when it loads).

    sparserl warm [--json report.json]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def numba_functions() -> list:
    """sparserl's disk-cached numba dispatchers of the runtime (``formats``, ``graphformats``,
    ``structure``), by module order. ``graphs`` (the graph generators of the benchmarks and
    examples) compiles on its first use instead: no product needs it."""
    from numba.core.registry import CPUDispatcher

    from sparserl_compile import formats, graphformats, structure

    out = []
    for mod in (formats, graphformats, structure):
        for name in sorted(vars(mod)):
            f = getattr(mod, name)
            if isinstance(f, CPUDispatcher) and getattr(f, "_cache", None) is not None \
                    and type(f._cache).__name__ != "NullCache":
                out.append(f)
    return out


def _misses(f) -> int:
    return sum(f.stats.cache_misses.values())


def _cache_path(f) -> Path | None:
    try:  # numba's FunctionCache: where this function's index and code go
        return Path(f._cache._cache_path)
    except AttributeError:
        return None


def _index_written(f) -> bool:
    try:
        return Path(f._cache._cache_file._index_path).is_file()
    except AttributeError:
        return False


def warm() -> dict:
    """Compile (or load) every disk-cached numba function for the types the runtime passes
    (``formats.warm``) and report: ``seconds``; ``functions``; ``compiled`` (those numba had
    to compile: not in the cache before); ``cached`` (those whose cache index is on disk now);
    ``cache_dirs``."""
    from sparserl_compile import formats

    fns = numba_functions()
    before = {f: _misses(f) for f in fns}
    t0 = time.perf_counter()
    formats.warm()
    seconds = time.perf_counter() - t0
    return {
        "seconds": round(seconds, 3),
        "functions": [f"{f.py_func.__module__}.{f.__name__}" for f in fns],
        "compiled": sorted(f"{f.py_func.__module__}.{f.__name__}" for f in fns if _misses(f) > before[f]),
        "cached": sorted(f"{f.py_func.__module__}.{f.__name__}" for f in fns if _index_written(f)),
        "cache_dirs": sorted({str(p) for p in map(_cache_path, fns) if p is not None}),
    }


def add_cli(sub) -> None:
    p = sub.add_parser("warm", help="compile sparserl's numba code into its disk cache (once per install)",
                       description="Compile sparserl's numba code (format converters, structure statistics) "
                                   "into numba's disk cache once per install, instead of in the first "
                                   "process that uses it.")
    p.add_argument("--json", help="also write the report here")
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    r = warm()
    n, missing = len(r["functions"]), sorted(set(r["functions"]) - set(r["cached"]))
    print(f"sparserl warm: {n} numba functions, {len(r['compiled'])} compiled now, "
          f"{n - len(r['compiled'])} loaded from the cache, {r['seconds']:.2f} s")
    for d in r["cache_dirs"]:
        print(f"  cache: {d}")
    if args.json:
        from sparserl_compile.fileio import write_json

        write_json(args.json, r)
    if missing:
        print(f"sparserl warm: no cache index on disk for {', '.join(missing)}: numba could not write "
              "its cache; set NUMBA_CACHE_DIR to a directory this user can write and run it again", file=sys.stderr)
        return 1
    return 0
