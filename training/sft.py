"""Stage 2: supervised fine-tuning on (matrix, best verified kernel) pairs.

For every supervision record (``data.py``) of the *training* split, the target is the source
of its fastest verified variant, rendered by ``sparserl_compile.kernels.render(family, op,
dtype, params, structure)`` for that matrix; the prompt is the structure prefix and
``<|structure|>op=.. dtype=.. n=..<|kernel|>``; the loss covers the kernel tokens and
``<|eos|>``. Held-out records are never trained on: they give the reported held-out loss.
Starts from a pretraining checkpoint (``init``) and resumes from ``out_dir``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sparserl_compile.training.config import check_resume, opt, resolve_device, save_config
from sparserl_compile.training.data import DEFAULT_SUPERVISION
from sparserl_compile.training.space import default_render, ranked_variants


@dataclass
class SFTConfig:
    init: str = opt("runs/pretrain", "checkpoint to start from (stage 1 output)")
    data: str = opt(DEFAULT_SUPERVISION, "supervision JSON-lines file(s), a comma list (training/data.py)")
    out_dir: str = opt("runs/sft", "output checkpoint folder (resumed if it holds an SFT state)")
    steps: int = opt(1000, "optimizer steps")
    batch_size: int = opt(8, "examples per step")
    max_len: int = opt(1536, "prompt + kernel tokens kept per example")
    lr: float = opt(5e-4, "peak learning rate")
    top_variants: int = opt(1, "training targets per record: its fastest this many verified variants "
                               "(distinct rendered sources); held-out loss always uses the fastest only")
    seed: int = opt(0, "seed for example order")
    log_every: int = opt(20, "log every this many steps")
    save_every: int = opt(200, "checkpoint every this many steps")
    device: str = opt("auto", "'auto' (cuda when torch sees a GPU), 'cpu' or 'cuda'")
    time_budget_s: float = opt(0.0, "cap the steps so this run takes about this long (0 = no cap)")
    sinusoidal: bool = opt(True, "off (--no-sinusoidal): the ablation; the structure encoder of --init is "
                                 "replaced by a fresh one over raw coordinates before fine-tuning")
    reset_point_mlp: bool = opt(False, "the no-sinusoidal ablation's control: the structure encoder's point MLP "
                                       "of --init is replaced by a freshly initialized one before fine-tuning, "
                                       "the sinusoidal embedding kept (--no-sinusoidal also starts that MLP afresh)")
    retrieval: bool = opt(False, "prompts carry a retrieval hint: the winner of the nearest other training "
                                 "matrix (policy/retrieval.py); the checkpoint is marked config.retrieval")
    hints: int = opt(1, "with --retrieval, N > 1: N examples per record, one per hint, the hints being the "
                        "first N proposals of the nearest other matrices and each target the record's fastest "
                        "verified variant of the hinted family (the policy learns to write the hinted kernel "
                        "for this matrix); 1: one example per record with the nearest winner as the hint and "
                        "the record's fastest variants as targets (--top-variants)")
    base: str = opt("", "the base model of a pretrained-base --init (policy/basepolicy.py) when it is not the "
                        "fetched one: a GGUF file or save_pretrained folder (default: $SPARSERL_BASE, then the "
                        "base `sparserl train fetch-base` keeps); checked against the checkpoint's sha256")
    hint_tolerance: float = opt(0.0, "--hints N: the target is the hinted point itself when the record measured "
                                     "it within this fraction of its family's best (0.1: 10 %% slower), so the "
                                     "policy copies a neighbour's parameters unless its own are clearly better")

    @classmethod
    def tiny(cls, init: str, data: str, out_dir: str) -> "SFTConfig":
        return cls(init=init, data=data, out_dir=out_dir, steps=30, batch_size=4, max_len=768,
                   lr=3e-3, log_every=10, save_every=15)


def build_examples(records, tokenizer, max_points: int, render=default_render, log=print, top: int = 1,
                   hint_entries=None, loaded: dict | None = None, hints: int = 1, hint_tolerance: float = 0.0):
    """``LMExample``s for records (matrices loaded once each): one per distinct rendered source
    among each record's ``top`` fastest verified variants. Records without a verified variant
    or whose fastest variant fails to render are skipped and counted. ``hint_entries``: a
    ``nearest`` table; each prompt then carries the winner of the nearest entry of *another*
    matrix (``policy.retrieval.nearest_hint(..., exclude=label)``). ``loaded``: matrices
    already loaded (MatrixRef -> CSR), e.g. by ``entries_from_records``.

    ``hints > 1`` (with ``hint_entries``): instead, one example per each of the first ``hints``
    proposals of the nearest other matrices (``retrieval.nearest_points``), the proposal as the
    hint and the record's fastest verified variant *of the hinted family* as the target (no
    example where the record has none of that family). The hint then says which kernel to
    write and the policy learns how to write it for this matrix (its parameters), so each of
    k hints at inference gives a different candidate (``candidates.hint_diverse``). With
    ``hint_tolerance`` t > 0 the target is the hinted point itself where the record measured it
    at most (1 + t) times its family's best."""
    from sparserl_compile.policy.sampling import completion_ids
    from sparserl_compile.policy.encoder import prepare_structure
    from sparserl_compile.policy.tokenizer import prompt_text
    from sparserl_compile.training.lm import LMExample

    cache: dict = {}
    out, skipped = [], 0
    for r in records:
        variants = ranked_variants(r, top) if r.best() is not None else []
        if not variants:
            skipped += 1
            continue
        if r.matrix not in cache:
            m = loaded[r.matrix] if loaded is not None and r.matrix in loaded else r.matrix.load()
            cache[r.matrix] = (m, prepare_structure(m.indptr, m.indices, m.shape, max_points=max_points))
        m, s = cache[r.matrix]
        if hint_entries is not None and hints > 1:
            out.extend(_family_hint_examples(r, m, s, tokenizer, render, log, hint_entries, hints, hint_tolerance))
            continue
        hint = None
        if hint_entries is not None:
            from sparserl_compile.policy.retrieval import nearest_hint, problem_for

            hint = nearest_hint(s.features, r.op, r.dtype, r.n, hint_entries, exclude=r.matrix.label,
                                problem=problem_for(r.op, r.dtype, r.n, m))
        seen: set[str] = set()
        for rank, v in enumerate(variants):
            try:
                src = render(v.family, r.op, r.dtype, dict(v.params), m)
            except Exception as e:  # a renderer bug must not stop training; it is reported
                log(f"[sft] skip {r.matrix.label} {v.family}{dict(v.params)}: {e}")
                skipped += rank == 0
                continue
            if src in seen:
                continue
            seen.add(src)
            out.append(LMExample(tokenizer.encode(prompt_text(r.op, r.dtype, r.n, hint)),
                                 completion_ids(tokenizer, src), s))
    return out, skipped


def _family_hint_examples(r, m, s, tokenizer, render, log, hint_entries, hints: int, tolerance: float = 0.0) -> list:
    """``build_examples``' ``hints > 1`` examples of one record (see there)."""
    from sparserl_compile.policy.sampling import completion_ids
    from sparserl_compile.policy.retrieval import hint_name, nearest_points, problem_for
    from sparserl_compile.policy.tokenizer import prompt_text
    from sparserl_compile.training.lm import LMExample

    ranked = ranked_variants(r, len(r.variants))
    out = []
    for family, params in nearest_points(s.features, r.op, r.dtype, r.n, hint_entries, hints,
                                         exclude=r.matrix.label, problem=problem_for(r.op, r.dtype, r.n, m)):
        best = next((v for v in ranked if v.family == family), None)
        if best is None:  # the record measured nothing of this family: no target to learn
            continue
        same = next((v for v in ranked if v.family == family and dict(v.params) == dict(params)), None)
        if tolerance > 0 and same is not None and same.us <= best.us * (1 + tolerance):
            best = same  # the neighbour's own parameters are good enough here: learn to copy them
        try:
            src = render(best.family, r.op, r.dtype, dict(best.params), m)
        except Exception as e:  # a renderer bug must not stop training; it is reported
            log(f"[sft] skip {r.matrix.label} {best.family}{dict(best.params)}: {e}")
            continue
        out.append(LMExample(tokenizer.encode(prompt_text(r.op, r.dtype, r.n, hint_name(family, params))),
                             completion_ids(tokenizer, src), s))
    return out


def sft(cfg: SFTConfig, render=default_render, log=print):
    """Run stage 2. Returns ``lm.FitResult`` (its ``eval_loss`` is on the held-out split).

    Under ``torchrun`` (``training/dist.py``): ``batch_size`` is the global batch (a multiple
    of the world size); every rank builds the same examples, draws the step's examples with
    the one-process rng and trains on its slice (DDP, token-count-weighted loss, ``lm.fit``).
    """
    from sparserl_compile.policy.model import load_policy
    from sparserl_compile.training import dist as tdist
    from sparserl_compile.training.checkpoint import has_state
    from sparserl_compile.training.data import load_supervision, split
    from sparserl_compile.training.lm import collate, fit

    if cfg.hints < 1 or (cfg.hints > 1 and not cfg.retrieval):
        raise ValueError(f"--hints {cfg.hints}: give N >= 1, and N > 1 only with --retrieval (the hints are "
                         "retrieved winners)")
    ctx = tdist.setup(resolve_device(cfg.device))
    log = tdist.quiet_unless_main(log, ctx)
    out = Path(cfg.out_dir)
    resume = has_state(out, "sft")
    if resume:
        check_resume(cfg, out, "sft")
    if ctx.is_main:
        save_config(cfg, out, "sft")
    src = out if resume else Path(cfg.init)
    model, tok = load_policy(src, base=cfg.base or None)
    torch.manual_seed(cfg.seed)  # a fresh point MLP below is drawn from the run's seed
    if not cfg.sinusoidal and model.config.sinusoidal:  # a resumed ablation run is already without
        model.drop_sinusoidal()
        log("[sft] ablation: structure encoder replaced by a fresh raw-coordinate one (no sinusoidal embedding)")
    elif cfg.reset_point_mlp and not resume:  # a resumed run already has its own
        model.reset_point_mlp()
        log("[sft] control: the structure encoder's point MLP starts afresh "
            f"({'sinusoidal embedding' if model.config.sinusoidal else 'raw coordinates'} kept)")
    parts = split(load_supervision(cfg.data))
    log(f"[sft] {cfg.data}: {parts.summary()}")
    entries, loaded = None, {}
    if cfg.retrieval or getattr(model.config, "retrieval", False):
        from sparserl_compile.training.neighbours import entries_from_records

        entries = entries_from_records(parts.train, loaded=loaded)
        model.config.retrieval = True  # saved with the checkpoint: the provider and eval give hints
        # > 1: trained to write the hinted family, so the provider's default is one candidate per hint
        model.config.retrieval_hints = cfg.hints
    train, n_skip = build_examples(parts.train, tok, model.config.max_points, render, log, cfg.top_variants,
                                   hint_entries=entries, loaded=loaded, hints=cfg.hints,
                                   hint_tolerance=cfg.hint_tolerance)
    loaded.clear()
    # the held-out loss is a diagnostic: a trimmed copy of the shared folder (on another machine)
    # may lack held-out matrices, and the loss is then over the records whose matrix is there
    present = {ref: ref.present() for ref in {r.matrix for r in parts.held_out}}
    held_records = [r for r in parts.held_out if present[r.matrix]]
    if len(held_records) < len(parts.held_out):
        absent = sorted(ref.label for ref, here in present.items() if not here)
        log(f"[sft] held-out loss over {len(held_records)} of {len(parts.held_out)} held-out records: "
            f"{len(absent)} shared matrices absent ({', '.join(absent)})")
    held, _ = build_examples(held_records, tok, model.config.max_points, render, log, hint_entries=entries,
                             hints=cfg.hints, hint_tolerance=cfg.hint_tolerance)
    log(f"[sft] {len(train)} training examples ({n_skip} skipped), {len(held)} held out")
    if not train:
        raise ValueError(f"{cfg.data}: no training examples (every record held out or without a verified variant)")
    n_pick = min(cfg.batch_size, len(train))
    tdist.shard_bounds(n_pick, ctx, f"examples per step (--batch-size {cfg.batch_size}, the global batch, "
                                    f"capped at the {len(train)} training examples)")

    def make_batch(step: int):
        rng = np.random.default_rng(cfg.seed * 1_000_003 + step)
        pick = rng.choice(len(train), size=n_pick, replace=False)
        pick = tdist.shard(pick, ctx, "examples per step")  # this rank's slice of the global batch
        return collate([train[i] for i in pick], tok.pad_token_id, cfg.max_len)

    evals = [collate(held[i:i + cfg.batch_size], tok.pad_token_id, cfg.max_len)
             for i in range(0, len(held), cfg.batch_size)]
    torch.manual_seed(cfg.seed)
    return fit(model, tok, make_batch, out_dir=out, stage="sft", steps=cfg.steps, lr=cfg.lr,
               log_every=cfg.log_every, save_every=cfg.save_every, eval_batches=evals, log=log,
               device=ctx.device, time_budget_s=cfg.time_budget_s, ctx=ctx)
