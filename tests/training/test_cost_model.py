import numpy as np

from sparserl_compile.training.cost_model import CostModel


def test_fits_a_known_relation_and_roundtrips(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for i in range(200):
        f = rng.random(5) * 10
        fam = ["a", "b"][i % 2]
        p = {"block": int(rng.choice([64, 128, 256]))}
        us = np.exp(0.3 * np.log1p(f[0]) + (0.5 if fam == "b" else 0.0) + 0.1 * np.log2(1 + p["block"]))
        rows.append((f, fam, p, 1, float(us), i % 5 == 0))
    cm, rep = CostModel.fit(rows)
    assert rep.n_test == 40 and rep.median_rel_err < 0.02
    cm2 = CostModel.load(cm.save(tmp_path / "cm.json"))
    f, fam, p, n, us, _ = rows[1]
    assert abs(cm2.predict(f, fam, p, n) / us - 1) < 0.05
