"""Supervision records (matrix -> measured kernel-space variants) and the held-out split.

Two JSON-lines formats are read (plain or ``.gz``), line by line, and may be mixed:

1. The H200 benchmark's per-variant lines (``sparserl_compile/suite.py``; the real file is
   ``training/data/h200_supervision_2026-12-02.jsonl.gz`` and
   ``h200_grid_supervision_2026-12-03.jsonl.gz`` beside it), one line per (matrix, op, n,
   kernel variant)::

    {"matrix": {"source": "generated", "generator": "stencil2d", "args": {"n": 100, "seed": 0}, "seed": 0}
             | {"source": "shared", "name": "bcsstk13"},
     "name": "stencil2d_100", "fingerprint": "...", "op": "spmv", "n": 1, "dtype": "f32",
     "arch": "sm_90", "variant": "csr_scalar[block=64]", "family": "csr_scalar",
     "params": {"block": 64}, "format": "csr", "kind": "ok" | <failure kind>,
     "kernel_us": 5.5, "graph_us": 2.07, "torch_int32_us": 16.9, "floor_us": 0.12}

   ``load_supervision`` groups them into one record per (matrix, op, n, dtype, arch), in
   first-seen order: the variant's time is ``kernel_us`` (the median kernel time the suite
   ranks by), ``None`` when ``kind`` is not ``"ok"``; ``reference_us`` is ``torch_int32_us``
   (torch.sparse with int32 indices, what the suite's speedups are over). ``graph_us`` and
   ``floor_us`` are kept on the record (``floor_us``) or dropped (``graph_us``).

2. Grouped records, one (matrix, op, dtype, n) per line (``record_to_json`` writes these;
   ``us`` is the verified median time, ``"us": null`` for a failed variant)::

    {"matrix": {"source": "generated", "generator": "banded", "kwargs": {"n": 4096, "half_bandwidth": 3, "seed": 1}}
             | {"source": "shared", "name": "bcsstk13"},
     "op": "spmv", "dtype": "f32", "n": 1,
     "variants": [{"family": "csr_vector", "params": {"threads": 8, "block": 256}, "us": 12.5}, ...],
     "reference_us": 30.1}

``record_from_json`` reads one grouped line; ``records_from_variant_lines`` groups format 1.

The held-out split (``is_held_out``) is deterministic and never trained on by any stage:

- shared matrices of the frozen **source split** (``source_split.py``): every matrix of whole
  source collections (``MANIFEST.json``'s ``source_repo``), from a file checked against its hash;
  ``sparserl eval --split source`` evaluates on these alone;
- shared matrices: the fixed list ``SHARED_HELD_OUT``, chosen once by the rule "within each
  ``kind`` of the full ``MANIFEST.json``, names sorted, every fourth one (positions 3, 7, 11,
  ...)" (``shared_held_out_by_rule`` recomputes it; a test checks they agree). The list is
  frozen so that a partial copy of the matrices (a trimmed copy for another machine, say) cannot
  move matrices between the splits;
- generated matrices: held out when BLAKE2b of ``generator`` + sorted ``kwargs`` (seed
  included) is 0 mod 5, i.e. about one in five, independently of the order of the file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
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
        info = self._shared_info()
        if info is None:
            raise FileNotFoundError(
                f"shared matrix {self.name!r} not found: set SPARSERL_SHARED_MATRICES to the folder "
                "holding MANIFEST.json"
            )
        if not info.path.is_file():
            raise FileNotFoundError(
                f"shared matrix {self.name!r} is in {info.path.parent / 'MANIFEST.json'} but its file "
                f"{info.path} is missing: copy it from ../shared/matrices (a trimmed copy must hold "
                "every matrix the supervision's training split names)")
        return matrices.load_npz(info.path)

    def present(self) -> bool:
        """Whether ``load`` finds the matrix: always for a generated one; for a shared one, a
        manifest entry whose file exists."""
        if self.source == "generated":
            return True
        info = self._shared_info()
        return info is not None and info.path.is_file()

    def _shared_info(self):
        """This shared matrix's manifest entry (``MatrixInfo``), None where the manifest lacks it."""
        from sparserl_compile import matrices

        return next((i for i in matrices.shared_manifest() if i.name == self.name), None)


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
    floor_us: float | None = None  # bytes / measured bandwidth (suite lines only)

    def best(self) -> Variant | None:
        ok = [v for v in self.variants if v.us is not None]
        return min(ok, key=lambda v: v.us) if ok else None


def matrix_ref_from_json(m: dict) -> MatrixRef:
    src = m.get("source")
    if src == "generated":
        kwargs = dict(m.get("kwargs", m.get("args", {})))
        if "seed" in m:  # the suite writes the seed beside the generator's args
            kwargs.setdefault("seed", m["seed"])
        return MatrixRef("generated", m["generator"], tuple(sorted(kwargs.items())))
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
                                 _opt_float(obj.get("reference_us")), _opt_float(obj.get("floor_us")))
    except KeyError as e:
        raise ValueError(f"supervision record lacks {e}: {json.dumps(obj)[:200]}") from None


def record_to_json(r: SupervisionRecord) -> dict:
    m = ({"source": "shared", "name": r.matrix.name} if r.matrix.source == "shared"
         else {"source": "generated", "generator": r.matrix.generator, "kwargs": dict(r.matrix.kwargs)})
    return {"matrix": m, "op": r.op, "dtype": r.dtype, "n": r.n,
            "variants": [{"family": v.family, "params": dict(v.params), "us": v.us} for v in r.variants],
            "reference_us": r.reference_us, "floor_us": r.floor_us}


def _opt_float(x) -> float | None:
    return None if x is None else float(x)


def is_variant_line(obj: dict) -> bool:
    """Whether ``obj`` is one of the benchmark suite's per-variant lines (format 1)."""
    return "variants" not in obj and "family" in obj and "kernel_us" in obj


def records_from_variant_lines(lines: list[tuple[int, dict]], where: str = "") -> list[SupervisionRecord]:
    """Group per-variant lines (``(line_number, obj)``) into records, first-seen order.

    A variant whose ``kind`` is not ``"ok"`` (or that has no ``kernel_us``) gets ``us=None``.
    A group whose lines disagree on ``torch_int32_us`` keeps the first non-null one.
    """
    groups: dict[tuple, dict] = {}
    for i, obj in lines:
        try:
            ref = matrix_ref_from_json(obj["matrix"])
            key = (ref, obj["op"], int(obj.get("n", 1)), obj.get("dtype", "f32"), obj.get("arch"))
            ok = obj.get("kind", "ok") == "ok" and obj.get("kernel_us") is not None
            v = Variant(obj["family"], tuple(sorted((obj.get("params") or {}).items())),
                        float(obj["kernel_us"]) if ok else None)
        except KeyError as e:
            raise ValueError(f"{where}:{i}: supervision line lacks {e}: {json.dumps(obj)[:200]}") from None
        g = groups.setdefault(key, {"variants": [], "ref": None, "floor": None})
        g["variants"].append(v)
        g["ref"] = g["ref"] if g["ref"] is not None else _opt_float(obj.get("torch_int32_us"))
        g["floor"] = g["floor"] if g["floor"] is not None else _opt_float(obj.get("floor_us"))
    return [SupervisionRecord(ref, op, dtype, n, tuple(g["variants"]), g["ref"], g["floor"])
            for (ref, op, n, dtype, _arch), g in groups.items()]


def _read_lines(path: Path) -> list[str]:
    if path.suffix == ".gz":
        import gzip

        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read().splitlines()
    return path.read_text(encoding="utf-8").splitlines()


#: the H200 supervision files every stage reads by default (the scale-up and shared suite of
#: 2026-12-02, the generated grids of 2026-12-03); ``--data`` takes such a comma list
DEFAULT_SUPERVISION = ("training/data/h200_supervision_2026-12-02.jsonl.gz,"
                       "training/data/h200_grid_supervision_2026-12-03.jsonl.gz,"
                       "training/data/h200_grid2_supervision_2026-12-03.jsonl.gz")


def load_supervision(path: str | Path | Sequence[str | Path]) -> list[SupervisionRecord]:
    """Read supervision files (JSON lines, optionally gzipped, either format of the module
    docstring): one path, a comma list of paths or a sequence of them, records in file order;
    errors name the file and line. Within a file grouped records come first, then the grouped
    per-variant lines."""
    if isinstance(path, (list, tuple)) or (isinstance(path, str) and "," in path):
        parts = [p for p in (path.split(",") if isinstance(path, str) else path) if str(p).strip()]
        return [r for p in parts for r in load_supervision(Path(str(p).strip()))]
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"supervision file {path} does not exist (the default files ship in training/data/; see docs/policy.md)")
    out, variant_lines = [], []
    for i, line in enumerate(_read_lines(path), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if is_variant_line(obj):
                variant_lines.append((i, obj))
            else:
                out.append(record_from_json(obj))
        except (ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}:{i}: {e}") from None
    return out + records_from_variant_lines(variant_lines, str(path))


@lru_cache(maxsize=1)
def _shared_kinds() -> dict[str, str]:
    from sparserl_compile.matrices import shared_manifest

    return {m.name: m.kind for m in shared_manifest()}


#: the shared matrices no stage trains on (see the module docstring for how they were chosen)
SHARED_HELD_OUT = frozenset({"bcsstk25", "cora_features", "fe_body", "hep-th", "rajat01", "shuttle_eddy", "uk"})


def shared_held_out_by_rule(kinds: dict[str, str] | None = None) -> frozenset[str]:
    """The rule behind ``SHARED_HELD_OUT`` applied to a manifest's name -> kind map (default:
    the shared folder's): per kind, names sorted, positions 3, 7, 11, ..."""
    by_kind: dict[str, list[str]] = {}
    for name, kind in (_shared_kinds() if kinds is None else kinds).items():
        by_kind.setdefault(kind, []).append(name)
    return frozenset(n for names in by_kind.values() for i, n in enumerate(sorted(names)) if i % 4 == 3)


def is_held_out(ref: MatrixRef) -> bool:
    """Whether ``ref`` belongs to the evaluation split (see the module docstring)."""
    if ref.source == "shared":
        from sparserl_compile.training.source_split import held_out_names

        return str(ref.name) in SHARED_HELD_OUT or str(ref.name) in held_out_names()
    key = json.dumps([ref.generator, sorted((k, v) for k, v in ref.kwargs)], default=str)
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % 5 == 0


@dataclass
class Split:
    train: list[SupervisionRecord] = field(default_factory=list)
    held_out: list[SupervisionRecord] = field(default_factory=list)

    def summary(self) -> str:
        """Record and matrix counts per side, e.g. for logs and docs."""
        def side(rs):
            return f"{len(rs)} records / {len({r.matrix for r in rs})} matrices"
        return f"train {side(self.train)}, held out {side(self.held_out)}"


def split(records: list[SupervisionRecord]) -> Split:
    """Records -> train / held-out (``is_held_out`` on each record's matrix)."""
    s = Split()
    for r in records:
        (s.held_out if is_held_out(r.matrix) else s.train).append(r)
    return s
