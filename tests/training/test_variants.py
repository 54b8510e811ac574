"""Verified variants of kernel-space points: inside the kernel language, compiled by NVRTC,
correct on the CPU executor, and wired into SFT targets through the supervision records."""

from __future__ import annotations

import pytest

from sparserl_compile import compiler, kernels
from sparserl_compile.training import transforms
from sparserl_compile.training import variants as V
from sparserl_compile.training.data import MatrixRef, SupervisionRecord, Variant
from sparserl_compile.training.novelty import is_novel

BANDED = MatrixRef("generated", "banded", (("half_bandwidth", 2), ("n", 64), ("seed", 0)))


def _record(op: str, n: int, family: str, params: dict) -> SupervisionRecord:
    return SupervisionRecord(BANDED, op, "f32", n, (Variant(family, tuple(sorted(params.items())), 2.0),))


@pytest.fixture(scope="module")
def cpu_evaluator():
    from sparserl_compile.training.rewards import SandboxEvaluator

    ev = SandboxEvaluator("cpu", workers=2)
    yield ev
    ev.close()


@pytest.mark.parametrize("op,n,family,params,combine", [
    ("spmv", 1, "csr_vector", {"block": 128, "tpr": 8}, True),
    ("spmm", 8, "csr_scalar", {"block": 128, "cols": 4}, False),
])
def test_every_variant_parses_compiles_and_verifies(cpu_evaluator, op, n, family, params, combine):
    m = BANDED.load()
    params = params if params in kernels.family(family).space(op, "f32") else kernels.family(family).space(op, "f32")[0]
    rec = _record(op, n, family, params)
    cands = V.record_candidates(rec, m, top=1, combine=combine)
    assert len(cands) >= 5  # every single transform applies to these templates
    for variant, text in cands:
        assert V.grammar_problems(text) == []
        compiler.compile_cubin(text, "sm_90")  # raises CompileError when NVRTC rejects it
        assert dict(variant.params)[V.TRANSFORM_KEY] and variant.us == 2.0
        assert V.render(family, op, "f32", dict(variant.params), m) == text
        assert is_novel(text, op, "f32")  # a new kernel, not a point of the space up to names
    verified = V.verified_variants(rec, m, cpu_evaluator, top=1, combine=combine)
    assert [v.params for v in verified] == [v.params for v, _t in cands]


def test_a_wrong_variant_is_not_a_target(cpu_evaluator, monkeypatch):
    m = BANDED.load()
    rec = _record("spmv", 1, "csr_scalar", {"block": 128})
    real = V.unroll
    # an unroll that forgets the remainder loop: wrong on rows whose length is odd
    monkeypatch.setitem(transforms._APPLY, "unroll2", lambda s: real(s, 2).replace("for (; k < end; k += 1)", "if (0)"))
    verified = {dict(v.params)[V.TRANSFORM_KEY] for v in V.verified_variants(rec, m, cpu_evaluator, top=1,
                                                                                 combine=False)}
    assert "unroll2" not in verified and "unroll4" in verified


def test_unroll_keeps_a_loop_that_synchronises():
    src = kernels.render("csr_scalar", "spmv", "f32", {"block": 128}).source
    synced = src.replace("acc = fmaf(", "__syncwarp();\n        acc = fmaf(")
    with pytest.raises(ValueError, match="does not apply"):
        V.apply(synced, "unroll2")
    with pytest.raises(ValueError, match="known transforms"):
        V.apply(src, "vectorise")


def test_variant_records_become_sft_targets(tiny_tok):
    from sparserl_compile.training.sft import build_examples

    m = BANDED.load()
    rec = _record("spmv", 1, "csr_scalar", {"block": 128})
    extra = tuple(v for v, _t in V.record_candidates(rec, m, top=1, combine=False))
    rec = SupervisionRecord(rec.matrix, rec.op, rec.dtype, rec.n, rec.variants + extra)
    examples, skipped = build_examples([rec], tiny_tok, 64, top=1 + len(extra), loaded={BANDED: m})
    assert skipped == 0 and len(examples) == 1 + len(extra)
    texts = {tiny_tok.decode(e.target_ids[:-1]) for e in examples}
    assert len(texts) == len(examples)


def test_the_command_writes_records_with_variants_that_load_back(tmp_path):
    import json

    from policy_fixtures import structure_dependent_supervision
    from sparserl_compile.training.data import load_supervision, split

    data = tmp_path / "sup.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in structure_dependent_supervision()))
    out = tmp_path / "variants.jsonl.gz"
    stats = tmp_path / "stats.json"
    assert V.main(["--data", str(data), "--out", str(out), "--max-records", "1", "--no-combine", "--top", "1",
                   "--stats", str(stats)]) == 0
    before, after = load_supervision(data), load_supervision(out)
    assert len(after) == len(before)
    grown = [r for r in after if any(V.TRANSFORM_KEY in dict(v.params) for v in r.variants)]
    assert len(grown) == 1 and grown[0].matrix in {r.matrix for r in split(before).train}
    # the variants rank right after their point: the record's best is still its measured point
    best = grown[0].best()
    assert V.TRANSFORM_KEY not in dict(best.params)
    assert split(after).held_out == split(before).held_out
    # the counts: every variant added was verified, and each counted transform is a single one
    counts = json.loads(stats.read_text())["transforms"]
    added = sum(V.TRANSFORM_KEY in dict(v.params) for v in grown[0].variants)
    assert sum(c["verified"] for c in counts.values()) == added > 0
    assert all(c["candidates"] >= c["verified"] >= c["novel"] for c in counts.values())
    assert not any(k.startswith("any:") or "+" in k for k in counts)


def test_stats_count_each_transform_and_each_part_of_a_combination():
    """A stand-in evaluator that passes every variant but the unroll2 ones: the counts follow it,
    a combination counts under its own name and under each of its parts."""
    from collections import Counter
    from types import SimpleNamespace

    m = BANDED.load()
    rec = _record("spmv", 1, "csr_scalar", {"block": 128})
    cands = V.record_candidates(rec, m, top=1, combine=True)
    names = [dict(v.params)[V.TRANSFORM_KEY] for v, _t in cands]

    def evaluator(problem, texts):
        return [SimpleNamespace(correct=not n.startswith("unroll2")) for n in names]

    stats = Counter()
    V.verified_variants(rec, m, evaluator, top=1, combine=True, stats=stats)
    assert stats["unroll2", "candidates"] == 1 and stats["unroll2", "verified"] == 0
    assert stats["unroll4", "verified"] == stats["unroll4", "novel"] == 1
    combos = [n for n in names if "+" in n]
    assert combos and stats[f"any:{combos[0].split('+')[1]}", "candidates"] >= 1
    table = V.stats_table(stats)
    assert f"{len(names):10d}" in table.splitlines()[-1]  # the total counts every distinct variant once
