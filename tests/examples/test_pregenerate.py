"""examples/pregenerate.py at CI scale: build a cache without a GPU (CPU executor), serve from it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from dataclasses import replace

import pytest
import torch
from example_loader import load_example

from sparserl_compile import cache, providers

pg = load_example("pregenerate")

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU build/serve flow (untimed entries); "
                              "test_gpu_build_and_serve covers a GPU machine")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The example's main on two generated matrices, spmv only: its output and the folders."""
    root = tmp_path_factory.mktemp("pregen_example")
    mats = root / "matrices"
    pg.write_demo_matrices(mats)
    out = root / "kernels"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = pg.main([str(mats), "--out", str(out), "--ops", "spmv", "--no-progress",
                      "--json", str(root / "pregen.json")])
    return rc, buf.getvalue(), mats, out


@cpu_only
def test_main_builds_untimed_entries_and_serves_every_product_from_them(built):
    rc, text, mats, out = built
    assert rc == 0, text
    assert "verified on the cpu executor" in text
    assert "2/2 products found" in text
    assert "$ sparserl cache ls" in text and "2 entries in" in text
    assert "first call from the cache: median" in text
    written = json.loads((out.parent / "pregen.json").read_text())
    assert written["executor"] == "cpu" and len(written["build"]) == 2
    assert [x["found"] for x in written["served"]] == [True, True]
    assert all(x["first_call_s"] > 0 and x["search_first_call_s"] is None for x in written["served"])
    assert "2 valid entries, 0 removed" in text
    listings = cache.KernelCache(out).ls()
    assert len(listings) == 2 and all(x.entry is not None for x in listings)
    for x in listings:
        e = x.entry
        assert e.key.op == "spmv" and e.key.arch == pg.DEFAULT_TARGET.arch
        assert e.key.gpu_name == pg.DEFAULT_TARGET.gpu_name
        if not e.reference_wins:  # a verified kernel: cubin and source, no timings (CPU build)
            assert e.cubin and "sparserl_kernel" in e.source
            assert e.verification.get("executor") == "cpu" and "kernel_us" not in e.times


@cpu_only
def test_serve_finds_each_key_and_restores_the_environment(built):
    _, _, mats, out = built
    before = os.environ["SPARSERL_CACHE_DIR"]
    report = pg.serve([str(mats)], out, ops=("spmv",))
    assert os.environ["SPARSERL_CACHE_DIR"] == before
    assert report.device == "cpu" and report.stats is None and report.entries == 2
    assert report.misses == 0
    assert {x.name for x in report.lookups} == {"stencil2d_8.npz", "banded_96_row40_empty.npz"}
    for x in report.lookups:
        assert x.verdict in ("untimed kernel", "reference wins")
        assert x.max_rel_err < 1e-5  # the served product (CPU reference) vs scipy float64


@cpu_only
def test_serving_another_target_misses_every_key(built):
    _, _, mats, out = built
    other = replace(pg.DEFAULT_TARGET, driver_version="12040")  # a different driver: other binaries
    report = pg.serve([str(mats)], out, ops=("spmv",), target=other)
    assert report.misses == len(report.lookups) == 2
    assert all(x.verdict == "missing" for x in report.lookups)


@cpu_only
def test_a_second_build_resumes_from_the_cache(built):
    _, _, mats, out = built
    b = pg.build([str(mats)], out, ops=("spmv",), progress=False)
    assert b.executor == "cpu" and b.failed == 0
    assert [r.outcome for r in b.rows] == ["cached", "cached"]


@cpu_only
def test_serve_only_uses_a_cache_built_elsewhere_and_builds_nothing(built, tmp_path):
    _, _, mats, out = built
    copied = tmp_path / "carried"  # the folder as another machine receives it
    shutil.copytree(out, copied)
    before = sorted(p.name for p in copied.rglob("*"))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = pg.main([str(mats), "--out", str(copied), "--ops", "spmv", "--serve-only",
                      "--json", str(tmp_path / "served.json")])
    text = buf.getvalue()
    assert rc == 0, text
    assert "== serve only" in text and "== build" not in text and "2/2 products found" in text
    assert sorted(p.name for p in copied.rglob("*")) == before  # nothing written into the cache
    written = json.loads((tmp_path / "served.json").read_text())
    assert written["serve_only"] is True and written["build"] == [] and written["build_seconds"] is None
    assert [x["found"] for x in written["served"]] == [True, True]


def test_serve_only_without_a_cache_says_to_build_one(tmp_path, capsys):
    with pytest.raises(SystemExit):
        pg.main(["--out", str(tmp_path / "empty"), "--ops", "spmv", "--serve-only"])
    assert "no cache entries" in capsys.readouterr().err


@cpu_only
def test_build_with_a_named_provider_restores_the_runtime_provider(tmp_path):
    mats = tmp_path / "matrices"
    pg.write_demo_matrices(mats)
    before = providers.get_provider()
    b = pg.build([str(mats)], tmp_path / "k", ops=("spmv",), progress=False, provider="reference")
    assert b.failed == 0 and [r.outcome for r in b.rows] == ["reference", "reference"]
    assert providers.get_provider() is before


class _CheckpointedReference(providers.ReferenceProvider):
    """A provider with a checkpoint hash, as the policy has (its entries are keyed to it)."""

    name = "checkpointed"
    checkpoint_hash = "ab12" * 16


@cpu_only
def test_entries_built_by_a_policy_are_found_by_that_policy_only(tmp_path):
    mats = tmp_path / "matrices"
    pg.write_demo_matrices(mats)
    out = tmp_path / "k"
    before = providers.get_provider()
    b = pg.build([str(mats)], out, ops=("spmv",), progress=False, provider=_CheckpointedReference())
    assert b.policy_hash == "ab12" * 16 and providers.get_provider() is before
    assert pg.serve([str(mats)], out, ops=("spmv",)).misses == 2  # the default provider (another checkpoint or none): no hit
    providers.set_provider(_CheckpointedReference())
    try:
        assert pg.serve([str(mats)], out, ops=("spmv",)).misses == 0
    finally:
        providers.set_provider(before)


@cpu_only
@pytest.mark.skipif(providers.policy_available() is not None, reason="the default provider here is not the policy")
def test_a_cache_built_by_the_default_policy_serves_a_process_without_it(tmp_path):
    """Built with the runtime's default (the shipped policy: its entries carry the checkpoint's
    hash), the cache serves every product to a process whose provider is the lookup, as one
    without the ``train`` extra has; the example prints no note saying otherwise."""
    mats = tmp_path / "matrices"
    pg.write_demo_matrices(mats)
    out = tmp_path / "k"
    before = providers.get_provider()
    b = pg.build([str(mats)], out, ops=("spmv",), progress=False, provider=providers.DefaultProvider(providers.POLICY_CHAIN))
    assert b.failed == 0 and b.policy_hash == providers.shipped_policy_hash() != "none"
    providers.set_provider("nearest")
    try:
        assert pg.serve([str(mats)], out, ops=("spmv",)).misses == 0
    finally:
        providers.set_provider(before)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert pg.main([str(mats), "--out", str(out), "--ops", "spmv", "--no-progress",
                        "--serve-provider", "nearest"]) == 0
    assert "will not find them" not in buf.getvalue()
    providers.set_provider(before)


def test_main_rejects_an_unknown_op(tmp_path):
    with pytest.raises(SystemExit):
        pg.main(["--out", str(tmp_path / "k"), "--ops", "spmv,gemm"])


@pytest.mark.gpu
def test_gpu_build_and_serve_runs_every_product_from_the_cache(tmp_path):
    mats = tmp_path / "matrices"
    pg.write_demo_matrices(mats)
    out = tmp_path / "kernels"
    b = pg.build([str(mats)], out, ops=("spmv", "spmm"), widths=(8,), progress=False)
    assert b.executor == "gpu" and b.failed == 0
    report = pg.serve([str(mats)], out, ops=("spmv", "spmm"), widths=(8,), timed=True)
    assert report.device == "cuda" and report.misses == 0
    assert all(x.served_us > 0 and x.torch_us > 0 for x in report.lookups)  # --time: side by side
    assert pg.speedup_geomean(report) > 0
    assert report.stats.cache_hits == len(report.lookups) == 4
    assert report.stats.searches == 0  # entries built here are timed: nothing is searched at serve time
    assert report.stats.fallbacks == 0
    assert all(x.max_rel_err < 1e-4 for x in report.lookups)
    cold = pg.search_first_calls([str(mats)], ops=("spmv", "spmm"), widths=(8,), timed=True)
    assert len(cold) == 4  # the same products, planned without the cache
    assert all(first > 0 and us > 0 and torch_us > 0 for first, us, torch_us in cold)
    text = pg.format_lookups(replace(report, lookups=[
        replace(x, search_first_call_s=c[0], search_served_us=c[1], search_torch_us=c[2])
        for x, c in zip(report.lookups, cold)]))
    assert "planned on first use without the cache, against torch.sparse: geomean" in text
