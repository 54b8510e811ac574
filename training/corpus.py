"""The pretraining corpus: CUDA/C++ text found on this machine at run time, plus kernels
rendered from the hand-written families.

Sources, each optional (a missing one is skipped and reported with 0 files):

- ``cuda_toolkit``: headers under ``$CUDA_HOME/include`` (default ``/usr/local/cuda/include``),
  CCCL (CUB, Thrust, libcu++) included;
- ``nvidia_wheels``: ``include/`` folders of installed ``nvidia-*`` wheels (cuda-nvrtc, cccl...);
- ``cupy``: CuPy's ``.cu``/``.cuh`` sources and headers, when CuPy is installed;
- ``torch``: the CUDA headers shipped in torch's ``include/`` (ATen/cuda, c10/cuda);
- ``kernel_space``: every point of ``sparserl_compile.kernels`` rendered as text (skipped until
  the kernel families expose ``FAMILIES``/``render``).

Files are read as UTF-8 (undecodable bytes replaced), deduplicated by SHA-256 of the text,
files over ``max_file_bytes`` skipped, and the total capped at ``max_bytes`` (sources are
visited in the order above, so the cap trims the largest, least relevant ones last). Nothing
is downloaded and nothing is written into the repository: ``build_corpus`` returns text in
memory, and ``save_corpus`` writes a JSON-lines file wherever the caller says.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".inl", ".cuhpp")


@dataclass
class CorpusDoc:
    source: str  # which source it came from (see the module docstring)
    path: str  # file path, or family/params for rendered kernels
    text: str


@dataclass
class CorpusStats:
    files: dict[str, int] = field(default_factory=dict)  # kept files per source
    bytes: dict[str, int] = field(default_factory=dict)  # kept bytes per source
    duplicates: int = 0  # files dropped as exact duplicates
    oversized: int = 0  # files over max_file_bytes
    capped: bool = False  # the byte cap was reached

    @property
    def total_files(self) -> int:
        return sum(self.files.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def summary(self) -> str:
        rows = [f"{s:14s} {self.files.get(s, 0):7d} files {self.bytes.get(s, 0) / 1e6:9.2f} MB"
                for s in sorted(set(self.files) | set(self.bytes))]
        rows.append(f"{'total':14s} {self.total_files:7d} files {self.total_bytes / 1e6:9.2f} MB"
                    f"  ({self.duplicates} duplicates, {self.oversized} oversized dropped"
                    f"{', capped' if self.capped else ''})")
        return "\n".join(rows)


@dataclass
class Corpus:
    docs: list[CorpusDoc]
    stats: CorpusStats

    def texts(self) -> list[str]:
        return [d.text for d in self.docs]


def source_files(root: Path) -> Iterator[Path]:
    """The CUDA and C++ sources under ``root`` (``SUFFIXES``), in a stable order; none where it
    is not a folder."""
    if not root.is_dir():
        return
    for dirpath, _, names in os.walk(root):
        for n in sorted(names):
            if n.endswith(SUFFIXES):
                yield Path(dirpath) / n


def cuda_toolkit_roots() -> list[Path]:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return [Path(home) / "include"]


def nvidia_wheel_roots() -> list[Path]:
    roots = []
    for p in sys.path:
        d = Path(p) / "nvidia"
        if d.is_dir():
            roots += sorted(x for x in d.glob("*/include") if x.is_dir())
            roots += sorted(x for x in d.glob("cu*/include") if x.is_dir() and x not in roots)
    return roots


def cupy_roots() -> list[Path]:
    try:
        import importlib.util

        spec = importlib.util.find_spec("cupy")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    base = Path(list(spec.submodule_search_locations)[0])
    return [base / "_core" / "include", base / "_core", base / "cuda"]


def torch_roots() -> list[Path]:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return []
    inc = Path(torch.__file__).parent / "include"
    return [inc / "ATen" / "cuda", inc / "ATen" / "native" / "cuda", inc / "c10" / "cuda"]


def rendered_kernels() -> Iterator[tuple[str, str]]:
    """(name, source) for every family point, when the kernel families are importable."""
    try:
        from sparserl_compile import kernels
    except ImportError:
        return
    families = getattr(kernels, "FAMILIES", None)
    if not families:
        return
    for fam in (families.values() if isinstance(families, dict) else families):
        for op in fam.ops:
            for dtype in ("f32", "f16", "bf16"):
                try:
                    points = fam.space(op, dtype)
                except Exception:  # a family without this dtype
                    continue
                for params in points:
                    if fam.needs_structure:
                        continue  # structure-baked kernels need a matrix; SFT covers them
                    try:
                        cand = fam.render(op, dtype, params)
                    except Exception:
                        continue
                    yield f"{fam.name}/{op}/{dtype}/{json.dumps(params, sort_keys=True)}", cand.source


def build_corpus(max_bytes: int = 64_000_000, max_file_bytes: int = 400_000,
                 sources: tuple[str, ...] = ("kernel_space", "cuda_toolkit", "nvidia_wheels", "torch", "cupy"),
                 ) -> Corpus:
    """Collect, deduplicate and cap the corpus (see the module docstring)."""
    roots = {"cuda_toolkit": cuda_toolkit_roots, "nvidia_wheels": nvidia_wheel_roots,
             "cupy": cupy_roots, "torch": torch_roots}
    stats = CorpusStats()
    seen: set[str] = set()
    seen_paths: set[Path] = set()
    docs: list[CorpusDoc] = []
    total = 0

    def add(source: str, path: str, text: str) -> bool:
        nonlocal total
        if len(text.encode()) > max_file_bytes:
            stats.oversized += 1
            return True
        h = hashlib.sha256(text.encode()).hexdigest()
        if h in seen:
            stats.duplicates += 1
            return True
        if total + len(text) > max_bytes:
            stats.capped = True
            return False
        seen.add(h)
        total += len(text)
        docs.append(CorpusDoc(source, path, text))
        stats.files[source] = stats.files.get(source, 0) + 1
        stats.bytes[source] = stats.bytes.get(source, 0) + len(text)
        return True

    for source in sources:
        stats.files.setdefault(source, 0)
        stats.bytes.setdefault(source, 0)
        if source == "kernel_space":
            for name, text in rendered_kernels():
                if not add(source, name, text):
                    return Corpus(docs, stats)
            continue
        if source not in roots:
            raise ValueError(f"unknown corpus source {source!r}; choose from {sorted(roots) + ['kernel_space']}")
        for root in roots[source]():
            for path in source_files(root):
                rp = path.resolve()
                if rp in seen_paths:
                    continue
                seen_paths.add(rp)
                try:
                    if path.stat().st_size > max_file_bytes:
                        stats.oversized += 1
                        continue
                    text = path.read_text(encoding="utf-8", errors="replace")
                except OSError:
                    continue
                if not add(source, str(path), text):
                    return Corpus(docs, stats)
    return Corpus(docs, stats)


def save_corpus(corpus: Corpus, path: str | Path) -> Path:
    """Write the corpus as JSON lines ({source, path, text}) -- outside the repository."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        for d in corpus.docs:
            f.write(json.dumps({"source": d.source, "path": d.path, "text": d.text}) + "\n")
    return p
