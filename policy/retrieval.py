"""Retrieval hints: the kernel that won on the most alike measured matrix, named in the prompt.

A policy trained with hints (``SFTConfig.retrieval``; ``model.config.retrieval`` is then True)
reads ``near=<family>[k=v]...`` in its prompt (``tokenizer.prompt_text``): the fastest variant
of the nearest entry of a ``sparserl_compile.nearest`` table (same op and dtype; distance of
structure features and widths). The model still writes the whole kernel and may choose another
one; the hint is evidence, as a retrieved document is for a retrieval-augmented LM.

Where the table comes from, by use:

* SFT: the training split's own records, each record's hint taken from the *other* matrices
  (``exclude`` its own label), so training hints are as informative as they will be on an
  unseen matrix, never the answer itself;
* ``sparserl eval``: the training split (the held-out matrices are not in it);
* the runtime (``PolicyProvider``): the table the ``"nearest"`` provider ships.
"""

from __future__ import annotations


def hint_name(family: str, params) -> str:
    """A kernel-space point as the prompt names it (``contract.Candidate.name``'s spelling)."""
    return family + "".join(f"[{k}={v}]" for k, v in params)


def nearest_points(features, op: str, dtype: str, n: int, entries, count: int = 1,
                   exclude: str | None = None, problem=None, space=None) -> list[tuple[str, tuple]]:
    """The first ``count`` proposals of the nearest entries (``nearest.proposals`` order: the
    nearest entry's winner first, then the next entries' winners, then runners-up; no
    repeats) as ``(family, ((param, value), ...))`` keys; fewer when the table has fewer, none
    when no entry fits. ``problem`` (a ``problem.Problem``, e.g. from ``problem_for``): only
    points it can run (``nearest.suitable``: in its pruned kernel space, its pattern converts
    to their padded format), as the ``"nearest"`` provider proposes them; a hint the matrix
    cannot run only wastes a candidate. ``space``: the problem's pruned kernel space, when the
    caller has built it (``nearest.suitable``)."""
    from sparserl_compile.nearest import proposals, suitable

    pool = [e for e in entries if e.label != exclude] if exclude is not None else entries
    keys = proposals(pool, features, op, dtype, 1 if op == "spmv" else int(n))
    return keys[:count] if problem is None else suitable(keys, problem, count, space=space)


def nearest_hints(features, op: str, dtype: str, n: int, entries, count: int = 1,
                  exclude: str | None = None, problem=None, space=None) -> list[str]:
    """``nearest_points`` spelled as prompt hints."""
    return [hint_name(*key) for key in nearest_points(features, op, dtype, n, entries, count, exclude, problem,
                                                      space)]


def nearest_hint(features, op: str, dtype: str, n: int, entries, exclude: str | None = None,
                 problem=None, space=None) -> str | None:
    """The hint for a problem: the nearest other entry's winner (that ``problem`` can run, when
    given), or None if no entry fits. ``space``: as ``nearest_points``."""
    hints = nearest_hints(features, op, dtype, n, entries, 1, exclude, problem, space)
    return hints[0] if hints else None


def problem_for(op: str, dtype: str, n: int, matrix):
    """The ``problem.Problem`` of ``op`` at width ``n`` on a CSR ``matrix`` (anything with
    ``indptr``, ``indices`` and ``shape``), for ``nearest_points(problem=...)`` outside the
    runtime (training and evaluation)."""
    from sparserl_compile.problem import make_problem
    from sparserl_compile.structure import fingerprint

    return make_problem(op, dtype, 1 if op == "spmv" else int(n), matrix.indptr, matrix.indices, matrix.shape,
                        fingerprint(matrix.indptr, matrix.indices, matrix.shape), "sm_90")


def reference_sources(features, op: str, dtype: str, n: int, entries, structure, count: int = 4,
                      exclude: str | None = None, formats=None, scan: int = 300) -> list[str]:
    """The rendered sources of the first ``count`` proposals of the nearest entries (the hint's
    kernel first): drafts for speculative decoding (``decode.generate(references=...)``). They
    change how fast a sample is decoded, never which sample comes out. ``structure``: the
    problem's pattern (``indptr``, ``indices``, ``shape``), for families that read it.

    ``formats``: also, for each of these formats the first ``count`` left without, the next
    proposal of that format (among the first ``scan``); default: every contract format, ``()``:
    none. A sample in a format no draft is written in is decoded one token a forward: a
    departure from the greedy kernel into another format (``departures.branch_diverse``), a format
    forced on it (``candidates.format_diverse``), or a greedy kernel or sample that leaves the
    nearest winners' formats. A draft of every format makes such samples several times cheaper
    in forwards, the same kernels (``benchmarks/format_drafts.py`` measures it); rendering the
    extra drafts costs a few milliseconds.

    Returned as a ``speculative.Drafts``: with these, the kernels of the whole space for this product
    by their header lines, rendered when a sample first asks (60 points of an SpMM, about 3 ms),
    so that a sample whose header no draft has is drafted from the space's kernel of its header."""
    from sparserl_compile.policy.sampling import format_of, header_of
    from sparserl_compile.policy.speculative import Drafts, format_key
    from sparserl_compile import contract, kernels
    from sparserl_compile.nearest import proposals

    pool = [e for e in entries if e.label != exclude] if exclude is not None else entries
    out, have, family_format = [], set(), {}
    wanted = set(contract.FORMATS if formats is None else formats)
    for i, (family, params) in enumerate(proposals(pool, features, op, dtype, 1 if op == "spmv" else int(n))):
        if len(out) >= count and (not wanted - have or i >= scan):
            break
        # a family's format, once seen, spares renders (csr_rowgroup's SpMM has two: a draft missed, no more)
        known = family_format.get(family)
        if len(out) >= count and known is not None and (known in have or known not in wanted):
            continue
        try:
            c = kernels.render(family, op, dtype, dict(params), structure)
        except Exception:  # noqa: BLE001 - a point the current families no longer render
            continue
        src = c if isinstance(c, str) else c.source
        fmt = family_format.setdefault(family, format_of(src) or "")
        if len(out) < count or (fmt in wanted and fmt not in have):
            out.append(src)
            have.add(fmt)

    def by_header() -> dict[str, list[str]]:  # the whole space of this product, rendered when first asked
        index: dict[str, list[str]] = {}
        for c in kernels.space(op, dtype, n=None if op == "spmv" else int(n), structure=structure):
            header = header_of(c.source) or ""
            index.setdefault(header, []).append(c.source)
            index.setdefault(format_key(c.source), []).append(c.source)  # by format alone (Drafts.for_header)
        return index

    return Drafts(out, index=by_header)


_default_entries = None


def default_entries():
    """The shipped ``"nearest"`` table (loaded once)."""
    global _default_entries
    if _default_entries is None:
        from sparserl_compile.nearest import load_table

        _default_entries = load_table()
    return _default_entries
