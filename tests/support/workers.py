"""Real ``celery worker`` and ``rq worker`` processes for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tests.support.servers import kill_tree

ROOT = Path(__file__).resolve().parents[2]


class LoggedProcess:
    """A subprocess in a session of its own, its output in a log file the test reads."""

    #: Text the log shows once the process is ready (None: ready at once).
    ready_text: str | None = None

    def __init__(self, args: list[str], env: dict, name: str):
        self.args = args
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        self.log = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1])
        #: Where it runs: the repository, whose test support it imports.
        self.cwd = ROOT
        self.process: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self, wait: bool = True):
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                self.args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        if wait and self.ready_text:
            self.wait_for_log(self.ready_text, timeout=60)
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.args[:6]} exited ({self.process.returncode}):\n{self.output()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {text!r} in the log:\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30, group: bool = False) -> int:
        """Signal the main process (as an init system would: a SIGTERM to a worker's
        pool children too would kill the tasks a warm shutdown should finish), or the
        whole ``group``; then make sure nothing of it is left."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            if group:
                kill_tree(self.process, sig)
            else:
                self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                kill_tree(self.process, signal.SIGKILL)
                self.process.wait(10)
        kill_tree(self.process, signal.SIGKILL)
        return self.process.returncode

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Worker(LoggedProcess):
    """One ``celery worker`` subprocess."""

    ready_text = "ready."

    def __init__(
        self,
        app: str,
        env: dict,
        pool: str = "prefork",
        concurrency: int = 2,
        name: str = "w1",
        extra: tuple = (),
    ):
        args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app,
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            f"{name}@%h",
            "-l",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            *extra,
        ]
        super().__init__(args, env, f"worker-{name}")


#: The job class of RQ workers under test, as users name it to ``rq worker --job-class``.
JOB_CLASS = "celery_exclusive.rq.ExclusiveJob"


class RQWorker(LoggedProcess):
    """One ``rq worker`` subprocess (using ExclusiveJob unless told otherwise), its log
    in a file."""

    ready_text = "Listening on"

    def __init__(
        self,
        url: str,
        queue: str,
        name: str,
        scheduler: bool = True,
        env=None,
        job_class: str | None = JOB_CLASS,
        extra: tuple = (),
    ):
        args = [
            sys.executable,
            "-m",
            "rq.cli",
            "worker",
            "--url",
            url,
            *(["--job-class", job_class] if job_class else []),
            "--name",
            f"{name}-{uuid.uuid4().hex[:8]}",
            "--logging_level",
            "INFO",
            *(["--with-scheduler"] if scheduler else []),
            *extra,
            queue,
        ]
        super().__init__(args, env or {}, f"rq-{name}")
        self.name = args[args.index("--name") + 1]

    def wait_ready(self, timeout: float = 30) -> RQWorker:
        self.wait_for_log(self.ready_text, timeout)
        return self

    def stop(self) -> int:
        # The whole group: a work horse still running a long job goes too.
        return super().stop(signal.SIGTERM, timeout=15, group=True)


def read_ledger(client) -> list[dict]:
    return [json.loads(raw) for raw in client.lrange("ledger", 0, -1)]


def runs_by_key(entries: list[dict]) -> list[list[dict]]:
    """Ledger entries grouped by key, each group in order of start."""
    by_key: dict[str, list[dict]] = {}
    for entry in entries:
        by_key.setdefault(entry["key"], []).append(entry)
    return [sorted(runs, key=lambda e: e["start"]) for runs in by_key.values()]


def overlaps(entries: list[dict]) -> list[tuple[dict, dict]]:
    """Pairs of runs of one key whose [start, end] intervals intersect."""
    found = []
    for runs in runs_by_key(entries):
        for earlier, later in zip(runs, runs[1:]):
            if later["start"] < earlier["end"]:
                found.append((earlier, later))
    return found
