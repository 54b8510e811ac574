"""Turn a ``sparserl bench`` results JSON into docs-ready markdown tables and PNG plots.

    python benchmarks/report.py benchmarks/results/bench_<date>.json [--out docs/bench.md]

Writes the markdown (per matrix/op: torch.sparse us, best us, family, fraction of the byte
floor, speedup; geometric-mean speedups overall, above 10^6 nonzeros and by matrix kind) to
``--out`` (default: next to the JSON, ``.md``) and two plots next to it: ``*_speedup.png``
(speedup per matrix and op) and ``*_floor.png`` (fraction of the floor, ours vs torch.sparse).
Rows without a timed best kernel (CPU runs, failures) are listed with dashes and left out of
the means.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def _f(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def geomean(xs) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def text_table(columns, rows) -> str:
    """A fixed-width text table: a header, a rule and one line per row. ``columns`` are
    ``(title, width, cell)`` with ``cell(row)`` the cell's text, right-aligned to ``width``
    (a negative width aligns left; 0 takes the text as it is)."""
    def fit(text, width):
        return f"{text:<{-width}.{-width}}" if width < 0 else f"{text:>{width}}"

    head = " ".join(fit(title, w) for title, w, _ in columns)
    return "\n".join([head, "-" * len(head)] + [" ".join(fit(cell(r), w) for _, w, cell in columns) for r in rows])


def op_label(r: dict) -> str:
    return "SpMV" if r.get("op") == "spmv" else f"SpMM N={r.get('n')}"


def markdown(doc: dict) -> str:
    rows = [r for r in doc.get("rows", []) if "op" in r]
    m = doc.get("machine", {})
    v = doc.get("versions", {})
    out = [f"## sparserl bench, {doc.get('date', '?')}", "",
           f"GPU: {m.get('gpu', 'none')} (SM clock {m.get('sm_clock', '?')}, driver {m.get('driver', '?')}); "
           f"torch {v.get('torch')}, CUDA {v.get('cuda')}, NVRTC {v.get('nvrtc')}, cuda-core {v.get('cuda-core')}, "
           f"kernel space {v.get('kernel_space')}; executor {doc.get('executor')}.", "",
           "| matrix | kind | nnz | op | torch.sparse i32 us | i64 us | best us | family | floor % | torch floor % | speedup | verified |",
           "|---|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        fl = r.get("frac_floor")
        tfl = r.get("torch_frac_floor")
        out.append(f"| {r['matrix']} | {r.get('kind', '')} | {r.get('nnz', '')} | {op_label(r)} | "
                   f"{_f(r.get('torch_int32_us'))} | {_f(r.get('torch_int64_us'))} | {_f(r.get('best_us'))} | "
                   f"{r.get('best_family') or '-'} | {_f(fl * 100 if fl else None, '.0f')} | "
                   f"{_f(tfl * 100 if tfl else None, '.0f')} | {_f(r.get('speedup'), '.2f')} | "
                   f"{r.get('verified', 0)}/{len(r.get('variants', []))} |")
    out += ["", "Geometric-mean speedup over torch.sparse (int32 indices):", "",
            "| subset | rows | geomean speedup |", "|---|---:|---:|"]
    timed = [r for r in rows if r.get("speedup")]
    groups = [("all", timed), ("nnz > 1e6", [r for r in timed if r.get("nnz", 0) > 1_000_000])]
    for label in sorted({op_label(r) for r in timed}):
        groups.append((label, [r for r in timed if op_label(r) == label]))
    for kind in sorted({r.get("kind", "") for r in timed}):
        groups.append((f"kind {kind}", [r for r in timed if r.get("kind") == kind]))
    for label, rs in groups:
        out.append(f"| {label} | {len(rs)} | {_f(geomean(r['speedup'] for r in rs), '.2f')} |")
    errs = [r for r in doc.get("rows", []) if r.get("error")]
    if errs:
        out += ["", "Failures (recorded and skipped):", ""]
        out += [f"- {r['matrix']} {r.get('op', '')}: {r['error'][:160]}" for r in errs]
    if doc.get("skipped_for_budget"):
        out += ["", "Not run (time budget): " + ", ".join(doc["skipped_for_budget"])]
    return "\n".join(out) + "\n"


def plots(doc: dict, stem: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc.get("rows", []) if r.get("speedup")]
    paths = []
    if not rows:
        return paths
    labels = [f"{r['matrix']} {op_label(r)}" for r in rows]
    h = max(3.0, 0.22 * len(rows))
    fig, ax = plt.subplots(figsize=(8, h))
    sp = [r["speedup"] for r in rows]
    ax.barh(range(len(rows)), sp, color=["tab:green" if s >= 1 else "tab:red" for s in sp])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.set_xlabel("speedup over torch.sparse (int32), L2 flushed")
    fig.tight_layout()
    p = stem.with_name(stem.name + "_speedup.png")
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
    fig, ax = plt.subplots(figsize=(8, h))
    ours = [(r.get("frac_floor") or 0) * 100 for r in rows]
    theirs = [(r.get("torch_frac_floor") or 0) * 100 for r in rows]
    y = list(range(len(rows)))
    ax.barh([i + 0.2 for i in y], ours, height=0.4, label="sparserl best")
    ax.barh([i - 0.2 for i in y], theirs, height=0.4, label="torch.sparse")
    ax.set_yticks(y, labels, fontsize=6)
    ax.set_xlabel("% of the byte floor (bytes / copy bandwidth)")
    ax.legend()
    fig.tight_layout()
    p = stem.with_name(stem.name + "_floor.png")
    fig.savefig(p, dpi=120)
    plt.close(fig)
    paths.append(p)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="bench_<date>.json written by sparserl bench")
    ap.add_argument("--out", default=None, help="markdown path (default: the JSON's path with .md)")
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    doc = json.loads(Path(a.results).read_text())
    md_path = Path(a.out) if a.out else Path(a.results).with_suffix(".md")
    md_path.write_text(markdown(doc))
    print(f"wrote {md_path}")
    if not a.no_plots:
        for p in plots(doc, md_path.with_suffix("")):
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
