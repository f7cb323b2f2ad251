"""The ``test`` extra installs everything the tests import: the README's test command
runs in a fresh virtual environment, where a module only another extra brings (the
benchmarks' python-redis-lock, say) is missing."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import distribution, packages_distributions
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]

#: Modules of the project itself, and modules a test imports only where it installs
#: them itself into a virtual environment of its own (none today).
OURS = {"tests", "celery_exclusive", "example_project", "benchmarks", "docs"}
OWN_ENVIRONMENT: set[str] = set()


def _guarded(tree: ast.AST) -> set[ast.AST]:
    """Imports inside ``try: ... except ImportError`` and its fallback: optional."""
    guarded: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
            for h in node.handlers
        ):
            for statement in node.body + [s for h in node.handlers for s in h.body]:
                guarded.update(ast.walk(statement))
    return guarded


def _imported_modules() -> dict[str, Path]:
    """Top-level modules imported anywhere under tests/ (but for optional imports with a
    fallback), with one file importing each."""
    found: dict[str, Path] = {}
    for path in (ROOT / "tests").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        optional = _guarded(tree)
        for node in ast.walk(tree):
            if node in optional:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], path)
    return found


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _closure(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install, with everything they require."""
    seen: set[str] = set()
    todo = [r for r in requirements if ";" not in r or _applies(r)]
    while todo:
        requirement = todo.pop()
        name = _name(requirement)
        extras = re.search(r"\[([^\]]*)\]", requirement.split(";")[0])
        key = name + (f"[{extras.group(1)}]" if extras else "")
        if key in seen:
            continue
        seen.add(key)
        seen.add(name)
        try:
            requires = distribution(name).requires or []
        except Exception:
            continue
        wanted = {e.strip() for e in extras.group(1).split(",")} if extras else set()
        for sub in requires:
            marker = sub.split(";", 1)[1] if ";" in sub else ""
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
            if extra and extra.group(1) not in wanted:
                continue
            if marker and not extra and not _applies(sub):
                continue
            todo.append(sub.split(";")[0] if extra else sub)
    return seen


def _applies(requirement: str) -> bool:
    from packaging.markers import Marker

    return Marker(requirement.split(";", 1)[1]).evaluate()


def test_every_module_the_tests_import_is_installed_by_the_test_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = _closure(project["dependencies"] + project["optional-dependencies"]["test"])
    by_module = packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    missing = []
    for module, where in sorted(_imported_modules().items()):
        if module in stdlib or module in OURS or module in OWN_ENVIRONMENT:
            continue
        dists = {_name(d) for d in by_module.get(module, [])}
        if not dists & installed:
            missing.append(f"{module} (imported by {where.relative_to(ROOT)})")
    assert not missing, (
        "the tests import modules the `test` extra does not install: "
        + ", ".join(missing)
        + "; add their distributions to [project.optional-dependencies] test"
    )
