import numpy as np
import pytest

from sparserl_compile.policy.sampling import DecodeConfig
from sparserl_compile.policy.provider import DEFAULT_CHECKPOINT, PolicyProvider
from sparserl_compile import contract
from sparserl_compile.matrices import banded


class _Problem:  # the fields of sparserl_compile.providers.Problem the provider reads
    def __init__(self, m):
        self.op, self.dtype, self.n = "spmv", "f32", 1
        self.n_rows, self.n_cols, self.nnz = m.shape[0], m.shape[1], m.nnz
        self.indptr, self.indices = m.indptr, m.indices
        self.fingerprint, self.arch = "x", "cpu"


def test_candidates_have_parsed_headers_and_drops_are_counted(tiny_model, tiny_tok):
    prov = PolicyProvider(model=tiny_model, tokenizer=tiny_tok, decode=DecodeConfig(max_new_tokens=40, seed=0))
    cands = prov.candidates(_Problem(banded(32, 1)), k=3)
    # 40 tokens are too few for an untrained model to finish a kernel: all are cut off
    assert prov.stats.sampled == 3 and prov.stats.returned == len(cands)
    assert prov.stats.unfinished + prov.stats.unparseable + len(cands) == 3
    for c in cands:
        assert isinstance(c, contract.Candidate) and c.family is None


def test_the_grammar_leaves_out_the_formats_the_matrix_does_not_fit(tiny_model, tiny_tok, monkeypatch):
    """A matrix that does not convert to DIA (scattered columns) is decoded under a grammar
    without DIA; one that fits every format under the default grammar (None); fit_formats=False
    keeps the default grammar everywhere."""
    from sparserl_compile.policy import provider as prov_mod
    from sparserl_compile.policy.grammar import kernel_grammar
    from sparserl_compile.matrices import uniform_random

    scattered = uniform_random(20000, 20000, 4)
    assert prov_mod.grammar_for("spmv", "f32", banded(64, 2).indptr, banded(64, 2).indices, (64, 64)) is None
    g = prov_mod.grammar_for("spmv", "f32", scattered.indptr, scattered.indices, scattered.shape)
    # thousands of diagonals, and rows up to ~4x the mean length: neither DIA nor ELL fits
    assert g == kernel_grammar("spmv", "f32", exclude=("dia", "ell"))
    assert "format=dia" not in g and "format=ell" not in g and "format=csr" in g
    seen = []

    def fake_generate(*args, grammar_text=None, **kw):
        seen.append(grammar_text)
        return []

    def fake_branches(*args, grammar_text=None, **kw):
        seen.append(grammar_text)
        return []

    monkeypatch.setattr(prov_mod, "generate", fake_generate)
    monkeypatch.setattr(prov_mod, "branch_diverse", fake_branches)
    for samples in ("temperature", "branches"):
        PolicyProvider(model=tiny_model, tokenizer=tiny_tok, speculative=False,
                       samples=samples).candidates(_Problem(scattered), k=2)
        PolicyProvider(model=tiny_model, tokenizer=tiny_tok, speculative=False,
                       samples=samples).candidates(_Problem(banded(32, 1)), k=2)
        PolicyProvider(model=tiny_model, tokenizer=tiny_tok, speculative=False, samples=samples,
                       fit_formats=False).candidates(_Problem(scattered), k=2)
    assert seen == [g, None, None] * 2


def test_branch_candidates_are_the_greedy_kernel_and_its_departures(tiny_model, tiny_tok, kernel_source,
                                                                   monkeypatch):
    """samples="branches": the candidates are ``departures.branch_diverse``'s (greedy, untraced, under
    the matrix's grammar), each kept once and only when it parses, like every other mode's."""
    from sparserl_compile.policy import provider as prov_mod
    from sparserl_compile.policy.sampling import Rollout

    calls = []
    other = kernel_source.replace("block=256 work=rows per_block=256", "block=128 work=rows per_block=128")

    def fake_branches(model, tok, s, op, dtype, n, k, config=None, grammar_text=None, **kw):
        calls.append((k, config.greedy, config.trace, grammar_text))
        return [Rollout([], [], t, [], True) for t in (kernel_source, kernel_source, other, "not a kernel")]

    monkeypatch.setattr(prov_mod, "branch_diverse", fake_branches)
    prov = PolicyProvider(model=tiny_model, tokenizer=tiny_tok, samples="branches", speculative=False)
    cands = prov.candidates(_Problem(banded(32, 1)), k=4)
    assert calls == [(4, True, False, None)]
    assert [c.source for c in cands] == [kernel_source, other]
    assert prov.stats.duplicates == 1 and prov.stats.unparseable == 1


def test_candidates_are_drafted_from_a_kernel_of_every_format(tiny_model, tiny_tok, monkeypatch):
    """The provider decodes against drafts that include a kernel of every contract format the
    nearest entries have a point of (a departure may switch format, a sample may leave the
    nearest winners'), in branch and temperature modes alike."""
    from sparserl_compile.policy import provider as prov_mod
    from sparserl_compile.policy.sampling import format_of

    drafts = {}

    def fake_branches(*args, references=None, **kw):
        drafts["branches"] = references
        return []

    def fake_generate(*args, references=None, **kw):
        drafts["temperature"] = references
        return []

    monkeypatch.setattr(prov_mod, "branch_diverse", fake_branches)
    monkeypatch.setattr(prov_mod, "generate", fake_generate)
    for samples in ("branches", "temperature"):
        PolicyProvider(model=tiny_model, tokenizer=tiny_tok, samples=samples).candidates(_Problem(banded(64, 2)), k=4)
    assert drafts["branches"] == drafts["temperature"]
    # every format the nearest entries have a point of for this SpMV (csr_perm has none for SpMV)
    assert {format_of(t) for t in drafts["branches"]} >= {"csr", "ell", "sell", "dia", "bsr", "merge"}


def test_screened_branch_candidates_ask_the_screen_about_the_problem(tiny_model, tiny_tok, kernel_source,
                                                                     monkeypatch):
    """screen_workers: the provider's branch_diverse gets a screen that checks departures for the
    problem's pattern, op, dtype and width with its ``Screen``; what it left out is counted in
    ``stats.screened_out``. A screen for another sampling mode is refused."""
    from sparserl_compile.policy import provider as prov_mod
    from sparserl_compile.policy.sampling import Rollout
    from sparserl_compile.policy.screen import Screen

    asked = []

    class FakeScreen:
        checker = Screen.checker  # the real binding of a problem; check is this fake's

        def __init__(self, workers):
            self.workers = workers

        def check(self, indptr, indices, shape, op, dtype, n, texts):
            asked.append((shape, op, dtype, n, len(texts)))
            return ["no"] * len(texts)

    def fake_branches(model, tok, s, op, dtype, n, k, screen=None, **kw):
        greedy = Rollout([], [], kernel_source, [], True)
        greedy.extra["screened_out"] = [(3, 7, why) for why in screen(["a", "b"])]
        return [greedy]

    import sparserl_compile.policy.screen as screen_mod

    monkeypatch.setattr(screen_mod, "Screen", FakeScreen)
    monkeypatch.setattr(prov_mod, "branch_diverse", fake_branches)
    prov = PolicyProvider(model=tiny_model, tokenizer=tiny_tok, samples="branches", speculative=False,
                          screen_workers=3)
    assert prov.screen.workers == 3
    m = banded(32, 1)
    assert [c.source for c in prov.candidates(_Problem(m), k=4)] == [kernel_source]
    assert asked == [((32, 32), "spmv", "f32", 1, 2)] and prov.stats.screened_out == 2
    with pytest.raises(ValueError, match="needs samples='branches'"):
        PolicyProvider(model=tiny_model, tokenizer=tiny_tok, samples="temperature", screen_workers=1)


def test_departures_are_cut_at_the_providers_budget_in_its_rounds(tiny_model, tiny_tok, monkeypatch):
    """Branches mode hands ``branch_diverse`` the provider's forward budget per departure
    (``departures.DEPARTURE_STEPS`` by default; None: no limit) and its rounds of replacements
    (``departures.DEPARTURE_ROUNDS``; None: branch_diverse's own); nonsense values are refused."""
    from sparserl_compile.policy import provider as prov_mod
    from sparserl_compile.policy.departures import DEPARTURE_ROUNDS, DEPARTURE_STEPS

    asked = []

    def fake_branches(*args, step_budget="missing", rounds="missing", **kw):
        asked.append((step_budget, rounds))
        return []

    monkeypatch.setattr(prov_mod, "branch_diverse", fake_branches)
    for kw in ({}, {"departure_steps": None, "departure_rounds": None}, {"departure_steps": 8, "departure_rounds": 3}):
        PolicyProvider(model=tiny_model, tokenizer=tiny_tok, samples="branches", **kw).candidates(
            _Problem(banded(32, 1)), k=4)
    assert asked == [(DEPARTURE_STEPS, DEPARTURE_ROUNDS), (None, None), (8, 3)]
    for name in ("departure_steps", "departure_rounds"):
        for bad in (0, 2.5, True):
            with pytest.raises(ValueError, match=name):
                PolicyProvider(model=tiny_model, tokenizer=tiny_tok, samples="branches", **{name: bad})


def test_missing_checkpoint_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="sparserl train"):
        PolicyProvider(checkpoint=tmp_path)


_ = np


def test_checkpoint_hash_is_the_weights_sha256(tmp_path, tiny_model, tiny_tok):
    import hashlib

    from sparserl_compile.policy.model import save_policy

    save_policy(tiny_model, tiny_tok, tmp_path)
    prov = PolicyProvider(checkpoint=tmp_path, device="cpu")
    assert prov.checkpoint_hash == hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()
    assert PolicyProvider(model=tiny_model, tokenizer=tiny_tok).checkpoint_hash is None


def test_a_kernel_written_twice_is_proposed_once(tiny_model, tiny_tok, kernel_source, monkeypatch):
    """Two samples (e.g. two hints) that give the same kernel are one candidate: selection
    would compile, verify and time it twice for nothing."""
    from sparserl_compile.policy import provider as prov_mod
    from sparserl_compile.policy.sampling import Rollout

    other = kernel_source.rstrip() + "\n// another kernel"
    rolls = [Rollout([], [1], text, [0.0], True) for text in (kernel_source, kernel_source, other)]
    monkeypatch.setattr(prov_mod, "generate", lambda *a, **kw: rolls)
    prov = PolicyProvider(model=tiny_model, tokenizer=tiny_tok, speculative=False, samples="temperature")
    cands = prov.candidates(_Problem(banded(32, 1)), k=3)
    assert [c.source for c in cands] == [kernel_source, other]
    assert prov.stats.duplicates == 1 and prov.stats.returned == 2 and prov.stats.sampled == 3


def _hint_provider(tiny_model, tiny_tok, kernel_source, monkeypatch):
    """A hints-mode provider over ten hints h0-h9 whose kernels h0-h2 are one text; decoding is
    stubbed and records the hints of each hint_diverse call. Returns (provider, texts, groups)."""
    import copy

    from sparserl_compile.policy import provider as prov_mod
    from sparserl_compile.policy import retrieval
    from sparserl_compile.policy.sampling import Rollout

    texts = {f"h{i}": kernel_source.rstrip() + f"\n// {'same' if i < 3 else i}" for i in range(10)}
    groups = []

    def one_per_hint(model, tok, s, op, dtype, n, hints, **kw):
        groups.append(list(hints))
        return [Rollout([], [1], texts[h], [0.0], True) for h in hints]

    monkeypatch.setattr(prov_mod, "hint_diverse", one_per_hint)
    monkeypatch.setattr(retrieval, "nearest_hints", lambda *a, **kw: [f"h{i}" for i in range(a[5])])
    model = copy.deepcopy(tiny_model)
    model.config.retrieval, model.config.retrieval_hints = True, 8
    return PolicyProvider(model=model, tokenizer=tiny_tok, speculative=False), texts, groups


def test_hint_candidates_fill_the_places_of_repeated_kernels(tiny_model, tiny_tok, kernel_source, monkeypatch):
    """samples="hints": when two hints give one kernel, the next hints are decoded until k
    distinct kernels are kept (at most 2k hints), so the selection still compares k."""
    prov, texts, groups = _hint_provider(tiny_model, tiny_tok, kernel_source, monkeypatch)
    cands = prov.candidates(_Problem(banded(32, 1)), k=3)
    assert sum(groups, []) == ["h0", "h1", "h2", "h3", "h4"]  # h0-h2 write one kernel: two more hints fill in
    assert [c.source for c in cands] == [texts["h0"], texts["h3"], texts["h4"]]
    assert prov.stats.duplicates == 2 and prov.stats.sampled == 5 and prov.stats.returned == 3
    groups.clear()
    assert len(prov.candidates(_Problem(banded(32, 1)), k=1)) == 1 and sum(groups, []) == ["h0"]


def test_hint_fill_up_stops_at_its_time_budget(tiny_model, tiny_tok, kernel_source, monkeypatch):
    """Filling the places of repeated kernels never delays a first call past the budget: the
    first k hints are always decoded, later ones only while the proposal is under budget."""
    import copy

    from sparserl_compile.policy import provider as prov_mod
    from sparserl_compile.policy import retrieval
    from sparserl_compile.policy.sampling import Rollout

    asked = []

    def same_kernel(model, tok, s, op, dtype, n, hints, **kw):
        asked.extend(hints)
        return [Rollout([], [1], kernel_source, [0.0], True) for _ in hints]

    monkeypatch.setattr(prov_mod, "hint_diverse", same_kernel)
    monkeypatch.setattr(retrieval, "nearest_hints", lambda *a, **kw: [f"h{i}" for i in range(a[5])])
    model = copy.deepcopy(tiny_model)
    model.config.retrieval, model.config.retrieval_hints = True, 8
    spent = PolicyProvider(model=model, tokenizer=tiny_tok, speculative=False, fill_budget_s=0.0)
    assert len(spent.candidates(_Problem(banded(32, 1)), k=3)) == 1
    assert asked == ["h0", "h1", "h2"]  # the first k only: the budget was spent
    asked.clear()
    roomy = PolicyProvider(model=model, tokenizer=tiny_tok, speculative=False, fill_budget_s=60.0)
    assert len(roomy.candidates(_Problem(banded(32, 1)), k=3)) == 1
    assert asked == [f"h{i}" for i in range(6)]  # up to 2k hints while under budget


def test_structure_and_formats_from_one_features_pass():
    """The encoder's structure and the plausible formats, read off one features pass: the same
    as each computed on its own; without formats, () and the plain structure."""
    import numpy as np

    from sparserl_compile.policy.encoder import prepare_structure
    from sparserl_compile.policy.provider import plausible_formats, structure_and_formats
    from sparserl_compile.matrices import banded

    m = banded(300, 3)
    s, formats = structure_and_formats(m.indptr, m.indices, m.shape, max_points=256)
    alone = prepare_structure(m.indptr, m.indices, m.shape, max_points=256)
    assert formats == plausible_formats(m.indptr, m.indices, m.shape) and "dia" in formats
    assert np.allclose(s.features, alone.features) and np.array_equal(s.points, alone.points)
    s2, none = structure_and_formats(m.indptr, m.indices, m.shape, max_points=256, formats=False)
    assert none == () and np.allclose(s2.features, alone.features)


def test_batched_hint_candidates_decode_the_first_k_hints_in_one_call(tiny_model, tiny_tok, kernel_source,
                                                                      monkeypatch):
    """The provider's default decode (DecodeConfig(batch_drafts=True)): the first k hints go to
    hint_diverse together (one batch), the fill-up hints one at a time; with batch_drafts off,
    every hint alone. The candidates are the same."""
    prov, texts, groups = _hint_provider(tiny_model, tiny_tok, kernel_source, monkeypatch)
    cands = prov.candidates(_Problem(banded(32, 1)), k=3)
    assert groups == [["h0", "h1", "h2"], ["h3"], ["h4"]]
    assert [c.source for c in cands] == [texts["h0"], texts["h3"], texts["h4"]]
    groups.clear()
    prov.decode = DecodeConfig(temperature=0.8, max_new_tokens=1536, batch_drafts=False)
    assert [c.source for c in prov.candidates(_Problem(banded(32, 1)), k=3)] == [c.source for c in cands]
    assert groups == [["h0"], ["h1"], ["h2"], ["h3"], ["h4"]]


def test_problem_inputs_leave_out_the_excluded_matrix_and_skip_drafts_when_asked(tiny_model):
    """RL prepares its problems with ``problem_inputs`` as evaluation does: ``exclude`` leaves a
    matrix's own table entries out of the drafts (the table without them gives the same drafts),
    and ``references=False`` decodes without drafts (None)."""
    from sparserl_compile.policy.provider import problem_inputs
    from sparserl_compile.policy.retrieval import default_entries, reference_sources
    from sparserl_compile.nearest import nearest_entries

    entries = default_entries()
    m = banded(400, 2)
    s, _, refs, _ = problem_inputs(tiny_model, m, "spmv", "f32", 1)
    label = nearest_entries(entries, s.features, "spmv", "f32", 1)[0].label  # its winner is the first draft
    _, _, kept, _ = problem_inputs(tiny_model, m, "spmv", "f32", 1, exclude=label)
    without = [e for e in entries if e.label != label]
    assert len(without) < len(entries) and kept
    assert kept == reference_sources(s.features, "spmv", "f32", 1, without, m, count=4)
    assert refs == reference_sources(s.features, "spmv", "f32", 1, entries, m, count=4) != kept
    assert problem_inputs(tiny_model, m, "spmv", "f32", 1, references=False)[2] is None


def test_the_provider_asks_for_a_spare_sandbox_worker_where_its_candidates_often_fail(tiny_model, tiny_tok):
    """Departures and samples fail verification now and then, and each failure replaces the
    sandbox worker: such a provider asks the runtime for one spare worker (its
    ``sandbox_spare``, what ``miss.sandbox_spare`` keeps unless configured); hinted
    candidates, nearly always measured kernel-space points, ask for none."""
    import copy

    from sparserl_compile import miss

    hinted = copy.deepcopy(tiny_model)
    hinted.config.retrieval, hinted.config.retrieval_hints = True, 8
    for model, samples, spare in ((tiny_model, "branches", 1), (tiny_model, "temperature", 1), (hinted, None, 0)):
        prov = PolicyProvider(model=model, tokenizer=tiny_tok, samples=samples, speculative=False)
        assert prov.sandbox_spare == spare and miss.sandbox_spare(prov) == spare
    assert prov.samples == "hints"  # a hinted checkpoint's default


@pytest.mark.skipif(not (DEFAULT_CHECKPOINT / "model.safetensors").is_file(), reason="no default checkpoint")
def test_warm_up_pays_the_first_decoding_and_leaves_the_counts(monkeypatch):
    """``warm_up`` (what ``miss.prewarm`` calls) proposes for a small SpMV and an SpMM of the
    shipped policy and leaves ``stats`` as it found them; proposals from two threads run one at a
    time, each complete and the same."""
    import threading
    from dataclasses import replace

    from sparserl_compile.policy.retrieval import problem_for

    prov = PolicyProvider(device="cpu")
    asked = []
    real = prov._candidates
    monkeypatch.setattr(prov, "_candidates", lambda problem, k: asked.append(problem.op) or real(problem, k))
    before = replace(prov.stats)
    prov.warm_up()
    assert asked == ["spmv", "spmm"] and prov.stats == before
    problem = problem_for("spmv", "f32", 1, banded(300, 2))
    out = [None, None]

    def go(i):
        out[i] = prov.candidates(problem, 2)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[0] and [c.source for c in out[0]] == [c.source for c in out[1]]
    assert prov.stats.requests == before.requests + 2


def test_without_the_train_extra_the_import_says_what_to_install():
    import subprocess
    import sys

    code = ("import sys\n"
            "for m in ('transformers', 'llguidance'): sys.modules[m] = None  # as where they are not installed\n"
            "from sparserl_compile.policy.provider import PolicyProvider\n"
            "PolicyProvider()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: the policy needs the train extra") and "transformers, llguidance" in last
    assert "pip install 'sparserl[train]'" in last
