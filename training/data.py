"""Supervision records (matrix -> measured kernel-space variants) and the held-out split.

Until the H200 benchmark's own file format is fixed, records are JSON lines of this schema
(one (matrix, op, dtype, n) per line; ``us`` is the verified median time, a variant that failed
verification has ``"us": null``)::

    {"matrix": {"source": "generated", "generator": "banded", "kwargs": {"n": 4096, "half_bandwidth": 3, "seed": 1}}
             | {"source": "shared", "name": "bcsstk13"},
     "op": "spmv", "dtype": "f32", "n": 1,
     "variants": [{"family": "csr_vector", "params": {"threads": 8, "block": 256}, "us": 12.5}, ...],
     "reference_us": 30.1}

``record_from_json`` is the one function to change when the real format arrives.

The held-out split (``is_held_out``) is deterministic and never trained on by any stage:

- shared matrices: within each ``kind`` of ``MANIFEST.json``, names sorted, every fourth one
  (positions 3, 7, 11, ...) is held out -- every kind with four or more matrices contributes;
- generated matrices: held out when BLAKE2b of ``generator`` + sorted ``kwargs`` (seed
  included) is 0 mod 5, i.e. about one in five, independently of the order of the file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import scipy.sparse as sp


@dataclass(frozen=True)
class MatrixRef:
    """Where a matrix comes from: a seeded generator or a shared matrix by name."""

    source: str  # "generated" or "shared"
    generator: str | None = None
    kwargs: tuple[tuple[str, object], ...] = ()
    name: str | None = None

    @property
    def label(self) -> str:
        if self.source == "shared":
            return str(self.name)
        return f"{self.generator}({', '.join(f'{k}={v}' for k, v in self.kwargs)})"

    @property
    def kind(self) -> str:
        """The matrix kind: the manifest's for shared matrices, the generator's name otherwise."""
        if self.source == "shared":
            return _shared_kinds().get(str(self.name), "shared")
        return str(self.generator)

    def load(self) -> sp.csr_matrix:
        from sparserl_compile import matrices

        if self.source == "generated":
            return matrices.generate(self.generator, **dict(self.kwargs))
        for info in matrices.shared_manifest():
            if info.name == self.name:
                return matrices.load_npz(info.path)
        raise FileNotFoundError(
            f"shared matrix {self.name!r} not found: set SPARSERL_SHARED_MATRICES to the folder "
            "holding MANIFEST.json"
        )


@dataclass(frozen=True)
class Variant:
    family: str
    params: tuple[tuple[str, object], ...]
    us: float | None  # None: failed to compile or verify


@dataclass(frozen=True)
class SupervisionRecord:
    matrix: MatrixRef
    op: str
    dtype: str
    n: int
    variants: tuple[Variant, ...]
    reference_us: float | None = None  # torch.sparse / cuSPARSE time

    def best(self) -> Variant | None:
        ok = [v for v in self.variants if v.us is not None]
        return min(ok, key=lambda v: v.us) if ok else None


def matrix_ref_from_json(m: dict) -> MatrixRef:
    src = m.get("source")
    if src == "generated":
        return MatrixRef("generated", m["generator"], tuple(sorted(m.get("kwargs", {}).items())))
    if src == "shared":
        return MatrixRef("shared", name=m["name"])
    raise ValueError(f"matrix source {src!r}: expected 'generated' or 'shared' in {m}")


def record_from_json(obj: dict) -> SupervisionRecord:
    """One line of the supervision file -> a record (adapt here to the H200 file format)."""
    try:
        variants = tuple(Variant(v["family"], tuple(sorted(v.get("params", {}).items())),
                                 None if v.get("us") is None else float(v["us"]))
                         for v in obj["variants"])
        return SupervisionRecord(matrix_ref_from_json(obj["matrix"]), obj["op"], obj.get("dtype", "f32"),
                                 int(obj.get("n", 1)), variants,
                                 None if obj.get("reference_us") is None else float(obj["reference_us"]))
    except KeyError as e:
        raise ValueError(f"supervision record lacks {e}: {json.dumps(obj)[:200]}") from None


def record_to_json(r: SupervisionRecord) -> dict:
    m = ({"source": "shared", "name": r.matrix.name} if r.matrix.source == "shared"
         else {"source": "generated", "generator": r.matrix.generator, "kwargs": dict(r.matrix.kwargs)})
    return {"matrix": m, "op": r.op, "dtype": r.dtype, "n": r.n,
            "variants": [{"family": v.family, "params": dict(v.params), "us": v.us} for v in r.variants],
            "reference_us": r.reference_us}


def load_supervision(path: str | Path) -> list[SupervisionRecord]:
    """Read a JSON-lines supervision file; errors name the line."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(record_from_json(json.loads(line)))
        except (ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}:{i}: {e}") from None
    return out


@lru_cache(maxsize=1)
def _shared_kinds() -> dict[str, str]:
    from sparserl_compile.matrices import shared_manifest

    return {m.name: m.kind for m in shared_manifest()}


@lru_cache(maxsize=1)
def _shared_held_out() -> frozenset[str]:
    by_kind: dict[str, list[str]] = {}
    for name, kind in _shared_kinds().items():
        by_kind.setdefault(kind, []).append(name)
    return frozenset(n for names in by_kind.values() for i, n in enumerate(sorted(names)) if i % 4 == 3)


def is_held_out(ref: MatrixRef) -> bool:
    """Whether ``ref`` belongs to the evaluation split (see the module docstring)."""
    if ref.source == "shared":
        return str(ref.name) in _shared_held_out()
    key = json.dumps([ref.generator, sorted((k, v) for k, v in ref.kwargs)], default=str)
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % 5 == 0


@dataclass
class Split:
    train: list[SupervisionRecord] = field(default_factory=list)
    held_out: list[SupervisionRecord] = field(default_factory=list)


def split(records: list[SupervisionRecord]) -> Split:
    s = Split()
    for r in records:
        (s.held_out if is_held_out(r.matrix) else s.train).append(r)
    return s
