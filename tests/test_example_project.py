"""The README's first command: the example on the embedded default, no server."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.workers import ROOT


def test_the_example_runs_without_a_server_and_shows_excluded_duplicates():
    out = subprocess.run(
        [sys.executable, "-m", "example_project"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    summary = re.search(
        r"(\d+) calls: (\d+) ran, (\d+) skipped as duplicates, (\d+) requeues; "
        r"overlapping runs of one key: (\d+)",
        out.stdout,
    )
    calls, ran, skipped, requeues, overlapping = map(int, summary.groups())
    assert calls == ran + skipped
    assert skipped >= 1
    assert overlapping == 0
    assert "skipped: key held by" in out.stdout
    assert "sqlite://" in out.stdout
