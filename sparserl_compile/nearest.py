"""The ``"nearest"`` provider: the kernels that won on the most alike measured matrices.

A table of measured problems (``TABLE``, ``sparserl_compile/data/neighbours.json.gz``, built
by ``python -m sparserl_compile.training.neighbours`` from the H200 supervision file's *training* split, so no
held-out matrix is in it) holds, per (matrix, op, width): the op, dtype and width, the
structure-feature vector (``structure.features(...).as_vector()``) and the verified variants
ranked by their measured time (family, parameters, microseconds).

For a problem, ``NearestProvider`` ranks the table's entries of the same op and dtype by
``distance``: the Euclidean distance of the signed-log feature vectors plus
``|log2 n - log2 n'|``. It then proposes, up to ``k`` (default ``DEFAULT_K``), the winners of
the nearest entries in order (each entry's fastest variant; after every entry gave its first,
the second fastest, and so on), keeping only those that are points of this problem's pruned
kernel space (``SearchProvider``'s candidates: they apply to this op, width and structure) and
dropping repeats; whether the pattern converts to a padded format (ELL, SELL, DIA, BSR) is
checked only for the points taken. If that yields fewer than ``k``, the search's own order
fills the rest.

Why it exists: it is retrieval over measured winners, the simplest learned policy there is.
On the held-out split its best of four is level with the language-model policy's, at half
the policy's first-call time and without the ``train`` extra (``docs/policy.md``,
"Evaluation"); that is why it is the runtime's default. It costs ``k`` timed candidates per miss
(``configure(provider="nearest", k=4)``) instead of the whole space. Like every provider it only proposes: each candidate
is still compiled, verified in the sandbox and timed against cuSPARSE, and cuSPARSE is kept
when none wins.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparserl_compile.contract import Candidate
from sparserl_compile.problem import Provider

TABLE = Path(__file__).resolve().parent / "data" / "neighbours.json.gz"
DEFAULT_K = 4
TABLE_FORMAT = 1


@dataclass(frozen=True)
class Entry:
    """One measured problem: what it was and its verified variants, fastest first."""

    label: str  # the matrix (generator call or shared name), for reports
    op: str
    dtype: str
    n: int
    features: np.ndarray
    ranked: tuple[tuple[str, tuple[tuple[str, object], ...], float], ...]  # (family, params, us)


def signed_log(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return np.sign(x) * np.log1p(np.abs(x))


def distance(f_a, n_a: int, f_b, n_b: int) -> float:
    """How unlike two problems are: signed-log feature distance plus the log2 width gap."""
    return float(np.linalg.norm(signed_log(f_a) - signed_log(f_b))) + abs(math.log2(max(n_a, 1)) - math.log2(max(n_b, 1)))


def point_key(family: str | None, params) -> tuple:
    """A kernel-space point's identity: family and sorted parameters."""
    return (family, tuple(sorted(dict(params).items())))


def nearest_entries(entries: list[Entry], features, op: str, dtype: str, n: int) -> list[Entry]:
    """The entries of this op and dtype, nearest first (``distance``)."""
    alike = [e for e in entries if e.op == op and e.dtype == dtype]
    alike.sort(key=lambda e: distance(features, n, e.features, e.n))
    return alike


def proposals(entries: list[Entry], features, op: str, dtype: str, n: int) -> list[tuple]:
    """Point keys in the order the module docstring gives (nearest entries' winners first)."""
    return winners(nearest_entries(entries, features, op, dtype, n))


def winners(alike: list[Entry]) -> list[tuple]:
    """Point keys of entries given nearest first: every entry's fastest, then every entry's
    second fastest, and so on, without repeats."""
    out, seen = [], set()
    depth = max((len(e.ranked) for e in alike), default=0)
    for d in range(depth):
        for e in alike:
            if d < len(e.ranked):
                key = point_key(e.ranked[d][0], e.ranked[d][1])
                if key not in seen:
                    seen.add(key)
                    out.append(key)
    return out


def save_table(entries: list[Entry], path: str | Path, source: str) -> Path:
    """Write entries as gzipped JSON (no pickle), with where they came from."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": TABLE_FORMAT, "source": source,
           "entries": [{"label": e.label, "op": e.op, "dtype": e.dtype, "n": e.n,
                        "features": [float(v) for v in e.features],
                        "ranked": [[f, [[k, v] for k, v in params], us] for f, params, us in e.ranked]}
                       for e in entries]}
    with gzip.open(p, "wt", encoding="utf-8") as fh:
        json.dump(doc, fh)
    return p


def load_table(path: str | Path = TABLE) -> list[Entry]:
    """The entries of a table file; a clear error if it is missing or malformed."""
    p = Path(path)
    try:
        with gzip.open(p, "rt", encoding="utf-8") as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        raise FileNotFoundError(f"no neighbour table at {p}: build it with `python -m sparserl_compile.training.neighbours`") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{p}: not a neighbour table ({e}); rebuild it with `python -m sparserl_compile.training.neighbours`") from None
    if doc.get("format") != TABLE_FORMAT:
        raise ValueError(f"{p}: table format {doc.get('format')!r}, expected {TABLE_FORMAT}; rebuild it")
    return [Entry(e["label"], e["op"], e["dtype"], int(e["n"]), np.asarray(e["features"], np.float64),
                  tuple((f, tuple((k, v) for k, v in params), float(us)) for f, params, us in e["ranked"]))
            for e in doc["entries"]]


class NearestProvider(Provider):
    """Proposes the winners of the nearest measured problems (module docstring)."""

    name = "nearest"

    def __init__(self, table: str | Path | list[Entry] = TABLE, k: int = DEFAULT_K):
        self.entries = table if isinstance(table, list) else load_table(table)
        self.k = k
        self.last_neighbours: list[str] = []  # labels of the nearest entries, for reports

    def candidates(self, problem, k: int = 0) -> list[Candidate]:
        from sparserl_compile import structure
        from sparserl_compile.search import SearchProvider, format_unsuitable, pattern_of

        k = k if k and k > 0 else self.k
        pat = pattern_of(problem)
        f = structure.features(pat.indptr, pat.indices, pat.shape)
        n = 1 if problem.op == "spmv" else int(problem.n)
        # the search's rules only: converting the pattern to every padded format of the space
        # to test suitability cost more than the rest of the proposal on large matrices, so
        # only the points taken are converted (below)
        space = SearchProvider(check_formats=False).candidates(problem, 0, features=f)
        alike = nearest_entries(self.entries, f.as_vector(), problem.op, problem.dtype, n)
        self.last_neighbours = [e.label for e in alike[:3]]
        memo: dict = {}
        by_key = {point_key(c.family, c.params): c for c in space}
        picked = [by_key[key] for key in suitable(winners(alike), problem, k, space=space, memo=memo)]
        # too few of the nearest winners suit: the search's own order fills the rest
        for c in space:
            if len(picked) >= k:
                break
            if c not in picked and format_unsuitable(pat, c, memo) is None:
                picked.append(c)
        return picked


def suitable(keys, problem, count: int | None = None, *, space=None, memo: dict | None = None) -> list[tuple]:
    """The point keys of ``keys``, in order and at most ``count``, that ``problem`` can run:
    points of its pruned kernel space (the search's rules for its op, width and structure;
    ``space``: those candidates if already built) whose padded format (ELL, SELL, DIA, BSR) its
    pattern converts to. A neighbour's winner in SELL is no use to a power-law matrix that SELL
    would pad beyond the limit; only the points taken are converted (``memo``: verdicts per
    format and parameters, shared between calls on one problem)."""
    from sparserl_compile.search import SearchProvider, format_unsuitable, pattern_of

    if space is None:
        space = SearchProvider(check_formats=False).candidates(problem, 0)
    by_key = {point_key(c.family, c.params): c for c in space}
    pat, memo = pattern_of(problem), ({} if memo is None else memo)
    out: list[tuple] = []
    for key in keys:
        if count is not None and len(out) >= count:
            break
        if key in by_key and key not in out and format_unsuitable(pat, by_key[key], memo) is None:
            out.append(key)
    return out


__all__ = ["NearestProvider", "Entry", "distance", "nearest_entries", "proposals", "winners", "suitable",
           "load_table", "save_table", "TABLE", "point_key", "DEFAULT_K"]
