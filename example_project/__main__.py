"""``python -m example_project``: real workers and beats, duplicate webhooks, and a table.

Everything runs on this machine with no server: a filesystem broker and the embedded
SQLite lease store. ``--backend URL`` moves the leases to Redis or Consul; ``--redis
URL`` adds the RQ part, which needs a Redis server.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent

INVOICES = (101, 102, 103, 104)
CALENDARS = (7, 8)
SENDS_PER_EVENT = 3  # a payment webhook arrives this many times, all at once
CHANGES_PER_CALENDAR = 5  # change notifications arriving together for one calendar
BEAT_SECONDS = 8.0  # how long the two beats run; the leader is stopped halfway


class Process:
    """A child process of the example, logging to a file in the run's folder."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                args,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise click.ClickException(f"{self.log.name}: no {text!r}:\n{self.text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)


def celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "example_project.app", *args]


@click.command()
@click.option("--backend", default=None, help="Lease store URL (default: the embedded SQLite).")
@click.option("--workers", default=2, show_default=True, help="Worker processes to start.")
@click.option("--redis", "redis_url", default=None, help="Redis URL: also run the RQ part.")
def main(backend: str | None, workers: int, redis_url: str | None) -> None:
    """Send duplicate webhooks to real workers and beats; show what was excluded and why."""
    var = Path(tempfile.mkdtemp(prefix="celery-exclusive-example-"))
    os.environ["EXAMPLE_VAR_DIR"] = str(var)
    if backend:
        os.environ["EXAMPLE_BACKEND_URL"] = backend
    from example_project import app as example  # reads EXAMPLE_* at import
    from example_project import journal

    procs = [
        Process(
            celery(
                "worker",
                "-P",
                "prefork",
                "-c",
                "2",
                "-n",
                f"example{i}@%h",
                "-l",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ),
            var / f"worker{i}.log",
        )
        for i in range(1, workers + 1)
    ]
    beats = [
        Process(
            celery("beat", "-l", "INFO", "--schedule", str(var / f"beat{i}-schedule")),
            var / f"beat{i}.log",
        )
        for i in (1, 2)
    ]
    try:
        for proc in procs:
            proc.wait_for("ready.")
        click.echo(f"{workers} workers and 2 beats running; sending webhooks...")
        started = time.monotonic()
        sent = send_webhooks(example)
        handover = run_beats(example, beats, started)
        rq_rows = run_rq(redis_url, var) if redis_url else None
        events = wait_for_outcomes(journal, example.JOURNAL, sent, var)
    finally:
        for proc in beats + procs:
            proc.stop()
    sent_per_task = Counter(call.split("(")[0] for call in sent.values())
    store = example.settle.exclusive_settings.backend_url
    print_report(events, sent_per_task, store, handover, rq_rows)
    shutil.rmtree(var, ignore_errors=True)
    if overlapping_runs(events) or any(e["event"] == "failed" for e in events):
        sys.exit(1)


def send_webhooks(example) -> dict[str, str]:
    """Each event's copies go out back to back, as a retrying webhook sender does.

    Returns the task ids sent, and for each, what it was."""
    sent: dict[str, str] = {}
    for invoice in INVOICES:
        for _ in range(SENDS_PER_EVENT):
            sent[example.settle.delay(invoice).id] = f"settle({invoice})"
    for calendar in CALENDARS:
        for change in range(1, CHANGES_PER_CALENDAR + 1):
            sent[example.sync_calendar.delay(calendar, change).id] = (
                f"sync_calendar({calendar}, {change})"
            )
    return sent


def run_beats(example, beats: list[Process], started: float) -> str:
    """Let the beats tick; stop the leader halfway and see the other take over."""
    from celery_exclusive import backend_for_url
    from celery_exclusive.beat.scheduler import beat_settings, lease_key

    settings = beat_settings(example.app)
    store, key = backend_for_url(settings.backend_url), lease_key(example.app, settings)

    def leader_pid():
        holders = store.holders_of(key)
        return holders[0].holder.get("pid") if holders else None

    deadline = time.monotonic() + 15
    while leader_pid() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(max(0.0, BEAT_SECONDS / 2 - (time.monotonic() - started)))
    first = leader_pid()
    stopped_at = time.monotonic()
    next(b for b in beats if b.proc.pid == first).stop()
    while leader_pid() in (None, first) and time.monotonic() - stopped_at < 10:
        time.sleep(0.05)
    took = time.monotonic() - stopped_at
    second = leader_pid()
    time.sleep(BEAT_SECONDS / 2)
    for beat in beats:
        beat.stop()
    return (
        f"beat pid {first} led; stopped (SIGTERM), it handed over to beat pid {second} "
        f"in {took:.2f}s"
    )


def run_rq(redis_url: str, var: Path) -> list[tuple]:
    """Three refunds per invoice through two real rq workers; the lease excludes duplicates."""
    import redis
    from rq import Queue

    from example_project import rq_jobs

    queue = Queue("example", connection=redis.Redis.from_url(redis_url))
    workers = [
        Process(
            [
                sys.executable,
                "-m",
                "rq.cli",
                "worker",
                "--url",
                redis_url,
                "--job-class",
                "celery_exclusive.rq.ExclusiveJob",
                "--logging_level",
                "INFO",
                "example",
            ],
            var / f"rq{i}.log",
        )
        for i in (1, 2)
    ]
    for worker in workers:
        worker.wait_for("Listening on")
    rows = []
    try:
        jobs = [queue.enqueue(rq_jobs.refund, i) for i in (201, 202) for _ in range(3)]
        deadline = time.monotonic() + 60
        # A skipped refund ends canceled: it did not run.
        ended = ("finished", "failed", "canceled")
        while not all(j.get_status(refresh=True) in ended for j in jobs):
            if time.monotonic() > deadline:
                raise click.ClickException("the RQ jobs did not finish")
            time.sleep(0.1)
        for job in jobs:
            result = job.return_value() or {}
            outcome = (
                "ran"
                if result.get("ran")
                else (f"skipped: key held by {short(result.get('holder'))}")
            )
            rows.append(
                (
                    "refund (RQ)",
                    f"invoice:{job.args[0]}",
                    short(job.id),
                    outcome,
                    str(result.get("fencing_token", "-")),
                    "",
                )
            )
    finally:
        for worker in workers:
            worker.stop()
    return rows


def wait_for_outcomes(journal, path: str, sent: dict[str, str], var: Path, timeout: float = 90):
    """Every call ends ran, skipped, coalesced or failed (requeues are on the way).

    A call that has not ended by ``timeout`` is named, with what the workers logged of
    it, and the run's folder is kept."""
    deadline = time.monotonic() + timeout
    while True:
        events = journal.events(path) if os.path.exists(path) else []
        ended = {e["task_id"] for e in events if e["event"] != "requeued"}
        waiting = [task_id for task_id in sent if task_id not in ended]
        if not waiting:
            return events
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    lines = [f"not every call ended within {timeout:.0f}s; the run's logs are in {var}"]
    for task_id in waiting:
        logged = [
            f"  {log.name}: {line}"
            for log in sorted(var.glob("worker*.log"))
            for line in log.read_text(errors="replace").splitlines()
            if task_id in line
        ]
        said = "; the workers logged:" if logged else "; no worker logged it"
        lines += [f"{sent[task_id]} [{task_id}]: no end{said}", *logged]
    raise click.ClickException("\n".join(lines))


def overlapping_runs(events: list[dict]) -> int:
    runs = defaultdict(list)
    for e in events:
        if e["event"] == "ran":
            runs[e["key"]].append((e["started"], e["ended"]))
    count = 0
    for spans in runs.values():
        spans.sort()
        count += sum(1 for a, b in zip(spans, spans[1:]) if b[0] < a[1])
    return count


def print_report(events, sent, store, handover, rq_rows) -> None:
    calls: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        calls[e["task_id"]].append(e)
    rows = []
    for task_id, evs in calls.items():
        final = evs[-1]
        if final["event"] == "ran":
            requeues = sum(1 for e in evs if e["event"] == "requeued")
            outcome = f"ran after {requeues} requeue(s)" if requeues else "ran"
            token = str(final["fencing_token"])
        elif final["event"] == "failed":
            outcome, token = "FAILED", "-"
        elif final["event"] == "coalesced":
            outcome, token = f"coalesced into {short(final['holder'])}", "-"
        else:
            outcome, token = f"skipped: key held by {short(final['holder'])}", "-"
        rows.append(
            (
                final["task"],
                final["key"],
                short(task_id),
                outcome,
                token,
                final["note"] or "",
                final["started"],
            )
        )
    rows.sort(key=lambda r: (r[0], r[1], r[6]))
    rows = [r[:6] for r in rows] + (rq_rows or [])
    header = ("task", "key", "call", "outcome", "fencing token", "note")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
    click.echo("\n" + line(header))
    click.echo("  ".join("-" * w for w in widths))
    for row in rows:
        click.echo(line(row))

    count = Counter(e["event"] for e in events)
    reports = [e for e in events if e["task"] == "nightly_report" and e["event"] == "ran"]
    # A tick whose report still ran when the next one came (a busy machine) is skipped:
    # it was sent, and it is counted.
    ticks = sum(1 for e in events if e["task"] == "nightly_report" and e["event"] != "requeued")
    click.echo(
        f"\n{sum(sent.values())} webhook calls and {ticks} beat ticks: "
        f"{count['ran']} ran, {count['skipped']} skipped as duplicates, "
        f"{count['coalesced']} coalesced into a follow-up, {count['requeued']} requeues; "
        f"overlapping runs of one key: {overlapping_runs(events)}"
    )
    click.echo(f"Beat: {handover}; ticks sent twice: {ticks_sent_twice(reports)}")
    if rq_rows is None:
        click.echo("RQ: not run (it needs a Redis server: add --redis redis://localhost:6379/0)")
    click.echo(
        "How: before its body runs, each task takes a lease on its key in "
        f"{store}.\nA call that finds the key held is a duplicate. settle skips it (a "
        "second settlement would charge twice).\nsync_calendar coalesces it: the first "
        "duplicate waits and runs once after the current sync, with the latest change;\n"
        "later ones join it. The beats elect a leader with a lease of their own; only the "
        "leader sends."
    )


def ticks_sent_twice(reports: list[dict]) -> int:
    """Reports *sent* closer together than half the schedule: one tick sent by two beats.

    Send times, stamped by the beat itself: a report that waited in the queue behind
    webhook work starts late, but it was still sent once.
    """
    from example_project.app import REPORT_EVERY

    sends = sorted(e["sent_at"] for e in reports)
    return sum(1 for a, b in zip(sends, sends[1:]) if b - a < REPORT_EVERY / 2)


def short(task_id: str | None) -> str:
    return task_id[:8] if task_id else "?"


if __name__ == "__main__":
    main()
