"""The README's quick start, run as a reader would: its files and worker command taken
from the README as written, a real worker, and the printed outcome compared with the
output the README shows. The blocks are the README's that say ``run by`` this file
(tests/docs/blocks.py)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from tests.docs.blocks import Block, run_by
from tests.support.workers import LoggedProcess

BLOCKS = run_by("tests/tools/test_quickstart.py")


def the(kind: str) -> Block:
    """The quick start's one block of ``kind``."""
    (block,) = [block for block in BLOCKS if block.kind == kind]
    return block


def test_the_quick_start_is_two_files_a_command_and_its_output():
    assert [(block.path.name, block.kind, block.file) for block in BLOCKS] == [
        ("README.md", "typecheck", "tasks.py"),
        ("README.md", "shell", None),
        ("README.md", "typecheck", "call.py"),
        ("README.md", "output", None),
    ]


class QuickstartWorker(LoggedProcess):
    ready_text = "ready."


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The quick start's folder, its worker running as the README starts it."""
    folder = tmp_path_factory.mktemp("quickstart")
    for block in BLOCKS:
        if block.file:
            (folder / block.file).write_text(block.text)
    command = shlex.split(the("shell").text.strip())
    assert command[0] == "celery"
    # Only the quick start's folder on the path, and the embedded default store in a
    # state folder of the test's own.
    env = {"XDG_STATE_HOME": str(folder / "state"), "PYTHONPATH": ""}
    worker = QuickstartWorker([sys.executable, "-m", *command], env, "quickstart")
    worker.env["PYTHONPATH"] = ""
    start_in(worker, folder)
    yield folder, worker
    worker.stop()


def start_in(worker: LoggedProcess, folder) -> None:
    with open(worker.log, "wb") as out:
        worker.process = subprocess.Popen(
            worker.args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=worker.env,
            cwd=folder,
            start_new_session=True,
        )
    worker.wait_for_log(worker.ready_text, timeout=60)


def call(folder) -> subprocess.CompletedProcess:
    """``python call.py``, run in the quick start's folder as the README says."""
    return subprocess.run(
        [sys.executable, "call.py"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "XDG_STATE_HOME": str(folder / "state"), "PYTHONPATH": ""},
    )


def test_the_quick_start_prints_one_run_and_one_skipped_duplicate(quickstart):
    folder, worker = quickstart
    out = call(folder)
    assert out.returncode == 0, out.stderr + worker.output()
    printed = out.stdout.splitlines()
    output = the("output")
    shown = output.text.splitlines()
    # Whichever call the worker took first ran, and printed first: the README says so.
    assert "in either order" in output.before
    holder_id = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
    assert sorted(holder_id.sub("<id>", line) for line in printed) == sorted(
        holder_id.sub("<id>", line) for line in shown
    )
    (skipped,) = [line for line in printed if line.startswith("skipped:")]
    ran_id = holder_id.search(skipped).group(0)
    assert f"Task tasks.settle[{ran_id}] succeeded" in worker.output()


def test_the_quick_start_prints_within_the_time_the_readme_says(quickstart):
    folder, worker = quickstart
    started = time.monotonic()
    out = call(folder)
    took = time.monotonic() - started
    print(f"\npython call.py printed in {took:.2f}s")
    assert out.returncode == 0, out.stderr + worker.output()
    low, high = the_readme_s_bounds()
    assert low <= took <= high


def the_readme_s_bounds() -> tuple[float, float]:
    """The seconds the README says ``python call.py`` takes to print, as written above
    its output: "... between three and six seconds after it starts ..."."""
    numbers = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}
    prose = " ".join(the("output").before.split())
    found = re.search(r"between (\w+) and (\w+) seconds after it starts", prose)
    assert found, "the README no longer says how long the quick start takes to print"
    low, high = found.groups()
    return float(numbers[low]), float(numbers[high])


def test_the_quick_start_keeps_its_leases_in_the_embedded_default_store(quickstart):
    folder, worker = quickstart
    assert list((folder / "state" / "celery-exclusive").glob("tasks-uid*.sqlite3"))
