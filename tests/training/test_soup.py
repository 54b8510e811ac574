"""``sparserl train soup``: weight averaging of policy checkpoints (training/soup.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sparserl_compile.policy.model import PolicyHParams, build_policy, load_policy, save_policy
from sparserl_compile.commands.cli import main
from sparserl_compile.training.soup import SoupError, parse_inputs, provenance, soup


@pytest.fixture()
def three(tmp_path, tiny_tok, n_features):
    """Three checkpoints of one tiny model, different weights (seeds 0, 1, 2)."""
    dirs = []
    for seed in range(3):
        d = tmp_path / f"run{seed}"
        save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=seed), tiny_tok, d)
        dirs.append(d)
    return dirs


def _weights(d):
    return load_file(str(d / "model.safetensors"))


def test_uniform_soup_is_the_mean_and_loads_as_a_policy(three, tmp_path):
    out = tmp_path / "soup"
    info = soup([(str(d), 1.0) for d in three], out)
    got, parts = _weights(out), [_weights(d) for d in three]
    for k, v in got.items():
        want = sum(p[k].double() for p in parts) / 3
        assert torch.allclose(v.double(), want, atol=1e-6), k
        assert v.dtype == parts[0][k].dtype
    assert [round(i["weight"], 6) for i in info["inputs"]] == [0.333333] * 3
    assert json.loads((out / "soup.json").read_text())["inputs"][2]["checkpoint"] == str(three[2])
    prov = provenance(out)  # what sparserl eval records of it
    assert [i["checkpoint"] for i in prov["soup"]] == [str(d) for d in three] and len(prov["model_sha256"]) == 64
    assert "soup" not in provenance(three[0])
    model, tok = load_policy(out)  # every command loads it like a trained checkpoint
    loaded = dict(model.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in got.items())


def test_weights_are_normalised_and_interpolate(three, tmp_path):
    """WiSE-FT: DIR=0.25,DIR=0.75 (any positive scale) is the interpolation between the two."""
    out = tmp_path / "wise"
    soup(parse_inputs(f"{three[0]}=1,{three[1]}=3"), out)
    a, b, got = _weights(three[0]), _weights(three[1]), _weights(out)
    for k in got:
        assert torch.allclose(got[k].double(), 0.25 * a[k].double() + 0.75 * b[k].double(), atol=1e-6), k


def test_parse_inputs():
    assert parse_inputs("a,b=0.5, c=2,") == [("a", 1.0), ("b", 0.5), ("c", 2.0)]
    with pytest.raises(SoupError, match="not a number"):
        parse_inputs("a=x")


def test_refuses_inputs_that_are_not_one_model(three, tmp_path, tiny_tok, n_features):
    other = tmp_path / "other"
    hp = PolicyHParams.tiny(len(tiny_tok), n_features)
    hp.n_layers = 3
    save_policy(build_policy(hp, seed=0), tiny_tok, other)
    with pytest.raises(SoupError, match="another model.*config differs"):
        soup([(str(three[0]), 1), (str(other), 1)], tmp_path / "out")
    retok = tmp_path / "retok"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=0), tiny_tok, retok)
    tokj = json.loads((retok / "tokenizer.json").read_text())
    tokj["model"]["vocab"] = {k: (v + 1) % len(tokj["model"]["vocab"]) for k, v in tokj["model"]["vocab"].items()}
    (retok / "tokenizer.json").write_text(json.dumps(tokj))
    with pytest.raises(SoupError, match="another tokenizer"):
        soup([(str(three[0]), 1), (str(retok), 1)], tmp_path / "out")
    with pytest.raises(SoupError, match="at least two"):
        soup([(str(three[0]), 1)], tmp_path / "out")
    with pytest.raises(SoupError, match="weights must be"):
        soup([(str(three[0]), 0), (str(three[1]), 0)], tmp_path / "out")
    with pytest.raises(SoupError, match="one of the inputs"):
        soup([(str(three[0]), 1), (str(three[1]), 1)], three[1])
    assert not (tmp_path / "out").exists()  # nothing half-written
    with pytest.raises(SoupError, match="not a soup"):  # a trained checkpoint is never overwritten
        soup([(str(three[0]), 1), (str(three[1]), 1)], three[2])
    soup([(str(three[0]), 1), (str(three[1]), 1)], tmp_path / "again")
    soup([(str(three[0]), 1), (str(three[2]), 1)], tmp_path / "again")  # an earlier soup is replaced
    assert json.loads((tmp_path / "again" / "soup.json").read_text())["inputs"][1]["checkpoint"] == str(three[2])


def test_cli_soup_and_its_errors(three, tmp_path, capsys):
    out = tmp_path / "cli_soup"
    assert main(["train", "soup", "--checkpoints", f"{three[0]},{three[1]}", "--out", str(out)]) == 0
    assert "soup of 2 checkpoints" in capsys.readouterr().out and (out / "model.safetensors").is_file()
    missing = tmp_path / "nowhere"
    for pair in (f"{three[0]},{missing}", f"{missing},{three[0]}"):  # the first input is checked as the others
        assert main(["train", "soup", "--checkpoints", pair, "--out", str(tmp_path / "x")]) == 2
        assert "config.json missing" in capsys.readouterr().err
    (three[2] / "config.json").write_text("{not json")
    assert main(["train", "soup", "--checkpoints", f"{three[0]},{three[2]}", "--out", str(tmp_path / "y")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
