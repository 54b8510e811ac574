"""Policy decoding speed: plain vs speculative (``decode.generate(references=...)``), and for
greedy also speculative untraced (``DecodeConfig(trace=False)``: no grammar mask where the
model's top token is grammatical, what the provider and ``sparserl eval`` use).

For each generated matrix and product, the checkpoint's greedy sample and k temperature samples
are decoded both ways (the retrieval hint and the references as the policy provider gives
them) and timed; the greedy texts must be identical (speculative decoding only changes how many
positions one forward checks). Untraced greedy is also timed at each ``--draft-lens`` value
(``DecodeConfig.draft_len``, the longest draft one forward checks), and the k samples also
speculatively in one batch (``DecodeConfig(batch_drafts=True)``, ``speculative_batched_s``).

    python benchmarks/decode_speed.py [--checkpoint policy/checkpoints/retrieval] [--device cpu|cuda]
                                      [--k 4] [--draft-lens 16,64,128] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

import torch

from sparserl_compile.policy.decode import DecodeConfig, generate
from sparserl_compile.policy.encoder import prepare_structure
from sparserl_compile.policy.model import CountingPolicy, load_policy
from sparserl_compile.policy.retrieval import default_entries, nearest_hint, problem_for, reference_sources
from sparserl_compile import matrices
from sparserl_compile.bench import sync
from sparserl_compile.fileio import write_json

#: (label, generator, kwargs, op, n)
CASES = (
    ("uniform_2k_d8", "uniform_random", {"n_rows": 2000, "n_cols": 2000, "per_row": 8, "seed": 1}, "spmv", 1),
    ("banded_3k_b4", "banded", {"n": 3000, "half_bandwidth": 4, "seed": 1}, "spmm", 32),
    ("rmat_s12_e8", "rmat", {"scale": 12, "edge_factor": 8, "seed": 1}, "spmv", 1),
)


def _timed(fn, device: str):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def run(checkpoint: str, device: str, k: int, draft_lens=(16, 64, 128)) -> list[dict]:
    model, tok = load_policy(checkpoint, device)
    counted = CountingPolicy(model)

    def calls(fn):  # fn's result and its model calls
        counted.calls = 0
        return fn(), counted.calls
    rows = []
    for label, gen, kw, op, n in CASES:
        m = matrices.generate(gen, **kw)
        s = prepare_structure(m.indptr, m.indices, m.shape, max_points=model.config.max_points)
        hint = (nearest_hint(s.features, op, "f32", n, default_entries(), problem=problem_for(op, "f32", n, m))
                if model.config.retrieval else None)
        refs = reference_sources(s.features, op, "f32", n, default_entries(), m)
        generate(model, tok, s, op, "f32", n, k=1, hint=hint, config=DecodeConfig(greedy=True, max_new_tokens=32))
        for mode, cfg, kk in (("greedy", DecodeConfig(greedy=True, max_new_tokens=1536), 1),
                              (f"sample_k{k}", DecodeConfig(temperature=0.8, seed=0, max_new_tokens=1536), k)):
            plain, tp = _timed(lambda: generate(model, tok, s, op, "f32", n, k=kk, hint=hint, config=cfg), device)
            (spec, spec_calls), ts = _timed(lambda: calls(lambda: generate(counted, tok, s, op, "f32", n, k=kk, hint=hint,
                                                                           config=cfg, references=refs)), device)
            row = {"matrix": label, "op": op, "n": n, "mode": mode, "plain_s": tp, "speculative_s": ts,
                   "tokens_plain": sum(len(r.tokens) for r in plain),
                   "tokens_speculative": sum(len(r.tokens) for r in spec),
                   "same_text": [r.text for r in plain] == [r.text for r in spec], "calls_speculative": spec_calls}
            extra = ""
            if mode != "greedy":  # the k samples speculatively in one batch (other draws, the same distribution)
                (together, together_calls), tb = _timed(lambda: calls(lambda: generate(
                    counted, tok, s, op, "f32", n, k=kk, hint=hint, references=refs,
                    config=replace(cfg, batch_drafts=True))), device)
                row.update(speculative_batched_s=tb, tokens_speculative_batched=sum(len(r.tokens) for r in together),
                           calls_speculative_batched=together_calls)
                extra = f"  speculative in one batch {tb:6.2f}s (model calls {spec_calls} -> {together_calls})"
            if mode == "greedy":  # untraced: no grammar mask where the top token is grammatical
                fast, tu = _timed(lambda: generate(model, tok, s, op, "f32", n, k=1, hint=hint, references=refs,
                                                   config=replace(cfg, trace=False)), device)
                row.update(untraced_s=tu, same_text_untraced=fast[0].text == plain[0].text,
                           untraced_s_by_draft_len={})
                for dl in draft_lens:  # the longest draft one forward checks (DecodeConfig.draft_len)
                    if dl == cfg.draft_len:  # the default: timed just above
                        row["untraced_s_by_draft_len"][dl] = tu
                        continue
                    other, td = _timed(lambda: generate(model, tok, s, op, "f32", n, k=1, hint=hint, references=refs,
                                                        config=replace(cfg, trace=False, draft_len=dl)), device)
                    row["untraced_s_by_draft_len"][dl] = td
                    row["same_text_untraced"] &= other[0].text == plain[0].text
                extra = f"  untraced {tu:6.2f}s (" + ", ".join(
                    f"draft {dl}: {t:.2f}s" for dl, t in row["untraced_s_by_draft_len"].items()) + ")"
                if not (row["same_text"] and row["same_text_untraced"]):
                    raise AssertionError(f"{label}: speculative greedy wrote another kernel than plain greedy")
            rows.append(row)
            print(f"{label:14s} {op} n={n:<3d} {mode:10s} plain {tp:6.2f}s  speculative {ts:6.2f}s{extra}  "
                  f"({row['tokens_plain']} / {row['tokens_speculative']} tokens)", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="policy/checkpoints/retrieval")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--draft-lens", default="16,64,128",
                   help="untraced greedy is also timed at these draft lengths (DecodeConfig.draft_len)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    rows = run(a.checkpoint, a.device, a.k, tuple(int(v) for v in a.draft_lens.split(",") if v))
    if a.json:
        write_json(a.json, {"rows": rows, "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(0),
                            "torch": torch.__version__, "checkpoint": a.checkpoint})
    return 0


if __name__ == "__main__":
    sys.exit(main())
