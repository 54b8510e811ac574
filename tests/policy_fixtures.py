"""Tiny tokenizer / policy fixtures shared by tests/policy and tests/training (their conftests import them)."""

from __future__ import annotations

import pytest

CSR_SCALAR = '''// sparserl op=spmv format=csr dtype=f32 index=i32
// launch block=256 work=rows per_block=256 tile_n=0 smem=0 zero_output=0 n_align=1
extern "C" __global__ void sparserl_kernel(int n_rows, int n_cols, const int* __restrict__ row_ptr, const int* __restrict__ col_idx, const float* __restrict__ vals, const float* __restrict__ x, float* __restrict__ y) {
    int row = blockIdx.x * 256 + threadIdx.x;
    if (row >= n_rows) return;
    float acc = 0.0f;
    for (int k = __ldg(&row_ptr[row]); k < __ldg(&row_ptr[row + 1]); ++k) {
        acc = fmaf(__ldg(&vals[k]), __ldg(&x[__ldg(&col_idx[k])]), acc);
    }
    y[row] = acc;
}
'''


@pytest.fixture(scope="session")
def kernel_source() -> str:
    return CSR_SCALAR


@pytest.fixture(scope="session")
def tiny_tok():
    from sparserl_compile.policy.tokenizer import TokenizerSpec, train_tokenizer

    return train_tokenizer([CSR_SCALAR] * 10, TokenizerSpec(vocab_size=400))


@pytest.fixture(scope="session")
def n_features() -> int:
    import numpy as np

    from sparserl_compile.policy.encoder import structure_features

    return len(structure_features(np.array([0, 1]), np.array([0]), (1, 1)))


@pytest.fixture()
def tiny_model(tiny_tok, n_features):
    from sparserl_compile.policy.model import PolicyHParams, build_policy

    return build_policy(PolicyHParams.tiny(len(tiny_tok), n_features), seed=0).eval()


def banded_structure():
    """A prepared structure of a small banded matrix: what the decoding tests prompt with."""
    from sparserl_compile.matrices import banded
    from sparserl_compile.policy.encoder import prepare_structure

    m = banded(64, 2)
    return prepare_structure(m.indptr, m.indices, m.shape)


def structure_dependent_supervision() -> list[dict]:
    """Supervision lines (training/data.py schema) whose best csr_scalar block depends on the
    structure: 128 for banded matrices, 512 for uniform random ones (6 seeds each)."""
    lines = []
    for seed in range(6):
        for gen, kw, best in (("banded", {"n": 64, "half_bandwidth": 1}, 128),
                              ("uniform_random", {"n_rows": 64, "n_cols": 64, "per_row": 6.0}, 512)):
            lines.append({"matrix": {"source": "generated", "generator": gen, "kwargs": {**kw, "seed": seed}},
                          "op": "spmv", "dtype": "f32", "n": 1,
                          "variants": [{"family": "csr_scalar", "params": {"block": best}, "us": 1.0},
                                       {"family": "csr_scalar", "params": {"block": 32}, "us": 5.0}]})
    return lines
