"""Per-token entropy of a checkpoint on the held-out prompts, header tokens apart from body tokens."""

from __future__ import annotations

import json
import math

from policy_fixtures import CSR_SCALAR, structure_dependent_supervision
from sparserl_compile.training.entropy import checkpoint_entropy, header_token_count, main


def test_header_tokens_are_those_of_the_two_contract_lines(tiny_tok):
    h = header_token_count(tiny_tok, CSR_SCALAR)
    ids = tiny_tok.encode(CSR_SCALAR.rstrip())
    head = CSR_SCALAR.split("\n", 2)
    assert 0 < h < len(ids)
    assert tiny_tok.decode(ids[:h]).startswith(head[0] + "\n" + head[1])
    assert not tiny_tok.decode(ids[:h - 1]).startswith(head[0] + "\n" + head[1] + "\n")


def test_checkpoint_entropy_on_the_held_out_records(tmp_path, tiny_tok, n_features, capsys):
    from sparserl_compile.policy.model import PolicyHParams, build_policy, save_policy
    from sparserl_compile.training.data import load_supervision, split

    ckpt = tmp_path / "ckpt"
    save_policy(build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=0), tiny_tok, ckpt)
    data = tmp_path / "sup.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in structure_dependent_supervision()))
    rep = checkpoint_entropy(str(ckpt), str(data))
    # the fixture's uniform random records name csr_scalar block=512, no point of the family
    held = split(load_supervision(data)).held_out
    assert rep.records + rep.skipped == len(held) and rep.records > 0
    assert rep.skipped == sum(dict(r.best().params)["block"] == 512 for r in held)
    assert rep.tokens == rep.header_tokens + rep.body_tokens and rep.header_tokens > 0 and rep.body_tokens > 0
    # an untrained policy over a 400-token vocabulary is far from certain, and never above log(400)
    for v in (rep.mean, rep.header_mean, rep.body_mean):
        assert 0.5 < v <= math.log(len(tiny_tok)) + 1e-4
    assert len(rep.per_record) == rep.records
    out = tmp_path / "entropy.json"
    assert main([str(ckpt), "--data", str(data), "--max-records", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["records"] == 1
    assert main([str(tmp_path / "absent"), "--data", str(data)]) == 2
    assert "model.safetensors missing" in capsys.readouterr().err
