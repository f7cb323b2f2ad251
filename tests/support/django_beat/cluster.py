"""Three ``celery beat`` processes and a worker, and a leader stopped on a schedule.

Shared by the django-celery-beat failover test and ``python -m benchmarks beat``, so
both stop leaders the same way and judge the ledger (``ledger.py``) by the same rules:

- *sent twice*: two sends of one entry closer than half its interval;
- *gap*: the longest time between two sends of one entry;
- *takeover*: from stopping the leader to the first send by another beat.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Optional

import redis

from tests.support.django_beat.ledger import LIST
from tests.support.workers import LoggedProcess, Worker


class Beat(LoggedProcess):
    """One ``celery beat`` process of ``app`` (its scheduler from the app's settings,
    unless ``scheduler`` names one)."""

    ready_text = "beat: Starting..."

    def __init__(self, app: str, env: dict, name: str, directory: Path, scheduler: str = ""):
        self.name = name
        args = [sys.executable, "-m", "celery", "-A", app, "beat", "-l", "INFO"]
        args += ["--schedule", str(directory / f"{name}-schedule")]
        if scheduler:
            args += ["-S", scheduler]
        super().__init__(args, env, f"beat-{name}")


class BeatCluster:
    """A worker and ``size`` beats of one app; a stopped beat is replaced at once."""

    def __init__(
        self,
        app: str,
        env: dict,
        ledger: redis.Redis,
        directory: Path,
        scheduler: str = "",
        size: int = 3,
    ):
        self.app, self.env, self.ledger = app, env, ledger
        self.directory, self.scheduler, self.size = directory, scheduler, size
        self.beats: list[Beat] = []
        self.worker = Worker(app, env, pool="solo", name="beat-ledger")

    def start(self) -> BeatCluster:
        self.worker.start()
        for _ in range(self.size):
            self.add_beat(wait=False)
        return self

    def add_beat(self, wait: bool = True) -> Beat:
        beat = Beat(self.app, self.env, f"b{len(self.beats) + 1}", self.directory, self.scheduler)
        self.beats.append(beat)
        return beat.start(wait=wait)

    def beat(self, pid: int) -> Beat:
        return next(b for b in self.beats if b.pid == pid)

    # --- the ledger -------------------------------------------------------------------

    def sends(self) -> list[dict]:
        return [json.loads(raw) for raw in self.ledger.lrange(LIST, 0, -1)]

    def wait_for_send(
        self, matches: Callable[[dict], bool], timeout: float = 40, what: str = "a send"
    ) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in self.sends() if matches(s)]
            if found:
                return min(found, key=lambda s: s["sent_at"])
            time.sleep(0.02)
        raise TimeoutError(f"no {what} within {timeout:.0f}s:\n{self.logs()}")

    def wait_until_drained(self, quiet: float = 1.5, timeout: float = 20) -> list[dict]:
        """The ledger once the worker has run everything sent (no change for ``quiet`` s)."""
        deadline = time.monotonic() + timeout
        count, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            now_count = self.ledger.llen(LIST)
            if now_count != count:
                count, since = now_count, time.monotonic()
            elif time.monotonic() - since > quiet:
                break
            time.sleep(0.1)
        return self.sends()

    # --- stopping leaders ---------------------------------------------------------------

    def failovers(
        self,
        signals: Iterable[int],
        entry: str,
        after_each: Optional[Callable[[int], None]] = None,
    ) -> list[dict]:
        """For each signal: wait for the leader to send ``entry``, stop that beat with the
        signal at once (its successor must not send ``entry`` again), wait for another
        beat's first send, and start a beat in the stopped one's place. ``after_each(i)``
        runs then. The new beat starts after the takeover, not during it: its start-up
        would take one of two cores from the successor whose takeover is being timed.
        """
        events, after = [], 0.0
        for i, sig in enumerate(signals):
            send = self.wait_for_send(
                lambda s, after=after: s["entry"] == entry and s["sent_at"] > after,
                what=f"send of {entry}",
            )
            stopped_at = time.time()
            self.beat(send["beat"]).stop(sig)
            first = self.wait_for_send(
                lambda s, stopped_at=stopped_at, old=send["beat"]: (
                    s["sent_at"] > stopped_at and s["beat"] != old
                ),
                what=f"send by a successor of beat {send['beat']}",
            )
            self.add_beat(wait=False)
            events.append(
                {
                    "signal": signal.Signals(sig).name,
                    "stopped_at": stopped_at,
                    "leader": send["beat"],
                    "successor": first["beat"],
                    "takeover_s": first["sent_at"] - stopped_at,
                }
            )
            if after_each is not None:
                after_each(i)
            after = first["sent_at"]
        return events

    def stop_beats(self, last: Optional[int] = None) -> None:
        """SIGKILL every beat but ``last`` (a pid), then SIGTERM that one."""
        for beat in self.beats:
            if beat.pid != last:
                beat.stop(signal.SIGKILL)
        for beat in self.beats:
            if beat.pid == last:
                beat.stop(signal.SIGTERM)

    def finish(self, last: Optional[int] = None) -> list[dict]:
        """Stop the beats (``last`` with SIGTERM, after the others), let the worker run
        what they sent, stop it; return the ledger."""
        self.stop_beats(last)
        sends = self.wait_until_drained()
        self.worker.stop()
        return sends

    def stop(self) -> None:
        """Stop everything at once (cleanup)."""
        self.stop_beats()
        self.worker.stop(signal.SIGKILL)

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {b.name} ({b.pid})\n{b.output()[-tail:]}" for b in self.beats)


def sent_twice(sends: list[dict], intervals: dict[str, float]) -> list[tuple[dict, dict]]:
    """Consecutive sends of one entry closer than half its (shortest) interval."""
    found = []
    for entry, runs in by_entry(sends).items():
        for earlier, later in zip(runs, runs[1:]):
            if later["sent_at"] - earlier["sent_at"] < intervals[entry] / 2:
                found.append((earlier, later))
    return found


def worst_gaps(sends: list[dict], until: Optional[dict[str, float]] = None) -> dict[str, float]:
    """The longest time between consecutive sends of each entry (up to ``until[entry]``)."""
    gaps = {}
    for entry, runs in by_entry(sends).items():
        times = [s["sent_at"] for s in runs if s["sent_at"] <= (until or {}).get(entry, 1e100)]
        gaps[entry] = max((b - a for a, b in zip(times, times[1:])), default=0.0)
    return gaps


def by_entry(sends: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = defaultdict(list)
    for send in sorted(sends, key=lambda s: s["sent_at"]):
        grouped[send["entry"]].append(send)
    return dict(grouped)
