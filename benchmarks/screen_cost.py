"""What screening departures on the CPU costs, and what keeping its workers after a failure saves (CPU).

For the first ``--records`` held-out records (``training.data`` split), the policy's greedy
kernel and k - 1 departures (``policy.decode.branch_diverse``, under each matrix's fitted
grammar, as ``sparserl eval --samples branches`` draws them) are decoded three ways: without a
screen, with a ``policy.screen.Screen`` whose workers stay up after a kernel fails on them (its
default), and with one whose workers are replaced after every failure (``SandboxPool``'s
default, what the GPU's pools do), after an untimed warm-up draw; each screen starts with an
empty kernel cache (``SPARSERL_CACHE_DIR``). Per way: seconds decoding (the replacement rounds included)
and seconds in the screen, departures left out and passed, worker restarts; and whether the two
screens gave the same verdicts (they must: a restart changes the cost, never the answer).

    python benchmarks/screen_cost.py [--checkpoint policy/checkpoints/default] [--records 8] [--k 8]
        [--workers 2] --json benchmarks/results/cpu_screen_cost_<date>.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time


def _draw(model, tok, problems, k: int, screen, max_new_tokens: int):
    """Per record: (texts, screened-out reasons, decode seconds, screen seconds)."""
    from sparserl_compile.policy.decode import DecodeConfig, branch_diverse
    from sparserl_compile.policy.provider import problem_inputs

    cfg = DecodeConfig(greedy=True, max_new_tokens=max_new_tokens, trace=False, batch_drafts=True)
    rows = []
    for pb in problems:
        m = pb.matrix
        s, _, refs, gram = problem_inputs(model, m, pb.op, pb.dtype, pb.n)
        spent = [0.0]

        bound = screen and screen.checker(m.indptr, m.indices, m.shape, pb.op, pb.dtype, pb.n)

        def check(texts, bound=bound):
            t = time.perf_counter()
            try:
                return bound(texts)
            finally:
                spent[0] += time.perf_counter() - t

        t0 = time.perf_counter()
        rolls = branch_diverse(model, tok, s, pb.op, pb.dtype, pb.n, k, cfg, grammar_text=gram, references=refs,
                               screen=check if screen is not None else None)
        total = time.perf_counter() - t0
        rows.append({"label": pb.label, "op": pb.op, "n": pb.n, "texts": [r.text for r in rolls],
                     "screened_out": [why for *_, why in rolls[0].extra.get("screened_out", ())],
                     "decode_s": total - spent[0], "screen_s": spent[0]})
    return rows


def _way(way: str, model, tok, problems, a, scratch: list, Screen):
    """One way's (texts per record, summary with rows): no screen, or a screen whose workers are
    kept ("keep") or replaced ("restart") after a failure, on a fresh kernel cache."""
    from sparserl_compile.sandbox import _RESTART

    screen = None
    if way != "none":
        # a fresh kernel cache per screen: the CPU executor's g++ builds (and NVRTC's) of one
        # screen would otherwise make the next one's free
        scratch.append(tempfile.mkdtemp(prefix=f"screen_cost_{way}_"))
        os.environ["SPARSERL_CACHE_DIR"] = scratch[-1]
        screen = Screen(a.workers)
        if way == "restart":
            screen.pool.restart_on = frozenset(_RESTART)
        screen.pool.start(count=a.workers, wait=True)  # started workers, as a serving process has them
    try:
        rows = _draw(model, tok, problems, a.k, screen, a.max_new_tokens)
    finally:
        restarts = screen.pool.restarts if screen is not None else 0
        counts = dict(screen.counts) if screen is not None else {}
        if screen is not None:
            screen.close()
    summary = {"decode_s": sum(r["decode_s"] for r in rows), "screen_s": sum(r["screen_s"] for r in rows),
               "candidates": sum(len(r["texts"]) for r in rows), "counts": counts, "restarts": restarts}
    print(f"[screen] {way:8s} decoding {summary['decode_s']:6.1f} s  screen {summary['screen_s']:5.1f} s  "
          f"{summary['candidates']} candidates  {counts}  restarts {restarts}", flush=True)
    return [r["texts"] for r in rows], {**summary, "rows": [{k: v for k, v in r.items() if k != "texts"} for r in rows]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="policy/checkpoints/default")
    p.add_argument("--records", type=int, default=8, help="the first this many held-out records")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--workers", type=int, default=2, help="the screen's CPU workers")
    p.add_argument("--max-new-tokens", type=int, default=1200)
    p.add_argument("--json", help="write the summary and the per-record rows here")
    a = p.parse_args(argv)

    from sparserl_compile.policy.model import load_policy
    from sparserl_compile.policy.screen import Screen
    from sparserl_compile.fileio import write_json
    from sparserl_compile.version import run_stamp
    from sparserl_compile.training.data import DEFAULT_SUPERVISION, load_supervision, split
    from sparserl_compile.training.rl import problems_from_records

    model, tok = load_policy(a.checkpoint, "cpu")
    recs = split(load_supervision(DEFAULT_SUPERVISION)).held_out[: a.records]
    problems = problems_from_records(recs)
    out = {**run_stamp(), "checkpoint": a.checkpoint, "records": len(problems), "k": a.k, "workers": a.workers,
           "ways": {}}
    _draw(model, tok, problems, a.k, None, a.max_new_tokens)  # warm-up, untimed: grammars compiled, caches filled
    texts, scratch, env = {}, [], os.environ.get("SPARSERL_CACHE_DIR")
    try:
        for way in ("none", "keep", "restart"):
            texts[way], out["ways"][way] = _way(way, model, tok, problems, a, scratch, Screen)
    finally:
        for d in scratch:
            shutil.rmtree(d, ignore_errors=True)
        if env is None:
            os.environ.pop("SPARSERL_CACHE_DIR", None)
        else:
            os.environ["SPARSERL_CACHE_DIR"] = env
    out["same_verdicts"] = texts["keep"] == texts["restart"]
    print(f"[screen] the two screens kept the same candidates: {out['same_verdicts']}")
    if a.json:
        write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
