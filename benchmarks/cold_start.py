"""Cold start (GPU): the first product on a structure the process has not seen, per provider.

For each provider and each matrix (generated, up to ~10^6 nonzeros, none of them in the
supervision data), the runtime's plan table is cleared and the disk cache is off, so the first
``A @ x`` asks the provider for candidates, compiles them (NVRTC), verifies them in the sandbox
worker against cuSPARSE, times them and keeps the winner or cuSPARSE. Measured per product:

* ``first_call_s``: wall time of that first call (synchronized), everything included;
* ``propose_s``: the part spent in the provider's ``candidates`` (for the policy: encoding the
  structure and decoding k kernels);
* ``steady_us`` / ``torch_us``: the median time of later calls and of torch.sparse on the same
  product (each call synchronized), and which plan the runtime kept;
* ``stream_us`` / ``torch_stream_us``: the same calls back to back with one synchronize at the
  end, per call (host-bound products show their host cost, the rest their warm-L2 GPU time);
* ``problem_s`` (the pattern copied to the host), ``select_s``, ``plan_s`` (the winner
  converted, uploaded and loaded), ``reference_wall_s`` and ``candidates`` (each one's worker
  wall time and its phases: prepare = static checks + format conversion + NVRTC + upload,
  values, runs, cusparse, time, graph): where the rest of the first call went, from the
  runtime's ``first_uses()`` log; with ``chosen``, ``reference_us`` and each candidate's
  ``kernel_us`` (L2-flushed GPU times), what the selection compared.

One-time process costs (sandbox worker start, CUDA context in the worker, loading the policy,
the numba format converters) are paid first by ``sparserl_compile.prewarm()`` (what a serving
process calls at start-up) and a warm-up product on a small unrelated matrix, so the figures
are what a serving process pays per new structure (the cold-start target: a new structure
of <= 10^6 nonzeros served in under 1 s).

    python benchmarks/cold_start.py [--providers nearest:4,policy:4,search:0] [--json out.json]
    (policy+hints+one@policy/checkpoints/retrieval:4: the hint candidates decoded one at a time,
    not in one batch as the provider does by default)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

import sparserl_compile as sr
from sparserl_compile import matrices, miss, plans, providers
from sparserl_compile.bench import stream_us, sync, wall_median_us
from sparserl_compile.fileio import write_json

#: (label, generator, kwargs): structures none of the supervision files holds (other seeds/sizes)
MATRICES = (
    ("stencil2d_250", "stencil2d", {"n": 250, "seed": 7}),
    ("banded_100k_b5", "banded", {"n": 100_000, "half_bandwidth": 5, "seed": 7}),
    ("uniform_100k_d8", "uniform_random", {"n_rows": 100_000, "n_cols": 100_000, "per_row": 8, "seed": 7}),
    ("rmat_s16_e12", "rmat", {"scale": 16, "edge_factor": 12, "seed": 7}),
    ("rgg_60k_d14", "random_geometric", {"n": 60_000, "avg_degree": 14, "seed": 7}),
)


def _parse_spec(spec: str) -> dict:
    """A provider spec's parts: ``name[+MOD...][@CHECKPOINT]`` -> base name, checkpoint, the
    policy's ``samples`` mode, the decoding order (``+batch``/``+one``), ``+screenN`` (0 without),
    ``+spareN`` (None without: the provider's own), ``+stepsN`` (None without: the provider's
    default; ``+steps0``: no limit). The one parser of a spec, for ``_make_provider`` and ``_spare``."""
    name, _, arg = spec.partition("@")
    base, *mods = name.split("+")

    def counted(mod: str, prefix: str) -> bool:
        return mod.startswith(prefix) and mod[len(prefix):].isdigit()

    def count(prefix: str, default=0):
        return next((int(m[len(prefix):]) for m in mods if counted(m, prefix)), default)

    screen, spare = count("screen"), count("spare", None)
    steps = count("steps", None)
    rest = [m for m in mods if not any(counted(m, p) for p in ("screen", "spare", "steps"))]
    order = {"batch": True, "one": False}
    return {"base": base, "checkpoint": arg, "samples": next((m for m in rest if m not in order), ""),
            "order": [order[m] for m in rest if m in order], "policy_mods": bool(rest) or steps is not None,
            "screen": screen, "spare": spare, "steps": steps}


def _make_provider(spec: str):
    """``name``, ``policy@CHECKPOINT`` or ``policy+MODE@CHECKPOINT`` (MODE: the provider's
    ``samples``, e.g. ``policy+hints@policy/checkpoints/retrieval``). The provider decodes its
    first k candidates speculatively in one batch (``DecodeConfig.batch_drafts``, its default);
    ``+one`` decodes them one at a time, ``+batch`` names the default, e.g.
    ``policy+hints+one@policy/checkpoints/retrieval``; ``+screenN`` screens branch departures
    on N CPU workers (``PolicyProvider(screen_workers=N)``); ``+stepsN`` cuts a departure after
    N forwards (``departure_steps``; ``+steps0``: never).
    ``+spareN`` (any provider) keeps N
    spare sandbox workers (``configure(sandbox_spare=N)``; see ``_spare``) and leaves the
    provider alone."""
    parts = _parse_spec(spec)
    if parts["base"] == "policy" and (parts["checkpoint"] or parts["policy_mods"] or parts["screen"]):
        from dataclasses import replace

        from sparserl_compile.policy.provider import PolicyProvider

        kw = {} if parts["steps"] is None else {"departure_steps": parts["steps"] or None}
        prov = PolicyProvider(checkpoint=parts["checkpoint"] or None, samples=parts["samples"] or None,
                              screen_workers=parts["screen"], **kw)
        for batch in parts["order"]:
            prov.decode = replace(prov.decode, batch_drafts=batch)
        return prov
    if parts["policy_mods"] or parts["screen"]:
        raise ValueError(f"provider spec {spec!r}: only the policy provider takes modifiers other than +spareN")
    return providers.resolve(parts["base"])


def _spare(spec: str) -> int | None:
    """The ``+spareN`` of a provider spec (None without: the runtime keeps what the provider asks
    for, ``miss.sandbox_spare``)."""
    return _parse_spec(spec)["spare"]


def _breakdown(row: dict | None) -> dict:
    """The first call's split from the runtime's ``first_uses()`` log (its last row)."""
    row = row or {}
    record = row.get("verification") or {}
    cands = record.get("candidates")
    return {"propose_s": row.get("propose_s"), "problem_s": row.get("problem_s"), "select_s": row.get("select_s"),
            "plan_s": row.get("plan_s"), "reference_wall_s": record.get("reference_wall_s"),
            "evaluate_s": record.get("seconds"), "evaluate_parts": record.get("parts"),
            "chosen": record.get("chosen"), "rule": record.get("rule"), "reference_us": record.get("reference_us"),
            "reference_graph_us": record.get("reference_graph_us"),
            "candidates": [{"name": c.get("name"), "family": c.get("family"), "params": c.get("params"),
                            "kind": c.get("kind"), "kernel_us": c.get("kernel_us"), "graph_us": c.get("graph_us"),
                            "wall_s": c.get("wall_s"),
                            "phases": c.get("phases"), "overhead": c.get("overhead")}
                           for c in cands] if isinstance(cands, list) else []}


def native_csr(m, dev):
    """``m`` (scipy CSR) as a torch.sparse CSR tensor with int32 indices on ``dev``."""
    return torch.sparse_csr_tensor(torch.from_numpy(m.indptr.astype(np.int32)),
                                   torch.from_numpy(m.indices.astype(np.int32)),
                                   torch.from_numpy(m.data.astype(np.float32)), m.shape).to(dev)


def first_product(a, native, x, dev) -> tuple[float, float]:
    """(seconds, relative error against torch.sparse) of ``a @ x`` on a cleared plan table:
    the first call on a structure the runtime has not seen (its ``first_uses()`` log then holds
    that call's breakdown)."""
    plans.clear()
    plans.reset_stats()
    sync(dev)
    t0 = time.perf_counter()
    y = a @ x
    sync(dev)
    first = time.perf_counter() - t0
    ref = torch.mv(native, x) if x.dim() == 1 else native @ x
    err = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) if ref.numel() else 0.0
    return first, err


def run(provider_specs: list[str], widths: list[int], device: str = "cuda", mats=MATRICES,
        on_row=None) -> list[dict]:
    """The rows (one per provider, matrix and width); ``on_row(rows)`` after each one."""
    dev = torch.device(device)
    rows: list[dict] = []
    _run(provider_specs, widths, dev, mats, on_row, rows)
    return rows


def _run(provider_specs, widths, dev, mats, on_row, rows) -> None:
    for spec in provider_specs:
        pspec, _, k = spec.rpartition(":")
        t0 = time.perf_counter()
        prov = _make_provider(pspec)
        load_s = time.perf_counter() - t0
        sr.configure(provider=prov, k=int(k), cache=False, on_miss="search", sandbox_spare=_spare(pspec))
        t0 = time.perf_counter()
        sr.prewarm().join()
        warm = sr.sparsify(matrices.stencil2d(40, seed=3)).to(dev)  # contexts, NVRTC: paid once
        warm @ torch.randn(warm.shape[1], device=dev)
        sync(dev)
        warm_s = time.perf_counter() - t0
        print(f"[cold] {pspec} k={k}: provider built in {load_s:.2f}s, warm-up product {warm_s:.2f}s", flush=True)
        for label, gen, kw in mats:
            m = matrices.generate(gen, **kw)
            a = sr.sparsify(m).to(dev)
            native = native_csr(m, dev)
            for n in widths:
                x = torch.randn(m.shape[1], device=dev) if n == 1 else torch.randn(m.shape[1], n, device=dev)
                stats = getattr(prov, "stats", None)
                screened = getattr(stats, "screened_out", 0)
                first, err = first_product(a, native, x, dev)
                plan = next(iter(plans.plans().values()), None)
                logged = miss.first_uses()
                row = {"provider": pspec, "k": int(k), "matrix": label, "nnz": int(m.nnz), "n": n,
                       "sandbox_spare": miss.sandbox_spare(prov),
                       "screened_out": getattr(stats, "screened_out", 0) - screened if stats is not None else None,
                       "first_call_s": first,
                       "steady_us": wall_median_us(lambda: a @ x, dev),
                       "torch_us": wall_median_us(lambda: native @ x if n > 1 else torch.mv(native, x), dev),
                       "stream_us": stream_us(lambda: a @ x, dev),
                       "torch_stream_us": stream_us(lambda: native @ x if n > 1 else torch.mv(native, x), dev),
                       "plan": getattr(getattr(plan, "header", None), "format", None) or repr(plan)[:60],
                       "rel_err": err, **_breakdown(logged[-1] if logged else None)}
                rows.append(row)
                if on_row is not None:
                    on_row(rows)
                print(f"  {label:18s} n={n:<4d} first {first:6.2f}s (propose {row['propose_s'] or 0:5.2f}s)  "
                      f"steady {row['steady_us']:8.1f}us  torch {row['torch_us']:8.1f}us  back-to-back "
                      f"{row['stream_us']:7.1f}us  torch {row['torch_stream_us']:7.1f}us  {row['plan']}",
                      flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--providers", default="nearest:4,policy:4,search:0",
                   help="comma list of NAME[+SAMPLES][+one|+batch][@CHECKPOINT]:K (K=0: the provider's default; "
                        "e.g. policy+hints@policy/checkpoints/retrieval:4; +one: the k candidates decoded "
                        "one at a time, +batch: in one batch, the default; +screenN: branch departures "
                        "screened on N CPU workers; +spareN: N spare sandbox workers)")
    p.add_argument("--widths", default="1,32", help="dense widths (1 = SpMV)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run of the script: CPU tensors take the reference)")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("cold start is measured on a GPU (--device cpu only smoke-tests the script)")
    device_name = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu"

    def save(rows):  # after every row: a run cut short keeps what it measured
        if a.json:
            write_json(a.json, {"rows": rows, "device": device_name, "torch": torch.__version__})

    rows = run([s for s in a.providers.split(",") if s], [int(w) for w in a.widths.split(",")], a.device,
               on_row=save)
    for prov in dict.fromkeys(r["provider"] for r in rows):
        fs = sorted(r["first_call_s"] for r in rows if r["provider"] == prov)
        print(f"[cold] {prov}: median first call {fs[len(fs) // 2]:.2f}s, max {fs[-1]:.2f}s over {len(fs)} products")
    return 0


if __name__ == "__main__":
    sys.exit(main())
