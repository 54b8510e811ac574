"""Checkpoint selection for stage 3 on a validation set apart from the held-out split
(``sparserl train rl --validate N``).

Why: RL's held-out figures move by whole points between updates, so which update to keep matters, and choosing it on the
held-out records would make those records part of training. The validation problems are drawn
as the unlabelled problems are (``training/unlabelled.py``), from the generators and from the
shared folder's *training-side* matrices, at seeds from ``VALIDATION_FIRST_SEED`` (the
unlabelled training problems use 100 up, the supervision 0-2). They are new instances of the
training kinds, not new kinds: the held-out records stay the only measure of generalization,
and no stage, this one included, ever looks at them.

Each validation draws the policy's greedy kernel for every problem (what the runtime's policy
provider tries first), has the stage's evaluator compile, verify and time it, and scores the
checkpoint by the geometric mean over problems of ``cuSPARSE time / kernel time``, a wrong or
failed kernel counting as the runtime's fallback, 1.0 (``sparserl eval``'s "greedy, fallback"
rule, against cuSPARSE instead of the kernel-space best: these problems have no measured
space). Ties, and evaluators without timings (the CPU ones time no cuSPARSE for unlabelled
problems), fall to the correct rate.

Timing noise must not choose the checkpoint. Within a run each problem's cuSPARSE time is the
first one measured, and a kernel source seen before on a problem keeps its first outcome, so two
checkpoints that write the same kernels score exactly the same.

The stage validates before its first update (the starting checkpoint), every ``validate_every``
updates and after the last one; a strictly better score saves the policy to ``<out>/best/``.
The history is ``<out>/validation.json`` (read back when a run resumes).

What it is worth: with a few dozen problems, one format decision moves the score about as much
as close checkpoints differ, so it guards against a collapse (wrong kernels, a kind lost) more
than it ranks close checkpoints; the checkpoint it picks can be worse on the held-out records
than the run's end.

A checkpoint chosen as the best of several validations is favoured on the problems it was
chosen on. To compare it with another checkpoint, draw fresh problems: a ``--seed`` that no run
used: a run's best can beat another checkpoint on its own problems and lose to it on fresh ones.

Several checkpoints on the same problems, in one process (so identical kernels score the same):

    python -m sparserl_compile.training.validation --checkpoints sft=runs/sft,rl=runs/rl/best --count 24 --seed 1 \
        --mix "rmat=1,shared:road_planar=1" --evaluator gpu --out validation.json

(``--count``, ``--seed``, ``--max-nnz`` and ``--mix`` as the RL run's ``--validate``, ``--seed``,
``--max-nnz`` and ``--validate-mix`` draw the same problems; another ``--seed`` draws fresh ones.)
"""

from __future__ import annotations

import json
from pathlib import Path

#: the first seed of the validation problems' generators and derived structures
VALIDATION_FIRST_SEED = 50_000
HISTORY_FILE = "validation.json"
BEST_DIR = "best"


def validation_problems(count: int, seed: int, max_nnz: int, exclude_labels=frozenset(), mix=None,
                        spmm_widths=(32,)) -> list:
    """``count`` validation ``RLProblem``s (module doc), deterministic in ``seed``; SpMM widths as
    ``unlabelled_problems`` draws them (default N = 32)."""
    from sparserl_compile.training.unlabelled import unlabelled_problems

    return unlabelled_problems(count, seed, max_nnz, exclude_labels=exclude_labels, mix=mix,
                               first_seed=VALIDATION_FIRST_SEED, spmm_widths=spmm_widths)


class Validator:
    """Scores checkpoints on fixed problems with one evaluator (module doc); keeps the first
    cuSPARSE time of each problem and the first outcome of each (problem, kernel source)."""

    def __init__(self, problems, evaluator, *, max_new_tokens: int, constrained: bool = True,
                 speculative: bool = True):
        self.problems = list(problems)
        self.evaluator = evaluator
        self.max_new_tokens = max_new_tokens
        self.constrained = constrained
        self.speculative = speculative
        self._structs: dict = {}
        self._refs: dict = {}
        self._reference_us: dict[int, float] = {}
        self._seen: dict[tuple[int, str], tuple[bool, bool, float | None]] = {}

    def __call__(self, model, tok, step: int) -> dict:
        """One validation of ``model``: ``{"step", "score", "correct_rate", "timed", "problems",
        "rows"}`` (rows: label, op, n, compiled, correct, us, reference_us, value)."""
        from sparserl_compile.policy.decode import generate
        from sparserl_compile.policy.sampling import DecodeConfig
        from sparserl_compile.policy.encoder import prepare_structure
        from sparserl_compile.training.space import normalized
        from sparserl_compile.training.stats import geomean

        cfg = DecodeConfig(greedy=True, max_new_tokens=self.max_new_tokens, constrained=self.constrained, trace=False)
        rows = []
        for i, pb in enumerate(self.problems):
            m = pb.matrix
            if i not in self._structs:
                self._structs[i] = prepare_structure(m.indptr, m.indices, m.shape, max_points=model.config.max_points)
                if self.speculative:  # drafts: decoding speed only, never which kernel comes out
                    from sparserl_compile.policy.retrieval import default_entries, reference_sources

                    self._refs[i] = reference_sources(self._structs[i].features, pb.op, pb.dtype, pb.n,
                                                      default_entries(), m, count=4)
            text = generate(model, tok, self._structs[i], pb.op, pb.dtype, pb.n, k=1, config=cfg,
                            references=self._refs.get(i))[0].text
            key = (i, normalized(text))
            if key not in self._seen:
                o = self.evaluator(pb, [text])[0]
                self._seen[key] = (bool(o.compiled), bool(o.correct), o.us if o.correct else None)
                ref = o.reference_us or pb.reference_us
                if ref and i not in self._reference_us:
                    self._reference_us[i] = float(ref)
            compiled, correct, us = self._seen[key]
            ref = self._reference_us.get(i)
            value = ref / us if (correct and us and ref) else 1.0
            rows.append({"label": pb.label, "op": pb.op, "n": pb.n, "compiled": compiled, "correct": correct,
                         "us": us, "reference_us": ref, "value": value})
        n = len(rows)
        return {"step": step,
                "score": geomean([r["value"] for r in rows]) or 1.0,
                "correct_rate": sum(r["correct"] for r in rows) / n if n else 0.0,
                "timed": sum(bool(r["correct"] and r["us"] and r["reference_us"]) for r in rows),
                "problems": n, "rows": rows}


def better(a: dict, b: dict | None) -> bool:
    """Whether validation ``a`` beats ``b`` (None: nothing yet): a higher score, then a higher
    correct rate; a tie keeps ``b`` (the earlier checkpoint)."""
    return b is None or (a["score"], a["correct_rate"]) > (b["score"], b["correct_rate"])


def load_history(out_dir) -> list[dict]:
    """The validations a run in ``out_dir`` recorded so far ([] for none)."""
    p = Path(out_dir) / HISTORY_FILE
    return json.loads(p.read_text())["history"] if p.is_file() else []


def best_of(history: list[dict]) -> dict | None:
    """The entry ``better`` ranks first (the earliest among equals)."""
    best = None
    for h in history:
        if better(h, best):
            best = h
    return best


def record(out_dir, history: list[dict], entry: dict, model, tok) -> bool:
    """Append ``entry`` to ``history``, save the policy to ``<out_dir>/best/`` when it beats
    every earlier entry, and write the history file. Returns whether it was the new best."""
    from sparserl_compile.policy.model import save_policy

    prior = best_of(history)
    new_best = better(entry, prior)
    history.append(entry)
    if new_best:
        save_policy(model, tok, Path(out_dir) / BEST_DIR)
    best = entry if new_best else prior
    Path(out_dir, HISTORY_FILE).write_text(json.dumps(
        {"best_step": best["step"], "best_score": best["score"], "history": history}, indent=1))
    return new_best


def compare(checkpoints: str, count: int, seed: int = 0, max_nnz: int = 0, mix: str = "", evaluator: str = "gpu",
            workers: int = 4, max_new_tokens: int = 1200, device: str = "auto", log=print,
            spmm_widths=(32,)) -> dict:
    """Validate every ``name=folder`` of ``checkpoints`` on the same ``count`` problems with one
    ``Validator`` -> ``{"problems": [labels], "checkpoints": {name: validation}}``."""
    from sparserl_compile.policy.model import load_policy
    from sparserl_compile.training.config import resolve_device
    from sparserl_compile.training.rewards import make_evaluator
    from sparserl_compile.training.soup import provenance
    from sparserl_compile.training.unlabelled import parse_mix

    pairs = [p.partition("=") for p in filter(None, checkpoints.split(","))]
    if not pairs or any(not name or not path for name, _, path in pairs):
        raise ValueError(f"--checkpoints {checkpoints!r}: write name=folder[,name=folder...]")
    probs = validation_problems(count, seed, max_nnz, mix=parse_mix(mix) if mix else None, spmm_widths=spmm_widths)
    ev = make_evaluator(evaluator, workers)
    v = Validator(probs, ev, max_new_tokens=max_new_tokens)
    from sparserl_compile.version import run_stamp

    out = {**run_stamp(), "problems": [f"{p.label} {p.op}" for p in probs], "evaluator": evaluator, "checkpoints": {}}
    try:
        for name, _, path in pairs:
            model, tok = load_policy(path, resolve_device(device))
            r = v(model, tok, 0)
            out["checkpoints"][name] = {k: r[k] for k in ("score", "correct_rate", "timed", "problems", "rows")}
            out["checkpoints"][name]["provenance"] = provenance(path)  # which weights: folder, SHA-256, soup inputs
            log(f"[validation] {name}: score {r['score']:.4f} (x cuSPARSE, geomean), correct {r['correct_rate']:.3f}, "
                f"timed {r['timed']}/{r['problems']}")
    finally:
        if hasattr(ev, "close"):
            ev.close()
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--checkpoints", required=True, help="name=folder pairs, comma-separated")
    ap.add_argument("--count", type=int, default=24, help="validation problems")
    ap.add_argument("--seed", type=int, default=0,
                    help="the RL run's --seed (its own validation problems), or a seed no run used (fresh problems, "
                         "for comparing a selected checkpoint without the selection's favour)")
    ap.add_argument("--max-nnz", type=int, default=0, help="the RL run's --max-nnz")
    ap.add_argument("--mix", default="", help="the RL run's --validate-mix (else --unlabelled-mix)")
    ap.add_argument("--spmm-n", default="32", help="the SpMM problems' widths N, comma-separated, drawn equally "
                                                   "(as sparserl train rl --unlabelled-spmm-n; 32 draws as before)")
    ap.add_argument("--evaluator", default="gpu", help="'gpu', 'cpu' or 'header'")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=1200)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default="", help="write the result as JSON here")
    a = ap.parse_args(argv)
    from sparserl_compile.training.unlabelled import parse_spmm_widths

    try:
        widths = parse_spmm_widths(a.spmm_n)
    except ValueError as e:
        ap.error(f"--spmm-n: {e}")
    res = compare(a.checkpoints, a.count, a.seed, a.max_nnz, a.mix, a.evaluator, a.workers, a.max_new_tokens, a.device,
                  spmm_widths=widths)
    if a.out:
        from sparserl_compile.fileio import write_json

        write_json(a.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
