"""The kernel space as training sees it: a supervision record's variants as CUDA sources.

``default_render`` renders one point of the hand-written kernel families
(``sparserl_compile.kernels.render``); ``ranked_variants`` orders a record's verified variants
by measured time; ``normalized`` is how a sample is matched to a rendered point (whitespace
removed); ``measured_sources`` maps a record's rendered points to their measured times. SFT
takes its targets from here, the evaluators and the evaluation match samples against it.
"""

from __future__ import annotations

import re


def default_render(family: str, op: str, dtype: str, params: dict, structure) -> str:
    """The source of one kernel-space point (``sparserl_compile.kernels.render``), or of a
    verified textual variant of one when ``params`` holds ``transform`` (``transforms.py``)."""
    from sparserl_compile.training import transforms

    return transforms.render(family, op, dtype, params, structure)


def ranked_variants(record, top: int):
    """The record's verified variants, fastest first, at most ``top``."""
    ok = sorted((v for v in record.variants if v.us is not None), key=lambda v: v.us)
    return ok[:max(1, top)]


def normalized(source: str) -> str:
    """A source without whitespace: how samples are matched to rendered kernel-space points."""
    return re.sub(r"\s+", "", source)


def measured_sources(record, matrix, render=default_render) -> dict[str, float | None]:
    """Normalized rendered source -> measured us (None: the variant failed there) for the
    variants of one supervision record (the fastest where two variants render alike)."""
    out: dict[str, float | None] = {}
    for v in record.variants:
        try:
            key = normalized(render(v.family, record.op, record.dtype, dict(v.params), matrix))
        except Exception:  # noqa: BLE001 - a variant the current families no longer render
            continue
        old = out.get(key)
        out[key] = v.us if old is None else (old if v.us is None else min(old, v.us))
    return out
