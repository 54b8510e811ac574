"""What ``pruned_llm.py`` prints for each sparsity level, as it goes: the level's line and table
header once pruned (and pre-generated), a row after each batch size, then the notes per batch
(token differences and why, the first call, the formats the plans chose), the weight memory.

A module of the ``pruned_llm.py`` example (imported from beside it), not a script of its own.
"""

from __future__ import annotations

from llm_decoding import TokenMatch
from llm_memory import gib
from llm_models import PROMPTS


def _fmt(v, width: int, spec: str) -> str:
    return f"{v:{width}{spec}}" if v is not None else f"{'-':>{width}s}"


def print_start(r, method: str, s: float, ppl: str) -> None:
    diff = ("at each batch, below" if r.max_abs_logit_diff is None else f"{r.max_abs_logit_diff:.2e}")
    print(f"\n== {method} {s:.0%}: {r.prune.layers} linears pruned ({r.prune.achieved:.1%} zeros), "
          f"{r.sparsified_layers} sparsified; max |logit diff| sparserl vs pruned dense {diff}; {ppl}")
    if r.pregen:
        pg = r.pregen
        each = lambda t, n: f"{t:.0f} s, {t / n:.2f} s each" if n else "none"  # noqa: E731
        print(f"pregen (--share {pg['share']}): {pg['products']} products of {pg['matrices']} weights at widths "
              f"{pg['widths']} in {pg['seconds']:.0f} s ({pg['full']} searched in full: "
              f"{each(pg['full_seconds'], pg['full'])}; {pg['shared']} from a look-alike's kernels: "
              f"{each(pg['shared_seconds'], pg['shared'])}): {pg['kernel']} kernels, {pg['reference']} cuSPARSE "
              f"verdicts, {pg['cached']} cached, {pg['failed']} failed; kernels of "
              f"{', '.join(pg['families']) or 'no family'}")
    print(f"{'batch':>5s} {'dense tok/s':>11s} {'sparserl':>9s} {'ratio':>6s} {'dense comp.':>11s} {'sparserl comp.':>14s} "
          f"{'ratio':>6s} {'kernels':>7s} {'read/dense':>10s} {'same tokens':>11s} {'first call':>10s}", flush=True)


def print_row(d) -> None:
    same = f"{d.same_tokens:.0%}" + ("" if d.compiled_same_tokens is None else f"/{d.compiled_same_tokens:.0%}")
    print(f"{d.batch:>5d} {d.dense_tokens_per_s:11.1f} {d.sparserl_tokens_per_s:9.1f} {d.sparserl_over_dense:6.2f} "
          f"{_fmt(d.dense_compiled_tokens_per_s, 11, '.1f')} {_fmt(d.compiled_tokens_per_s, 14, '.1f')} "
          f"{_fmt(d.compiled_over_dense_compiled, 6, '.2f')} {_fmt(d.kernel_fraction, 7, '.0%')} "
          f"{_fmt(d.memory['read_over_dense'] if d.memory else None, 10, '.2f')} {same:>11s} {d.first_call_s:9.1f}s",
          flush=True)


def print_end(r, real: bool) -> None:
    for d in r.decode:
        notes = [f"max |logit diff| {d.max_abs_logit_diff:.2e} (one token per sequence)"]
        notes += [f"{k} {TokenMatch(**m).describe()}" for k, m in (("eager:", d.tokens), ("compiled:", d.compiled_tokens))
                  if m is not None and m["first_difference"] is not None]
        if d.background_wait_s is not None:
            notes.append(f"waited {d.background_wait_s:.1f} s for {d.searches} background selections")
        elif d.searches:
            notes.append(f"the first call waited {d.first_call_s:.1f} s for {d.searches} selections (--pregen K, i.e. "
                         f"sparserl pregen --share K, pays them once ahead; --on-miss background does not wait)")
        if d.memory:
            notes.append("weights as " + ", ".join(f"{n} {k}" for k, n in sorted(d.memory["formats"].items())))
        if d.compile_s:
            notes.append("compiled warm-up " + ", ".join(f"{k} {v:.0f} s" for k, v in d.compile_s.items()))
        if d.torch_sparse_tokens_per_s is not None:
            notes.append(f"torch.sparse eager {d.torch_sparse_tokens_per_s:.1f} tok/s")
        if not d.decode_only:
            notes.append("tokens/s include the prefill (too few tokens to take it out)")
        print(f"  batch {d.batch}: " + "; ".join(notes))
    if r.memory:
        m = r.memory
        print(f"weight memory: {m.weights} sparse weights, dense {gib(m.dense_bytes)}; held by sparserl (CSR "
              f"{gib(m.csr_bytes)} + every plan's arrays) {gib(m.held_bytes)} = {m.held_over_dense:.2f}x dense")
    if r.decode and real:
        print(f"dense   : {PROMPTS[0]!r} -> {r.sample_dense!r}\nsparserl: {PROMPTS[0]!r} -> {r.sample_sparserl!r}")
    print(f"level done in {r.seconds:.0f} s", flush=True)


if __name__ == "__main__":
    raise SystemExit(f"{__file__} is a module of the pruned-LLM example, not a script: run "
                     "python examples/pruned_llm.py (--help lists its options)")
