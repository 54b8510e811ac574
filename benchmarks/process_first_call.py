"""A fresh process's first products on new structures, with the runtime's default provider.

``cold_start.py`` and ``provider_e2e.py`` measure a serving process that has paid its one-time
costs (``prewarm``: the sandbox worker's interpreter and CUDA context, the format converters,
the policy's model). This script measures what a user's script pays when it has not: each
case runs in its own fresh interpreter (``python -c`` of this file's ``child``), which imports
``sparserl_compile``, optionally calls ``prewarm().join()`` (``startup_s``), and then times the
first product on each of three generated structures (synchronized, the disk cache off):

* ``first_s``: the process's first product (the sandbox worker's start is in it unless
  prewarmed; the default provider does not wait for the policy's model: until it is loaded and
  warmed up, in the background, the lookup proposes), its ``propose_s`` / ``select_s`` split
  from ``first_uses()`` and ``first_proposer``, who proposed;
* ``second_s``: the next new structure's first product, right after;
* ``third_s``: a third new structure's, once the default provider's background load is done
  (waited ``ready_wait_s`` for it after the second).

Cases: ``default`` (the runtime's default provider, unconfigured: the policy where the ``train``
extra is installed) and ``nearest``, each ``cold`` and ``prewarm``. Before them one more
``default`` cold process, its row marked ``"after_install": True``: the first process after an
install also writes the disk caches every later one reads (numba's compiled converters and
structure statistics, Python's bytecode), a one-time cost that would otherwise land on whichever
case runs first (``--no-prime`` leaves it out). Each product's selection record (``*_record``:
per-candidate worker phases, the waits for a worker) says where its time went.

On a CPU every product uses the reference (kernels are GPU-only): the script then measures only
the imports. ``tests/benchmarks/test_process_first_call.py`` runs it there.

    python benchmarks/process_first_call.py [--device cuda] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CASES = (("default", False), ("default", True), ("nearest", False), ("nearest", True))


def child(provider: str, prewarm: bool, device: str) -> dict:
    """One case, in this (fresh) process."""
    t0 = time.perf_counter()
    import torch

    import sparserl_compile as sr
    from sparserl_compile import matrices, miss, plans, providers
    from sparserl_compile.bench import sync

    out = {"import_s": time.perf_counter() - t0}
    dev = torch.device(device)
    sr.configure(cache=False, **({} if provider == "default" else {"provider": provider}))
    if prewarm:
        t0 = time.perf_counter()
        sr.prewarm().join()
        out["startup_s"] = time.perf_counter() - t0
    for label, (gen, kw) in (("first", ("stencil2d", {"n": 300, "seed": 11})),
                             ("second", ("banded", {"n": 200_000, "half_bandwidth": 3, "seed": 11})),
                             ("third", ("random_geometric", {"n": 50_000, "avg_degree": 8, "seed": 11}))):
        if label == "third":  # once the default provider's background load (if it started one) is done
            t0, prov = time.perf_counter(), providers.get_provider()
            while getattr(prov, "loading", False) and time.perf_counter() - t0 < 120:
                time.sleep(0.05)
            out["ready_wait_s"] = time.perf_counter() - t0
        a = sr.sparsify(matrices.generate(gen, **kw)).to(dev)
        x = torch.randn(a.shape[1], device=dev)
        sync(dev)
        t0 = time.perf_counter()
        y = a @ x
        sync(dev)
        out[f"{label}_s"] = time.perf_counter() - t0
        log = miss.first_uses()
        row = log[-1] if log else {}
        for part in ("propose", "select", "plan"):  # plan: the winner's conversion, upload and load
            out[f"{label}_{part}_s"] = row.get(f"{part}_s")
        out[f"{label}_proposer"] = (row.get("verification") or {}).get("provider")  # who proposed
        out[f"{label}_plan"] = next((pl.kind for key, pl in plans.plans().items() if key[0] == a.fingerprint), None)
        out[f"{label}_finite"] = bool(torch.isfinite(y).all())
        out[f"{label}_record"] = row.get("verification")
    p = providers.get_provider()
    out["provider"] = p.name
    out["fallback_reason"] = getattr(p, "fallback_reason", None)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda (default where torch sees one) or cpu")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per case")
    p.add_argument("--no-prime", action="store_true",
                   help="no first process to write the disk caches (its row: after_install)")
    a = p.parse_args(argv)
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    runs = [(provider, prewarm, False) for provider, prewarm in CASES]
    if not a.no_prime:  # first, the process that writes the disk caches
        runs.insert(0, ("default", False, True))
    for provider, prewarm, primer in runs:
        here = str(Path(__file__).resolve().parent)
        code = (f"import json, sys; sys.path.insert(0, {here!r}); from process_first_call import child; "
                f"print('ROW', json.dumps(child({provider!r}, {prewarm!r}, {a.device!r})))")
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=a.timeout)
        row = {"case": provider, "prewarm": prewarm, "after_install": primer,
               "process_s": time.perf_counter() - t0, "rc": r.returncode}
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
        if lines:
            row.update(json.loads(lines[-1][4:]))
        else:
            row["stderr"] = r.stderr[-2000:]
        rows.append(row)
        print(f"[process] {provider:8s} prewarm={prewarm!s:5s}{' (after install)' if primer else ''} -> {row.get('provider')}: "
              f"startup {row.get('startup_s') or 0:.2f}s first {row.get('first_s', float('nan')):.2f}s "
              f"(propose {row.get('first_propose_s') or 0:.2f}s, {row.get('first_proposer')}) second "
              f"{row.get('second_s', float('nan')):.2f}s (propose {row.get('second_propose_s') or 0:.2f}s, "
              f"{row.get('second_proposer')}) third {row.get('third_s', float('nan')):.2f}s "
              f"({row.get('third_proposer')}, after waiting {row.get('ready_wait_s') or 0:.1f}s) rc={r.returncode}",
              flush=True)
    if a.json:
        from sparserl_compile.fileio import write_json

        write_json(a.json, {"device": a.device, "rows": rows})
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
