"""The pre-generation benchmark's folder (benchmarks/pregen_set.py): formats pregen must read."""

import numpy as np
import pytest

pregen_set = pytest.importorskip("pregen_set")

from sparserl_compile import matrices, pregen  # noqa: E402


def test_pruned_mlp_onnx_gives_its_pruned_weights_as_out_by_in_float32_matrices(tmp_path):
    pytest.importorskip("onnx")
    path = tmp_path / "mlp.onnx"
    pregen_set.pruned_mlp_onnx(path, sizes=(40, 24, 8), sparsity=0.75)
    items = pregen.discover([str(path)])
    assert [(it.name, it.matrix.shape) for it in items] == [("mlp.onnx:fc0.weight", (24, 40)),
                                                            ("mlp.onnx:fc1.weight", (8, 24))]
    for it in items:
        assert it.matrix.dtype == np.float32
        assert it.matrix.nnz == pytest.approx(0.25 * it.matrix.shape[0] * it.matrix.shape[1], abs=2)


def test_assemble_writes_npz_mtx_and_onnx_that_pregen_discovers(tmp_path):
    pytest.importorskip("onnx")
    shared = matrices.shared_matrices_dir()
    if shared is None:
        pytest.skip("../shared/matrices is absent (set SPARSERL_SHARED_MATRICES to the shared matrices folder)")
    out = tmp_path / "set"
    files = pregen_set.assemble(shared, out)
    assert {f.suffix for f in files} == {".npz", ".mtx", ".onnx"}
    names = {it.name for it in pregen.discover([str(out)])}
    assert names == ({f"{n}.npz" for n in pregen_set.NPZ} | {f"{pregen_set.MTX}.mtx"}
                     | {"mlp_pruned90.onnx:fc0.weight", "mlp_pruned90.onnx:fc1.weight"})
    mtx = next(it for it in pregen.discover([str(out / f"{pregen_set.MTX}.mtx")]))
    assert (mtx.matrix != matrices.load_npz(shared / f"{pregen_set.MTX}.npz")).nnz == 0
