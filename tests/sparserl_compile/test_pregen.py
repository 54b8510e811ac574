"""sparserl pregen: discovery (.npz, .mtx, ONNX), a CPU build-machine run, resume, the CLI."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.io
import scipy.sparse as sp

from sparserl_compile import cache, matrices, miss, pregen
from sparserl_compile.commands.cli import main
from sparserl_compile.problem import make_problem

TARGET = cache.Target(arch="sm_90", gpu_name="NVIDIA H200", driver_version="13000", nvrtc_version="13.0")


def _save_npz(path, m):
    np.savez(path, indptr=m.indptr, indices=m.indices, data=m.data, shape=np.array(m.shape))


def test_discover_reads_npz_mtx_and_skips_what_is_not_a_matrix(tmp_path):
    a = matrices.stencil2d(6)
    _save_npz(tmp_path / "a.npz", a)
    scipy.io.mmwrite(str(tmp_path / "sub_b.mtx"), matrices.banded(30, 1))
    np.savez(tmp_path / "labels.npz", labels=np.arange(3))
    (tmp_path / "notes.txt").write_text("not a matrix")
    items = pregen.discover([str(tmp_path)])
    names = sorted(i.name for i in items)
    assert names == ["a.npz", "sub_b.mtx"]
    got = {i.name: i.matrix for i in items}
    assert (got["a.npz"] != a).nnz == 0


def test_discover_names_a_missing_path(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        pregen.discover([str(tmp_path / "absent")])


def test_onnx_pruned_weights_become_out_by_in_matrices(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 5)).astype(np.float32)  # MatMul B: [in=8, out=5]
    w[rng.random(w.shape) < 0.7] = 0.0
    dense = rng.standard_normal((5, 3)).astype(np.float32)  # not sparse: ignored
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("MatMul", ["h", "d"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(dense, "d")])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g), str(path))
    (item,) = pregen.discover([str(path)], min_sparsity=0.5)
    assert item.name == "m.onnx:w" and item.matrix.shape == (5, 8)
    np.testing.assert_array_equal(item.matrix.toarray(), w.T)


def test_onnx_float64_weights_are_skipped_with_a_reason(tmp_path, capsys):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    w = np.zeros((4, 6))  # float64, all zeros: sparse, but not a dtype sparserl runs
    w[0, 1] = 1.0
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [1, 6])],
                          initializer=[numpy_helper.from_array(w, "w")])
    path = tmp_path / "f64.onnx"
    onnx.save(helper.make_model(g), str(path))
    assert pregen.discover([str(path)]) == []
    assert "skipping f64.onnx:w: DOUBLE weights" in capsys.readouterr().err


@pytest.mark.slow
def test_cpu_build_machine_run_writes_untimed_entries_and_resumes(tmp_path):
    _save_npz(tmp_path / "s.npz", matrices.stencil2d(8))
    out = tmp_path / "kernels"
    items = pregen.discover([str(tmp_path / "s.npz")])
    rows = pregen.pregenerate(items, cache_dir=out, ops=("spmv",), target=TARGET, executor="cpu", progress=False)
    (row,) = rows
    assert row.outcome == "kernel" and row.kernel_us is None  # verified on the CPU, not timed
    store = cache.KernelCache(out)
    (listing,) = store.ls()
    m = items[0].matrix
    from sparserl_compile import structure

    problem = make_problem("spmv", "f32", 1, m.indptr, m.indices, m.shape,
                                   structure.fingerprint(m.indptr, m.indices, m.shape), "sm_90")
    entry = store.get(miss.key_for(problem, TARGET))
    assert entry is not None and entry.cubin and "sparserl_kernel" in entry.source
    assert entry.verification["executor"] == "cpu"
    again = pregen.pregenerate(items, cache_dir=out, ops=("spmv",), target=TARGET, executor="cpu", progress=False)
    assert [r.outcome for r in again] == ["cached"]


def test_cli_without_gpu_or_target_explains(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _save_npz(tmp_path / "s.npz", matrices.stencil2d(4))
    assert main(["pregen", str(tmp_path / "s.npz"), "--out", str(tmp_path / "k"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--target-gpu" in err and "sparserl target" in err
    assert not (tmp_path / "k").exists()


def test_cli_target_gpu_needs_the_serving_versions(tmp_path, capsys):
    """Keys carry the serving machine's driver and NVRTC versions: entries keyed 'unknown' would
    never be found there, so pregen refuses before any work."""
    _save_npz(tmp_path / "s.npz", matrices.stencil2d(4))
    assert main(["pregen", str(tmp_path / "s.npz"), "--out", str(tmp_path / "k"), "--no-progress",
                 "--target-gpu", "NVIDIA H200"]) == 2
    err = capsys.readouterr().err
    assert "--target-driver and --target-nvrtc" in err and "sparserl target" in err
    assert not (tmp_path / "k").exists()


@pytest.mark.parametrize("flag, value, why", [
    ("--widths", "a,b", "comma list of integers"), ("--widths", "32,-3", "at least 1"),
    ("--widths", "0", "at least 1"), ("--ops", "spmx", "comma list of spmv, spmm"),
])
def test_cli_refuses_bad_widths_and_ops_before_any_work(tmp_path, capsys, flag, value, why):
    _save_npz(tmp_path / "s.npz", matrices.stencil2d(4))
    with pytest.raises(SystemExit) as done:
        main(["pregen", str(tmp_path / "s.npz"), "--out", str(tmp_path / "k"), "--target-gpu", "NVIDIA H200",
              flag, value])
    assert done.value.code == 2 and why in capsys.readouterr().err
    assert not (tmp_path / "k").exists()


def test_discover_skips_corrupt_and_malformed_files_and_keeps_going(tmp_path, capsys):
    """One unreadable file never stops a run, and a malformed one is never read as another
    matrix (a cast would have wrapped an index of 2^32 + 2 to 2, or cut nonzeros silently)."""
    good = matrices.stencil2d(4)
    _save_npz(tmp_path / "good.npz", good)
    _save_npz(tmp_path / "b_trunc.npz", good)
    data = (tmp_path / "b_trunc.npz").read_bytes()
    (tmp_path / "b_trunc.npz").write_bytes(data[: len(data) // 2])
    (tmp_path / "c_notgz.mtx.gz").write_text("not gzip")
    bad = {
        "d_lastptr.npz": dict(indptr=np.array([0, 1, 2]), indices=np.array([0, 1, 1]), data=np.ones(3)),
        "e_bigidx.npz": dict(indptr=np.array([0, 1, 2]), indices=np.array([0, 2**32 + 1]), data=np.ones(2)),
        "f_floatidx.npz": dict(indptr=np.array([0, 1, 2]), indices=np.array([0.0, 1.0]), data=np.ones(2)),
        "g_complex.npz": dict(indptr=np.array([0, 1, 2]), indices=np.array([0, 1]), data=np.ones(2) * 1j),
    }
    for name, arrays in bad.items():
        np.savez(tmp_path / name, shape=np.array([2, 2]), **arrays)
    items = pregen.discover([str(tmp_path)])
    assert [i.name for i in items] == ["good.npz"]
    err = capsys.readouterr().err
    for name, why in [("b_trunc.npz", "cannot read it"), ("c_notgz.mtx.gz", "cannot read it"),
                      ("d_lastptr.npz", "!= nnz (3)"), ("e_bigidx.npz", "span [0, 4294967297]"),
                      ("f_floatidx.npz", "not integers"), ("g_complex.npz", "real matrices")]:
        assert f"skipping {tmp_path / name}: " in err and why in err, name


def test_empty_matrices_are_skipped_with_a_reason(tmp_path, capsys):
    _save_npz(tmp_path / "e.npz", sp.csr_matrix((4, 4), dtype=np.float32))
    assert pregen.discover([str(tmp_path)]) == []
    assert "empty matrix" in capsys.readouterr().err


def _row_pruned(n_rows, n_cols, per_row, seed):
    """A weight pruned to exactly ``per_row`` nonzeros in every row (as per-row pruning does)."""
    rng = np.random.default_rng(seed)
    cols = np.concatenate([np.sort(rng.choice(n_cols, per_row, replace=False)) for _ in range(n_rows)])
    indptr = np.arange(0, n_rows * per_row + 1, per_row)
    return sp.csr_matrix((rng.standard_normal(cols.size).astype(np.float32), cols, indptr), shape=(n_rows, n_cols))


def test_share_key_groups_alike_row_pruned_weights():
    a, b = _row_pruned(48, 64, 16, 0), _row_pruned(48, 64, 16, 1)
    assert pregen.share_key(a, "spmm", 4, "f32") == pregen.share_key(b, "spmm", 4, "f32")
    assert pregen.share_key(a, "spmm", 4, "f32") != pregen.share_key(a, "spmm", 8, "f32")
    assert pregen.share_key(a, "spmm", 4, "f32") != pregen.share_key(_row_pruned(48, 64, 8, 0), "spmm", 4, "f32")


@pytest.mark.slow
def test_share_searches_a_group_once_and_verifies_every_member(tmp_path, monkeypatch):
    seen = []
    real = miss.search_entry

    def spy(problem, key, *, candidates=None, executor=None):
        seen.append(len(candidates))
        return real(problem, key, candidates=candidates, executor=executor)

    monkeypatch.setattr(miss, "search_entry", spy)
    items = [pregen.Item("w0", _row_pruned(48, 64, 16, 0)), pregen.Item("w1", _row_pruned(48, 64, 16, 1)),
             pregen.Item("w2", _row_pruned(48, 64, 16, 2)), pregen.Item("other", matrices.stencil2d(8))]
    rows = pregen.pregenerate(items, cache_dir=tmp_path / "k", ops=("spmv",), target=TARGET, executor="cpu",
                              progress=False, share=2)
    assert [r.outcome for r in rows] == ["kernel"] * 4
    assert not rows[0].detail.startswith("shared") and not rows[3].detail.startswith("shared")
    assert rows[1].detail.startswith("shared") and rows[2].detail.startswith("shared")
    # the leader and the unlike matrix saw the whole pruned space; the members at most 2 kernels
    assert seen[0] > 2 and seen[3] > 2 and 1 <= seen[1] <= 2 and seen[1] == seen[2]
    # every member's entry was verified on its own pattern (in the sandbox, CPU executor)
    store = cache.KernelCache(tmp_path / "k")
    assert len(store.ls()) == 4


def test_a_timed_run_decides_again_a_verdict_reached_without_the_dense_product(tmp_path, monkeypatch):
    """A cached "reference wins" of an older selection (no dense timing) is kept by an untimed run
    and searched again by a timed one, whose dense verdict the report shows with its time."""
    from sparserl_compile import plans, structure

    plans.configure(provider="reference")  # proposes nothing: only the stubbed search below decides
    m = matrices.stencil2d(8)  # 64 x 64, 5 per row: dense enough for the dense product
    items = [pregen.Item("s", m)]
    problem = make_problem("spmv", "f32", 1, m.indptr, m.indices, m.shape,
                           structure.fingerprint(m.indptr, m.indices, m.shape), "sm_90")
    key = miss.key_for(problem, TARGET)
    cache.KernelCache(tmp_path / "k").put(cache.CacheEntry(key, None, verification={"why": "reference wins"}))

    def search_entry(problem, key, *, candidates=None, executor=None):
        return cache.CacheEntry(key, None, times={"reference_us": 9.0, "dense_us": 3.0}, outcome="dense",
                                verification={"why": "the dense product wins: ...", "dense_us": 3.0})

    monkeypatch.setattr(miss, "search_entry", search_entry)
    run = dict(cache_dir=tmp_path / "k", ops=("spmv",), target=TARGET, progress=False)
    assert [r.outcome for r in pregen.pregenerate(items, executor="cpu", **run)] == ["cached"]
    (row,) = pregen.pregenerate(items, executor="gpu", **run)
    assert row.outcome == "dense" and row.dense_us == 3.0 and "dense" in pregen.format_table([row])
    assert cache.KernelCache(tmp_path / "k").get(key).dense_wins

