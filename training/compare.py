"""Paired comparison of two evaluated variants, record by record (``sparserl eval``'s ``per_record``).

    python -m sparserl_compile.training.compare BASE.json:sft NEW.json:rl [MORE.json:name ...] [--metric greedy_fallback_fraction]

The held-out split has 42 records, and a kind has as few as 2, so a geometric mean moves with one
matrix. This pairs each record's figure under the base variant with the same record's under
each other variant (records matched by label, product and N; a record with no figure on either
side is left out and counted) and reports the geometric mean of the per-record ratios, a 95 %
bootstrap interval over the records (resampled with replacement, seeded), and how many records
got better or worse by more than ``--tie`` (2 %). Metrics: ``greedy_fallback_fraction`` (a wrong
greedy kernel counted as the cuSPARSE fallback, the default), ``greedy_fraction`` or
``best_of_k_fraction``.

A ``python -m sparserl_compile.training.validation`` result pairs the same way, problem by problem, with
``--metric value`` (the greedy kernel's speedup over cuSPARSE, a wrong one counted as 1.0).

``--metric compile_rate`` or ``correct_rate`` compares rates instead: each record's share of
samples that compiled (were correct), ``compiled / samples`` (a validation row's one greedy
kernel: 1 or 0). A rate can be 0, so these are paired **differences** in percentage points
(other - base, averaged over the records and bootstrapped the same way), not ratios; ``--tie``
is then in rate units (0.02 = 2 points), and one sample of 9 moves a record by 11 points.

``--exclude TEXT`` (repeatable) leaves out the records whose label contains TEXT (e.g. one
matrix that carries a gain). ``--pool`` adds one comparison of all the others together, for
replicated runs: each record's log-ratio is averaged over the others (on the records they all
have), then bootstrapped over records as above. ``--pair BASE OTHER`` (repeatable, instead of the
positional arguments) compares matched pairs, each other against its own base (e.g. a speed-rewarded
run against the control of the same seed), and with two or more pairs pools them the same way:

    python -m sparserl_compile.training.compare --pair C.json:ctl1 R.json:run1 --pair C.json:ctl3 R.json:seed3

Pairs scored on different problems (two draws of fresh validation problems) share no record to
average over; ``--stack`` pools them by putting every pair's per-record log-ratios in one sample
instead, bootstrapped over all those records:

    python -m sparserl_compile.training.compare --stack --pair F96.json:temp F96.json:mixed --pair F48.json:temp F48.json:mixed
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

RATIO_METRICS = ("greedy_fallback_fraction", "greedy_fraction", "best_of_k_fraction", "value")
RATE_METRICS = ("compile_rate", "correct_rate")  # compared as differences (module doc)
METRICS = RATIO_METRICS + RATE_METRICS


def load_rows(spec: str) -> list[dict]:
    """``FILE.json:VARIANT`` -> that variant's ``per_record`` rows (a validation result's: that
    checkpoint's ``rows``). Raises ValueError saying what is
    missing (a report written before ``per_record`` existed, an unknown variant)."""
    path, sep, variant = spec.rpartition(":")
    if not sep or not path:
        raise ValueError(f"{spec!r}: write FILE.json:VARIANT (a variant of sparserl eval's report)")
    report = json.loads(Path(path).read_text())
    if "checkpoints" in report and "per_record" not in report:  # a training.validation result (an eval
        # report also names its checkpoints, for provenance, beside per_record)
        if variant not in report["checkpoints"]:
            raise ValueError(f"{path}: no checkpoint {variant!r}; it holds {sorted(report['checkpoints'])}")
        return report["checkpoints"][variant]["rows"]
    per = report.get("per_record")
    if not per:
        raise ValueError(f"{path}: no per_record rows (written before they existed); evaluate again with sparserl eval")
    if variant not in per:
        raise ValueError(f"{path}: no variant {variant!r}; it holds {sorted(per)}")
    return per[variant]


def _key(row: dict) -> tuple:
    return row["label"], row["op"], row["n"]


def paired(base: list[dict], other: list[dict], metric: str = METRICS[0], n_boot: int = 10_000,
           seed: int = 0, tie: float = 0.02, exclude=()) -> dict:
    """Per-record ratios ``other / base`` of ``metric`` over the records both have (module doc)."""
    return pooled(base, [other], metric, n_boot, seed, tie, exclude)


def pooled(base: list[dict], others: list[list[dict]], metric: str = METRICS[0], n_boot: int = 10_000,
           seed: int = 0, tie: float = 0.02, exclude=()) -> dict:
    """Per-record log-ratios ``other / base`` averaged over ``others``, over the records that the
    base and every other have a figure for, less those whose label contains an ``exclude`` text
    (module doc). With one other this is the plain paired comparison."""
    return pooled_pairs([(base, other) for other in others], metric, n_boot, seed, tie, exclude)


def _figure(row: dict, metric: str):
    """A row's figure: the metric itself, or for a rate its count over the row's samples."""
    if metric not in RATE_METRICS:
        return row.get(metric)
    count = row.get("compiled" if metric == "compile_rate" else "correct")
    samples = row.get("samples", 1)  # a validation row: its greedy kernel, True or False
    return None if count is None or not samples else float(count) / samples


def _figures(rows: list[dict], metric: str, exclude=()) -> dict:
    """Record -> its figure, the records whose label contains an ``exclude`` text left out."""
    return {_key(r): _figure(r, metric) for r in rows if not any(e in r["label"] for e in exclude)}


def _usable(value, metric: str) -> bool:
    """A figure that compares: a rate that exists (0 included), a ratio's positive figure."""
    return value is not None and (metric in RATE_METRICS or value > 0)


def _change(metric: str, base: float, other: float) -> float:
    """One record's change: its log-ratio, or for a rate its difference."""
    return other - base if metric in RATE_METRICS else math.log(other / base)


def _step(metric: str, tie: float) -> float:
    """``--tie`` on the scale of ``_change``: a log-ratio, or for a rate a difference."""
    return tie if metric in RATE_METRICS else math.log1p(tie)


def _summary(metric: str, changes: np.ndarray, n_boot: int, seed: int, tie: float) -> dict:
    """The mean change over records with its 95 % bootstrap interval, as a geometric-mean ratio
    (``ratio_geomean``) or, for a rate, a mean difference (``difference_mean``), and how many
    records moved by more than the tie."""
    boots = changes[np.random.default_rng(seed).integers(0, len(changes), size=(n_boot, len(changes)))].mean(axis=1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    rate, step = metric in RATE_METRICS, _step(metric, tie)
    out = ({"difference_mean": float(changes.mean()), "ci95": [float(lo), float(hi)]} if rate else
           {"ratio_geomean": math.exp(changes.mean()), "ci95": [math.exp(lo), math.exp(hi)]})
    return {**out, "better": int((changes > step).sum()), "worse": int((changes < -step).sum())}


def _empty(metric: str) -> dict:
    return {"difference_mean" if metric in RATE_METRICS else "ratio_geomean": None, "ci95": None,
            "better": 0, "worse": 0, "changes": []}


def pooled_pairs(pairs: list[tuple[list[dict], list[dict]]], metric: str = METRICS[0], n_boot: int = 10_000,
                 seed: int = 0, tie: float = 0.02, exclude=()) -> dict:
    """Per-record log-ratios ``other / base`` of each ``(base, other)`` pair, averaged over the
    pairs, over the records that every base and every other have a figure for (module doc). The
    ``changes`` show the geometric means of the bases' and of the others' figures."""
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r}: choose from {METRICS}")
    bs = [_figures(base, metric, exclude) for base, _ in pairs]
    os_ = [_figures(other, metric, exclude) for _, other in pairs]
    both = [k for k in bs[0] if all(_usable(x.get(k), metric) for x in bs + os_)]
    logs = np.array([np.mean([_change(metric, b[k], o[k]) for b, o in zip(bs, os_)]) for k in both])
    def centre(figs):  # one variant: its own figures, as they are; else their geometric mean (a rate's mean)
        if len(figs) == 1:
            return {k: figs[0][k] for k in both}
        if metric in RATE_METRICS:
            return {k: float(np.mean([x[k] for x in figs])) for k in both}
        return {k: math.exp(np.mean([math.log(x[k]) for x in figs])) for k in both}
    b, o = centre(bs), centre(os_)
    keys = set().union(*bs, *os_)
    out = {"metric": metric, "records": len(both), "left_out": len(keys) - len(both),
           "excluded": sorted(exclude)}
    if not both:
        return {**out, **_empty(metric)}
    order, step = np.argsort(-np.abs(logs)), _step(metric, tie)
    return {**out, **_summary(metric, logs, n_boot, seed, tie),
            "changes": [{"label": both[i][0], "op": both[i][1], "n": both[i][2], "base": b[both[i]],
                         "other": o[both[i]]} for i in order if abs(logs[i]) > step]}


def stacked_pairs(pairs: list[tuple[list[dict], list[dict]]], metric: str = METRICS[0], n_boot: int = 10_000,
                  seed: int = 0, tie: float = 0.02, exclude=()) -> dict:
    """Matched pairs on different records (e.g. two draws of validation problems) pooled as one
    sample: each pair's per-record log-ratios ``other / base`` over the records both sides of
    that pair have, all together, bootstrapped over those records. A record present in two
    pairs counts twice: use ``pooled_pairs`` for replicated runs on the same records."""
    out = [pooled_pairs([pair], metric, n_boot, seed, tie, exclude) for pair in pairs]
    logs, changes = [], []
    for (base, other), r in zip(pairs, out):
        b, o = _figures(base, metric, exclude), _figures(other, metric, exclude)
        logs += [_change(metric, b[k], o[k]) for k in b if _usable(b[k], metric) and _usable(o.get(k), metric)]
        changes += r["changes"]
    res = {"metric": metric, "records": len(logs), "left_out": sum(r["left_out"] for r in out),
           "excluded": sorted(exclude), "stacked": len(pairs)}
    if not logs:
        return {**res, **_empty(metric)}
    changes.sort(key=lambda c: -abs(_change(metric, c["base"], c["other"])))
    return {**res, **_summary(metric, np.array(logs), n_boot, seed, tie), "changes": changes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparserl_compile.training.compare", description=__doc__.split("\n")[0])
    p.add_argument("base", nargs="?", help="FILE.json:VARIANT, the variant compared against")
    p.add_argument("others", nargs="*", help="FILE.json:VARIANT, each compared with the base")
    p.add_argument("--pair", nargs=2, action="append", default=[], metavar=("BASE", "OTHER"),
                   help="a matched pair, OTHER against its own BASE (repeatable; instead of base and others; "
                        "two or more are also pooled)")
    p.add_argument("--metric", default=METRICS[0], choices=METRICS)
    p.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples (default 10000)")
    p.add_argument("--tie", type=float, default=0.02, help="a change within this fraction is a tie (default 0.02)")
    p.add_argument("--exclude", action="append", default=[], metavar="TEXT",
                   help="leave out records whose label contains TEXT (repeatable)")
    p.add_argument("--pool", action="store_true", help="also compare all the others together (replicated runs)")
    p.add_argument("--stack", action="store_true",
                   help="with --pair: pool pairs scored on different problems (draws) by putting their records' "
                        "ratios together, instead of averaging each record over the pairs")
    p.add_argument("--json", help="also write the comparisons here")
    args = p.parse_args(argv)
    if bool(args.pair) == bool(args.base) or (args.base and not args.others):
        p.error("give BASE and one or more OTHERS, or one or more --pair BASE OTHER")
    if args.stack and len(args.pair) < 2:
        p.error("--stack pools two or more --pair BASE OTHER")
    kw = dict(metric=args.metric, n_boot=args.bootstrap, tie=args.tie, exclude=args.exclude)
    try:
        if args.pair:
            pairs = {f"{o} vs {b}": (load_rows(b), load_rows(o)) for b, o in args.pair}
            results = {name: pooled_pairs([pair], **kw) for name, pair in pairs.items()}
            if args.stack:
                results["stacked pairs: " + " + ".join(pairs)] = stacked_pairs(list(pairs.values()), **kw)
            elif len(pairs) > 1:
                results["pooled pairs: " + " + ".join(pairs)] = pooled_pairs(list(pairs.values()), **kw)
        else:
            base = load_rows(args.base)
            rows = {spec: load_rows(spec) for spec in args.others}
            results = {spec: paired(base, r, **kw) for spec, r in rows.items()}
            if args.pool:
                if len(rows) < 2:
                    raise ValueError("--pool needs two or more variants to pool")
                results["pooled: " + " + ".join(rows)] = pooled(base, list(rows.values()), **kw)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    against = "its own base" if args.pair else args.base
    rate = args.metric in RATE_METRICS
    what = "mean of per-record differences, percentage points" if rate else "geometric mean of per-record ratios"
    print(f"{args.metric}, each against {against} ({what}, 95 % bootstrap interval)"
          + (f"; records whose label contains {' or '.join(map(repr, args.exclude))} left out" if args.exclude else ""))
    for spec, r in results.items():
        if r["ci95"] is None:
            hint = ""
            if spec.startswith("pooled pairs") and all(x["ci95"] is not None for x in results.values()
                                                       if x is not r):
                hint = ("; the pairs share no record (different problems?): --stack pools such pairs, "
                        "averaging needs replicated runs on the same records")
            print(f"  {spec}: no record with a figure on both sides{hint}")
            continue
        lo, hi = r["ci95"]
        estimate = (f"{100 * r['difference_mean']:+.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}]" if rate else
                    f"x{r['ratio_geomean']:.3f} [{lo:.3f}, {hi:.3f}]")
        print(f"  {spec}: {estimate} over {r['records']} records "
              f"({r['better']} better, {r['worse']} worse; {r['left_out']} left out)")
        for c in r["changes"][:6]:
            print(f"      {c['label']} {c['op']} n={c['n']}: {c['base']:.3f} -> {c['other']:.3f}")
    if args.json:
        from sparserl_compile.fileio import write_json

        write_json(args.json, {"base": args.base or "each pair's own", "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
