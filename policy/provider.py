"""``PolicyProvider``: the trained policy as a source of kernel candidates for the runtime.

The runtime (``sparserl_compile/providers.py``) asks a provider for ``k`` candidates for a
``Problem`` (op, dtype, n, shape, nnz, CSR ``indptr``/``indices``, fingerprint, arch). This
provider encodes the structure, samples ``k`` completions (grammar-constrained unless told
otherwise), parses each one's header with ``contract.parse_header`` and returns the parseable
ones as ``contract.Candidate`` (family ``None``: policy output is not a family point). Samples
that are cut off or whose header does not parse are dropped and counted in ``stats``.

It does not compile, verify or time anything: the runtime does, and falls back to cuSPARSE
if no candidate wins. The default checkpoint is package data under
``policy/checkpoints/default/`` (the policy without hints, the paper's setting; by default its
candidates are its greedy kernel and its most likely departures). ``policy/checkpoints/retrieval/`` is the retrieval-hinted policy
(pass ``checkpoint=``); without a checkpoint, constructing the provider fails with a message
saying how to get one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from sparserl_compile.policy.candidates import check_samples, format_diverse, hint_diverse
from sparserl_compile.policy.decode import generate
from sparserl_compile.policy.departures import DEPARTURE_ROUNDS, DEPARTURE_STEPS, branch_diverse
from sparserl_compile.policy.sampling import DecodeConfig
from sparserl_compile.policy.encoder import prepare_structure
from sparserl_compile import contract

#: samples per miss when the runtime asks for its default (k=0): best-of-4
DEFAULT_K = 4

#: hints mode: past the first k hints, further ones (filling the places of repeated kernels)
#: are decoded only while the proposal has taken less than this many seconds, so filling up
#: cannot push a first call past the cold-start budget (on a GPU the first four hints take a few
#: tenths of a second; on a CPU they take longer and nothing is filled)
FILL_BUDGET_S = 0.4

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "default"


@dataclass
class ProviderStats:
    """Counts over this provider's lifetime."""

    requests: int = 0
    sampled: int = 0
    unfinished: int = 0  # cut off by max_new_tokens
    unparseable: int = 0  # header rejected by contract.parse_header
    duplicates: int = 0  # the same kernel as an earlier sample of the request (dropped)
    screened_out: int = 0  # departures left out (stale, ``departures.stale_departure``, or by the CPU screen), replaced by others
    returned: int = 0


def weights_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a checkpoint's weights file."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _host(a) -> np.ndarray:
    try:
        import torch

        if isinstance(a, torch.Tensor):
            return a.detach().cpu().numpy()
    except ImportError:  # pragma: no cover
        pass
    return np.asarray(a)


def plausible_formats(indptr, indices, shape, features=None) -> tuple[str, ...]:
    """The contract's formats that can win on this CSR pattern (``search.format_plausible``:
    no DIA for scattered diagonals, no ELL for skewed rows, no BSR without dense blocks).
    ``features``: the pattern's ``structure.features``, where the caller has them already."""
    from sparserl_compile import search, structure

    f = features if features is not None else structure.features(
        _host(indptr).astype(np.int32), _host(indices).astype(np.int32), (int(shape[0]), int(shape[1])))
    return tuple(fmt for fmt in contract.FORMATS if search.format_plausible(fmt, f))


def structure_and_formats(indptr, indices, shape, max_points: int, formats: bool = True):
    """The encoder's ``prepare_structure`` and, when ``formats``, the ``plausible_formats``
    (else ``()``), from one ``structure.features`` pass: both read the pattern's features, O(nnz)."""
    from sparserl_compile import structure

    if not formats:
        return prepare_structure(indptr, indices, shape, max_points=max_points), ()
    indptr, indices, shape = _host(indptr).astype(np.int32), _host(indices).astype(np.int32), (int(shape[0]), int(shape[1]))
    feats = structure.features(indptr, indices, shape)
    s = prepare_structure(indptr, indices, shape, max_points=max_points,
                          features=np.asarray(feats.as_vector(), np.float32))
    return s, plausible_formats(indptr, indices, shape, features=feats)


def grammar_for(op: str, dtype: str, indptr, indices, shape) -> str | None:
    """The output grammar for one matrix: ``policy.grammar.kernel_grammar`` less the
    parameter-free padded formats the pattern does not convert to
    (``sparserl_compile.formats.unfit_formats``: DIA on a road network, ELL on a power-law
    graph), whose kernels could only fail; None when the pattern fits them all (the decoder's
    default grammar). Formats with parameters (SELL, BSR) stay: whether they fit depends on
    the parameters the kernel writes."""
    from sparserl_compile.policy.grammar import kernel_grammar
    from sparserl_compile.formats import unfit_formats

    unfit = unfit_formats(_host(indptr), _host(indices), (int(shape[0]), int(shape[1])))
    return kernel_grammar(op, dtype, exclude=sorted(unfit)) if unfit else None


def problem_inputs(model, matrix, op: str, dtype: str, n: int, *, formats: bool = False, entries=None,
                   count: int = 4, fit_formats: bool = True, references: bool = True, exclude: str | None = None):
    """What decoding one problem outside the runtime takes, prepared as ``PolicyProvider``
    prepares it (evaluation, RL and the benchmarks): ``(structure, formats, references, grammar)``:
    the encoder's structure; the ``plausible_formats`` when ``formats`` (else ``()``);
    drafts for speculative decoding (``retrieval.reference_sources``: the first ``count``
    proposals of ``entries``, default the shipped ``nearest`` table, and one of every format,
    leaving out the entries of the matrix ``exclude``; None without ``references``);
    and the grammar fitted to the matrix (``grammar_for``; None without ``fit_formats``).
    ``matrix``: anything with ``indptr``, ``indices`` and ``shape``."""
    from sparserl_compile.policy.retrieval import default_entries, reference_sources

    s, plausible = structure_and_formats(matrix.indptr, matrix.indices, matrix.shape, model.config.max_points,
                                         formats=formats)
    refs = None
    if references:
        refs = reference_sources(s.features, op, dtype, n, entries if entries is not None else default_entries(),
                                 matrix, count=count, exclude=exclude)
    grammar = grammar_for(op, dtype, matrix.indptr, matrix.indices, matrix.shape) if fit_formats else None
    return s, plausible, refs, grammar


def _count_or_none(name: str, value, unit: str, none: str = "") -> int | None:
    """``value`` when it is None or an int >= 1 (not a bool); else a ValueError naming ``name``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r}: a number of {unit} >= 1, or None{none}")
    return value


class PolicyProvider:
    """Kernel candidates sampled from a policy checkpoint."""

    name = "policy"

    def __init__(self, checkpoint: str | Path | None = None, device: str | None = None,
                 decode: DecodeConfig = DecodeConfig(temperature=0.8, max_new_tokens=1536, batch_drafts=True),
                 model=None, tokenizer=None, samples: str | None = None, speculative: bool = True,
                 fill_budget_s: float = FILL_BUDGET_S, fit_formats: bool = True, screen_workers: int = 0,
                 departure_steps: int | None = DEPARTURE_STEPS, departure_rounds: int | None = DEPARTURE_ROUNDS):
        checkpoint_path = None
        if model is None:
            import importlib.util

            missing = [m for m in ("transformers", "tokenizers", "safetensors", "llguidance")
                       if importlib.util.find_spec(m) is None]
            if missing:
                raise ImportError(f"the policy needs the train extra ({', '.join(missing)} not installed): "
                                  "pip install 'sparserl[train]'")
            from sparserl_compile.policy.model import load_policy

            path = checkpoint_path = Path(checkpoint) if checkpoint else DEFAULT_CHECKPOINT
            if not (path / "model.safetensors").is_file():
                raise FileNotFoundError(
                    f"no policy checkpoint at {path}: the default checkpoint is installed with "
                    "the package once trained (see docs/policy.md); pass checkpoint=<folder> "
                    "written by `sparserl train sft|rl`, or use the kernel-space provider"
                )
            if device is None:
                import torch

                device = "cuda" if torch.cuda.is_available() else "cpu"
            model, tokenizer = load_policy(path, device)
        elif tokenizer is None:
            raise ValueError("PolicyProvider(model=...) also needs tokenizer=")
        self.model, self.tokenizer, self.decode = model, tokenizer, decode
        if samples is None:  # a checkpoint trained to write the hinted kernel: one candidate per hint;
            # else the greedy kernel and its most likely departures: after SFT the policy is nearly
            # deterministic, so temperature samples are mostly copies of the greedy kernel
            samples = "hints" if getattr(model.config, "retrieval_hints", 1) > 1 else "branches"
        check_samples(samples, model)
        #: how the k candidates are drawn: "temperature" (k samples), "formats" (the model's k
        #: most likely formats, each written greedily: ``candidates.format_diverse``), "hints" (one
        #: greedy sample per nearest measured winner as the hint: ``candidates.hint_diverse``) or
        #: "branches" (the greedy kernel and its k - 1 most likely departures in the header:
        #: ``departures.branch_diverse``)
        self.samples = samples
        #: decode speculatively against the nearest measured winners (``speculative.generate_speculative``:
        #: the same samples' distribution, a fraction of the model calls when the policy writes them)
        self.speculative = speculative
        #: leave out of the grammar the parameter-free padded formats (ELL, DIA) the matrix does
        #: not convert to (``grammar_for``): a kernel in them could never run on it
        self.fit_formats = fit_formats
        #: hints mode: seconds of proposal after which no hint past the k-th is decoded
        self.fill_budget_s = fill_budget_s
        #: branches mode: a departure still unfinished after this many forwards is cut off and
        #: replaced by the next most likely one (``departures.DEPARTURE_STEPS``; None: no limit). A
        #: departure no draft predicts is written a token or two a forward and holds up the
        #: proposal's batch; those the held-out records gave failed verification
        self.departure_steps = _count_or_none("departure_steps", departure_steps, "forwards", " for no limit")
        #: branches mode: how many times departures are drawn to replace repeats, stale and cut
        #: ones (``branch_diverse(rounds=)``; ``departures.DEPARTURE_ROUNDS``; None: its default, 4)
        self.departure_rounds = _count_or_none("departure_rounds", departure_rounds, "rounds")
        #: branches mode with ``screen_workers``: a ``policy.screen.Screen`` (that many sandboxed CPU
        #: workers) every departure passes before it is a candidate; one that fails (its format does
        #: not fit the matrix, or it fails verification on the CPU executor on the matrix's first
        #: rows) is replaced by the next most likely departure, so the GPU's sandbox does not spend
        #: a worker restart on it
        self.screen = None
        if screen_workers:
            if samples != "branches":
                raise ValueError(f"screen_workers={screen_workers} screens departures from the greedy kernel: it "
                                 f"needs samples='branches', not {samples!r}")
            from sparserl_compile.policy.screen import Screen

            self.screen = Screen(screen_workers)
        #: idle sandbox workers this provider asks the runtime to keep (``RuntimeConfig.sandbox_spare``
        #: None): departures and samples fail verification now and then (a fault or a wrong result
        #: replaces the sandbox worker), and with a spare the next job need not wait seconds for the
        #: replacement; hinted candidates are nearly always measured kernel-space points
        self.sandbox_spare = 0 if samples == "hints" else 1
        self.stats = ProviderStats()
        self._lock = threading.Lock()
        #: sha256 of the weights file (None for an in-memory model); the runtime's cache key
        #: reads ``getattr(provider, "checkpoint_hash", None)`` so a new checkpoint misses the cache
        self.checkpoint_hash: str | None = (weights_sha256(path / "model.safetensors")
                                            if checkpoint_path is not None else None)

    def warm_up(self) -> None:
        """Pay a process's one-time decoding costs now (``miss.prewarm`` calls it): one proposal
        for a small SpMV and one for an SpMM, each op's first, build llguidance's view of the
        tokenizer and each grammar, load the numba structure statistics and, on a GPU, the model's
        first kernels (seconds in a fresh process, which the first new structure's proposal
        would pay otherwise). ``stats`` is left as it was."""
        from sparserl_compile.policy.retrieval import problem_for
        from sparserl_compile import matrices

        m = matrices.generate("banded", n=256, half_bandwidth=1, seed=0)
        with self._lock:  # no proposal of another thread is counted in between and then dropped
            before = replace(self.stats)
            for op, n in (("spmv", 1), ("spmm", 32)):
                self._candidates(problem_for(op, "f32", n, m), 2)
            self.stats = before

    def candidates(self, problem, k: int) -> list[contract.Candidate]:
        """Up to ``k`` distinct parseable candidates for ``problem``. Temperature and format
        samples: ``k`` decoded, fewer returned when some are dropped. Hints: decoded one per
        hint, nearest first, until ``k`` are kept or ``2k`` hints are spent; hints past the k-th
        only while the proposal has taken less than ``fill_budget_s``. One proposal at a time:
        a second thread (``prewarm``'s warm-up, a background search) waits for the first."""
        with self._lock:
            return self._candidates(problem, k)

    def _candidates(self, problem, k: int) -> list[contract.Candidate]:
        t0 = time.perf_counter()
        self.stats.requests += 1
        k = k or DEFAULT_K
        from sparserl_compile import structure
        from sparserl_compile.search import SearchProvider

        indptr, indices, shape = _host(problem.indptr), _host(problem.indices), (problem.n_rows, problem.n_cols)
        feats = structure.features(indptr, indices, shape)  # once: the encoder's and the hints' filter
        s = prepare_structure(indptr, indices, shape, max_points=self.model.config.max_points,
                              features=np.asarray(feats.as_vector(), np.float32))
        dtype = contract.TORCH_DTYPES.get(str(problem.dtype).replace("torch.", ""), str(problem.dtype))
        n = int(getattr(problem, "n", 1) or 1)
        from sparserl_compile.policy.retrieval import default_entries, nearest_hint, reference_sources
        from sparserl_compile.search import pattern_of

        hint = None
        retrieval = getattr(self.model.config, "retrieval", False)
        # the pruned space, built once: the filter of every hint (nearest.suitable)
        space = (SearchProvider(check_formats=False).candidates(problem, 0, features=feats)
                 if retrieval or self.samples == "hints" else None)
        if retrieval and self.samples != "hints":
            # trained with hints: give it one (in "hints" mode each candidate has its own)
            hint = nearest_hint(s.features, problem.op, dtype, n, default_entries(), problem=problem, space=space)
        formats = plausible_formats(indptr, indices, shape, features=feats) if self.samples == "formats" else ()
        # drafts for speculative decoding: the nearest measured winners, rendered (speed only)
        # (one per hint, filling hints included, when each candidate has its own hint), and one of
        # every format, for candidates forced or departing into another format
        refs = reference_sources(s.features, problem.op, dtype, n, default_entries(), pattern_of(problem),
                                 count=max(4, 2 * k) if self.samples == "hints" else 4) if self.speculative else None
        grammar = (grammar_for(problem.op, dtype, indptr, indices, shape)
                   if self.fit_formats and self.decode.constrained else None)
        out, seen = [], set()
        if self.samples == "hints":
            from sparserl_compile.policy.retrieval import nearest_hints

            # one greedy candidate per hint, nearest first, until k distinct parseable kernels:
            # two hints often give one kernel (the policy copies its hint), so further hints
            # (up to 2k) fill the places of repeats and of dropped samples
            hints = nearest_hints(s.features, problem.op, dtype, n, default_entries(), 2 * k, problem=problem,
                                  space=space)
            cfg = replace(self.decode, greedy=True, trace=False)  # no PPO bookkeeping
            i = 0
            while i < len(hints) and len(out) < k and (i < k or time.perf_counter() - t0 <= self.fill_budget_s):
                # the first k hints in one batch with DecodeConfig.batch_drafts, the rest one at a time
                group = hints[i:i + (k if cfg.batch_drafts and i == 0 else 1)]
                for r in hint_diverse(self.model, self.tokenizer, s, problem.op, dtype, n, group, config=cfg,
                                      references=refs, grammar_text=grammar):
                    self._accept(r, problem.op, dtype, out, seen)
                i += len(group)
        else:
            if self.samples == "formats":
                cfg = replace(self.decode, greedy=True)
                rolls = format_diverse(self.model, self.tokenizer, s, problem.op, dtype, n, k, formats, config=cfg,
                                       hint=hint, references=refs, grammar_text=grammar)
            elif self.samples == "branches":
                cfg = replace(self.decode, greedy=True, trace=False)  # no PPO bookkeeping
                check = self.screen and self.screen.checker(indptr, indices, shape, problem.op, dtype, n)
                rolls = branch_diverse(self.model, self.tokenizer, s, problem.op, dtype, n, k, config=cfg,
                                       hint=hint, references=refs, grammar_text=grammar, screen=check,
                                       step_budget=self.departure_steps, rounds=self.departure_rounds)
                self.stats.screened_out += len(rolls[0].extra.get("screened_out", ())) if rolls else 0
            else:
                rolls = generate(self.model, self.tokenizer, s, problem.op, dtype, n, k=k, config=self.decode,
                                 hint=hint, references=refs, grammar_text=grammar)
            for r in rolls:
                self._accept(r, problem.op, dtype, out, seen)
        self.stats.returned += len(out)
        return out

    def _accept(self, r, op: str, dtype: str, out: list, seen: set) -> None:
        """Append rollout ``r`` to ``out`` as a candidate if it is finished, new (not in
        ``seen``: two hints, one kernel; verifying and timing it twice gains nothing) and its
        header parses for this op and dtype; count it in ``stats`` either way."""
        self.stats.sampled += 1
        if not r.finished:
            self.stats.unfinished += 1
            return
        if r.text in seen:
            self.stats.duplicates += 1
            return
        seen.add(r.text)
        try:
            header = contract.parse_header(r.text)
        except contract.ContractError:
            self.stats.unparseable += 1
            return
        if header.op != op or header.dtype != dtype:
            self.stats.unparseable += 1
            return
        out.append(contract.Candidate(source=r.text, header=header))
