"""Cold start's provider specs (benchmarks/cold_start.py): the policy provider decodes its first k
candidates in one batch by default; ``+one`` and ``+batch`` choose, and the sampling mode is kept."""

from pathlib import Path

import pytest

cold_start = pytest.importorskip("cold_start")

RETRIEVAL = Path(__file__).resolve().parents[2] / "policy" / "checkpoints" / "retrieval"


@pytest.mark.skipif(not (RETRIEVAL / "model.safetensors").is_file(), reason="no retrieval checkpoint in this checkout")
@pytest.mark.parametrize("spec, batch", [("policy+hints", True), ("policy+hints+batch", True),
                                         ("policy+hints+one", False)])
def test_policy_specs_choose_how_the_candidates_are_decoded(spec, batch):
    prov = cold_start._make_provider(f"{spec}@{RETRIEVAL}")
    assert prov.samples == "hints" and prov.decode.batch_drafts is batch
    assert prov.decode.temperature == 0.8  # the rest of the provider's decoding is its default


def test_a_plain_name_is_the_registered_provider():
    assert cold_start._make_provider("nearest").name == "nearest"


DEFAULT = RETRIEVAL.parent / "default"


@pytest.mark.skipif(not (DEFAULT / "model.safetensors").is_file(), reason="no default checkpoint in this checkout")
def test_screen_and_spare_modifiers():
    """``+screenN`` gives the provider a CPU screen of N workers (branches only); ``+spareN`` is
    the runtime's spare sandbox workers, for any provider, and leaves the provider alone."""
    prov = cold_start._make_provider(f"policy+branches+screen2+spare1@{DEFAULT}")
    try:
        assert prov.samples == "branches" and prov.screen is not None and prov.screen.pool.workers == 2
    finally:
        prov.screen.close()
    assert cold_start._spare(f"policy+branches+screen2+spare1@{DEFAULT}") == 1
    assert cold_start._spare("nearest+spare2") == 2 and cold_start._spare("nearest") is None  # the provider's own
    assert cold_start._make_provider(f"policy@{DEFAULT}").screen is None
    with pytest.raises(ValueError, match="needs samples='branches'"):
        cold_start._make_provider(f"policy+temperature+screen1@{DEFAULT}")


def test_spare_on_a_registered_provider_leaves_its_name():
    """``nearest+spare1`` is the registered ``nearest`` provider with one spare sandbox worker."""
    assert cold_start._make_provider("nearest+spare1").name == "nearest"
    assert cold_start._spare("nearest+spare1") == 1
    with pytest.raises(ValueError, match="only the policy provider takes modifiers"):
        cold_start._make_provider("nearest+one")


@pytest.mark.skipif(not (DEFAULT / "model.safetensors").is_file(), reason="no default checkpoint in this checkout")
def test_steps_modifier():
    """``+stepsN`` sets the branch provider's forward budget per departure (``+steps0``: none);
    without it the provider's default stands."""
    from sparserl_compile.policy.departures import DEPARTURE_STEPS

    assert cold_start._make_provider(f"policy+branches+steps0@{DEFAULT}").departure_steps is None
    assert cold_start._make_provider(f"policy+branches+steps12@{DEFAULT}").departure_steps == 12
    assert cold_start._make_provider(f"policy+branches@{DEFAULT}").departure_steps == DEPARTURE_STEPS
    with pytest.raises(ValueError, match="only the policy provider takes modifiers"):
        cold_start._make_provider("nearest+steps1")
