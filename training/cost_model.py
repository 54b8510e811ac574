"""A cost model: log kernel time from structure features and the kernel-space point.

Used by the CPU reward evaluator, where nothing can be timed: a ridge regression (closed form,
numpy) from [structure features (signed log1p), one-hot family, numeric params (log2),
log2(n)] to log(us), fitted on supervision records (``data.py``). ``fit`` reports the held-out
error (records of the held-out split, else a deterministic 20 % of records) as the median and
90th-percentile of |predicted/measured - 1|.

Honest limits: it predicts only for kernel-space points (family + params); a policy sample
that is no family point gets ``None`` (the speed term is then 0). Until the H200 supervision
file exists, it is fitted on whatever records are given and says so in ``FitReport.note``.
The model is saved as JSON (no pickle).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sparserl_compile.nearest import signed_log

DEFAULT_PATH = Path(__file__).resolve().parent / "data" / "cost_model.json"


@dataclass
class FitReport:
    n_train: int
    n_test: int
    median_rel_err: float | None
    p90_rel_err: float | None
    note: str = ""


class CostModel:
    def __init__(self, families: list[str], params: list[str], weights: np.ndarray | None = None,
                 mean: np.ndarray | None = None, std: np.ndarray | None = None):
        self.families, self.params = families, params
        self.weights, self.mean, self.std = weights, mean, std

    def row(self, features: np.ndarray, family: str, params: dict, n: int) -> np.ndarray:
        oh = np.array([float(family == f) for f in self.families])
        pv = np.array([math.log2(1 + abs(float(params.get(p, 0)))) for p in self.params])
        return np.concatenate([signed_log(features), oh, pv, [math.log2(max(n, 1)), 1.0]])

    @classmethod
    def fit(cls, rows: list[tuple[np.ndarray, str, dict, int, float, bool]], ridge: float = 1e-2):
        """``rows``: (features, family, params, n, us, held_out). Returns (model, FitReport)."""
        rows = [r for r in rows if r[4] is not None and r[4] > 0]
        if not rows:
            raise ValueError("no timed rows to fit the cost model on")
        fams = sorted({r[1] for r in rows})
        pnames = sorted({k for r in rows for k in r[2]})
        cm = cls(fams, pnames)
        X = np.stack([cm.row(f, fam, p, n) for f, fam, p, n, _, _ in rows])
        y = np.log(np.array([r[4] for r in rows]))
        test = np.array([r[5] for r in rows])
        if not test.any() or test.all():
            test = (np.arange(len(rows)) % 5) == 4
        tr = ~test
        cm.mean = X[tr].mean(0)
        cm.std = X[tr].std(0) + 1e-6
        cm.mean[-1], cm.std[-1] = 0.0, 1.0  # keep the bias column
        Z = (X - cm.mean) / cm.std
        A = Z[tr].T @ Z[tr] + ridge * np.eye(Z.shape[1])
        cm.weights = np.linalg.solve(A, Z[tr].T @ y[tr])
        err = np.abs(np.exp(Z[test] @ cm.weights - y[test]) - 1) if test.any() else np.array([])
        rep = FitReport(int(tr.sum()), int(test.sum()),
                        float(np.median(err)) if err.size else None,
                        float(np.quantile(err, 0.9)) if err.size else None)
        return cm, rep

    def predict(self, features: np.ndarray, family: str, params: dict, n: int) -> float:
        if self.weights is None:
            raise RuntimeError("cost model is not fitted")
        z = (self.row(features, family, params, n) - self.mean) / self.std
        return float(np.exp(z @ self.weights))

    def predict_source(self, matrix, candidate, n: int = 1) -> float | None:
        """Predicted time of a candidate that is a kernel-space point (``n`` dense columns),
        else None."""
        if candidate.family is None or candidate.family not in self.families:
            return None
        from sparserl_compile.policy.encoder import structure_features

        f = structure_features(matrix.indptr, matrix.indices, matrix.shape)
        return self.predict(f, candidate.family, dict(candidate.params), n)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"families": self.families, "params": self.params,
                                 "weights": self.weights.tolist(), "mean": self.mean.tolist(),
                                 "std": self.std.tolist()}))
        return p

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        d = json.loads(Path(path).read_text())
        return cls(d["families"], d["params"], np.array(d["weights"]), np.array(d["mean"]), np.array(d["std"]))

    @classmethod
    def load_default(cls) -> "CostModel | None":
        return cls.load(DEFAULT_PATH) if DEFAULT_PATH.is_file() else None


def rows_from_records(records) -> list:
    """Cost-model rows from supervision records (matrices loaded once each)."""
    from sparserl_compile.policy.encoder import structure_features
    from sparserl_compile.training.data import is_held_out

    feats, rows = {}, []
    for r in records:
        if r.matrix not in feats:
            m = r.matrix.load()
            feats[r.matrix] = structure_features(m.indptr, m.indices, m.shape)
        for v in r.variants:
            if v.us is not None:
                rows.append((feats[r.matrix], v.family, dict(v.params), r.n, v.us, is_held_out(r.matrix)))
    return rows


def main(argv=None) -> int:
    """``python -m sparserl_compile.training.cost_model DATA [--out PATH]``: fit on a supervision file, save,
    print the fit report."""
    import argparse

    from sparserl_compile.training.data import load_supervision

    ap = argparse.ArgumentParser(prog="python -m sparserl_compile.training.cost_model", description=main.__doc__)
    ap.add_argument("data", help="supervision file (training/data.py formats)")
    ap.add_argument("--out", default=str(DEFAULT_PATH), help="where to write the model JSON")
    ap.add_argument("--ridge", type=float, default=300.0, help="ridge penalty (300: the best held-out error over 1e-2..3e3 on the default supervision)")
    a = ap.parse_args(argv)
    rows = rows_from_records(load_supervision(a.data))
    cm, rep = CostModel.fit(rows, ridge=a.ridge)
    cm.save(a.out)
    print(f"cost model: {rep.n_train} train rows, {rep.n_test} test rows (held-out matrices); "
          f"|pred/measured - 1| median {rep.median_rel_err:.3f}, p90 {rep.p90_rel_err:.3f} -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
