"""Verified textual variants of kernel-space points: SFT targets beyond the best template.

A policy fine-tuned only on each matrix's best template puts all its probability on that text
and has nothing to explore from. This module writes other kernels that compute the same
product, starting from the family points a supervision record measured (the families' declared
parameters: block sizes, vector widths, threads per row, partition sizes ...) and rewriting
their text with transformations that stay inside the kernel grammar
(``sparserl_compile/grammar/kernel.lark``):

- ``unroll2``, ``unroll4``: the first innermost ``for`` loop of the form
  ``for (T v = a; v < b; ++v | v++ | v += S)`` whose body has no ``break``, ``continue``,
  ``return``, warp or block synchronisation and does not assign ``v`` is unrolled by 2 or 4
  (each copy in its own braces, ``v`` read as ``(v + j*S)``), with a remainder loop;
- ``while``: that loop (without ``continue``) written as ``{ init; while (cond) { body inc; } }``;
- ``fma_expand``: ``fmaf(a, b, c)`` written as ``((a) * (b) + (c))`` (rounding differs: the
  verification's tolerance decides whether that is still correct);
- ``plain_loads``: ``__ldg(&e)`` written as ``e`` (ordinary loads instead of the read-only path);
- ``split_acc``: accumulator splitting for instruction-level parallelism: the first loop that
  ``unroll2`` would take whose body accumulates into ``float``/``double`` scalars declared before
  it (``a += e;``, ``a = fmaf(x, y, a);``, ``a`` read nowhere else in the body) unrolled by 2,
  the second copy summing into a fresh partial accumulator per ``a``, a remainder loop for the odd
  iteration and ``a += partial;`` after it (the summation order changes: the tolerance decides);
- ``shfl_xor``: warp reductions ``v += __shfl_down_sync(m, v, off);`` (a run of such statements
  with distinct power-of-two offsets per variable, or a halving loop ``for (o = P; o > 0; o /= 2)``)
  written as the ``__shfl_xor_sync`` butterfly: lane 0 of each group adds the same partners in the
  same order, and every other lane of the group ends with the sum too;
- ``prefetch``: software pipelining of the first loop that ``unroll2`` would take whose body
  reads read-only pointer parameters at the loop variable (``__ldg(&col_idx[k])``, ``vals[k]``):
  the elements of iteration ``k + S`` are loaded into registers before iteration ``k``'s work.

Transforms combine with ``+`` (``unroll2+plain_loads``), applied left to right; ``transform_names``
pairs a loop transform (``unroll2``, ``unroll4``, ``while``, ``split_acc``, ``prefetch``) with one
of the others. A variant is a
supervision ``Variant`` with the point's parameters plus ``transform=<names>``;
``space.default_render`` renders it (the point's source, then ``apply``). A variant becomes a
target only after it passes the grammar (``language.accepts``), the language checks
(``language.check``) and verification on the CPU executor (``sparserl_compile/simt``) in
sandboxed workers, on the record's own matrix (``verified_variants``).

``python -m sparserl_compile.training.variants --out runs/variants.jsonl.gz`` writes the
supervision records with their verified variants added to the training split's (grouped-record
format, ``data.record_to_json``; the held-out records unchanged); ``sparserl sft --data runs/variants.jsonl.gz
--top-variants N`` then trains on them; ``--stats PATH`` also counts, per transform, the
candidates, the verified variants and the novel ones (no point of the space up to whitespace and
names). A variant inherits the measured time of its point (its own time is unknown until it is
timed on a GPU), so it ranks right after its point.
"""

from __future__ import annotations

from sparserl_compile.training.transforms import (  # noqa: F401  (the transforms are part of this module's API)
    TRANSFORM_KEY, TRANSFORMS, apply, as_while, fma_expand, grammar_problems, plain_loads, prefetch, reindent, render,
    shfl_xor, split_acc, transform_names, unroll,
)


def record_candidates(record, matrix, top: int = 2, combine: bool = True) -> list[tuple]:
    """(variant, source) for the transforms of the record's ``top`` fastest verified points,
    inside the kernel language (``grammar_problems``); each variant carries its point's time."""
    from sparserl_compile.training.data import Variant
    from sparserl_compile.training.space import ranked_variants

    out, seen = [], set()
    for v in ranked_variants(record, top) if record.best() is not None else []:
        params = dict(v.params)
        if TRANSFORM_KEY in params:
            continue  # already a variant
        try:
            source = render(v.family, record.op, record.dtype, params, matrix)
        except Exception:  # noqa: BLE001 - a point the current families no longer render
            continue
        for name in transform_names(source, combine):
            text = apply(source, name)
            if text in seen or grammar_problems(text):
                continue
            seen.add(text)
            out.append((Variant(v.family, tuple(sorted({**params, TRANSFORM_KEY: name}.items())), v.us), text))
    return out


def verified_variants(record, matrix, evaluator, top: int = 2, combine: bool = True, stats=None) -> list:
    """The record's variants (``record_candidates``) that ``evaluator`` (a ``rewards``
    evaluator; ``SandboxEvaluator(executor="cpu")`` verifies on the CPU executor in sandboxed
    workers) finds correct on ``matrix``. ``stats`` (a ``collections.Counter``): counts
    ``(transform, "candidates" | "verified" | "novel")`` for each variant's transform names, a
    combination under its own name and under each part's ``any:<part>`` (novel: no point of the
    space, ``novelty.is_novel``)."""
    from sparserl_compile.training.rewards import RLProblem

    cands = record_candidates(record, matrix, top, combine)
    if not cands:
        return []
    pb = RLProblem(matrix, record.op, record.dtype, record.n, record.matrix.label)
    outcomes = evaluator(pb, [text for _v, text in cands])
    if stats is not None:
        from sparserl_compile.training.novelty import is_novel

        for (v, text), o in zip(cands, outcomes):
            name = dict(v.params)[TRANSFORM_KEY]
            novel = o.correct and is_novel(text, record.op, record.dtype, matrix)
            parts = name.split("+")
            for key in [name] + ([f"any:{part}" for part in parts] if len(parts) > 1 else []):
                stats[key, "candidates"] += 1
                stats[key, "verified"] += bool(o.correct)
                stats[key, "novel"] += bool(novel)
    return [v for (v, _t), o in zip(cands, outcomes) if o.correct]


def stats_table(stats) -> str:
    """``verified_variants``'s counts as a text table, single transforms and combinations first."""
    names = sorted({k for k, _ in stats}, key=lambda k: (k.startswith("any:"), k))
    lines = [f"{'transform':28s} {'candidates':>10s} {'verified':>8s} {'novel':>6s}"]
    lines += [f"{k:28s} {stats[k, 'candidates']:10d} {stats[k, 'verified']:8d} {stats[k, 'novel']:6d}" for k in names]
    own = [k for k in names if not k.startswith("any:")]
    lines.append(f"{'all (distinct variants)':28s} {sum(stats[k, 'candidates'] for k in own):10d} "
                 f"{sum(stats[k, 'verified'] for k in own):8d} {sum(stats[k, 'novel'] for k in own):6d}")
    return "\n".join(lines)


def augment(records, evaluator, top: int = 2, combine: bool = True, max_nnz: int = 20000, limit: int = 0,
            log=print, stats=None) -> list:
    """``records`` with their verified variants added after their measured variants. Records
    whose matrix has more than ``max_nnz`` nonzeros are kept as they are (the CPU executor is
    slow on large matrices), and so is every record after the first ``limit`` that get variants
    (0: no limit). ``stats``: see ``verified_variants``."""
    from dataclasses import replace

    out, loaded, done = [], {}, 0
    for i, r in enumerate(records):
        if r.best() is None or (limit and done >= limit):
            out.append(r)
            continue
        if r.matrix not in loaded:
            loaded = {r.matrix: r.matrix.load()}  # records of one matrix are usually adjacent
        m = loaded[r.matrix]
        if m.nnz > max_nnz:
            out.append(r)
            continue
        done += 1
        found = verified_variants(r, m, evaluator, top, combine, stats)
        log(f"[variants] {i + 1}/{len(records)} {r.matrix.label} {r.op} n={r.n}: {len(found)} verified variants")
        out.append(replace(r, variants=r.variants + tuple(found)))
    return out


def main(argv=None) -> int:
    import argparse
    import gzip
    import json
    from collections import Counter

    from sparserl_compile.training.data import DEFAULT_SUPERVISION, load_supervision, record_to_json, split
    from sparserl_compile.training.rewards import make_evaluator

    p = argparse.ArgumentParser(description="Write the training split's supervision records with their verified "
                                            "textual variants added (SFT targets beyond the best template).")
    p.add_argument("--data", default=DEFAULT_SUPERVISION, help="supervision file(s), a comma list")
    p.add_argument("--out", required=True, help="grouped-record JSON lines to write (.gz: gzipped)")
    p.add_argument("--top", type=int, default=2, help="transform each record's fastest this many points")
    p.add_argument("--no-combine", action="store_true", help="single transforms only")
    p.add_argument("--max-nnz", type=int, default=20000, help="leave records of larger matrices unchanged")
    p.add_argument("--max-records", type=int, default=0, help="add variants to only the first this many training "
                                                               "records within --max-nnz (0 = all)")
    p.add_argument("--executor", choices=("cpu", "gpu"), default="cpu", help="where variants are verified")
    p.add_argument("--workers", type=int, default=2, help="sandbox worker processes")
    p.add_argument("--stats", help="also write per transform the candidates, the verified and the novel "
                                   "variants (no point of the space) to this JSON file, and print them")
    a = p.parse_args(argv)
    if a.top < 1 or a.max_nnz < 1 or a.max_records < 0:
        p.error("--top and --max-nnz are 1 or more, --max-records 0 or more")
    parts = split(load_supervision(a.data))
    evaluator = make_evaluator(a.executor, a.workers)
    stats = Counter() if a.stats else None
    try:
        records = augment(parts.train, evaluator, a.top, not a.no_combine, a.max_nnz, a.max_records, stats=stats)
    finally:
        evaluator.close()
    if stats is not None:
        rows = {k: {c: stats[k, c] for c in ("candidates", "verified", "novel")} for k, _ in stats}
        with open(a.stats, "w", encoding="utf-8") as f:
            json.dump({"executor": a.executor, "top": a.top, "combine": not a.no_combine, "max_nnz": a.max_nnz,
                       "max_records": a.max_records, "transforms": rows}, f, indent=1, sort_keys=True)
        print(stats_table(stats))
    records += parts.held_out  # unchanged: the file serves SFT's held-out loss and the evaluation alike
    lines = "".join(json.dumps(record_to_json(r)) + "\n" for r in records)
    opener = gzip.open if a.out.endswith(".gz") else open
    with opener(a.out, "wt", encoding="utf-8") as f:
        f.write(lines)
    added = sum(len(r.variants) for r in records) - sum(len(r.variants) for r in parts.train + parts.held_out)
    print(f"{a.out}: {len(records)} records, {added} verified variants added")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
