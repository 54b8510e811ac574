"""``sparserl pregen`` (fill a deployable kernel cache ahead of time; see ``pregen``) and
``sparserl target`` (this machine's GPU as pregen's ``--target-*`` flags)."""

from __future__ import annotations

import argparse
import os
import sys

from sparserl_compile import pregen


def _widths(text: str) -> tuple[int, ...]:
    """``--widths``: a comma list of SpMM dense widths, each >= 1 (argparse type)."""
    try:
        widths = tuple(int(w) for w in text.split(",") if w.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of integers, e.g. 8,32,128") from None
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every width must be at least 1")
    return widths


def _ops(text: str) -> tuple[str, ...]:
    """``--ops``: a comma list of spmv, spmm (argparse type)."""
    ops = tuple(o.strip() for o in text.split(",") if o.strip())
    bad = [o for o in ops if o not in ("spmv", "spmm")]
    if not ops or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of spmv, spmm")
    return ops


def _cmd(args) -> int:
    import torch

    from sparserl_compile import cache, providers

    if not args.target_gpu and not torch.cuda.is_available():
        print("error: no CUDA device here: name the GPU the cache will serve with --target-gpu, --target-arch, "
              "--target-driver and --target-nvrtc (run `sparserl target` on that machine to print them); the "
              "kernels are then compiled for it and verified with the CPU executor, and timed against cuSPARSE "
              "there on first use", file=sys.stderr)
        return 2
    if args.target_gpu and "unknown" in (args.target_driver, args.target_nvrtc):
        print("error: --target-gpu needs --target-driver and --target-nvrtc too: the cache key holds the serving "
              "machine's CUDA driver and NVRTC versions, so entries keyed 'unknown' are never found there; run "
              "`sparserl target` on that machine to print all four flags", file=sys.stderr)
        return 2
    if args.provider:
        providers.set_provider(args.provider)
    target = None
    if args.target_gpu:
        target = cache.Target(arch=args.target_arch, gpu_name=args.target_gpu,
                                driver_version=args.target_driver, nvrtc_version=args.target_nvrtc)
    items = pregen.discover(args.paths, args.min_sparsity)
    if not items:
        print("no matrices found", file=sys.stderr)
        return 1
    total = len(items)
    items = pregen.shard(items, args.rank, args.world_size)
    if args.world_size > 1:
        print(f"rank {args.rank}/{args.world_size}: {len(items)} of {total} matrices", file=sys.stderr)
    out = args.out.replace("{rank}", str(args.rank))
    rows = pregen.pregenerate(items, cache_dir=out, ops=args.ops, widths=args.widths,
                       dtype=args.dtype, target=target, executor=args.executor, progress=not args.no_progress,
                       share=args.share)
    print(pregen.format_table(rows))
    digest = providers.policy_hash(providers.get_provider())
    if digest not in ("none", providers.shipped_policy_hash()):
        print(f"note: the entries are keyed to the policy checkpoint {digest[:12]}: a serving process finds "
              f"them only while running that checkpoint; entries built with the default provider (the "
              f"shipped policy) or --provider search or nearest serve every process", file=sys.stderr)
    return 1 if any(r.outcome == "failed" for r in rows) else 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("pregen", help="pre-generate a deployable kernel cache",
                              description=pregen.__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help=".npz / .mtx files, directories of them, or .onnx models")
    p.add_argument("--out", required=True, help="cache directory to fill (created 0700)")
    p.add_argument("--ops", default=_ops("spmv,spmm"), type=_ops, help="comma list of spmv, spmm")
    p.add_argument("--widths", default=_widths("32"), type=_widths, help="SpMM dense widths, comma list")
    p.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"])
    p.add_argument("--provider", default=None, help="search | nearest | policy (default: the runtime's)")
    p.add_argument("--executor", default=None, choices=["gpu", "cpu"], help="default: gpu if present")
    p.add_argument("--min-sparsity", type=float, default=0.5, help="ONNX: fraction of zeros to count as sparse")
    p.add_argument("--target-gpu", default=None, help="without a GPU: the serving GPU's name, e.g. 'NVIDIA H200'")
    p.add_argument("--target-arch", default="sm_90")
    p.add_argument("--target-driver", default="unknown", help="serving machine's CUDA driver version, e.g. 13000")
    p.add_argument("--target-nvrtc", default="unknown", help="serving machine's NVRTC version, e.g. 13.0")
    p.add_argument("--share", type=int, default=0, metavar="K",
                   help="search alike matrices (same shape and row lengths) once; the others get the "
                        "K best kernels as candidates, verified and timed on each (default 0: off)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--rank", type=int, default=int(os.environ.get("RANK", 0)),
                   help="this shard (default $RANK, as torchrun sets it, else 0)")
    p.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                   help="number of shards (default $WORLD_SIZE, else 1); --out may contain {rank}")
    p.set_defaults(func=_cmd)
    t = subparsers.add_parser("target", help="print this machine's GPU as pregen --target-* flags",
                              description="Print this machine's CUDA GPU, arch, driver and NVRTC versions as the "
                                          "--target-* flags of `sparserl pregen` on a machine without a GPU.")
    t.set_defaults(func=_cmd_target)


def _cmd_target(args) -> int:
    import shlex

    import torch

    from sparserl_compile import cache

    if not torch.cuda.is_available():
        print("error: no CUDA device here: run `sparserl target` on the machine that will serve the cache",
              file=sys.stderr)
        return 2
    t = cache.local_target()
    print(f"--target-gpu {shlex.quote(t.gpu_name)} --target-arch {t.arch} --target-driver {t.driver_version} "
          f"--target-nvrtc {t.nvrtc_version}")
    return 0
