"""mypy and pyright as a user of the package runs them: ``mypy --strict`` and pyright's
standard mode, with Celery's types from celery-types and the package from this checkout.

Each checker runs once over a folder of files and returns every error it reports, as
:class:`Error` (file, line, message), for the caller to map back to where the code came
from. A checker that could not run at all fails the caller's test with its output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, NamedTuple

ROOT = Path(__file__).resolve().parents[2]


class Error(NamedTuple):
    path: Path  # resolved
    line: int  # 1-based
    message: str


def mypy(folder: Path, files: Sequence[Path]) -> list[Error]:
    """``mypy --strict`` over ``files``; imports are followed, and checked only where
    they are among ``files``."""
    ran = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--follow-imports=silent",
            "--show-error-codes",
            "--no-color-output",
            "--no-error-summary",
            "--config-file",
            os.devnull,
            *map(str, files),
        ],
        cwd=folder,
        env={**os.environ, "MYPYPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = []
    for line in ran.stdout.splitlines():
        found = re.match(r"(.+?):(\d+): error: (.*)", line)
        if found:
            path = Path(folder, found.group(1)).resolve()
            errors.append(Error(path, int(found.group(2)), found.group(3)))
    # 0: no error, 1: errors reported; anything else (2: a crash, a bad option) is not a
    # verdict on the files.
    assert ran.returncode == 0 or (ran.returncode == 1 and errors), ran.stdout + ran.stderr
    return errors


def pyright(folder: Path, files: Sequence[Path]) -> list[Error]:
    """pyright (standard mode, as a project without a configuration gets it) over
    ``files``; it reports only on those."""
    (folder / "pyrightconfig.json").write_text(
        json.dumps({"extraPaths": [str(ROOT)], "typeCheckingMode": "standard"})
    )
    ran = subprocess.run(
        [sys.executable, "-m", "pyright", "--outputjson", *map(str, files)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # 0: no error, 1: errors reported; anything else is a failure to run.
    assert ran.returncode in (0, 1), ran.stdout + ran.stderr
    report = json.loads(ran.stdout)
    return [
        Error(
            Path(diagnostic["file"]).resolve(),
            diagnostic["range"]["start"]["line"] + 1,
            f"{diagnostic['message']}  [{diagnostic.get('rule', 'pyright')}]",
        )
        for diagnostic in report["generalDiagnostics"]
        if diagnostic["severity"] == "error"
    ]


#: Each checker by the name a test shows.
CHECKERS: dict[str, Callable[[Path, Sequence[Path]], list[Error]]] = {
    "mypy": mypy,
    "pyright": pyright,
}
