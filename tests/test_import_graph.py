"""The import graph of ``sparserl_compile`` (with ``policy/`` and ``training/`` installed inside it)
has no cycle.

Every module is parsed with ``ast``; imports at any depth count (an import inside a function is
still a dependency). ``from x import y`` depends on ``x.y`` where that is a module, else on ``x``.
Importing a submodule implicitly imports its parent packages; that edge is not counted, since a
package's ``__init__`` is where such a cycle would show up as an edge of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "sparserl_compile"
# Where each package's source lies in the repository (pyproject.toml's package-dir mapping).
SOURCES = {
    PACKAGE: ROOT / "sparserl_compile",
    f"{PACKAGE}.policy": ROOT / "policy",
    f"{PACKAGE}.training": ROOT / "training",
}
MODEL_SIDE = (f"{PACKAGE}.policy", f"{PACKAGE}.training")


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the three source trees."""
    out: dict[str, Path] = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            # policy/ and training/ are separate source trees, not subpackages of sparserl_compile/
            if package == PACKAGE and parts and parts[0] in ("policy", "training"):
                continue
            out[name] = path
    return out


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return name in modules and modules[name].name == "__init__.py"


def _resolve(node: ast.ImportFrom, name: str, modules: dict[str, Path]) -> str:
    """The absolute module a relative ``from`` import starts from."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if _is_package(name, modules) else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(name: str, tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The ``sparserl_compile`` modules that module ``name`` imports, at any depth."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node, name, modules)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in modules else source)
    targets = set()
    for target in found:
        # `import a.b.c` names a.b.c; fall back to the longest prefix that is one of ours
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            targets.add(target)
    return targets


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _targets(name, ast.parse(path.read_text(), str(path)), modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _under(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _touches_model_side(component: list[str]) -> bool:
    return any(_under(m, MODEL_SIDE) for m in component)


def _describe(components: list[list[str]], graph: dict[str, set[str]]) -> str:
    lines = []
    for component in components:
        members = set(component)
        edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a] & members)]
        lines.append(f"cycle among {', '.join(component)}:\n    " + "\n    ".join(edges))
    return "\n".join(lines)


def test_graph_sees_every_source_tree():
    graph = import_graph()
    assert f"{PACKAGE}.policy.model" in graph and f"{PACKAGE}.training.rl" in graph
    assert f"{PACKAGE}.plans" in graph and f"{PACKAGE}.commands.cli" in graph
    # an import inside a function counts: the policy provider loads its model lazily
    assert f"{PACKAGE}.policy.model" in graph[f"{PACKAGE}.policy.provider"]


def test_imports_resolve_to_the_modules_they_load():
    """Inside a function too; ``from p import name`` is ``p.name`` where that is a module, else
    ``p`` itself (the bare package, whose ``__init__`` runs); relative imports count."""
    modules = {name: Path(file) for name, file in (("pkg", "pkg/__init__.py"), ("pkg.a", "pkg/a.py"),
                                                   ("pkg.b", "pkg/b.py"), ("pkg.sub", "pkg/sub/__init__.py"),
                                                   ("pkg.sub.c", "pkg/sub/c.py"), ("pkg.x", "pkg/x.py"))}
    tree = ast.parse("import os\n\ndef f():\n    from pkg import a, helper\n    import pkg.sub.c\n"
                     "    from .b import thing\n")
    assert _targets("pkg.x", tree, modules) == {"pkg.a", "pkg", "pkg.sub.c", "pkg.b"}


def test_cycle_finder_names_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_policy_and_training_are_in_no_cycle():
    graph = import_graph()
    found = [c for c in cycles(graph) if _touches_model_side(c)]
    assert not found, "import cycles through policy/ or training/:\n" + _describe(found, graph)


#: the call path and the commands: the runtime loads the policy, never the other way round
ABOVE_POLICY = ("plans", "miss", "reference", "transpose", "providers", "proposer", "tensor", "ops", "dispatch",
                "backend", "commands")


def test_policy_imports_only_low_runtime_modules():
    """The policy sits below the runtime. It may use the low modules (contract, problem,
    structure, formats, kernels, language, sandbox, verify, compiler, matrices, simt, the kernel
    search), not the call path, the commands, whatever calls ``select``, or the bare package
    (whose ``__init__`` imports the whole runtime)."""
    graph = import_graph()
    above = [f"{PACKAGE}.{m}" for m in ABOVE_POLICY]
    assert all(m in graph for m in above), f"not modules of {PACKAGE}: {[m for m in above if m not in graph]}"
    select_callers = [name for name, targets in graph.items()
                      if f"{PACKAGE}.select" in targets and not _under(name, MODEL_SIDE)]
    wrong = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items() if _under(name, [f"{PACKAGE}.policy"])
        for target in targets if target == PACKAGE or _under(target, above + select_callers)
    )
    assert not wrong, "policy/ imports modules above it: " + ", ".join(wrong)


def test_the_runtime_is_in_no_cycle():
    graph = import_graph()
    found = [c for c in cycles(graph) if not _touches_model_side(c)]
    assert not found, "import cycles in sparserl_compile/:\n" + _describe(found, graph)
