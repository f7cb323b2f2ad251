"""The README's first command: the example on the embedded default, no server."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.workers import ROOT


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
        r"(\d+) webhook calls and (\d+) beat ticks: (\d+) ran, (\d+) skipped as duplicates, "
        r"(\d+) coalesced into a follow-up, (\d+) requeues; overlapping runs of one key: (\d+)",
        out.stdout,
    )
    calls, ticks, ran, skipped, coalesced, requeues, overlapping = map(int, summary.groups())
    assert calls + ticks == ran + skipped + coalesced
    assert skipped >= 1 and coalesced >= 1
    assert overlapping == 0
    assert ticks >= 2
    assert "ticks sent twice: 0" in out.stdout
    assert "handed over to beat pid" in out.stdout
    assert "skipped: key held by" in out.stdout and "coalesced into" in out.stdout
    assert "sqlite://" in out.stdout
