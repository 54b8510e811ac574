"""Every point of the kernel space (all families, both ops, all dtypes) compiles with NVRTC."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import scipy.sparse as sp

from sparserl_compile import compiler, contract, kernels


def test_whole_space_compiles_for_sm90():
    m = sp.random(64, 48, density=0.05, format="csr", random_state=3, dtype=np.float32)
    cands = [c for op in contract.OPS for dt in contract.DTYPES for c in kernels.space(op, dt, structure=m)]
    assert {c.family for c in cands} == {f.name for f in kernels.FAMILIES}

    def build(c):
        try:
            r = compiler.compile_cubin(c.source, "sm_90")
            return c.name, r.cubin[:4], ""
        except compiler.CompileError as e:
            return c.name, b"", str(e) + "\n" + e.numbered_source()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=4) as ex:
        results = list(ex.map(build, cands))
    elapsed = time.perf_counter() - t0
    failures = [(n, err) for n, _, err in results if err]
    assert not failures, failures[0]
    assert all(magic == b"\x7fELF" for _, magic, _ in results)  # cubins are ELF images
    print(f"\ncompiled {len(cands)} kernels in {elapsed:.1f} s")
