"""How well the text-only stale check (``policy.decode.stale_departure``) predicts the CPU screen (CPU).

For the held-out records (``training.data`` split), the policy's greedy kernel and k - 1
departures (``policy.decode.branch_diverse`` with ``stale_check=False``, under each matrix's
fitted grammar, as ``sparserl eval --samples branches`` draws them) are decoded once. Each
departure then gets two verdicts: the stale check's (on the greedy kernel's text and its own,
timed) and the full CPU screen's (``policy.screen.Screen``: header, format fit, and NVRTC plus
every verification check on the CPU executor on the matrix's first rows, in sandboxed
workers), which stands in for the GPU's verification (no kernel the screen passed has failed on
the GPU). Reported: the departures the stale check leaves out that the screen also fails (what
it saves the screen or the GPU) and that the screen passes (kernels it would lose), per format,
and the seconds each check takes.

    python benchmarks/stale_departures.py [--checkpoint policy/checkpoints/default] [--records 42]
        [--k 8] [--workers 2] --json benchmarks/results/cpu_stale_departures_<date>.json
"""

from __future__ import annotations

import argparse
import collections
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default="policy/checkpoints/default")
    p.add_argument("--records", type=int, default=42, help="the first this many held-out records")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--workers", type=int, default=2, help="the screen's CPU workers")
    p.add_argument("--max-new-tokens", type=int, default=1200)
    p.add_argument("--json", help="write the summary and every departure's verdicts here")
    a = p.parse_args(argv)

    from sparserl_compile.policy.decode import DecodeConfig, branch_diverse, stale_departure
    from sparserl_compile.policy.model import load_policy
    from sparserl_compile.policy.provider import problem_inputs
    from sparserl_compile.policy.screen import Screen
    from sparserl_compile import contract
    from sparserl_compile.fileio import write_json
    from sparserl_compile.version import run_stamp
    from sparserl_compile.training.data import DEFAULT_SUPERVISION, load_supervision, split
    from sparserl_compile.training.rl import problems_from_records

    model, tok = load_policy(a.checkpoint, "cpu")
    problems = problems_from_records(split(load_supervision(DEFAULT_SUPERVISION)).held_out[: a.records])
    cfg = DecodeConfig(greedy=True, max_new_tokens=a.max_new_tokens, trace=False, batch_drafts=True)
    rows, stale_s, screen_s = [], 0.0, 0.0
    with Screen(a.workers) as screen:
        for pb in problems:
            m = pb.matrix
            s, _, refs, gram = problem_inputs(model, m, pb.op, pb.dtype, pb.n)
            rolls = branch_diverse(model, tok, s, pb.op, pb.dtype, pb.n, a.k, cfg, grammar_text=gram,
                                   references=refs, stale_check=False)
            greedy, deps = rolls[0], rolls[1:]
            t = time.perf_counter()
            stale = [stale_departure(greedy.text, r.text) for r in deps]
            stale_s += time.perf_counter() - t
            t = time.perf_counter()
            probe = screen.check(m.indptr, m.indices, m.shape, pb.op, pb.dtype, pb.n, [r.text for r in deps])
            screen_s += time.perf_counter() - t
            for r, st, pr in zip(deps, stale, probe):
                try:
                    fmt = contract.parse_header(r.text).format
                except contract.ContractError:
                    fmt = "?"
                rows.append({"label": pb.label, "op": pb.op, "n": pb.n, "format": fmt, "branch": list(r.extra["branch"]),
                             "stale": st, "screen": pr})
            print(f"[stale] {pb.label} {pb.op} n={pb.n}: {len(deps)} departures, "
                  f"{sum(x is not None for x in stale)} stale, {sum(x is not None for x in probe)} fail the screen",
                  flush=True)

    def kind(why):  # "probe cuda_error: ..." -> "cuda_error"; "format: ..." -> "format"
        return None if why is None else (why.split(":")[0].split(" ")[-1])

    table = collections.Counter((r["stale"] is not None, kind(r["screen"])) for r in rows)
    per_format = collections.defaultdict(collections.Counter)
    for r in rows:
        per_format[r["format"]]["departures"] += 1
        per_format[r["format"]]["stale"] += r["stale"] is not None
        per_format[r["format"]]["stale_and_screen_fails"] += r["stale"] is not None and r["screen"] is not None
        per_format[r["format"]]["screen_fails"] += r["screen"] is not None
    stale_n = sum(r["stale"] is not None for r in rows)
    both = sum(r["stale"] is not None and r["screen"] is not None for r in rows)
    fails = sum(r["screen"] is not None for r in rows)
    # which rule left a departure out: an SpMV body under an SpMM header, or header values kept
    rules = collections.Counter(("spmv body" if "never reads n" in r["stale"] else "header values",
                                 r["screen"] is not None) for r in rows if r["stale"] is not None)
    summary = {"departures": len(rows), "stale": stale_n, "stale_and_screen_fails": both,
               "by_rule": {f"{rule}, screen {'fails' if f else 'passes'}": c for (rule, f), c in sorted(rules.items())},
               "stale_but_screen_passes": stale_n - both, "screen_fails": fails,
               "stale_s": stale_s, "screen_s": screen_s,
               "by_verdicts": {f"stale={s} screen={k}": c for (s, k), c in sorted(table.items(), key=str)},
               "per_format": {f: dict(c) for f, c in sorted(per_format.items())}}
    print(f"[stale] {len(rows)} departures: the stale check leaves out {stale_n} ({both} of them fail the screen, "
          f"{stale_n - both} pass it); the screen fails {fails}. Stale check {stale_s * 1e3:.1f} ms in all, "
          f"screen {screen_s:.1f} s", flush=True)
    print(f"[stale] by rule: {summary['by_rule']}")
    for f, c in summary["per_format"].items():
        print(f"[stale]   {f:9s} {c}")
    if a.json:
        write_json(a.json, {**run_stamp(), "checkpoint": a.checkpoint, "records": len(problems), "k": a.k,
                            "workers": a.workers, "summary": summary, "departures": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
