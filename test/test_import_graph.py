"""The package's module import graph has no cycles, and the core packages sit below the rest.

Why a test: a cycle between two modules means neither can be read, tested or moved without the
other, and a core package (models, engine, cache, io, ipc) that reaches up into the nodes, the
commands or the training tooling drags ROS-facing or offline-job code into everything that
loads a checkpoint. Both creep back one convenient import at a time, so they are checked on
every run.

The graph is read from the source with ``ast`` (nothing is imported), so a module that needs
ROS, a GPU or a simulator is checked like any other. What counts as an edge ``A -> B``:

* every ``import``/``from ... import`` statement anywhere in ``A``: at module level, inside
  functions (they run later, but ``A`` still depends on ``B``) and under ``if TYPE_CHECKING:``
  (a type-only back-reference is still a circle between the two modules; it only hides from the
  interpreter);
* relative imports resolved against ``A``'s package; ``from P import x`` is an edge to the
  submodule ``P.x`` when there is one, else to ``P`` itself (``x`` is a name ``P/__init__``
  defines or re-exports);
* importing ``P.Q.m`` also runs ``P/__init__`` and ``P/Q/__init__``, so those are edges too,
  except for the packages that contain ``A`` (they are already initialised, or initialising,
  whenever ``A`` runs). So a cycle through a package ``__init__`` that re-exports its modules
  counts: ``x -> P`` (whose ``__init__`` imports ``P.y``) and ``P.y -> x`` is a real cycle
  (importing ``x`` first runs ``P.y`` against a half-initialised ``x``).

Only modules of ``vla_runtime`` are nodes; imports of other packages are ignored.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

import vla_runtime

PACKAGE_ROOT = Path(vla_runtime.__file__).parent

#: The packages everything else builds on: they must not depend on what builds on them.
CORE = ("models", "engine", "cache", "io", "ipc")
#: What builds on the core: the ROS-facing nodes, the user's commands (and the CLI that
#: dispatches them), the training and data-recording tooling, and the old mixed ``tools`` (split
#: into ``commands`` and ``training``; listed so that a file brought back there is still caught).
ABOVE_CORE = ("nodes", "commands", "cli", "training", "tools")


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package rooted at ``root``, by dotted name (a package by its own name,
    from its ``__init__.py``)."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` statement names (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 > len(package) - 1:
        raise ValueError(f"{module}: relative import goes above the top-level package (line {node.lineno})")
    anchor = package[:len(package) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _with_parents(target: str, importer: str, modules: dict[str, Path]) -> set[str]:
    """``target`` and the packages whose ``__init__`` importing it runs, less ``importer``'s own
    ancestors among the latter (already initialised, or initialising, when ``importer`` runs; a
    name taken from one of them explicitly still counts)."""
    parts = target.split(".")
    own = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
    implied = {".".join(parts[:i]) for i in range(1, len(parts))} - own
    return {name for name in implied | {target} if name in modules and name != importer}


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The package modules ``module`` imports (anywhere in its source), each with the first line."""
    is_package = path.name == "__init__.py"
    edges: dict[str, int] = {}

    def add(targets: set[str], line: int) -> None:
        for target in targets:
            edges[target] = min(edges.get(target, line), line)   # ast.walk is breadth-first, not in line order

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_with_parents(alias.name, module, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(_with_parents(sub if sub in modules else base, module, modules), node.lineno)
    return edges


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """Module -> {imported package module: line of the first such import}."""
    modules = module_names(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted, only those that hold a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
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
                if len(component) > 1 or node in graph[node]:
                    components.append(sorted(component))
    return components


def shortest_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One shortest cycle through the component's first module, for the failure message."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1] + [start]
            if child in members and child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")  # unreachable for a strongly connected component


def describe_cycle(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def cycles(graph: dict[str, dict[str, int]]) -> list[str]:
    return [describe_cycle(graph, shortest_cycle(graph, component)) for component in strongly_connected(graph)]


def imports_between(graph: dict[str, dict[str, int]], importers: tuple[str, ...], targets: tuple[str, ...]) -> list[str]:
    """Every import from a module of the ``importers`` subpackages into one of the ``targets``
    subpackages (an implied package ``__init__`` is left out when its submodule is listed)."""
    def package(name: str) -> str | None:
        parts = name.split(".")
        return parts[1] if len(parts) > 1 else None

    found = []
    for importer, edges in sorted(graph.items()):
        if package(importer) not in importers:
            continue
        hits = [t for t in edges if package(t) in targets]
        found += [f"{importer} imports {t} (line {edges[t]})" for t in sorted(hits)
                  if not any(other.startswith(t + ".") for other in hits)]
    return found


def layer_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every import from a core package up into a package above the core."""
    return imports_between(graph, CORE, ABOVE_CORE)


# The package itself


def test_the_package_has_no_import_cycles():
    found = cycles(import_graph(PACKAGE_ROOT))
    assert not found, "import cycles between vla_runtime's modules:\n" + "\n".join(found)


def test_core_packages_do_not_import_nodes_commands_or_training():
    found = layer_violations(import_graph(PACKAGE_ROOT))
    assert not found, "core packages importing from above the core:\n" + "\n".join(found)


def test_commands_and_training_stay_apart():
    """The user's commands and the project's training jobs share what is below them, never each
    other: a helper both need belongs in the layer below (``sim``, ``io``, ...)."""
    graph = import_graph(PACKAGE_ROOT)
    found = imports_between(graph, ("commands", "cli"), ("training",)) + imports_between(graph, ("training",), ("commands", "cli"))
    assert not found, "commands and training importing each other:\n" + "\n".join(found)


def test_the_graph_sees_the_package_as_it_is():
    """The reader is not blind: known edges of the real package are found, of every kind."""
    graph = import_graph(PACKAGE_ROOT)
    assert "vla_runtime.models.config" in graph["vla_runtime.models.checkpoint"]  # from .config import ...
    assert "vla_runtime.kernels.loader" in graph["vla_runtime.kernels.ops"]  # from . import loader
    assert "vla_runtime.ipc.ring" in graph["vla_runtime.ipc"]  # an __init__ re-export
    assert "vla_runtime.kernels" in graph["vla_runtime.cache.action_cache"]  # from .. import kernels


# The checker on small packages written here


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_mutual_import_inside_a_function_is_a_cycle(tmp_path):
    root = _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from .b import g\n",
                             "pkg/b.py": "def g():\n    from .a import f\n    return f\n"})
    found = cycles(import_graph(root))
    assert found == ["pkg.a (line 1) -> pkg.b (line 2) -> pkg.a"]


def test_a_type_checking_back_reference_is_a_cycle(tmp_path):
    root = _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n",
                             "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"})
    assert cycles(import_graph(root)) == ["pkg.a (line 1) -> pkg.b (line 3) -> pkg.a"]


def test_a_cycle_through_a_package_reexport_counts(tmp_path):
    root = _write(tmp_path, {"pkg/__init__.py": "", "pkg/x.py": "from .sub import Y\n",
                             "pkg/sub/__init__.py": "from .y import Y\n", "pkg/sub/y.py": "from ..x import X\n"})
    assert cycles(import_graph(root)) == ["pkg.sub (line 1) -> pkg.sub.y (line 1) -> pkg.x (line 1) -> pkg.sub"]


def test_a_module_importing_its_own_packages_reexport_is_no_cycle(tmp_path):
    """``P/__init__`` imports ``P.a``, and ``P.a`` imports ``P.b`` (which runs ``P``'s init first,
    already under way): Python resolves this without a half-initialised module."""
    root = _write(tmp_path, {"pkg/__init__.py": "from .a import A\n", "pkg/a.py": "from pkg.b import B\nA = B\n",
                             "pkg/b.py": "B = 1\n"})
    graph = import_graph(root)
    assert graph["pkg.a"] == {"pkg.b": 1}
    assert cycles(graph) == []


def test_from_package_import_submodule_is_an_edge_to_the_submodule(tmp_path):
    root = _write(tmp_path, {"pkg/__init__.py": "", "pkg/low/__init__.py": "", "pkg/low/m.py": "",
                             "pkg/up.py": "from .low import m\nfrom . import low\n"})
    assert import_graph(root)["pkg.up"] == {"pkg.low.m": 1, "pkg.low": 1}


def test_a_core_package_importing_nodes_is_a_layer_violation(tmp_path):
    root = _write(tmp_path, {"pkg/__init__.py": "", "pkg/io/__init__.py": "", "pkg/nodes/__init__.py": "",
                             "pkg/nodes/conv.py": "", "pkg/commands/__init__.py": "", "pkg/commands/run.py": "",
                             "pkg/io/bags.py": "def f():\n    from ..nodes.conv import g\n",
                             "pkg/nodes/user.py": "from ..io.bags import f\nfrom ..commands import run\n"})
    assert layer_violations(import_graph(root)) == ["pkg.io.bags imports pkg.nodes.conv (line 2)"]


def test_a_relative_import_above_the_package_is_refused(tmp_path):
    root = _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from ... import x\n"})
    with pytest.raises(ValueError, match="above the top-level package"):
        import_graph(root)
