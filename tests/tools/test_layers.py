"""The package's folders are layers, and imports only point down them.

From the top: the package's face (``celery_exclusive``, ``testing``, ``metrics``),
the integrations (``celery/``, ``beat/``, ``rq/``, ``web/``, ``cli/``), the attempt
engine (``engine/``), the core (``core/``), the stores (``backends/``), and at the
bottom the errors and signals everyone raises and sends. The import graph is read
from the source, every import including one inside a function (a cycle there is a
cycle in the design) and one under ``TYPE_CHECKING`` (a module that names another's
type for its annotations depends on it too), and must have no cycle and no import that
points up.

Run with ``-s`` to see each module's size in lines.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import pytest

PACKAGE = "celery_exclusive"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

#: Each module's layer, by the first part of its name under the package; higher
#: layers may import lower ones (and their own), never the other way.
LAYERS = {
    "errors": 0,
    "signals": 0,
    "runtime": 0,
    "telemetry": 0,
    "backends": 1,
    "core": 2,
    "engine": 3,
    "celery": 4,
    "beat": 4,
    "rq": 4,
    "web": 4,
    "cli": 4,
    "testing": 5,
    "metrics": 5,
    "": 5,  # the package itself: what users import
}


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _type_only(tree: ast.Module) -> set[int]:
    """The ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                found.update(id(child) for child in ast.walk(inner))
    return found


def imports_of(name: str, path: Path, known: dict[str, Path], typing: bool = True) -> set[str]:
    """The package's modules that module ``name`` imports, anywhere in its source (and
    under ``TYPE_CHECKING`` too, with ``typing``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    skipped = set() if typing else _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # "from . import x" names a module x, or else a name in the package.
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            resolved = _known_prefix(target, known)
            if resolved is not None and resolved != name:
                found.add(resolved)
    return found


def _known_prefix(target: str, known: dict[str, Path]) -> Optional[str]:
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


def layer_of(name: str) -> int:
    parts = name.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else ""]


def graph(typing: bool = True) -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known, typing) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_relative_lazy_and_type_checking_imports():
    edges = graph()
    assert "celery_exclusive.core.lease" in edges["celery_exclusive.core.policies"]
    assert "celery_exclusive.engine.attempt" in edges["celery_exclusive.celery.execution"]
    assert "celery_exclusive.errors" in edges["celery_exclusive.backends"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_package_imports_no_module_in_a_cycle():
    assert cycles(graph(typing=False)) == []


def test_no_module_names_a_type_of_one_that_imports_it():
    assert cycles(graph()) == []


def test_no_module_imports_a_layer_above_its_own():
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in graph().items()
        for target in targets
        if layer_of(target) > layer_of(name)
    )
    assert upward == []


#: The host libraries (Celery's, RQ's, OpenTelemetry's) each folder may import, and why;
#: none but these.
HOSTS = {"celery", "kombu", "billiard", "rq", "opentelemetry"}
ALLOWED_HOSTS = {
    # Pickled errors are resolved with kombu's symbol_by_name, which every Celery
    # client has; the signals are Celery's dispatcher, which users connect to.
    "errors": {"kombu"},
    "signals": {"celery"},
    "runtime": set(),
    # The one module that speaks OpenTelemetry, importing it at first use (optional).
    "telemetry": {"opentelemetry"},
    "backends": set(),
    "core": set(),
    # A pending rerun's arguments are kept as kombu's JSON, as Celery's messages are.
    "engine": {"kombu"},
    "celery": {"celery", "kombu", "billiard"},
    "beat": {"celery", "kombu"},
    "rq": {"rq"},
    # The operators' views read an app's settings when given one (celery -A ...).
    "web": {"celery"},
    "cli": {"celery"},
    "testing": {"celery"},
    "metrics": {"celery", "billiard"},
    "": {"celery"},
}


def host_imports(path: Path) -> set[str]:
    """The host libraries a module imports, anywhere in its source."""
    tree = ast.parse(path.read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and not node.level
    }
    return imported & HOSTS


def folder_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_folder_imports_only_the_host_libraries_it_is_allowed():
    assert set(ALLOWED_HOSTS) == set(LAYERS)
    extra = sorted(
        f"{name} imports {', '.join(sorted(found - ALLOWED_HOSTS[folder_of(name)]))}"
        for name, path in modules().items()
        if (found := host_imports(path)) - ALLOWED_HOSTS[folder_of(name)]
    )
    assert extra == []


def test_the_core_and_the_stores_know_neither_celery_nor_rq():
    for name, path in modules().items():
        if folder_of(name) in ("core", "backends"):
            assert host_imports(path) == set(), name


@pytest.fixture(scope="module", autouse=True)
def sizes(request):
    """Print each module's size in lines, largest first (seen with ``-s``)."""
    yield
    lengths = sorted(
        ((len(path.read_text().splitlines()), name) for name, path in modules().items()),
        reverse=True,
    )
    print("\nmodule sizes (lines):")
    for lines, name in lengths:
        print(f"{lines:6d}  {name}")
