"""Sparse matrices to run on: the real set in ``../shared/matrices`` and seeded generators.

Generators return ``scipy.sparse.csr_matrix`` with float32 values, int32 indices, sorted
column indices and no duplicates, and are deterministic in their ``seed``: the supervision
data set stores (generator, arguments, seed) rather than the matrices themselves.

The real matrices are data read at run time from ``../shared/matrices`` next to the checkout
(or ``$SPARSERL_SHARED_MATRICES``); they are never copied into the project.
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

_REPO = Path(__file__).resolve().parent.parent


def shared_matrices_dir() -> Path | None:
    """``$SPARSERL_SHARED_MATRICES``, else ``../shared/matrices`` beside the checkout, else None."""
    env = os.environ.get("SPARSERL_SHARED_MATRICES")
    for cand in ([Path(env)] if env else []) + [_REPO.parent / "shared" / "matrices", _REPO / "shared" / "matrices"]:
        if (cand / "MANIFEST.json").is_file():
            return cand
    return None


@dataclass(frozen=True)
class MatrixInfo:
    name: str
    kind: str
    n_rows: int
    n_cols: int
    nnz: int
    path: Path


def shared_manifest(directory: Path | None = None) -> list[MatrixInfo]:
    """Every entry of MANIFEST.json (adjacency, feature and sparse-DNN matrices alike)."""
    d = directory or shared_matrices_dir()
    if d is None:
        return []
    entries = json.loads((d / "MANIFEST.json").read_text())
    out = []
    for e in entries:
        out.append(MatrixInfo(e["name"], e["kind"], e["n_rows"], e["n_cols"], e["nnz"], d / e["file"]))
    return out


_NPZ_ERRORS = (ValueError, EOFError, KeyError, MemoryError, zipfile.BadZipFile, zlib.error)


def load_npz(path: str | os.PathLike) -> sp.csr_matrix:
    """Load a sparse ``.npz`` without pickle: sparserl's CSR layout (keys indptr, indices, data,
    shape) or any of ``scipy.sparse.save_npz``'s (its ``format`` key: csr, csc, coo, bsr, dia).
    The arrays are checked (``inputs.py``) before scipy builds anything from them; a malformed
    file raises ``ValueError`` naming the file and the problem."""
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise
    except (OSError, *_NPZ_ERRORS) as e:
        raise ValueError(f"{path}: cannot read it as a .npz archive ({type(e).__name__}: {e})") from None
    except AttributeError:  # np.load read a bare .npy array, not an archive
        raise ValueError(f"{path}: a single .npy array, not a sparse matrix .npz") from None
    try:
        return _from_npz(arrays, path)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None


def _from_npz(z: dict, path) -> sp.csr_matrix:
    from types import SimpleNamespace

    from sparserl_compile import inputs

    keys = set(z)
    fmt = z["format"].item() if "format" in keys and z["format"].shape == () else None
    fmt = fmt.decode("ascii", "replace") if isinstance(fmt, bytes) else fmt
    if "data" not in keys or "shape" not in keys:
        raise ValueError(f"not a sparse matrix .npz (expected keys indptr, indices, data, shape; found {sorted(keys)})")
    shape = _shape(z["shape"])
    data = _real(z["data"])
    if fmt != "bsr" and fmt != "dia" and data.ndim != 1:
        raise ValueError(f"data must be 1-D (one value per stored entry), got shape {data.shape}")
    if fmt in (None, "csr", "csc", "bsr") and {"indptr", "indices"} <= keys:
        if fmt == "bsr":
            fake = SimpleNamespace(format="bsr", shape=shape, data=data, indptr=z["indptr"], indices=z["indices"])
            pattern, data = inputs.read_scipy(fake)
        else:
            build = inputs.csc if fmt == "csc" else inputs.csr
            pattern = build(z["indptr"], z["indices"], shape, data.size, ptr="indptr")
    elif fmt in (None, "coo") and {"row", "col"} <= keys:
        pattern = inputs.coo(z["row"], z["col"], shape, data.size)
    elif fmt == "dia" and "offsets" in keys:
        offsets = z["offsets"]
        if data.ndim != 2 or offsets.ndim != 1 or offsets.size != data.shape[0] or offsets.dtype.kind not in "iu":
            raise ValueError(f"a DIA matrix needs 2-D data and one integer offset per row of it, got data of shape "
                             f"{data.shape} and offsets of shape {offsets.shape} ({offsets.dtype})")
        pattern, data = inputs.read_scipy(sp.dia_matrix((data, offsets), shape=shape))
    else:
        raise ValueError(f"not a sparse matrix .npz (expected keys indptr, indices, data, shape; found "
                         f"{sorted(keys)}{'' if fmt is None else f', format {fmt!r}'})")
    return _csr_of(pattern, data)


def _shape(a: np.ndarray) -> tuple[int, int]:
    if a.shape != (2,) or a.dtype.kind not in "iu":
        raise ValueError(f"shape must be two non-negative integers, got {a.tolist()!r}")
    from sparserl_compile.structure import check_shape

    return check_shape(tuple(int(v) for v in a))


def _real(data: np.ndarray) -> np.ndarray:
    """Values that are real numbers (what a cast to float32 would not silently change in kind)."""
    if np.iscomplexobj(data) or not (np.issubdtype(data.dtype, np.number) or data.dtype == np.bool_):
        raise ValueError(f"values are {data.dtype}; sparserl multiplies real matrices (float32): "
                         "save the real part (or the magnitude) if that is what you mean")
    return data


def _csr_of(pattern, data: np.ndarray) -> sp.csr_matrix:
    """The canonical scipy CSR (float32 values) of a checked pattern and its stored values."""
    values = pattern.values(np.asarray(data).ravel()).astype(np.float32)
    return sp.csr_matrix((values, pattern.indices, pattern.indptr), shape=pattern.shape)


#: the Matrix Market header fields this loader reads (scipy.io.mmread takes the same)
_MM_FORMATS, _MM_FIELDS = ("coordinate", "array"), ("real", "integer", "pattern", "double", "complex")
_MM_SYMMETRIES = ("general", "symmetric", "skew-symmetric", "hermitian")
#: the fewest bytes one stored entry takes in a Matrix Market file ("1 1\n"), and the most a
#: gzip byte can expand to (deflate's limit): what bounds a header's claimed size by the file's
_MM_MIN_ENTRY_BYTES, _GZIP_MAX_RATIO = 4, 1032


def _mm_header(p: str) -> None:
    """Check a Matrix Market file's banner and size line before scipy reads it: scipy allocates
    what the size line claims, so a forged ``1 1 10000000000`` would exhaust memory first."""
    import gzip

    size = os.path.getsize(p)
    opener = gzip.open if p.endswith(".gz") else open
    limit = size * (_GZIP_MAX_RATIO if p.endswith(".gz") else 1)
    try:
        with opener(p, "rt", encoding="ascii", errors="replace") as f:
            banner = f.readline(1024).split()
            line = f.readline(1024)
            while line.startswith("%") or (line.strip() == "" and line):
                line = f.readline(1024)
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{p}: cannot read it as Matrix Market ({type(e).__name__}: {e})") from None
    if (len(banner) != 5 or banner[0].lower() != "%%matrixmarket" or banner[1].lower() != "matrix"
            or banner[2].lower() not in _MM_FORMATS or banner[3].lower() not in _MM_FIELDS
            or banner[4].lower() not in _MM_SYMMETRIES):
        raise ValueError(f"{p}: not a Matrix Market matrix (its first line is {' '.join(banner)[:80]!r}; expected "
                         "'%%MatrixMarket matrix coordinate|array real|integer|pattern general|symmetric|...')")
    if banner[3].lower() == "complex":
        raise ValueError(f"{p}: a complex matrix; sparserl multiplies real matrices (float32): "
                         "convert the real part (or the magnitude) if that is what you mean")
    fields = line.split()
    want = 3 if banner[2].lower() == "coordinate" else 2
    if len(fields) != want or not all(f.isdigit() for f in fields):
        raise ValueError(f"{p}: the size line {line.strip()[:80]!r} is not {want} non-negative integers")
    n_rows, n_cols = int(fields[0]), int(fields[1])
    from sparserl_compile.structure import check_shape

    check_shape((n_rows, n_cols))
    entries = int(fields[2]) if want == 3 else n_rows * n_cols
    if entries * _MM_MIN_ENTRY_BYTES > limit + _MM_MIN_ENTRY_BYTES:
        raise ValueError(f"{p}: the header claims {entries} entries but the file ({size} bytes) cannot hold "
                         "them: it is truncated or its size line is wrong")


def load_matrix(path: str | os.PathLike) -> sp.csr_matrix:
    """Load ``.npz`` (see ``load_npz``) or Matrix Market (``.mtx``, ``.mtx.gz``, ``.mm``) as
    canonical CSR; a malformed file raises ``ValueError`` naming the file and the problem."""
    p = str(path)
    if p.endswith(".npz"):
        return load_npz(p)
    if p.endswith((".mtx", ".mtx.gz", ".mm")):
        import scipy.io

        _mm_header(p)
        try:
            m = scipy.io.mmread(p)
        except (ValueError, OSError, EOFError, IndexError, OverflowError, MemoryError, zlib.error) as e:
            raise ValueError(f"{p}: cannot read it as Matrix Market ({type(e).__name__}: {e})") from None
        if np.iscomplexobj(m.data if sp.issparse(m) else m):
            raise ValueError(f"{p}: a complex matrix; sparserl multiplies real matrices (float32): "
                             "convert the real part (or the magnitude) if that is what you mean")
        try:
            return canonical(m)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{p}: {e}") from None
    raise ValueError(f"{p}: unknown matrix file type (use .npz CSR or Matrix Market .mtx)")


def canonical(m) -> sp.csr_matrix:
    """CSR, float32 values, int32 indices, sorted, duplicates summed. A scipy matrix of any
    format has its index arrays checked first (``inputs.read_scipy``); a dense array is taken
    as it is."""
    from sparserl_compile import inputs

    if not sp.issparse(m):
        m = sp.csr_matrix(np.asarray(m))  # dense: no index arrays to distrust
    pattern, data = inputs.read_scipy(m)
    return _csr_of(pattern, _real(np.asarray(data)))


def _values(nnz: int, rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal(nnz).astype(np.float32)


def stencil2d(n: int, seed: int = 0) -> sp.csr_matrix:
    """5-point Laplacian on an n x n grid (n^2 rows)."""
    one = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n), dtype=np.float32)
    eye = sp.identity(n, dtype=np.float32)
    m = canonical(sp.kron(one, eye) + sp.kron(eye, one))
    m.data = _values(m.nnz, np.random.default_rng(seed))
    return m


def stencil3d(n: int, seed: int = 0) -> sp.csr_matrix:
    """7-point Laplacian on an n x n x n grid (n^3 rows)."""
    one = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n), dtype=np.float32)
    eye = sp.identity(n, dtype=np.float32)
    m = sp.kron(sp.kron(one, eye), eye) + sp.kron(sp.kron(eye, one), eye) + sp.kron(sp.kron(eye, eye), one)
    m = canonical(m)
    m.data = _values(m.nnz, np.random.default_rng(seed))
    return m


def banded(n: int, half_bandwidth: int, fill: float = 1.0, seed: int = 0) -> sp.csr_matrix:
    """n x n band of the given half bandwidth; ``fill`` < 1 drops entries at random."""
    rng = np.random.default_rng(seed)
    offsets = np.arange(-half_bandwidth, half_bandwidth + 1)
    m = sp.diags([np.ones(n - abs(o), np.float32) for o in offsets], offsets, shape=(n, n), format="csr",
                 dtype=np.float32)
    if fill < 1.0:
        keep = rng.random(m.nnz) < fill
        coo = m.tocoo()
        m = sp.csr_matrix((coo.data[keep], (coo.row[keep], coo.col[keep])), shape=(n, n))
    m = canonical(m)
    m.data = _values(m.nnz, rng)
    return m


def block_diagonal(n_blocks: int, block: int, density: float = 1.0, seed: int = 0) -> sp.csr_matrix:
    """``n_blocks`` dense (or ``density``-filled) ``block`` x ``block`` blocks on the diagonal."""
    rng = np.random.default_rng(seed)
    if density < 1:
        blocks = [sp.random(block, block, density=density, random_state=rng, format="csr") for _ in range(n_blocks)]
        m = canonical(sp.block_diag(blocks, format="csr"))
    else:  # dense blocks, built directly: sp.block_diag of 2e4 blocks took seconds (the same matrix)
        n = n_blocks * block
        cols = (np.arange(n, dtype=np.int64) // block * block)[:, None] + np.arange(block)
        m = canonical(sp.csr_matrix((np.ones(n * block, np.float32), cols.ravel(), np.arange(n + 1) * block),
                                    shape=(n, n)))
    m.data = _values(m.nnz, rng)
    return m


def block_random(n_brows: int, n_bcols: int, R: int, C: int, blocks_per_row: int, seed: int = 0) -> sp.csr_matrix:
    """Random block-sparse matrix of dense R x C blocks (``blocks_per_row`` per block row)."""
    rng = np.random.default_rng(seed)
    k = min(blocks_per_row, n_bcols)
    # the block columns drawn row by row (the random stream the records were measured with), then
    # every block's R x C entries at once (a meshgrid per block took seconds at 10^4 block rows)
    bc = np.array([rng.choice(n_bcols, size=k, replace=False) for _ in range(n_brows)], np.int64).reshape(-1)
    br = np.repeat(np.arange(n_brows, dtype=np.int64), k)
    r = ((br * R)[:, None, None] + np.arange(R)[None, :, None] + np.zeros((1, 1, C), np.int64)).ravel()
    c = ((bc * C)[:, None, None] + np.zeros((1, R, 1), np.int64) + np.arange(C)[None, None, :]).ravel()
    m = sp.csr_matrix((np.ones(len(r), np.float32), (r, c)), shape=(n_brows * R, n_bcols * C))
    m = canonical(m)
    m.data = _values(m.nnz, rng)
    return m


def uniform_random(n_rows: int, n_cols: int, per_row: float, seed: int = 0) -> sp.csr_matrix:
    """Each row gets Poisson(per_row) entries at uniform random columns."""
    rng = np.random.default_rng(seed)
    lengths = rng.poisson(per_row, size=n_rows)
    rows = np.repeat(np.arange(n_rows), lengths)
    cols = rng.integers(0, max(n_cols, 1), size=rows.size)
    m = sp.csr_matrix((np.ones(rows.size, np.float32), (rows, cols)), shape=(n_rows, n_cols))
    m = canonical(m)
    m.data = _values(m.nnz, rng)
    return m


def rmat(scale: int, edge_factor: int, a: float = 0.57, b: float = 0.19, c: float = 0.19,
         seed: int = 0) -> sp.csr_matrix:
    """R-MAT power-law graph with 2^scale vertices and about edge_factor * 2^scale edges."""
    rng = np.random.default_rng(seed)
    n = 1 << scale
    m_edges = edge_factor * n
    src = np.zeros(m_edges, np.int64)
    dst = np.zeros(m_edges, np.int64)
    for bit in range(scale):
        r = rng.random(m_edges)
        go_down = r > (a + b)  # quadrants c, d: source bit set
        go_right = ((r > a) & (r <= a + b)) | (r > a + b + c)  # quadrants b, d: target bit set
        src |= go_down.astype(np.int64) << bit
        dst |= go_right.astype(np.int64) << bit
    m = sp.csr_matrix((np.ones(m_edges, np.float32), (src, dst)), shape=(n, n))
    m = canonical(m)
    m.data = _values(m.nnz, rng)
    return m


def random_geometric(n: int, avg_degree: float, seed: int = 0) -> sp.csr_matrix:
    """Random geometric graph in the unit square, symmetric, about ``avg_degree`` per row."""
    from scipy.spatial import cKDTree

    rng = np.random.default_rng(seed)
    pts = rng.random((n, 2))
    # rows sorted by a coarse grid cell so that neighbours are close in index (locality)
    cells = int(np.sqrt(n))
    key = (pts[:, 0] * cells).astype(np.int64) * cells + (pts[:, 1] * cells).astype(np.int64)
    pts = pts[np.argsort(key, kind="stable")]
    radius = np.sqrt(avg_degree / (np.pi * n))
    pairs = cKDTree(pts).query_pairs(radius, output_type="ndarray")
    r = np.concatenate([pairs[:, 0], pairs[:, 1]])
    c = np.concatenate([pairs[:, 1], pairs[:, 0]])
    m = canonical(sp.csr_matrix((np.ones(r.size, np.float32), (r, c)), shape=(n, n)))
    m.data = _values(m.nnz, rng)
    return m


def circuit(n: int, per_row: float, dense_lines: int = 0, dense_fill: float = 0.2, local: float = 0.5,
            seed: int = 0) -> sp.csr_matrix:
    """Circuit-simulation-like (MNA) pattern: a full diagonal, Poisson(``per_row``) couplings per
    row of which a ``local`` fraction sits within a band of about n/100 and the rest anywhere,
    mirrored to a symmetric pattern, plus ``dense_lines`` supply nets: rows and columns that
    touch a ``dense_fill`` fraction of all rows (the few very long rows of rajat01-type
    matrices)."""
    rng = np.random.default_rng(seed)
    lengths = rng.poisson(per_row / 2, size=n)  # halved: the pattern is mirrored below
    rows = np.repeat(np.arange(n), lengths)
    near = rng.random(rows.size) < local
    width = max(n // 100, 2)
    cols = np.where(near, rows + rng.integers(-width, width + 1, size=rows.size),
                    rng.integers(0, n, size=rows.size))
    cols = np.clip(cols, 0, n - 1)
    lines = rng.choice(n, size=min(dense_lines, n), replace=False)
    line_r, line_c = [], []
    for ln in lines:
        touched = np.flatnonzero(rng.random(n) < dense_fill)
        line_r.append(np.full(touched.size, ln))
        line_c.append(touched)
    r = np.concatenate([np.arange(n), rows, cols, *line_r, *line_c])
    c = np.concatenate([np.arange(n), cols, rows, *line_c, *line_r])
    m = canonical(sp.csr_matrix((np.ones(r.size, np.float32), (r, c)), shape=(n, n)))
    m.data = _values(m.nnz, rng)
    return m


def pruned_weight(n_rows: int, n_cols: int, sparsity: float, mask: str = "magnitude",
                  seed: int = 0) -> sp.csr_matrix:
    """A random ``nn.Linear`` weight (``n_rows`` out x ``n_cols`` in features, normal values)
    pruned to exactly ``round(sparsity * size)`` zeros: ``mask="magnitude"`` drops the smallest
    ``|w|`` of the whole matrix, ``"wanda"`` the smallest ``|w_ij| * a_j`` of each row (``a``:
    log-normal input-feature norms standing in for the calibration activations; Wanda's score,
    compared per output). Not in ``GENERATORS``: a weight to benchmark, not a supervision structure."""
    if not 0.0 <= float(sparsity) < 1.0:
        raise ValueError(f"sparsity={sparsity} must be a fraction in [0, 1)")
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_rows, n_cols), dtype=np.float32)
    if mask == "magnitude":
        k = int(round(sparsity * w.size))
        if k:
            w.reshape(-1)[np.argpartition(np.abs(w).reshape(-1), k - 1)[:k]] = 0
    elif mask == "wanda":
        k = int(round(sparsity * n_cols))
        score = np.abs(w) * rng.lognormal(0.0, 1.0, n_cols).astype(np.float32)[None, :]
        if k:
            np.put_along_axis(w, np.argpartition(score, k - 1, axis=1)[:, :k], 0, axis=1)
    else:
        raise ValueError(f"mask={mask!r}: use 'magnitude' or 'wanda'")
    return canonical(sp.csr_matrix(w))


GENERATORS = {
    "stencil2d": stencil2d,
    "stencil3d": stencil3d,
    "banded": banded,
    "block_diagonal": block_diagonal,
    "block_random": block_random,
    "uniform_random": uniform_random,
    "rmat": rmat,
    "random_geometric": random_geometric,
    "circuit": circuit,
}


def generate(generator: str, **kwargs) -> sp.csr_matrix:
    """Build a generated matrix by generator name and keyword arguments (incl. ``seed``)."""
    try:
        fn = GENERATORS[generator]
    except KeyError:
        raise ValueError(f"unknown generator {generator!r}; choose from {sorted(GENERATORS)}") from None
    return fn(**kwargs)
