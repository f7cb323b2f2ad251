"""The README's quick start, run as a reader would: its files and worker command taken
from the README as written, a real worker, and the printed outcome compared with the
output the README shows."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.workers import ROOT, LoggedProcess


def readme_block(name: str) -> str:
    """The code block that follows ``<!-- quickstart:<name> -->`` in the README."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(rf"<!-- quickstart:{re.escape(name)} -->\n```\w*\n(.*?)```", readme, re.S)
    assert found, f"no quickstart:{name} block in README.md"
    return found.group(1)


class QuickstartWorker(LoggedProcess):
    ready_text = "ready."


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The quick start's folder, its worker running as the README starts it."""
    folder = tmp_path_factory.mktemp("quickstart")
    for name in ("tasks.py", "call.py"):
        (folder / name).write_text(readme_block(name))
    command = shlex.split(readme_block("worker").strip())
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


def test_the_quick_start_prints_one_run_and_one_skipped_duplicate(quickstart):
    folder, worker = quickstart
    out = subprocess.run(
        [sys.executable, "call.py"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "XDG_STATE_HOME": str(folder / "state"), "PYTHONPATH": ""},
    )
    assert out.returncode == 0, out.stderr + worker.output()
    printed = out.stdout.splitlines()
    shown = readme_block("output").splitlines()
    # Whichever call the worker took first ran; the README shows one of the two orders.
    holder_id = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
    assert sorted(holder_id.sub("<id>", line) for line in printed) == sorted(
        holder_id.sub("<id>", line) for line in shown
    )
    (skipped,) = [line for line in printed if line.startswith("skipped:")]
    ran_id = holder_id.search(skipped).group(0)
    assert f"Task tasks.settle[{ran_id}] succeeded" in worker.output()


def test_the_quick_start_keeps_its_leases_in_the_embedded_default_store(quickstart):
    folder, worker = quickstart
    assert list((folder / "state" / "celery-exclusive").glob("tasks-uid*.sqlite3"))
