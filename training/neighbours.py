"""Build the ``"nearest"`` provider's table and measure it offline on the held-out split.

    python -m sparserl_compile.training.neighbours                  # build sparserl_compile/data/neighbours.json.gz
    python -m sparserl_compile.training.neighbours --eval           # also: best-of-k on the held-out split

The table holds the *training* split of the supervision file (``data.split``): no held-out
matrix is in it, so ``--eval`` measures generalization to unseen matrices, as ``sparserl eval``
does for the policy. ``--eval`` needs no GPU: every held-out record carries the measured
(H200) time of every pruned kernel-space point, so the fraction of the kernel-space best that
the provider's first ``k`` proposals reach is read off the measurements. Beside it, two
baselines computed the same way: the cost model's top ``k`` (``cost_model.py``, fitted on the
training split) and the single point that is best on average over the training records of the
same op. Reading the shared matrices needs ``../shared/matrices`` (or
``SPARSERL_SHARED_MATRICES``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from sparserl_compile.fileio import write_json
from sparserl_compile.training import data
from sparserl_compile.training.stats import geomean

DEFAULT_DATA = data.DEFAULT_SUPERVISION
KS = (1, 2, 4, 8)
RIDGE = 300.0  # the cost model's own default (python -m sparserl_compile.training.cost_model)


def entries_from_records(records, feats: dict | None = None, loaded: dict | None = None):
    """Table entries (``nearest.Entry``) from supervision records (matrices loaded once each;
    ``loaded``, MatrixRef -> CSR, is used and filled so a caller that needs the matrices too
    loads each once)."""
    import numpy as np

    from sparserl_compile.nearest import Entry
    from sparserl_compile.structure import features

    feats = {} if feats is None else feats
    out = []
    for r in records:
        ok = sorted((v for v in r.variants if v.us is not None), key=lambda v: v.us)
        if not ok:
            continue
        if r.matrix not in feats:
            if loaded is None:
                m = r.matrix.load()
            else:
                if r.matrix not in loaded:
                    loaded[r.matrix] = r.matrix.load()
                m = loaded[r.matrix]
            feats[r.matrix] = np.asarray(features(m.indptr, m.indices, m.shape).as_vector(), np.float64)
        out.append(Entry(r.matrix.label, r.op, r.dtype, r.n, feats[r.matrix],
                         tuple((v.family, tuple(sorted(v.params)), float(v.us)) for v in ok)))
    return out


def best_of_k(record, ranked_keys, k: int) -> float | None:
    """best_us / (measured us of the fastest of the first k proposals that were measured)."""
    from sparserl_compile.nearest import point_key

    times = {point_key(v.family, v.params): v.us for v in record.variants if v.us is not None}
    if not times:
        return None
    got = [times[key] for key in ranked_keys if key in times][:k]
    return min(times.values()) / min(got) if got else None


def offline_eval(train, held_out, ks=KS) -> dict:
    """Fraction of the kernel-space best (geomean over held-out records) per k and per kind,
    for the nearest-neighbour proposals and the two baselines."""
    from sparserl_compile.nearest import point_key, proposals
    from sparserl_compile.training import cost_model

    feats: dict = {}
    table = entries_from_records(train, feats)
    ev = entries_from_records(held_out, feats)
    cm, fit = cost_model.CostModel.fit(cost_model.rows_from_records(train + held_out), ridge=RIDGE)
    methods = defaultdict(lambda: defaultdict(list))  # method -> k -> fractions
    by_kind = defaultdict(lambda: defaultdict(list))  # kind -> method -> k=1 fractions
    for r, e in zip([r for r in held_out if any(v.us is not None for v in r.variants)], ev):
        orders = {"nearest": proposals(table, e.features, r.op, r.dtype, r.n)}
        measured = [v for v in r.variants if v.us is not None]
        orders["cost_model"] = [point_key(v.family, v.params) for v in
                                sorted(measured, key=lambda v: cm.predict(e.features, v.family, dict(v.params), r.n))]
        single = {}
        for v in measured:
            key = point_key(v.family, v.params)
            fr = [f for t in train if t.op == r.op for f in [best_of_k(t, [key], 1)] if f is not None]
            if len(fr) >= 3:
                single[key] = geomean(fr)
        orders["best_single_point"] = sorted(single, key=single.get, reverse=True)
        for name, order in orders.items():
            for k in ks:
                f = best_of_k(r, order, k)
                if f is not None:
                    methods[name][k].append(f)
            f1 = best_of_k(r, order, 1)
            if f1 is not None:
                by_kind[r.matrix.kind][name].append(f1)
    return {
        "records": len(ev), "table_entries": len(table),
        "cost_model_fit": {"median_rel_err": fit.median_rel_err, "p90_rel_err": fit.p90_rel_err,
                           "note": "fitted on the training split; its held-out rows are the test set"},
        "fraction_of_space_best": {m: {str(k): geomean(v) for k, v in ks_.items()} for m, ks_ in methods.items()},
        "greedy_by_kind": {kind: {m: geomean(v) for m, v in ms.items()} for kind, ms in sorted(by_kind.items())},
    }


def main(argv=None) -> int:
    from sparserl_compile.nearest import TABLE, save_table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=DEFAULT_DATA, help="supervision file (its training split is tabled)")
    p.add_argument("--out", default=str(TABLE), help="table file to write")
    p.add_argument("--eval", action="store_true", help="measure best-of-k on the held-out split")
    p.add_argument("--json", help="write the --eval report here")
    p.add_argument("--eval-data", default=None,
                   help="--eval on the held-out split of these file(s) instead of --data's (e.g. an older "
                        "file, to compare with figures measured on it)")
    args = p.parse_args(argv)
    s = data.split(data.load_supervision(args.data))
    print(s.summary())
    path = save_table(entries_from_records(s.train), args.out, source=f"{args.data} (training split)")
    print(f"table: {path}")
    if args.eval:
        held_out = data.split(data.load_supervision(args.eval_data)).held_out if args.eval_data else s.held_out
        rep = offline_eval(s.train, held_out)
        print(json.dumps(rep, indent=1))
        if args.json:
            write_json(args.json, rep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
