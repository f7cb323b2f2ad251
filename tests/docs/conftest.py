"""The documentation site, built once per test process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT


def offline(command: list[str]) -> list[str]:
    """``command`` in a network namespace of its own (no network at all) where this
    machine allows one; the build must not need one either way."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        return [unshare, "-n", *command]
    return command


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    """The site as ``mkdocs build --strict`` writes it, built without a network once the
    scripts it serves itself are taken from their packages (which needs one, once)."""
    fetched = run([sys.executable, "docs/hooks/offline_scripts.py"])
    assert fetched.returncode == 0, fetched.stdout + fetched.stderr
    out = tmp_path_factory.mktemp("site")
    built = run(
        offline([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)])
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return out
