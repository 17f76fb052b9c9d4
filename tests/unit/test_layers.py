"""hpcrl reads top-down: no import cycle between modules, none between packages, and the role entry point imports
nothing of the run it starts.

The graph is read from the source with `ast` (nothing is imported). Two rules:

- **Module cycles**: imports at module level (the ones that run when a module is imported, `if`/`try` blocks
  included, `if TYPE_CHECKING:` blocks not). An import inside a function is how a module breaks an import-time
  cycle on purpose (sessions/sandbox.py and its server), so it does not count here.
- **Package cycles**: every import, inside functions and `TYPE_CHECKING` blocks too: a lazy import is still a
  dependency. The nodes are hpcrl's subpackages (hpcrl/rollout/, hpcrl/trainer/, ...) and its top-level modules
  (hpcrl/driver.py, hpcrl/run_config.py, ...). One refinement: run_config.py composes each component's
  `config.py` dataclasses and nothing else of them, so its import of `hpcrl/<pkg>/config.py` is an edge to a
  node of that config module alone, whose own imports are its edges. A package may then hold both its config
  (below run_config.py) and commands that read a whole RunConfig (above it), as slurm/ does, but a config module
  that reached back up to a package reading RunConfig would still close a cycle.

Run: .venv/bin/python -m pytest tests/unit/test_layers.py -q
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "hpcrl"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def _import_nodes(tree: ast.Module, *, module_level: bool) -> Iterable[ast.Import | ast.ImportFrom]:
    if not module_level:
        yield from (n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom))
        return
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, ast.With):
            todo += node.body


def _resolve(name: str) -> str | None:
    """The hpcrl module that `name` (a module, or a name inside one) lives in; None outside hpcrl."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


@functools.cache
def imports_of(module: str, *, module_level: bool) -> frozenset[str]:
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(tree, module_level=module_level):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            # `from hpcrl.x import y` imports the module hpcrl.x.y when there is one, else a name of hpcrl.x.
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            resolved = _resolve(target) if target.split(".")[0] == "hpcrl" else None
            if resolved is not None and resolved != module:
                found.add(resolved)
    return frozenset(found)


def _node(module: str) -> str:
    """A subpackage (hpcrl.rollout) or a top-level module (hpcrl.driver); hpcrl/__init__.py is `hpcrl`."""
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, dict[str, list[str]]]:
    """node -> node it imports -> the module imports behind that edge (see the module docstring)."""
    graph: dict[str, dict[str, list[str]]] = {}
    for module in MODULES:
        src = module if module != "hpcrl.run_config" else None
        for target in imports_of(module, module_level=False):
            if module == "hpcrl.run_config" and target.endswith(".config"):
                dst = target  # a component's config module, a node of its own
            else:
                dst = _node(target)
            source = _node(module) if src else module
            if source != dst:
                graph.setdefault(source, {}).setdefault(dst, []).append(f"{module} -> {target}")
    # The config modules that run_config.py composes: their own imports are their edges.
    for node in [d for edges in graph.values() for d in edges if d in MODULES and d.endswith(".config")]:
        for target in imports_of(node, module_level=False):
            if _node(target) != node:
                graph.setdefault(node, {}).setdefault(_node(target), []).append(f"{node} -> {target}")
    return graph


def strongly_connected(graph: dict[str, Iterable[str]]) -> list[list[str]]:
    """The components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read() -> None:
    """The reader finds what is there (a graph of nothing has no cycle either)."""
    assert "hpcrl.rollout.generate" in imports_of("hpcrl.rollout.producer", module_level=True)
    assert "hpcrl.samples.sample" in imports_of("hpcrl.trainer.advantage", module_level=False)
    assert "hpcrl.samples.sample" not in imports_of("hpcrl.trainer.advantage", module_level=True)  # TYPE_CHECKING
    graph = package_graph()
    assert "hpcrl.samples" in graph["hpcrl.trainer"] and "hpcrl.run" in graph["hpcrl.driver"]
    assert strongly_connected({"a": ["b"], "b": ["c", "a"], "c": []}) == [["a", "b"]]


def test_no_module_cycle() -> None:
    graph = {m: imports_of(m, module_level=True) for m in MODULES}
    cycles = strongly_connected(graph)
    assert not cycles, f"modules that import each other at import time: {cycles}"


def test_no_package_cycle() -> None:
    graph = package_graph()
    cycles = strongly_connected(graph)
    detail = [
        f"{a} -> {b}: {graph[a][b][:3]}" for cycle in cycles for a in cycle for b in cycle if b in graph.get(a, {})
    ]
    assert not cycles, "packages that import each other:\n" + "\n".join(detail)


def test_samples_are_the_bottom() -> None:
    """Sample, Group, Example and the sampling supports import nothing of hpcrl beside themselves."""
    for module in [m for m in MODULES if m.startswith("hpcrl.samples")]:
        above = {t for t in imports_of(module, module_level=False) if not t.startswith("hpcrl.samples")}
        assert not above, f"{module} imports {sorted(above)}"


@pytest.mark.parametrize("below", ["hpcrl.run", "hpcrl.driver"])
def test_the_role_entry_point_imports_nothing_of_the_run(below: str) -> None:
    """slurm/roles.py starts every role of a job; the driver and the run's parts are passed to it (cli.py)."""
    found = {t for t in imports_of("hpcrl.slurm.roles", module_level=False) if _node(t) == below}
    assert not found, f"hpcrl/slurm/roles.py imports {sorted(found)}"
