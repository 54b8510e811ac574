"""``sparserl cache``: inspect, repair and merge kernel cache folders.

``sparserl cache [--dir DIR] ACTION``, ACTION one of ``ls``, ``show KEY``, ``clear --yes``,
``verify``, ``merge SRC... --into DST``. ``--dir`` may be given before or after the action.
Errors go to stderr and exit with status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
import warnings

from sparserl_compile import merge
from sparserl_compile.cache import CacheWarning, KernelCache


def _age(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit}"
    return f"{s:.0f}s"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _open(args, write: bool = False) -> KernelCache | None:
    """The folder of ``--dir`` (never created: these commands inspect); ``write``: the command
    removes files, so a read-only folder is an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        c = KernelCache(args.dir, create=False)
    if not c.readable:
        print(f"error: cannot use the cache folder: {c.disabled_reason}", file=sys.stderr)
        return None
    if write and not c.on_disk:
        print(f"error: cannot change the cache folder: {c.read_only_reason}", file=sys.stderr)
        return None
    return c


def _cmd_ls(args) -> int:
    c = _open(args)
    if c is None:
        return 1
    items = c.ls()
    cubins = _cubin_note(c.directory)
    if not items:
        print(f"{c.directory}: no kernel entries" + (f" ({cubins})" if cubins else ""))
        return 0
    rows = [["DIGEST", "OP", "DTYPE", "WIDTH", "ARCH", "VERDICT", "KERNEL_US", "REF_US", "DENSE_US", "SIZE", "AGE"]]
    for x in items:
        if x.entry is None:
            rows.append([x.digest[:12], "?", "?", "?", "?", "CORRUPT", "-", "-", "-", str(x.size), "-"])
            continue
        e, k = x.entry, x.entry.key
        fmt = lambda v: f"{v:.2f}" if isinstance(v, (int, float)) else "-"  # noqa: E731
        rows.append([x.digest[:12], k.op, k.dtype, str(k.width), k.arch,
                     e.outcome, fmt(e.times.get("kernel_us")), fmt(e.times.get("reference_us")),
                     fmt(e.times.get("dense_us")),
                     str(x.size), _age(e.created)])
    print(_table(rows))
    print(f"{len(items)} entries in {c.directory}" + (f" ({cubins})" if cubins else ""))
    return 0


def _cubin_note(directory) -> str:
    """What the NVRTC compile cache beside the entries holds (``compiler``'s ``cubin/``
    subfolder: compiled candidates, kept so the same source is not compiled twice)."""
    d = directory / "cubin"
    if not d.is_dir():
        return ""
    files = [f for f in d.rglob("*") if f.is_file() and not f.is_symlink()]
    if not files:
        return ""
    mb = sum(f.stat().st_size for f in files) / 2**20
    return f"and {len(files)} compiled candidates ({mb:.1f} MB) in the compile cache {d}"


def _cmd_show(args) -> int:
    c = _open(args)
    if c is None:
        return 1
    hits = c.find(args.key)
    if not hits:
        print(f"error: no entry of {c.directory} has a digest starting with {args.key!r}; list them with "
              "`sparserl cache ls` (and --dir for another folder)", file=sys.stderr)
        return 1
    if len(hits) != 1:
        print(f"error: {len(hits)} entries match {args.key!r}; give a longer digest prefix (see `sparserl cache ls`)", file=sys.stderr)
        return 1
    x = hits[0]
    if x.entry is None:
        print(f"{x.path}: CORRUPT ({x.problem}); `sparserl cache verify` removes it", file=sys.stderr)
        return 1
    e = x.entry
    print(f"entry   {x.path}")
    for k, v in dataclasses.asdict(e.key).items():
        print(f"key.{k:<22} {v}")
    print("verdict " + ("reference wins (no kernel)" if e.reference_wins else
                        "dense product wins (no kernel; the matrix is kept stored dense)" if e.dense_wins else
                        f"kernel, cubin {len(e.cubin)} bytes sha256 {hashlib.sha256(e.cubin).hexdigest()[:16]}"))
    print(f"times   {json.dumps(e.times, sort_keys=True)}")
    print(f"verify  {json.dumps(e.verification, sort_keys=True)}")
    print(f"created {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e.created))}")
    if e.source:
        print("source:\n" + e.source.rstrip())
    return 0


def _cmd_clear(args) -> int:
    c = _open(args, write=True)
    if c is None:
        return 1
    n = c.count_files()
    if not args.yes:
        print(f"would remove {n} entries from {c.directory}; run again with --yes to remove them")
        return 1
    print(f"removed {c.clear()} entries from {c.directory}")
    return 0


def _cmd_verify(args) -> int:
    c = _open(args, write=True)
    if c is None:
        return 1
    r = c.verify()
    for p in r.removed:
        print(f"removed {p}")
    for p in r.failed:
        print(f"error: {p}", file=sys.stderr)
    print(f"{r.valid} valid entries, {len(r.removed)} removed"
          + (f", {len(r.failed)} corrupt and not removable" if r.failed else "") + f" in {c.directory}")
    return 1 if r.failed else 0


def add_cli(subparsers) -> None:
    """``sparserl cache ls | show KEY | clear [--yes] | verify | merge SRC... --into DST``."""
    dir_help = "cache folder (default $SPARSERL_CACHE_DIR or ~/.cache/sparserl)"
    p = subparsers.add_parser("cache", help="inspect, repair or merge kernel cache folders",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help=dir_help)
    # --dir also after the action (`sparserl cache ls --dir X`); SUPPRESS keeps one given before
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", default=argparse.SUPPRESS, help=dir_help)
    sub = p.add_subparsers(dest="cache_command", metavar="ACTION")
    sub.add_parser("ls", parents=[common], help="list entries").set_defaults(func=_cmd_ls)
    s = sub.add_parser("show", parents=[common], help="show one entry by digest prefix")
    s.add_argument("key", help="digest or a unique prefix of it")
    s.set_defaults(func=_cmd_show)
    c = sub.add_parser("clear", parents=[common], help="remove every entry")
    c.add_argument("--yes", action="store_true", help="really remove them")
    c.set_defaults(func=_cmd_clear)
    sub.add_parser("verify", parents=[common],
                   help="check every entry (hash, signature, owner, mode) and remove bad ones"
                   ).set_defaults(func=_cmd_verify)
    _add_merge(sub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _cmd_merge(args) -> int:
    try:
        report = merge.merge_caches(args.sources, args.into, prefer_faster=args.prefer_faster)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for note in report.warnings:
        print(f"warning: {note}", file=sys.stderr)
    for why in report.refused:
        print(f"error: not merged: {why}", file=sys.stderr)
    for a in report.actions:
        if a.outcome in ("corrupt", "failed", "kept", "replaced"):
            label = {"corrupt": "skipped corrupt entry"}.get(a.outcome, a.outcome)
            print(f"{label} {a.digest[:12]} from {a.source}: {a.detail}")
    print(f"merged into {report.into}: {report.summary()}")
    return 1 if report.count("failed") or report.refused else 0


def _add_merge(cache_subparsers) -> None:
    """Add ``merge`` to the ``sparserl cache`` actions."""
    p = cache_subparsers.add_parser("merge", help="merge cache folders of several ranks/machines into one",
                                    description=merge.__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+", metavar="SRC", help="cache folders to read (e.g. kernels/rank0 kernels/rank1)")
    p.add_argument("--into", required=True, metavar="DST", help="cache folder to fill (created 0700)")
    p.add_argument("--prefer-faster", action="store_true",
                   help="on a conflict keep the faster entry when both are timed (default: keep the existing one)")
    p.set_defaults(func=_cmd_merge)
