"""Build ``.device_carry/`` for a training call on a remote GPU machine: ``python benchmarks/device_carry.py``.

That machine cannot read ``../shared`` and a call carries at most 64 MiB, the tracked tree
(about 45 MB on disk, two 15.6 MB checkpoints among it) included. The whole shared folder (35 MB) does
not fit beside a carried checkpoint, so this copies a trimmed one:

- ``MANIFEST.json`` whole (the held-out split is a frozen list, so a trimmed copy moves no
  matrix between the splits: ``training.data``);
- every training-side matrix the supervision files name (SFT and RAFT's replayed examples
  read them);
- the training-side matrices of the kinds RL's ``shared:KIND`` sources draw
  (``SHARED_MIX_KINDS``: the ``--unlabelled-mix`` and ``--validate-mix`` of the shipped runs)
  whose file is under ``--max-bytes``; with the default 1 MB these are sixteen matrices, the
  ones ``training.validation --count 48 --seed 7`` drew its recorded problems from;
- the held-out matrices, unless ``--no-held-out``: the per-kind list, and those of the source
  split (``training/source_split.py``) that the supervision files name (SFT's held-out loss and
  ``sparserl eval`` read them; without them SFT skips those records and says so).

``--checkpoint NAME=REV`` also writes a committed checkpoint of an earlier revision to
``.device_carry/NAME`` (``v1=b78a58b``: version 1, where version 2's SFT stage started); with
``--pack`` as ``.device_carry/NAME.tgz`` instead, 1.1 MB smaller, which ``device_train.sh`` unpacks
when ``SFT_INIT`` or ``RL_INIT`` names it (carry the ``.tgz`` by its own path). ``--wheel``
downloads llguidance's wheel for that machine's Python into ``.whl`` (it has no network).

The last line says how much of the 64 MiB the call will carry, counted as the machine counts it:
the blocks the files take on disk (``du``), not their bytes, which for the tree's 500 files is
about 1 MB more.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from sparserl_compile.training.data import SHARED_HELD_OUT

#: the ``shared:KIND`` sources of the shipped RL runs' problem mixes
SHARED_MIX_KINDS = ("social_powerlaw", "gnn_citation", "road_planar", "mesh", "circuit")
CARRY_LIMIT = 64 * 2**20
CHECKPOINT_FILES = ("README.md", "config.json", "model.safetensors", "tokenizer.json", "training_log.json")
#: llguidance for the GPU machine's Python 3.12 (x86_64); pip matches the manylinux tag exactly
WHEEL_COMMAND = ("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                 "cp", "--platform", "manylinux_2_31_x86_64", "--platform", "manylinux_2_28_x86_64",
                 "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64")
REPO = Path(__file__).resolve().parent.parent


def carry_selection(max_bytes: int = 1_000_000, held_out: bool = True, kinds=SHARED_MIX_KINDS,
                    supervision=None) -> list:
    """The shared matrices (``MatrixInfo``) a training call needs, by the rules of the module
    doc, in manifest order; [] without the shared folder."""
    from sparserl_compile import matrices
    from sparserl_compile.training.data import DEFAULT_SUPERVISION, load_supervision
    from sparserl_compile.training.unlabelled import shared_sources

    records = load_supervision((supervision or DEFAULT_SUPERVISION).split(","))
    named = {r.matrix.name for r in records if r.matrix.source == "shared"}
    train = {i.name for i in shared_sources()  # present and training-side
             if i.name in named or (i.kind in kinds and i.path.stat().st_size < max_bytes)}
    from sparserl_compile.training.source_split import held_out_names

    held = SHARED_HELD_OUT | (held_out_names() & named)  # the source split's that records name
    return [i for i in matrices.shared_manifest() if i.name in train
            or (held_out and i.path.is_file() and i.name in held)]


def disk_bytes(path: Path) -> int:
    """What one file counts toward the carry limit: the blocks it takes on disk, as ``du`` counts
    them (module doc), never less than its size."""
    st = path.stat()
    return max(st.st_size, st.st_blocks * 512)


def tracked_bytes(repo: Path = REPO) -> int:
    """Bytes on disk of the files git tracks (what every device call carries), 0 outside a checkout."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(disk_bytes(repo / n) for n in names.decode().split("\0") if n and (repo / n).is_file())


def folder_bytes(path: Path) -> int:
    if path.is_file():
        return disk_bytes(path)
    return sum(disk_bytes(f) for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def write_checkpoint(name: str, rev: str, dest: Path, repo: Path = REPO, pack: bool = False) -> Path:
    """``policy/checkpoints/default`` as committed at ``rev``, into ``dest/name``; with ``pack``
    into ``dest/name.tgz`` (the files at its top level), and no folder."""
    out = dest / name
    out.mkdir(parents=True, exist_ok=True)
    for f in CHECKPOINT_FILES:
        blob = subprocess.run(["git", "show", f"{rev}:policy/checkpoints/default/{f}"], cwd=repo,
                              capture_output=True)
        if blob.returncode != 0:
            raise SystemExit(f"--checkpoint {name}={rev}: git show found no policy/checkpoints/default/{f} at {rev} "
                             f"({blob.stderr.decode().strip()}); name a revision of this repository")
        (out / f).write_bytes(blob.stdout)
    if not pack:
        return out
    tgz = dest / f"{name}.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        for f in CHECKPOINT_FILES:
            tar.add(out / f, arcname=f)
    shutil.rmtree(out)
    return tgz


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/device_carry.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=str(REPO / ".device_carry"), help="the folder to fill (default .device_carry)")
    ap.add_argument("--max-bytes", type=int, default=1_000_000,
                    help="largest file of the mix kinds' matrices to copy (default 1 MB)")
    ap.add_argument("--no-held-out", action="store_true", help="leave out the held-out matrices")
    ap.add_argument("--checkpoint", action="append", default=[], metavar="NAME=REV",
                    help="also write the default checkpoint committed at REV to DEST/NAME (e.g. v1=b78a58b)")
    ap.add_argument("--pack", action="store_true",
                    help="write each --checkpoint as DEST/NAME.tgz (1.1 MB smaller; device_train.sh unpacks it)")
    ap.add_argument("--wheel", action="store_true", help="also download llguidance's wheel into .whl")
    args = ap.parse_args(argv)
    from sparserl_compile import matrices

    src = matrices.shared_matrices_dir()
    if src is None:
        print("no shared folder: set SPARSERL_SHARED_MATRICES to the folder holding MANIFEST.json", file=sys.stderr)
        return 2
    dest = Path(args.dest)
    mdir = dest / "matrices"
    if mdir.exists():
        shutil.rmtree(mdir)
    mdir.mkdir(parents=True)
    shutil.copy2(src / "MANIFEST.json", mdir / "MANIFEST.json")
    chosen = carry_selection(args.max_bytes, held_out=not args.no_held_out)
    for i in chosen:
        shutil.copy2(i.path, mdir / i.path.name)
    print(f"{mdir}: {len(chosen)} matrices, {folder_bytes(mdir) / 1e6:.1f} MB ({', '.join(i.name for i in chosen)})")
    for spec in args.checkpoint:
        name, _, rev = spec.partition("=")
        if not name or not rev:
            print(f"--checkpoint {spec!r}: use NAME=REV, e.g. v1=b78a58b", file=sys.stderr)
            return 2
        print(f"{write_checkpoint(name, rev, dest, pack=args.pack)}: the default checkpoint at {rev}")
    whl = REPO / ".whl"
    if args.wheel:
        from importlib.metadata import version  # the llguidance this environment runs is the one to carry

        subprocess.run([sys.executable, "-m", "pip", *WHEEL_COMMAND, "-d", str(whl),
                        f"llguidance=={version('llguidance')}"], check=True)
    total = tracked_bytes() + folder_bytes(dest) + folder_bytes(whl)
    print(f"a call carrying {dest.name} and .whl takes {total / 1e6:.1f} MB on disk of the {CARRY_LIMIT / 1e6:.1f} MB "
          "limit" + ("" if total <= CARRY_LIMIT else ": too much, carry fewer checkpoints, pass --pack or --no-held-out"))
    return 0 if total <= CARRY_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
