"""The simulation's seam holds: the layers it runs read the clock, sleep, wait, lock, start
threads and ask for or signal their process only through ``celery_exclusive.runtime``.
A direct ``time.monotonic()`` there would run on the real clock inside the simulation,
and what the simulation explores would no longer be the code that ships."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "celery_exclusive"
#: What the simulation runs: the engine, the core and the store it simulates.
SIMULATED = sorted(
    [
        *PACKAGE.joinpath("core").glob("*.py"),
        *PACKAGE.joinpath("engine").glob("*.py"),
        PACKAGE / "backends" / "memory.py",
        PACKAGE / "backends" / "line.py",
    ]
)
#: The names the seam stands in for, by module.
BYPASSES = {
    "time": {"monotonic", "time", "sleep", "process_time", "perf_counter"},
    "threading": {"Event", "Lock", "RLock", "Condition", "Thread", "Timer", "get_ident"},
    "os": {"getpid", "getppid", "kill"},
}


def bypasses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        called = node.func if isinstance(node, ast.Call) else None
        if isinstance(called, ast.Attribute) and isinstance(called.value, ast.Name):
            if called.attr in BYPASSES.get(called.value.id, ()):
                found.append(f"{called.value.id}.{called.attr}() at line {node.lineno}")
        elif isinstance(node, ast.ImportFrom) and node.module in BYPASSES:
            names = {alias.name for alias in node.names} & BYPASSES[node.module]
            found += [f"from {node.module} import {name}" for name in sorted(names)]
    return found


@pytest.mark.parametrize("path", SIMULATED, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_simulated_module_reaches_the_clock_threads_and_process_through_the_seam(path):
    assert bypasses(path) == [], "use celery_exclusive.runtime instead"


def test_the_check_finds_a_bypass(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import time\nfrom os import getpid\nx: time.monotonic = time.monotonic()\n")
    assert bypasses(module) == ["from os import getpid", "time.monotonic() at line 3"]
