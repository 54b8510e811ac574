"""A benchmark suite's entry: a matrix or graph by name, generated (a generator and its
arguments, the seed included, so a result file says how to make it again) or shared (a file of
``../shared/matrices``). ``bench.py`` and ``bench_graphs.py`` list their suites with it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MatrixSpec:
    """One suite matrix or graph: generated (generator + kwargs incl. seed) or shared (a file).
    ``generators``: the module whose generator it names, ``matrices`` (``matrices.generate``)
    or ``graphs`` (the graph suite's generators, called by name)."""

    name: str
    kind: str
    source: str  # "generated" | "shared"
    generator: str | None = None
    kwargs: dict = field(default_factory=dict)
    path: str | None = None
    nnz_estimate: int = 0
    quick: bool = False
    generators: str = "matrices"

    def origin(self) -> dict:
        if self.source == "shared":
            return {"source": "shared", "name": self.name}
        return {"source": "generated", "generator": self.generator, "args": self.kwargs,
                "seed": self.kwargs.get("seed", 0)}

    def load(self):
        """The matrix as canonical scipy CSR."""
        from sparserl_compile import graphs, matrices

        if self.source == "shared":
            return matrices.load_matrix(self.path)
        if self.generators == "graphs":
            return getattr(graphs, self.generator)(**self.kwargs)
        return matrices.generate(self.generator, **self.kwargs)
