"""The held-out split by source: whole collections of real matrices that no stage trains on.

The generated half of the held-out split (``data.is_held_out``) holds other-seed instances of
the generators the policy trains on: siblings of its training data. This split holds out instead
every real matrix of whole **source collections**, the repositories the shared folder's
``MANIFEST.json`` names in ``source_repo``: all of a collection's matrices or none, whatever
their kind, and never a generated matrix. The collections were chosen once, before any policy
was trained on this split: the three collections other than the two largest (``kahypar/kahypar``
and ``networkit/networkit``, which keep the training side its circuits, meshes, FEM, road and
social graphs), so that the held-out side has kinds of its own (sparse DNN layers, citation
graphs and features, a circuit, FEM and Groebner matrices, a random geometric graph) from
repositories the training side never saw.

The split is frozen in ``training/data/heldout_sources.json`` (the collections, and each
held-out matrix's name, kind and manifest source) whose SHA-256 is ``SOURCE_SPLIT_SHA256``:
``load`` refuses a file whose hash differs, so an edited split cannot pass for the frozen one.
``data.is_held_out`` holds these matrices out of every stage; ``sparserl eval --split source``
evaluates on them alone.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SOURCE_SPLIT_PATH = Path(__file__).parent / "data" / "heldout_sources.json"
#: the SHA-256 of the frozen file (``load`` checks it)
SOURCE_SPLIT_SHA256 = "ddd21254a7c7a7063cb0832626414aa46919bb89ee2bcbad3b75850c84732fb5"

#: the source collections held out (``MANIFEST.json`` ``source_repo``)
HELD_OUT_SOURCES = ("DrTimothyAldenDavis/SuiteSparse", "KaHIP/KaHIP", "tkipf/gcn")


@dataclass(frozen=True)
class SourceSplit:
    sources: tuple[str, ...]
    matrices: frozenset[str]
    sha256: str


def by_sources(manifest: list[dict], sources=HELD_OUT_SOURCES) -> dict:
    """The split file's content for ``manifest`` (``MANIFEST.json``'s entries): every matrix of
    the ``sources`` collections, by name."""
    known = {e.get("source_repo") for e in manifest}
    missing = sorted(set(sources) - known)
    if missing:
        raise ValueError(f"collections {missing} are in no MANIFEST.json entry's source_repo (known: {sorted(known)})")
    held = {e["name"]: {"kind": e.get("kind"), "source_repo": e["source_repo"], "source_path": e.get("source_path")}
            for e in manifest if e.get("source_repo") in sources}
    return {"rule": "every shared matrix whose MANIFEST.json source_repo is one of the held-out sources",
            "sources": sorted(sources), "matrices": dict(sorted(held.items()))}


def dumps(content: dict) -> bytes:
    """The file's bytes for ``content`` (sorted keys, one matrix a line)."""
    return (json.dumps(content, indent=1, sort_keys=True) + "\n").encode()


@lru_cache(maxsize=4)
def load(path: str | Path = SOURCE_SPLIT_PATH, sha256: str = SOURCE_SPLIT_SHA256) -> SourceSplit:
    """The frozen split, after checking the file's SHA-256 against ``sha256``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"the held-out source split {path} is missing: it ships in training/data/ "
                                "(reinstall the package or restore the file from the repository)")
    data = path.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise ValueError(f"{path} has SHA-256 {got}, not the frozen split's {sha256}: the held-out split was "
                         "edited. Restore the file from the repository; a new split is a new file and a new hash, "
                         "chosen before any training on it")
    content = json.loads(data)
    return SourceSplit(tuple(content["sources"]), frozenset(content["matrices"]), got)


def held_out_names() -> frozenset[str]:
    """The shared matrices of the frozen source split (hash checked)."""
    return load().matrices
