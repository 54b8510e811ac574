"""Assemble the folder the pre-generation benchmark serves (docs/benchmarks.md, "Pre-generation").

A deployment's model folder holds matrices in several formats; this one holds, from the shared
matrices, seven ``.npz`` files of different kinds (circuit, FEM, mesh, social, road, DNN), one of
them written as Matrix Market ``.mtx`` instead, and one ONNX model: a two-layer MLP
(1024 -> 1024 -> 1024, float32) whose weights are magnitude-pruned to 90 % zeros, so that
``sparserl pregen`` finds its two initializers as sparse matrices.

    python benchmarks/pregen_set.py ../shared/matrices .device_carry/pregen
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np
import scipy.io

from sparserl_compile import matrices

#: the shared matrices copied as .npz (kind in the MANIFEST: one or two of each)
NPZ = ("rajat01", "bcsstk17", "fe_body", "wiki-Vote", "rgg_n_2_15_s0", "dnn_n1024_l1", "pushpull")
#: the shared matrix written as Matrix Market instead
MTX = "4elt"


def pruned_mlp_onnx(path: Path, sizes=(1024, 1024, 1024), sparsity: float = 0.9, seed: int = 0) -> None:
    """An MLP ``x -> relu(x W1^T + b1) W2^T + b2`` as ONNX, its weights magnitude-pruned."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes, prev = [], [], "x"
    for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        w = (rng.standard_normal((d_out, d_in)) / np.sqrt(d_in)).astype(np.float32)
        w[np.abs(w) < np.quantile(np.abs(w), sparsity)] = 0.0
        inits += [numpy_helper.from_array(w, f"fc{i}.weight"),
                  numpy_helper.from_array(np.zeros(d_out, np.float32), f"fc{i}.bias")]
        out = f"h{i}" if i < len(sizes) - 2 else "y"
        # Gemm with transB=1: y = x W^T + b, as torch.onnx exports nn.Linear
        nodes.append(helper.make_node("Gemm", [prev, f"fc{i}.weight", f"fc{i}.bias"],
                                      [out + "_lin" if out != "y" else "y"], transB=1))
        if out != "y":
            nodes.append(helper.make_node("Relu", [out + "_lin"], [out]))
        prev = out
    graph = helper.make_graph(nodes, "pruned_mlp",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", sizes[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", sizes[-1]])],
                              initializer=inits)
    model = helper.make_model(graph)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def assemble(shared: Path, out: Path) -> list[Path]:
    """Write the folder; returns the files in it."""
    out.mkdir(parents=True, exist_ok=True)
    for name in NPZ:
        shutil.copy(shared / f"{name}.npz", out / f"{name}.npz")
    scipy.io.mmwrite(str(out / f"{MTX}.mtx"), matrices.load_npz(shared / f"{MTX}.npz"))
    pruned_mlp_onnx(out / "mlp_pruned90.onnx")
    return sorted(out.iterdir())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shared", type=Path, help="the shared matrices folder (../shared/matrices)")
    p.add_argument("out", type=Path, help="the folder to write")
    args = p.parse_args(argv)
    missing = [n for n in (*NPZ, MTX) if not (args.shared / f"{n}.npz").is_file()]
    if missing:
        p.error(f"{args.shared} lacks {', '.join(m + '.npz' for m in missing)}: point at ../shared/matrices")
    for f in assemble(args.shared, args.out):
        print(f"{f.stat().st_size / 1e6:7.2f} MB  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
