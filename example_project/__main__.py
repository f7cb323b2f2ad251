"""``python -m example_project``: workers, duplicate webhooks, and a table of outcomes."""

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
SENDS_PER_EVENT = 3  # each webhook arrives this many times, all at once


@click.command()
@click.option("--backend", default=None, help="Lease store URL (default: the embedded SQLite).")
@click.option("--workers", default=2, show_default=True, help="Worker processes to start.")
def main(backend: str | None, workers: int) -> None:
    """Send duplicate webhooks to real Celery workers and show what was excluded."""
    var = tempfile.mkdtemp(prefix="celery-exclusive-example-")
    os.environ["EXAMPLE_VAR_DIR"] = var
    if backend:
        os.environ["EXAMPLE_BACKEND_URL"] = backend
    from example_project import app as example  # reads EXAMPLE_* at import
    from example_project import journal

    procs = [start_worker(i, var) for i in range(1, workers + 1)]
    try:
        for proc, log in procs:
            wait_ready(proc, log)
        click.echo(f"{workers} workers ready; sending each webhook {SENDS_PER_EVENT} times...")
        sent = send_webhooks(example)
        outcome = wait_for_outcomes(journal, example.JOURNAL, sent)
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            proc.wait(30)
    store = example.settle.exclusive_settings.backend_url
    print_report(outcome, sent, store)
    shutil.rmtree(var, ignore_errors=True)
    if overlapping_runs(outcome):
        sys.exit(1)


def start_worker(number: int, var: str):
    log = Path(var) / f"worker{number}.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "example_project.app",
            "worker",
            "-P",
            "prefork",
            "-c",
            "2",
            "-n",
            f"example{number}@%h",
            "-l",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-f",
            str(log),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    return proc, log


def wait_ready(proc, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (log.exists() and "ready." in log.read_text(errors="replace")):
        if proc.poll() is not None or time.monotonic() > deadline:
            text = log.read_text(errors="replace") if log.exists() else ""
            raise click.ClickException(f"a worker did not start:\n{text[-2000:]}")
        time.sleep(0.05)


def send_webhooks(example) -> dict[str, int]:
    """Each event's copies go out back to back, as a retrying webhook sender does."""
    sent: Counter = Counter()
    events = [(example.settle, i) for i in INVOICES] + [
        (example.sync_calendar, c) for c in CALENDARS
    ]
    for task, argument in events:
        for _ in range(SENDS_PER_EVENT):
            task.delay(argument)
            sent[task.name] += 1
    return sent


def wait_for_outcomes(journal, path: str, sent: dict[str, int], timeout: float = 90):
    """Every settle call ends ran or skipped; every sync_calendar call ends ran."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = journal.events(path) if os.path.exists(path) else []
        ended = Counter(e["task"] for e in events if e["event"] in ("ran", "skipped"))
        if all(ended[task] >= count for task, count in sent.items()):
            return events
        time.sleep(0.2)
    raise click.ClickException(f"not every call finished within {timeout}s")


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


def print_report(events: list[dict], sent: dict[str, int], store: str) -> None:
    calls: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        calls[e["task_id"]].append(e)
    rows = []
    for task_id, evs in calls.items():
        final = evs[-1]
        requeues = sum(1 for e in evs if e["event"] == "requeued")
        if final["event"] == "ran":
            outcome = f"ran after {requeues} requeue(s)" if requeues else "ran"
            token = str(final["fencing_token"])
        else:
            outcome = f"skipped: key held by {short(final['holder'])}"
            token = "-"
        rows.append((final["task"], final["key"], short(task_id), outcome, token, final["started"]))
    rows.sort(key=lambda r: (r[0], r[1], r[5]))
    header = ("task", "key", "call", "outcome", "fencing token")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(5)]
    line = lambda r: "  ".join(str(v).ljust(w) for v, w in zip(r, widths))  # noqa: E731
    click.echo("\n" + line(header))
    click.echo("  ".join("-" * w for w in widths))
    for row in rows:
        click.echo(line(row[:5]))

    ran = sum(1 for e in events if e["event"] == "ran")
    skipped = sum(1 for e in events if e["event"] == "skipped")
    requeued = sum(1 for e in events if e["event"] == "requeued")
    click.echo(
        f"\n{sum(sent.values())} calls: {ran} ran, {skipped} skipped as duplicates, "
        f"{requeued} requeues; overlapping runs of one key: {overlapping_runs(events)}"
    )
    click.echo(
        "How: before its body runs, each task takes a lease on its key (invoice:<id>, "
        f"calendar:<id>) in {store}.\nA call that finds the key held is a duplicate: "
        "settle skips it (a second settlement would charge twice);\nsync_calendar "
        "requeues it with backoff, so every change is synced, one sync at a time."
    )


def short(task_id: str | None) -> str:
    return task_id[:8] if task_id else "?"


if __name__ == "__main__":
    main()
