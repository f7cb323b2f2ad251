"""Chaos: real workers running exclusive tasks while workers and the lease store fail.

The harness owns what the chaos hits (the workers and the lease store's Redis) and
what it never touches (the broker and the ledger, on a Redis of their own). It submits
jobs over a few keys, injects seeded random faults, drains, and returns what it saw;
test_chaos.py states what must hold.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field

import redis
from celery import signals as celery_signals

from celery_exclusive import BackendUnavailable, backend_for_url
from tests.support.servers import RedisServer, kill_tree
from tests.support.workers import Worker, runs_by_key

KEYS = ("alpha", "beta", "gamma")


@dataclass
class Chaos:
    """One run: its seed, its faults, and everything the checks need."""

    seed: int
    seconds: float
    workers: int = 3
    ttl: float = 3.0
    #: Longest SIGSTOP; below ttl * 2/3 no lease can expire under a stopped holder.
    max_pause: float = 1.0
    events: list[str] = field(default_factory=list)
    submitted: set[int] = field(default_factory=set)
    #: Task id of each submitted job (every copy of a job has the same one).
    task_ids: dict[int, str] = field(default_factory=dict)
    #: Every worker process started, the replacements of killed ones included.
    started_workers: list[Worker] = field(default_factory=list)
    #: (killed at, pids of the killed worker's processes)
    kills: list[tuple[float, set[int]]] = field(default_factory=list)
    outliving: list[str] = field(default_factory=list)

    def log(self, what: str) -> None:
        self.events.append(f"{time.time() - self.started:6.2f}s {what}")

    def run(self, tmp_path) -> dict:
        self.random = random.Random(self.seed)
        self.started = time.time()
        base = RedisServer()  # broker and ledger: never touched by the chaos
        # A store restarted empty would forget its fencing counters and start them
        # again at 1, which no fence survives; a lease store runs with persistence.
        store = RedisServer(appendonly=True)
        base.start()
        store.start()
        self.store_server = store
        self.env = {
            "CHAOS_BROKER": base.url_for_db(1),
            "CHAOS_LEDGER": base.url_for_db(0),
            "CHAOS_STORE": store.url,
            "CHAOS_TTL": str(self.ttl),
        }
        self.ledger = base.client(0)
        self.store = backend_for_url(store.url)
        from tests.chaos import chaos_app

        chaos_app.app.conf.broker_url = self.env["CHAOS_BROKER"]
        # The first copy of each job is sent from here: note it in this run's ledger.
        chaos_app.app.conf.chaos_ledger = self.env["CHAOS_LEDGER"]
        self.task = chaos_app.work
        self.pool = [self._worker(i) for i in range(self.workers)]
        drained = False
        celery_signals.after_task_publish.connect(chaos_app._published, weak=False)
        try:
            for w in self.pool:
                w.start(wait=False)
            for w in self.pool:
                w.wait_for_log("ready.", timeout=90)
            self.log(f"seed={self.seed} workers={self.workers} ttl={self.ttl}")
            self._inject_faults()
            drained = self._drain(timeout=60 + self.ttl * 4)
            entries = [json.loads(x) for x in self.ledger.lrange("ledger", 0, -1)]
            done = {int(x) for x in self.ledger.smembers("done")}
            broker = redis.Redis.from_url(self.env["CHAOS_BROKER"])
            if not drained:
                self.log(
                    f"not drained: queue={broker.llen('celery')} unacked={broker.hlen('unacked')} "
                    f"unacked_index={broker.zcard('unacked_index')} "
                    f"unacked_mutex={broker.exists('unacked_mutex')}; worker logs kept: "
                    + " ".join(str(w.log) for w in self.started_workers)
                )
                self._describe(self.submitted - done)
            return {
                "entries": entries,
                "missing": sorted(self.submitted - done),
                "missing_never_started": self._never_started(self.submitted - done),
                "drained": drained,
                "outliving": self.outliving,
                "events": self.events,
            }
        finally:
            celery_signals.after_task_publish.disconnect(chaos_app._published)
            for w in self.pool:
                with contextlib.suppress(Exception):
                    kill_tree(w.process, signal.SIGCONT)
                    w.stop(signal.SIGKILL, timeout=5)
            if drained:
                for w in self.started_workers:
                    w.log.unlink(missing_ok=True)
            base.cleanup()
            store.cleanup()

    def _worker(self, i: int) -> Worker:
        worker = Worker("tests.chaos.chaos_app", self.env, concurrency=2, name=f"chaos{i}")
        self.started_workers.append(worker)
        return worker

    def _submit(self, count: int) -> None:
        for _ in range(count):
            job = len(self.submitted)
            self.submitted.add(job)
            key = self.random.choice(KEYS)
            result = self.task.apply_async((key, job, self.random.uniform(0.02, 0.25)))
            self.task_ids[job] = result.id

    def _inject_faults(self) -> None:
        deadline = self.started + self.seconds
        store_restart_at = self.started + self.seconds * self.random.uniform(0.3, 0.7)
        while time.time() < deadline:
            self._submit(self.random.randint(2, 6))
            if store_restart_at and time.time() >= store_restart_at:
                store_restart_at = None
                self._restart_store()
            else:
                fault = self.random.choice(
                    (self._kill_worker, self._kill_child, self._pause_worker, None)
                )
                if fault:
                    fault(self.random.randrange(len(self.pool)))
            self._sleep_watching(self.random.uniform(0.5, 2.0))

    def _kill_worker(self, i: int) -> None:
        w = self.pool[i]
        pids = _group(w.process.pid)
        kill_tree(w.process, signal.SIGKILL)
        w.process.wait(10)
        self.kills.append((time.time(), pids))
        self.log(f"SIGKILL worker chaos{i} (pids {sorted(pids)})")
        self.pool[i] = self._worker(i).start(wait=False)

    def _kill_child(self, i: int) -> None:
        children = _group(self.pool[i].process.pid) - {self.pool[i].process.pid}
        if children:
            pid = self.random.choice(sorted(children))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.log(f"SIGKILL pool child {pid} of chaos{i}")

    def _pause_worker(self, i: int) -> None:
        pause = self.random.uniform(0.1, self.max_pause)
        kill_tree(self.pool[i].process, signal.SIGSTOP)
        self.log(f"SIGSTOP chaos{i} for {pause:.2f}s")
        self._sleep_watching(pause)
        kill_tree(self.pool[i].process, signal.SIGCONT)

    def _restart_store(self) -> None:
        down = self.random.uniform(0.3, 1.0)
        self.store_server.stop(signal.SIGKILL)
        self.log(f"lease store SIGKILLed, down for {down:.2f}s")
        self._sleep_watching(down)
        self.store_server.start()

    def _sleep_watching(self, seconds: float) -> None:
        """Sleep, checking meanwhile that no lease outlives a killed holder by > ttl."""
        until = time.time() + seconds
        while time.time() < until:
            self._check_outliving()
            time.sleep(min(0.1, max(0.0, until - time.time())))

    def _check_outliving(self) -> None:
        now = time.time()
        overdue = [(at, pids) for at, pids in self.kills if now - at > self.ttl + 0.3]
        if not overdue:
            return
        try:
            holders = self.store.holders("exclusive:")
        except BackendUnavailable:
            return  # the store is down: nothing to see
        for info in holders:
            for at, pids in overdue:
                if info.holder.get("pid") in pids:
                    self.outliving.append(
                        f"{info.key} held by killed pid {info.holder['pid']} "
                        f"{now - at:.2f}s after the kill (ttl {self.ttl}s)"
                    )
        # Checked long enough after the kill: stop watching it.
        self.kills = [(at, p) for at, p in self.kills if now - at < self.ttl * 3]

    def _describe(self, missing: set[int]) -> None:
        """Log, for each missing job, its task id and what the workers' logs say of it."""
        published = self.ledger.hgetall("published")
        started = self.ledger.hgetall("started")
        for job in sorted(missing):
            task_id = self.task_ids[job]
            self.log(
                f"job {job} ({task_id}) last sent at {published.get(str(job).encode())}, "
                f"last started at {started.get(str(job).encode())}"
            )
            for w in self.started_workers:
                for line in w.output().splitlines():
                    if task_id in line:
                        self.log(f"  {w.log.name}: {line[:300]}")

    def _never_started(self, missing: set[int]) -> list[int]:
        """Missing jobs whose last copy (the first, or a requeue) no worker started.

        Such a copy never reached this library's code: it was lost between the broker
        and a worker. kombu's Redis transport pops a message (BRPOP) and only then
        records it as unacked, so a worker SIGKILLed in between loses it, and Redis
        can hand a message to a dead worker's pending BRPOP before it notices the
        closed connection. A copy that started (``task_prerun``) and did not complete
        is a failure of ours.
        """
        published = {int(j): float(t) for j, t in self.ledger.hgetall("published").items()}
        started = {int(j): float(t) for j, t in self.ledger.hgetall("started").items()}
        return sorted(
            job for job in missing if job in published and started.get(job, 0.0) < published[job]
        )

    def _drain(self, timeout: float) -> bool:
        """Leave the workers alone until every submitted job has completed once."""
        for w in self.pool:
            with contextlib.suppress(Exception):
                w.wait_for_log("ready.", timeout=60)
        self.log(f"faults over; draining {len(self.submitted)} jobs")
        deadline = time.time() + timeout
        broker = redis.Redis.from_url(self.env["CHAOS_BROKER"])
        idle_since = None
        while time.time() < deadline:
            self._check_outliving()
            if self.ledger.scard("done") >= len(self.submitted):
                self.log("drained")
                return True
            # Nothing queued and nothing unacked (with acks_late, a running or countdown
            # task is unacked) for a while: what is missing will not come back.
            if broker.llen("celery") or broker.hlen("unacked"):
                idle_since = None
            elif idle_since is None:
                idle_since = time.time()
            elif time.time() - idle_since > 3:
                self.log("broker idle with jobs missing")
                return False
            time.sleep(0.2)
        return False


def _group(pgid: int) -> set[int]:
    """Pids of the processes in process group ``pgid`` (a worker and its pool)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError), open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[2]) == pgid:
                    pids.add(int(entry))
    return pids


def forbidden_overlaps(entries: list[dict]) -> list[tuple[dict, dict]]:
    """Pairs of runs of one key that overlapped without the allowed excuse.

    Two runs may overlap only if the later one holds a higher fencing token and the
    earlier one had been told (by the end of its run) that its lease was lost.
    """
    found = []
    for runs in runs_by_key(entries):
        for i, earlier in enumerate(runs):
            for later in runs[i + 1 :]:
                if later["start"] >= earlier["end"]:
                    break
                if not (later["token"] > earlier["token"] and earlier["lost"]):
                    found.append((earlier, later))
    return found
