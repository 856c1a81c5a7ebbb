"""The package layout keeps its shape: import layers without cycles, and size limits.

(a) Imports. The sub-packages of ``oakemu_core`` (and ``oakemu_services``, the ``services/``
folder) form layers, lowest first::

    step_schema, shared_memory, errors < policy < envs < transport < actor < storage < run < algo
    < config < tuning < the oakemu_core package root (its ``__init__``) < services

A module may import its own layer and the layers below it at runtime, never one above; the
module import graph has no cycle. Every ``import`` counts, at module level or inside a function
(a lazy import is a dependency all the same), except those under ``if TYPE_CHECKING:``.

(b) Sizes. No module over :data:`MAX_MODULE_LINES` lines, no class over :data:`MAX_CLASS_LINES`,
no function or method over :data:`MAX_FUNCTION_LINES` (from its ``def`` line to its last line,
docstring included), in ``oakemu_core/`` and ``services/``.

What breaks a rule today is listed in :data:`UPWARD_IMPORT_EXCEPTIONS`, :data:`CYCLE_EXCEPTIONS`
and :data:`SIZE_EXCEPTIONS`, each with its reason: ``TO GO`` entries are being removed by the
redesign under way, ``TO DECIDE`` ones wait for a choice of layout. A new offender fails the
tests, and so does an entry nothing needs any more (delete it).

The sources are parsed with :mod:`ast`; nothing is imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"oakemu_core": REPO_ROOT / "oakemu_core", "oakemu_services": REPO_ROOT / "services"}
"""Import name -> source folder (``services/`` installs as ``oakemu_services``)."""

LAYERS: tuple[tuple[str, ...], ...] = (
    ("step_schema", "shared_memory", "errors"),
    ("policy",),
    ("envs",),
    ("transport",),
    ("actor",),
    ("storage",),
    ("run",),
    ("algo",),
    ("config", "options", "presets"),  # the model, its command-line options, named sets of settings
    ("tuning",),  # hyperparameter studies: search spaces, Optuna studies of runs, their outputs
    ("oakemu_core",),  # the package root's __init__: re-exports what a user starts from
    ("services",),
)
LAYER = {room: rank for rank, rooms in enumerate(LAYERS) for room in rooms}

MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80

UPWARD_IMPORT_EXCEPTIONS: dict[tuple[str, str], str] = {
    # (importing module, imported module) -> why it is allowed for now.
}

CYCLE_EXCEPTIONS: dict[frozenset[str], str] = {
    # The modules of one import cycle (a strongly connected component) -> why it is allowed for now.
}

SIZE_EXCEPTIONS: dict[str, str] = {
    # "path" (a module) or "path::qualname" (a class or function) -> why it may be over its limit.
    # -- TO GO: split by the redesign under way (one concept per module; services keep process loops).
}


# ------------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class Module:
    """One source file: its dotted import name, its path and its parsed tree."""

    name: str
    path: Path
    is_package: bool
    tree: ast.Module

    @property
    def relative_path(self) -> str:
        return self.path.relative_to(REPO_ROOT).as_posix()


def read_modules() -> dict[str, Module]:
    """Every ``.py`` file of :data:`PACKAGES`, by dotted module name."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join(parts)
            modules[name] = Module(
                name, path, is_package, ast.parse(path.read_text(encoding="utf-8"), str(path))
            )
    return modules


def room(module: str) -> str:
    """The layer name of a module of :data:`PACKAGES` (fails for a room not in :data:`LAYERS`)."""
    parts = module.split(".")
    found = (
        "services"
        if parts[0] == "oakemu_services"
        else parts[1]
        if len(parts) > 1
        else "oakemu_core"
    )
    assert found in LAYER, f"{module}: '{found}' is in no layer of LAYERS; place it there"
    return found


# ------------------------------------------------------------------------------- imports
def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node`` at any depth, skipping the body of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for branch in child.orelse:
                yield from _import_nodes(ast.Module(body=[branch], type_ignores=[]))
        else:
            yield from _import_nodes(child)


def _resolve(name: str, modules: dict[str, Module]) -> str | None:
    """The module of ours that importing ``name`` names: itself, or its longest known prefix."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def runtime_imports(module: Module, modules: dict[str, Module]) -> set[str]:
    """The modules of :data:`PACKAGES` that ``module`` imports at runtime (``from a import b`` names
    the module ``a.b`` when there is one, else ``a``)."""
    found = set()
    for node in _import_nodes(module.tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                package = module.name.split(".")
                if not module.is_package:
                    package.pop()
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, base] if base else package)
            names = [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            target = _resolve(name, modules)
            if target is not None and target != module.name:
                found.add(target)
    return found


def import_graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    return {name: runtime_imports(module, modules) for name, module in modules.items()}


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """``(importer, imported)`` pairs where the imported module's layer is above the importer's."""
    return {
        (source, target)
        for source, targets in graph.items()
        for target in targets
        if LAYER[room(target)] > LAYER[room(source)]
    }


def import_cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
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
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.add(frozenset(component))
    return cycles


# --------------------------------------------------------------------------------- sizes
def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def _oversized_definitions(node: ast.AST, prefix: str) -> Iterator[tuple[str, str, int]]:
    """``(qualname, kind, lines)`` of the classes and functions under ``node`` over their limit."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            qualname = prefix + child.name
            if _lines(child) > MAX_CLASS_LINES:
                yield qualname, "class", _lines(child)
            yield from _oversized_definitions(child, qualname + ".")
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            qualname = prefix + child.name
            if _lines(child) > MAX_FUNCTION_LINES:
                yield qualname, "function", _lines(child)
            yield from _oversized_definitions(child, qualname + ".<locals>.")
        else:
            yield from _oversized_definitions(child, prefix)


def oversized(modules: dict[str, Module]) -> dict[str, str]:
    """``key -> "kind of N lines (limit M)"`` for every module, class and function over its limit;
    keys as in :data:`SIZE_EXCEPTIONS`."""
    limits = {"module": MAX_MODULE_LINES, "class": MAX_CLASS_LINES, "function": MAX_FUNCTION_LINES}
    found = {}
    for module in modules.values():
        lines = len(module.path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            found[module.relative_path] = f"module of {lines} lines (limit {MAX_MODULE_LINES})"
        for qualname, kind, size in _oversized_definitions(module.tree, ""):
            found[f"{module.relative_path}::{qualname}"] = (
                f"{kind} of {size} lines (limit {limits[kind]})"
            )
    return found


# --------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return read_modules()


def _listing(items: dict) -> str:
    return "\n".join(f"  {key}: {value}" for key, value in sorted(items.items(), key=str))


def test_no_new_upward_import(modules: dict[str, Module]) -> None:
    upward = upward_imports(import_graph(modules))
    new = {
        edge: f"{room(edge[1])} is above {room(edge[0])}"
        for edge in upward - set(UPWARD_IMPORT_EXCEPTIONS)
    }
    assert not new, (
        "runtime imports from a lower layer to a higher one (move the code down, invert the "
        "dependency, or import under `if TYPE_CHECKING:` for annotations):\n" + _listing(new)
    )


def test_no_new_import_cycle(modules: dict[str, Module]) -> None:
    new = {
        cycle: "an import cycle"
        for cycle in import_cycles(import_graph(modules)) - set(CYCLE_EXCEPTIONS)
    }
    assert not new, "modules that import each other (directly or round a cycle):\n" + _listing(
        {", ".join(sorted(cycle)): why for cycle, why in new.items()}
    )


def test_no_new_oversized_module_class_or_function(modules: dict[str, Module]) -> None:
    new = {key: what for key, what in oversized(modules).items() if key not in SIZE_EXCEPTIONS}
    assert not new, (
        "over the size limits (split it, or list it in SIZE_EXCEPTIONS with a reason):\n"
        + _listing(new)
    )


def test_every_exception_is_still_needed(modules: dict[str, Module]) -> None:
    graph = import_graph(modules)
    stale = {
        **{
            f"UPWARD_IMPORT_EXCEPTIONS {edge}": "no such import now"
            for edge in set(UPWARD_IMPORT_EXCEPTIONS) - upward_imports(graph)
        },
        **{
            f"CYCLE_EXCEPTIONS {sorted(cycle)}": "no such cycle now"
            for cycle in set(CYCLE_EXCEPTIONS) - import_cycles(graph)
        },
        **{
            f"SIZE_EXCEPTIONS {key!r}": "within its limit now, or gone"
            for key in set(SIZE_EXCEPTIONS) - set(oversized(modules))
        },
    }
    assert not stale, "exceptions nothing needs any more (delete them):\n" + _listing(stale)


def test_every_exception_has_a_reason() -> None:
    tables = (UPWARD_IMPORT_EXCEPTIONS, CYCLE_EXCEPTIONS, SIZE_EXCEPTIONS)
    assert all(
        reason.strip() and "\n" not in reason for table in tables for reason in table.values()
    )
