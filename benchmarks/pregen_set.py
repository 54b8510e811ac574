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

import scipy.io

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from pregenerate import pruned_mlp_onnx  # noqa: E402  (the example's writer of a pruned ONNX model)

from sparserl_compile import matrices  # noqa: E402

#: the shared matrices copied as .npz (kind in the MANIFEST: one or two of each)
NPZ = ("rajat01", "bcsstk17", "fe_body", "wiki-Vote", "rgg_n_2_15_s0", "dnn_n1024_l1", "pushpull")
#: the shared matrix written as Matrix Market instead
MTX = "4elt"


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
