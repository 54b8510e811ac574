"""The three applications, short, on whatever machine this is: one table (``make demo`` runs it).

1. **GNN inference**: a 2-layer GCN and a GraphSAGE mean aggregator (``gnn_inference.py``'s
   models, random weights) on a generated random-geometric graph, run through sparserl eager
   and through ``torch.compile(backend="sparserl", fullgraph=True)``, against eager torch.sparse.
2. **Pruned-LLM decoding**: a random tiny Llama (``pruned_llm.py --tiny``: no download),
   magnitude-pruned to 80 % per row, its linear layers converted with ``sparsify_``, greedy
   decoding against the pruned dense model.
3. **Pre-generation**: ``pregenerate.py``'s flow on two generated matrices and a pruned ONNX
   MLP: build a kernel cache (on this GPU, or for an H200 with the CPU executor), then look
   every product up as a serving process would.

Each row says what ran, the times side by side, and the check that the answer is the
comparison's. Without a GPU every sparserl product runs torch's CPU CSR kernel (generated
kernels are GPU-only), so the CPU rows show that the plumbing changes nothing and costs
little; the speedups are measured on the H200 (``docs/benchmarks.md``, "Applications").

    python examples/applications.py            # 20-45 s on 2 CPU cores (the first run: JIT caches)
    python examples/applications.py --quick    # smaller sizes (CI)
    python examples/applications.py --json apps.json

The exit status is 1 if any check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling examples

import gnn_inference as gnn  # noqa: E402
import pregenerate as pg  # noqa: E402
import pruned_llm as llm  # noqa: E402

import sparserl_compile as sr  # noqa: E402
from sparserl_compile import bench, matrices  # noqa: E402


@dataclass
class Row:
    application: str
    what: str
    sparserl: str  # sparserl's figure
    comparison: str  # the comparison's figure, measured beside it
    check: str  # what was compared
    ok: bool


def _median_ms(fn, device: str, reps: int) -> float:
    """Median wall time of ``fn()`` in ms, synchronized after each call, after two warm-up calls."""
    return bench.wall_median_us(fn, device, reps=reps, warmup=2) / 1e3


def gnn_rows(n_nodes: int, hidden: int, device: str, reps: int) -> list[Row]:
    a = matrices.random_geometric(n_nodes, 10.0, seed=0)
    rows = []
    for name, norm, cls in (("GCN", "gcn", gnn.GCN), ("SAGE mean", "mean", gnn.SAGEMean)):
        a_hat = gnn.normalized_adjacency(a, norm)
        native = gnn.native_csr(a_hat, device)
        torch.manual_seed(0)
        model = cls(native, hidden, hidden, hidden).to(device).eval()
        x = torch.randn(n_nodes, hidden, device=device)
        with torch.no_grad():
            ref = model(x)
            t_ref = _median_ms(lambda: model(x), device, reps)
            model.adj = sr.sparsify(a_hat).to(device)
            eager = model(x)  # the first call plans (on a GPU: proposal, verification, timing)
            t_eager = _median_ms(lambda: model(x), device, reps)
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="sparserl", fullgraph=True)
            out = compiled(x)
            t_comp = _median_ms(lambda: compiled(x), device, reps)
        scale = ref.abs().max().clamp_min(1e-30)
        err = max(float((eager - ref).abs().max() / scale), float((out - ref).abs().max() / scale))
        rows.append(Row("GNN", f"{name}, geometric graph, {a.nnz} edges, hidden {hidden}",
                        f"{t_eager:.2f} ms, compiled {t_comp:.2f}", f"torch.sparse {t_ref:.2f} ms",
                        f"max rel err {err:.1e}", err < 1e-4))
    return rows


def llm_rows(sparsity: float, batch: int, new_tokens: int, device: str) -> list[Row]:
    tiny = llm.tiny_model()
    dense = tiny.model.to(device)
    report = llm.prune_(dense, sparsity, "magnitude")
    sparse = sr.sparsify_(copy.deepcopy(dense), min_sparsity=sparsity)
    n_sparse = sum(isinstance(m.weight, sr.SparseRLTensor) for m in llm.decoder_linears(sparse).values())
    g_dense = llm.greedy(dense, tiny.tokenizer, batch=batch, new_tokens=new_tokens)
    g_sparse = llm.greedy(sparse, tiny.tokenizer, batch=batch, new_tokens=new_tokens)
    same = float((g_sparse.tokens == g_dense.tokens).float().mean())
    return [Row("pruned LLM", f"tiny Llama, {report.achieved:.0%} zeros, {n_sparse} sparse linears, batch {batch}",
                f"{g_sparse.tokens_per_s:.0f} tok/s", f"dense {g_dense.tokens_per_s:.0f} tok/s",
                f"same tokens {same:.0%}", same == 1.0)]


def _pruned_mlp_onnx(path: Path) -> bool:
    """A one-layer ONNX model (96 x 96, 80 % pruned, ``pregenerate.pruned_mlp_onnx``); False
    without the ``onnx`` package."""
    try:
        pg.pruned_mlp_onnx(path, sizes=(96, 96), sparsity=0.8)
    except ImportError:
        return False
    return True


def pregen_rows(folder: Path) -> list[Row]:
    mats = folder / "matrices"
    pg.write_demo_matrices(mats)
    with_onnx = _pruned_mlp_onnx(mats / "mlp_pruned80.onnx")
    out = folder / "kernels"
    with contextlib.redirect_stderr(io.StringIO()):  # the build's progress bar
        b = pg.build([str(mats)], out, ops=("spmv", "spmm"), widths=(16,), progress=False)
    s = pg.serve([str(mats)], out, ops=("spmv", "spmm"), widths=(16,), target=b.target)
    kernels = sum(r.outcome == "kernel" for r in b.rows)
    found = len(s.lookups) - s.misses
    where = "this GPU" if b.executor == "gpu" else f"{b.target.gpu_name.removeprefix('NVIDIA ')} (CPU-verified)"
    return [Row("pre-generation", f"{len(b.rows)} products{', 1 from ONNX' if with_onnx else ''}, for {where}, "
                f"{b.seconds:.0f} s",
                f"{found}/{len(s.lookups)} served from cache",
                f"{kernels} kernels, {len(b.rows) - kernels} cuSPARSE verdicts",
                f"max rel err {max(x.max_rel_err for x in s.lookups):.1e}",
                b.failed == 0 and s.misses == 0 and all(x.max_rel_err < 1e-4 for x in s.lookups))]


def format_rows(rows: list[Row]) -> str:
    cols = ("application", "what", "sparserl", "comparison", "check")
    widths = [max(len(c), *(len(getattr(r, c)) for r in rows)) for c in cols]
    line = lambda vals: "  ".join(f"{v:{w}s}" for v, w in zip(vals, widths)) + "  ok"  # noqa: E731
    out = [line(cols), "-" * (sum(widths) + 2 * len(cols) + 2)]
    out += [line([getattr(r, c) for c in cols])[:-2] + ("ok" if r.ok else "FAILED") for r in rows]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes (CI)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu")
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    t0 = time.perf_counter()
    n_nodes, reps, tokens = (3000, 5, 4) if args.quick else (20000, 10, 16)
    rows = gnn_rows(n_nodes, 64, args.device, reps)
    rows += llm_rows(0.8, 2, tokens, args.device)
    with tempfile.TemporaryDirectory(prefix="sparserl-apps-") as tmp:
        rows += pregen_rows(Path(tmp))
    print(f"== the applications, short ({time.perf_counter() - t0:.0f} s on "
          f"{torch.cuda.get_device_name(0) if args.device.startswith('cuda') else 'the CPU'})")
    print(format_rows(rows))
    if not args.device.startswith("cuda"):
        print("On the CPU every sparserl product runs torch's CSR kernel (generated kernels are GPU-only): "
              "these rows check the plumbing, not speed.\nThe H200 speedups are in docs/benchmarks.md, "
              "\"Applications\".")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "rows": [asdict(r) for r in rows]}, indent=1))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":  # the guard matters: the verification sandbox spawns workers
    sys.exit(main())
