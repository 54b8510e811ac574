"""Pre-generation: fill a deployable kernel cache ahead of time (``sparserl pregen``).

Input: Matrix Market (``.mtx``, ``.mtx.gz``) and CSR ``.npz`` files, directories of them
(searched recursively), and ONNX models, whose 2-D float initializers that are stored sparse
or are at least ``--min-sparsity`` zeros become matrices (a ``MatMul`` weight ``B[in, out]``
is used as ``B^T``, the ``[out, in]`` operand of ``F.linear``; a ``Gemm`` with ``transB=1``
as stored).

For every matrix and every requested product (SpMV; SpMM at each ``--widths`` value) it does
what the runtime does on a miss -- the active provider proposes candidates, ``select.choose``
compiles, verifies in the sandbox and (on a GPU) times them against cuSPARSE -- and writes the
verdict (a verified kernel, "the reference wins" or "the dense product wins") into the cache at
``--out``. A key already in the cache is skipped, so an interrupted run resumes where it
stopped, unless a timed run finds its verdict reached without timing the dense product where
that is now a candidate (``miss.dense_stale``): that product is searched again. Another
machine of the same GPU kind, driver and NVRTC loads the entries without searching again
(point ``SPARSERL_CACHE_DIR`` at the folder).

On a machine without a GPU, pass ``--target-gpu`` (and the driver/NVRTC versions of the
serving machine): candidates are compiled for its arch and verified with the CPU executor;
such entries carry no timings, and the runtime times them against cuSPARSE in its sandbox on
first use before it trusts them (``miss.search_entry``).

``--share K`` (for models whose pruned weights come in families: an LLM's 30 ``q_proj``
matrices pruned to the same per-row sparsity): matrices with the same shape and the same row
lengths (min, max, mean) form a group per product; the first is searched in full, and every
other gets only the group's ``K`` fastest verified kernels as candidates (structure-baked
kernels excluded: their source is one matrix's). Each of those is still compiled, verified in
the sandbox on *this* matrix and timed against cuSPARSE on it, so nothing is trusted on the
strength of a neighbour; only the exploration is shared. A product where none of them beats
cuSPARSE gets the "reference wins" verdict, as in a full search.

Sharded over several processes or machines: ``--rank R --world-size W`` (default: torchrun's
``RANK``/``WORLD_SIZE``, else 0/1) makes each rank take its share of the matrices, split
greedily by estimated cost (nonzeros + rows; ``shard``; every rank must see the same paths).
Give each rank its own folder, ``--out kernels/rank{rank}`` (``{rank}`` is replaced), then
``sparserl cache merge kernels/rank* --into kernels``; or one shared folder on a shared
filesystem, which is also safe (atomic renames, the shards hold disjoint matrices).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from sparserl_compile import matrices
from sparserl_compile.problem import make_problem

MATRIX_SUFFIXES = (".npz", ".mtx", ".mtx.gz", ".mm")


@dataclass(frozen=True)
class Item:
    """One matrix to pre-generate kernels for."""

    name: str  # file name, or "model.onnx:initializer"
    matrix: sp.csr_matrix


@dataclass(frozen=True)
class Row:
    """What pre-generation did for one (matrix, op, width)."""

    name: str
    op: str
    n: int
    nnz: int
    outcome: str  # "kernel", "reference", "dense", "cached", "failed"
    detail: str  # family of the kernel, or why the reference / the dense product / the failure
    kernel_us: float | None
    reference_us: float | None
    seconds: float
    dense_us: float | None = None  # the dense product's time, where it was timed


def onnx_matrices(path: Path, min_sparsity: float = 0.5) -> list[Item]:
    """Sparse or pruned 2-D float initializers of an ONNX model, as ``[out, in]`` CSR matrices."""
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError:
        raise SystemExit(f"{path}: reading ONNX models needs the onnx package: pip install 'sparserl[onnx]'")
    model = onnx.load(str(path), load_external_data=True)
    g = model.graph
    transposed = set()  # initializers used as MatMul B (stored [in, out])
    for node in g.node:
        if node.op_type == "MatMul" and len(node.input) > 1:
            transposed.add(node.input[1])
        if node.op_type == "Gemm" and len(node.input) > 1:
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            if not trans_b:
                transposed.add(node.input[1])
    items = []
    for sparse in g.sparse_initializer:
        dense = numpy_helper.to_array(sparse.values)
        idx = numpy_helper.to_array(sparse.indices)
        dims = tuple(sparse.dims)
        if len(dims) != 2:
            continue
        coords = np.unravel_index(idx.ravel(), dims) if idx.ndim == 1 else (idx[:, 0], idx[:, 1])
        m = sp.csr_matrix((dense.astype(np.float32), coords), shape=dims)
        name = sparse.values.name
        items.append(Item(f"{path.name}:{name}", matrices.canonical(m.T if name in transposed else m)))
    for init in g.initializer:
        if len(init.dims) != 2:
            continue
        if init.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
            kind = onnx.TensorProto.DataType.Name(init.data_type)
            print(f"skipping {path.name}:{init.name}: {kind} weights (sparserl runs float32, float16 and bfloat16)",
                  file=sys.stderr)
            continue
        w = numpy_helper.to_array(init).astype(np.float32)
        if w.size == 0 or float(np.mean(w == 0)) < min_sparsity:
            continue
        m = sp.csr_matrix(w.T if init.name in transposed else w)
        items.append(Item(f"{path.name}:{init.name}", matrices.canonical(m)))
    return items


def discover(paths: list[str], min_sparsity: float = 0.5) -> list[Item]:
    """Every matrix named by ``paths`` (files, directories searched recursively, ONNX models)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.is_file()
                                and (f.name.endswith(MATRIX_SUFFIXES) or f.suffix == ".onnx")))
        elif p.is_file():
            files.append(p)
        else:
            raise SystemExit(f"{p}: no such file or directory")
    items: list[Item] = []
    for f in files:
        try:
            if f.suffix == ".onnx":
                items.extend(onnx_matrices(f, min_sparsity))
                continue
            m = matrices.load_matrix(f)
        except Exception as e:  # a feature .npy, an unrelated .npz, a truncated or corrupt file: say so, keep going
            why = str(e) if isinstance(e, ValueError) else f"cannot read it ({type(e).__name__}: {e})"
            print(f"skipping {f}: {why}", file=sys.stderr)
            continue
        if m.nnz == 0 or min(m.shape) == 0:
            print(f"skipping {f}: empty matrix (the reference handles it; nothing to generate)", file=sys.stderr)
            continue
        items.append(Item(f.name, m))
    return items


def shard(items: list[Item], rank: int, world_size: int) -> list[Item]:
    """This rank's items: ``distributed.split_by_cost`` over nonzeros + rows (deterministic)."""
    if not 0 <= rank < world_size:
        raise SystemExit(f"--rank {rank} must be in [0, --world-size {world_size})")
    from sparserl_compile.distributed import split_by_cost

    mine = split_by_cost([it.matrix.nnz + it.matrix.shape[0] for it in items], world_size)[rank]
    return [items[i] for i in mine]


def share_key(m: sp.csr_matrix, op: str, n: int, dtype: str) -> tuple:
    """Products whose kernels ``--share`` explores once: same op, width, dtype, shape and row
    lengths (min, max, mean to 0.1)."""
    lengths = np.diff(m.indptr)
    return (op, n, dtype, m.shape, int(lengths.min()), int(lengths.max()), round(float(lengths.mean()), 1))


def ranked_candidates(candidates, entry, k: int) -> list:
    """The ``k`` best verified, structure-free candidates of a finished search, fastest first
    (untimed searches: in the provider's order)."""
    by_name = {c.name: c for c in candidates if not (c.family and "baked" in c.family)}
    outcomes = [o for o in entry.verification.get("candidates", [])
                if o.get("kind") == "ok" and o.get("name") in by_name]
    outcomes.sort(key=lambda o: float("inf") if o.get("kernel_us") is None else o["kernel_us"])
    return [by_name[o["name"]] for o in outcomes[:k]]


def pregenerate(items: list[Item], *, cache_dir: str | os.PathLike, ops=("spmv", "spmm"),
                widths=(32,), dtype: str = "f32", target=None, executor: str | None = None,
                progress: bool = True, share: int = 0) -> list[Row]:
    """Fill the cache at ``cache_dir`` for every item and product; returns one ``Row`` each.
    ``share=K > 0``: explore once per group of alike products (module doc, ``--share``)."""
    from tqdm import tqdm

    from sparserl_compile import cache, config, miss, providers, select, structure

    store = cache.KernelCache(cache_dir)
    if not store.on_disk:
        raise SystemExit(f"cannot write the kernel cache at {cache_dir}: {store.disabled_reason}")
    target = target or cache.local_target()
    timed = (executor or select.default_executor()) == "gpu"
    jobs = [(it, op, n) for it in items for op in ops for n in ((1,) if op == "spmv" else widths)]
    rows: list[Row] = []
    bar = tqdm(jobs, disable=not progress, unit="product", file=sys.stderr)
    fps: dict[str, str] = {}
    groups: dict[tuple, list] = {}  # share_key -> the leader's ranked candidates
    for it, op, n in bar:
        bar.set_postfix_str(f"{it.name} {op} n={n}")
        t0 = time.perf_counter()
        m = it.matrix
        fp = fps.get(it.name) or structure.fingerprint(m.indptr, m.indices, m.shape)
        fps[it.name] = fp
        problem = make_problem(op, dtype, n, m.indptr, m.indices, m.shape, fp, target.arch)
        key = miss.key_for(problem, target)
        hit = store.get(key)
        if hit is not None and miss.dense_stale(hit, problem, timed=timed) is None:
            rows.append(Row(it.name, op, n, m.nnz, "cached", f"already in the cache ({hit.outcome})",
                            hit.times.get("kernel_us"), hit.times.get("reference_us"), 0.0,
                            hit.times.get("dense_us")))
            continue
        gkey = share_key(m, op, n, dtype) if share else None
        shared = groups.get(gkey) if share else None
        try:
            if shared:
                entry = miss.search_entry(problem, key, candidates=shared, executor=executor)
            else:
                prov = providers.get_provider()
                cands = prov.candidates(problem, config.get_config().k)
                if prov.name == "search" and len(cands) > 1:
                    # the kernel space's own sources (not generated code): compile them in
                    # threads here, so the sandbox worker finds them in the compile cache
                    from sparserl_compile import compiler

                    compiler.precompile([c.source for c in cands], arch=target.arch)
                entry = miss.search_entry(problem, key, candidates=cands, executor=executor)
                if share:
                    groups[gkey] = ranked_candidates(cands, entry, share)
            if not entry.verification.get("transient"):  # a failure that may not recur is not shipped
                store.put(entry)
        except Exception as e:  # one bad matrix never stops the run
            rows.append(Row(it.name, op, n, m.nnz, "failed", f"{type(e).__name__}: {e}"[:120], None, None,
                            time.perf_counter() - t0))
            continue
        detail = entry.verification.get("winner_family") or entry.verification.get("why", "")
        if shared:
            detail = f"shared {len(shared)}: {detail}"
        rows.append(Row(it.name, op, n, m.nnz, entry.outcome, str(detail), entry.times.get("kernel_us"),
                        entry.times.get("reference_us"), time.perf_counter() - t0, entry.times.get("dense_us")))
    return rows


def format_table(rows: list[Row]) -> str:
    def f(v):
        return "-" if v is None else f"{v:.1f}"

    head = (f"{'matrix':34s} {'op':5s} {'n':>4s} {'nnz':>9s} {'outcome':9s} {'kernel_us':>9s} {'ref_us':>8s} "
            f"{'dense_us':>8s} {'s':>6s}  detail")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.name[:34]:34s} {r.op:5s} {r.n:>4d} {r.nnz:>9d} {r.outcome:9s} {f(r.kernel_us):>9s} "
                     f"{f(r.reference_us):>8s} {f(r.dense_us):>8s} {r.seconds:>6.1f}  {r.detail[:60]}")
    counts = {k: sum(r.outcome == k for r in rows) for k in ("kernel", "reference", "dense", "cached", "failed")}
    lines.append(" ".join(f"{k}={v}" for k, v in counts.items()))
    return "\n".join(lines)
