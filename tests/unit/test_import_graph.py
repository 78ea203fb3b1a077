"""The layering of the three Python folders, read from the source (AST), not from what a
process happens to import: no module imports another that, directly or through others,
imports it back (an import inside a function counts: it only hides the cycle), and no
module imports a layer above its own (`kernels` < `common` < `services`). Imports under
`if TYPE_CHECKING:` never run and are left out."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("kernels", "common", "services")  # each may import only those before it


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "pdserve." + ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for layer in LAYERS
        for path in sorted((ROOT / layer).rglob("*.py"))
        if ".venv" not in path.parts
    }


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST, this: str, known: set[str]) -> set[str]:
    """The project modules `this` imports (a `from package import name` that names a
    submodule counts as that submodule)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package of `this`
                package = this.split(".")[: -node.level]
                base = ".".join([*package, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name in known and name != this}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {
        name: _imported(ast.parse(path.read_text(), str(path)), name, known)
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def test_the_module_graph_reads_every_folder_and_sees_function_level_imports():
    graph = _graph()
    assert {_layer(m) for m in graph} == {0, 1, 2}
    # The worker process imports its servicers at the top; the CLI imports it in a function.
    assert "pdserve.services.decode.servicer" in graph["pdserve.services.worker_process"]
    assert "pdserve.services.worker_process" in graph["pdserve.services.cli"]
    # A TYPE_CHECKING import is no edge: the remote-KV line only names the scheduler's type.
    assert "pdserve.common.scheduler" not in graph["pdserve.common.handoff.remote_queue"]


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_no_module_imports_a_layer_above_its_own():
    upward = sorted(
        (module, imported)
        for module, imports in _graph().items()
        for imported in imports
        if _layer(imported) > _layer(module)
    )
    assert upward == []
