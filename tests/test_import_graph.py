"""No import cycles among difftest's modules, read statically from their source.

Every module of ``difftest``, ``difftest.backends`` and ``difftest.generation`` is parsed (never
imported) and each import that runs when the module loads is an edge: module-level imports,
including those in class bodies and ``try``/``if`` blocks. Imports under ``if TYPE_CHECKING:``
never run but still say which module depends on which, so they are judged too, separately.
Imports inside functions run later, once every module has loaded; they are not judged.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

# The layer packages, lowest first: the data flows case -> inputs (cache and views) -> backends
# -> results -> judgement -> report, and each layer imports only from layers before it.
LAYERS = ("primitives", "machine", "case", "inputs", "contract", "generation", "backends",
          "results", "judgement", "reporting", "run", "frontends", "kernel_tests")
# Above every layer: the package face and the entry points (``difftest``, ``difftest.cli``,
# ``difftest.pytest_plugin``, ``difftest.__main__``).
TOP = len(LAYERS)


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, package
    return Path(next(iter(spec.submodule_search_locations)))


def modules() -> dict[str, Path]:
    """Every module of ``difftest`` and its sub-packages by dotted name (packages by their
    ``__init__``)."""
    root = _package_dir("difftest")
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("difftest", *path.relative_to(root).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def layer(module: str) -> int:
    """The index of ``module``'s layer in :data:`LAYERS` (:data:`TOP` for the face and the
    entry points)."""
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and parts[1] not in LAYERS):
        return TOP
    return LAYERS.index(parts[1])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


LOAD, TYPE_ONLY, DEFERRED = "load", "type-only", "deferred"


def _imports(tree: ast.AST, kind: str = LOAD
             ) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Each import statement with its kind: run at load, for type checkers only, or deferred
    (inside a function)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, kind
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _imports(ast.Module([child], []), TYPE_ONLY)
            for child in node.orelse:
                yield from _imports(ast.Module([child], []), kind)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _imports(node, DEFERRED)
        else:
            yield from _imports(node, kind)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             known: dict[str, Path]) -> set[str]:
    """The known modules one import statement loads (submodules named in a from-import)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = module.split(".")
            anchor = anchor if is_package else anchor[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                 for alias in node.names]
    targets = set()
    for name in names:
        while name and name not in known:  # `import difftest.x.y`: the deepest known module
            name = name.rpartition(".")[0]
        if name and name != module:
            targets.add(name)
    return targets


def import_graph(*kinds: str) -> dict[str, set[str]]:
    """Edges between the known modules, from the imports of the given kinds."""
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        for node, kind in _imports(tree):
            if kind in kinds:
                graph[name] |= _targets(node, name, path.stem == "__init__", known)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path ``a -> ... -> a``) through each strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    return [*paths[node], start]
                if succ not in paths:
                    paths[succ] = [*paths[node], succ]
                    nxt.append(succ)
        frontier = nxt
    raise AssertionError(f"no cycle through {sorted(component)}")


def test_the_walk_sees_every_package_and_their_imports() -> None:
    at_load = import_graph(LOAD)
    assert {"difftest.run.runner", "difftest.backends.torch_ref",
            "difftest.generation.corpus"} <= set(at_load)
    assert "difftest.contract.backend" in at_load["difftest.backends.torch_ref"]


def test_every_module_sits_in_a_named_layer_or_at_the_top() -> None:
    """A handful of modules at the top (the face and the entry points); the rest in layers."""
    top = sorted(m for m in modules() if layer(m) == TOP)
    assert top == ["difftest", "difftest.__main__", "difftest.cli", "difftest.pytest_plugin"]
    present = {m.split(".")[1] for m in modules() if layer(m) < TOP}
    assert present == set(LAYERS)


def _upward(graph: dict[str, set[str]]) -> list[str]:
    def name(module: str) -> str:
        return LAYERS[layer(module)] if layer(module) < TOP else "top"
    return sorted(f"{m} ({name(m)}) imports {t} ({name(t)})"
                  for m, targets in graph.items() for t in targets if layer(t) > layer(m))


def test_layers_import_only_downward() -> None:
    upward = _upward(import_graph(LOAD, TYPE_ONLY, DEFERRED))
    assert not upward, "imports reaching up a layer:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import() -> None:
    graph = {"difftest.case.spec": {"difftest.run.runner"}, "difftest.run.runner": set(),
             "difftest.cli": {"difftest.run.runner"}}
    assert _upward(graph) == ["difftest.case.spec (case) imports difftest.run.runner (run)"]
    assert layer("difftest.backends.torch_ref") == LAYERS.index("backends")


def test_import_kinds_and_targets() -> None:
    source = """
import difftest.case.spec.nothing
from difftest import __version__
from difftest.contract import backend
from . import torch_ref
try:
    from .vllm_imports import x
except ImportError:
    pass
if TYPE_CHECKING:
    from difftest.run.runner import CaseResult
else:
    from difftest.contract import compare
class A:
    from difftest.inputs import kv_cache
def f():
    from difftest.contract import registry
"""
    known = modules()
    found: dict[str, set[str]] = {LOAD: set(), TYPE_ONLY: set(), DEFERRED: set()}
    for node, kind in _imports(ast.parse(source)):
        found[kind] |= _targets(node, "difftest.backends.aiter_gluon", False, known)
    assert found == {
        LOAD: {"difftest.case.spec", "difftest.contract.backend", "difftest",
               "difftest.backends.torch_ref", "difftest.backends.vllm_imports",
               "difftest.contract.compare", "difftest.inputs.kv_cache"},
        TYPE_ONLY: {"difftest.run.runner"},
        DEFERRED: {"difftest.contract.registry"},
    }


def test_cycle_finder_reports_the_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def _assert_acyclic(graph: dict[str, set[str]], what: str) -> None:
    found = cycles(graph)
    assert not found, f"import cycles {what}:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_import_cycle_at_module_level() -> None:
    _assert_acyclic(import_graph(LOAD), "at module level")


def test_no_import_cycle_counting_type_only_imports() -> None:
    """Data flows one way: a module a type checker reads must not depend back on its reader."""
    _assert_acyclic(import_graph(LOAD, TYPE_ONLY), "counting `if TYPE_CHECKING:` imports")

