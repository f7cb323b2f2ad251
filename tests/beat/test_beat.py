"""The leader-elected beat scheduler on real ``celery beat`` processes.

Every beat runs the same one-second schedule (``tests/support/apps/beat_app.py``) with its
own schedule file; a real worker appends each run, with the second it was sent for
and the pid of the beat that sent it, to a ledger in Redis. A tick is a wall-clock
second: the same second in the ledger twice is a duplicate, a second missing
outside a failover window is a gap.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from celery import Celery
from celery.signals import before_task_publish

from celery_exclusive import backend_for_url, register_scheme
from celery_exclusive.backends import Backend
from celery_exclusive.backends.memory import MemoryBackend
from celery_exclusive.beat.scheduler import LeaderScheduler
from tests.conftest import fresh_redis_db
from tests.support import otel
from tests.support.beats import die, run_due
from tests.support.layouts import record_layout
from tests.support.servers import RedisServer
from tests.support.workers import LoggedProcess, Worker

TTL = 2.4
RETRY = TTL / 3
#: Slack for process scheduling on a busy two-core machine. A handover after SIGTERM
#: stays bounded below TTL (RETRY + SLACK = 1.8 s < 2.4 s): a beat that waited for the
#: stopped leader's lease to expire instead of its release still fails.
SLACK = 1.0
LEASE_KEY = "exclusive:beat:beat_app"


class Beat(LoggedProcess):
    """One ``celery beat`` subprocess with its own schedule file and log."""

    def __init__(self, env: dict, name: str, scheduler: str, directory: Path):
        self.name = name
        args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.support.apps.beat_app",
            "beat",
            "-S",
            scheduler,
            "--schedule",
            str(directory / f"{name}-schedule"),
            "-l",
            "INFO",
        ]
        super().__init__(args, env, f"beat-{name}")


class Stack:
    """Broker, lease store, ledger and worker shared by one test's beats."""

    def __init__(self, server, store: str, tmp_path: Path, inner: str = ""):
        self.broker = fresh_redis_db(server)
        ledger_url = fresh_redis_db(server)
        self.ledger = redis.Redis.from_url(ledger_url)
        named = {
            "redis": lambda: fresh_redis_db(server),
            "sqlite": lambda: f"sqlite:///{tmp_path}/l.db",
        }
        self.store = named[store]() if store in named else store
        self.tmp_path = tmp_path
        self.env = {
            "EXCLUSIVE_TEST_BROKER": self.broker,
            "EXCLUSIVE_TEST_STORE": self.store,
            "EXCLUSIVE_TEST_LEDGER": ledger_url,
            "EXCLUSIVE_TEST_TTL": str(TTL),
            "EXCLUSIVE_TEST_INNER": inner,
        }
        self.beats: list[Beat] = []
        self.worker = Worker(
            "tests.support.apps.beat_app", self.env, pool="solo", name="beat-worker"
        )

    def beat(self, name: str, scheduler: str = "exclusive") -> Beat:
        beat = Beat(self.env, name, scheduler, self.tmp_path)
        self.beats.append(beat)
        return beat.start()

    def ticks(self) -> list[dict]:
        return [json.loads(raw) for raw in self.ledger.lrange("ticks", 0, -1)]

    def leader(self):
        """The holder record of the beat lease, or None while nobody leads."""
        infos = backend_for_url(self.store).holders_of(LEASE_KEY)
        return infos[0] if infos else None

    def wait_for_sends(self, pid: int, count: int, timeout: float = 20) -> list[dict]:
        """Wait until beat ``pid`` has sent ``count`` ticks; return them."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sent = [t for t in self.ticks() if t["pid"] == pid]
            if len(sent) >= count:
                return sent
            time.sleep(0.05)
        raise TimeoutError(f"beat {pid} sent fewer than {count} ticks:\n{self.logs()}")

    def wait_for_new_leader(self, old_pid: int, timeout: float = 20):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.leader()
            if info is not None and info.holder["pid"] != old_pid:
                return info
            time.sleep(0.02)
        raise TimeoutError(f"no beat took over from {old_pid}:\n{self.logs()}")

    def wait_until_drained(self, quiet: float = 1.5, timeout: float = 20) -> list[dict]:
        """The ledger once the worker has run everything sent (no change for ``quiet`` s)."""
        deadline = time.monotonic() + timeout
        count, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            now_count = self.ledger.llen("ticks")
            if now_count != count:
                count, since = now_count, time.monotonic()
            elif time.monotonic() - since > quiet:
                break
            time.sleep(0.1)
        return self.ticks()

    def logs(self) -> str:
        return "\n".join(f"--- {b.name}\n{b.output()[-2000:]}" for b in self.beats)

    def stop(self) -> None:
        for beat in self.beats:
            beat.stop(signal.SIGKILL)
        self.worker.stop()


@pytest.fixture
def make_stack(redis_server, tmp_path):
    stacks = []

    def make(store: str, inner: str = "", worker: bool = True) -> Stack:
        """``store``: "redis", "sqlite" or a lease store URL."""
        stack = Stack(redis_server, store, tmp_path, inner)
        stacks.append(stack)
        if worker:
            stack.worker.start()
        return stack

    yield make
    for stack in stacks:
        stack.stop()


def duplicates(ticks: list[dict]) -> list[int]:
    slots = [t["slot"] for t in ticks]
    return sorted({s for s in slots if slots.count(s) > 1})


def missing(ticks: list[dict]) -> set[int]:
    slots = {t["slot"] for t in ticks}
    return set(range(min(slots), max(slots) + 1)) - slots


def failover(stack: Stack, leader: Beat, sig: int, beats: list[Beat]) -> tuple[float, Beat, set]:
    """Stop ``leader`` with ``sig``; return how long until another beat held the lease,
    that beat, and the seconds a tick may be missing for (the failover window)."""
    stopped_at = time.time()
    leader.stop(sig)
    info = stack.wait_for_new_leader(leader.pid)
    took_over = info.holder["acquired_at"] - stopped_at
    successor = next(b for b in beats if b.pid == info.holder["pid"])
    first_send = min(t["at"] for t in stack.wait_for_sends(successor.pid, 1))
    # The successor sends at once: its first send follows its grant, after catching up
    # with the records, in the same second or (when that straddles a second's end, as on
    # a loaded machine) the next one.
    assert first_send - info.holder["acquired_at"] < 2.0, "the new leader did not send"
    # The dead leader may not have sent the second it died in, and nothing between that
    # and the successor's first send is sent by anyone.
    window = set(range(int(stopped_at), int(first_send)))
    return took_over, successor, window


# --- failover -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "store, inner",
    [("redis", ""), ("sqlite", "celery.beat:Scheduler")],
    ids=["redis-persistent-scheduler", "sqlite-plain-scheduler"],
)
def test_across_a_kill_and_a_sigterm_every_tick_is_sent_exactly_once(make_stack, store, inner):
    stack = make_stack(store, inner)
    beats = [
        stack.beat("b1", "exclusive"),
        stack.beat("b2", "celery_exclusive.beat:LeaderScheduler"),
        stack.beat("b3", "exclusive"),
    ]
    stack.wait_for_new_leader(old_pid=-1, timeout=30)
    first = next(b for b in beats if b.pid == stack.leader().holder["pid"])
    stack.wait_for_sends(first.pid, 3)

    killed, second, window_kill = failover(stack, first, signal.SIGKILL, beats)
    stack.wait_for_sends(second.pid, 3)
    handed, third, window_term = failover(stack, second, signal.SIGTERM, beats)
    stack.wait_for_sends(third.pid, 3)
    third.stop(signal.SIGTERM)
    ticks = stack.wait_until_drained()

    print(
        f"\n[{store}] failover after SIGKILL {killed:.2f}s, after SIGTERM {handed:.2f}s; "
        f"{len(ticks)} ticks, {len(missing(ticks))} in failover windows not sent"
    )
    assert duplicates(ticks) == []
    lost = sorted(missing(ticks) - (window_kill | window_term))
    assert lost == [], f"seconds not sent, outside failovers: {lost}\n{stack.logs()}"
    assert killed <= TTL + RETRY + SLACK
    assert handed <= RETRY + SLACK
    assert {t["pid"] for t in ticks} == {first.pid, second.pid, third.pid}
    assert not any("Traceback" in beat.output() for beat in beats), stack.logs()


# --- leadership ---------------------------------------------------------------------


def test_holders_name_the_host_and_process_of_the_leading_beat(make_stack):
    stack = make_stack("redis")
    beats = [stack.beat("b1"), stack.beat("b2")]
    info = stack.wait_for_new_leader(old_pid=-1, timeout=30)
    assert info.key == LEASE_KEY
    assert info.holder["task"] == "celery beat"
    assert info.holder["pid"] in {b.pid for b in beats}
    assert info.holder["hostname"]
    assert info.holder["scheduler"] == "celery.beat:PersistentScheduler"


def test_a_leader_whose_lease_is_taken_stops_sending_and_logs_an_error(make_stack):
    stack = make_stack("redis")
    beat = stack.beat("b1")
    stack.wait_for_sends(beat.pid, 2, timeout=30)
    backend = backend_for_url(stack.store)
    backend.force_release(LEASE_KEY)
    assert backend.try_acquire(LEASE_KEY, "impostor", 30) is not None
    taken_at = time.time()
    time.sleep(3)
    late = [t for t in stack.ticks() if t["at"] > taken_at + 0.1]
    assert late == []
    assert "ERROR" in beat.output() and "stops sending" in beat.output()


# --- the Celery PersistentScheduler, driven in process ------------------------------------


@pytest.fixture
def local_app(memory_url):
    """Beats with Celery's default PersistentScheduler (a local schedule file each)."""
    app = Celery("local", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        exclusive_backend_url=memory_url,
        exclusive_beat_lease_ttl=3,
        beat_schedule={"half-second": {"task": "tests.half_second", "schedule": 0.5}},
    )
    return app


@pytest.fixture
def sent():
    """Names of the tasks published, in order."""
    names: list[str] = []

    def record(sender=None, **kwargs):
        names.append(sender)

    before_task_publish.connect(record, weak=False)
    yield names
    before_task_publish.disconnect(record)


def test_run_counts_carry_over_from_one_leader_to_the_next(local_app, tmp_path, sent):
    a = LeaderScheduler(local_app, schedule_filename=str(tmp_path / "a"))
    run_due(a)  # leads; its new entry counts as run now
    for _ in range(2):
        time.sleep(0.55)
        run_due(a)
    die(a)
    b = LeaderScheduler(local_app, schedule_filename=str(tmp_path / "b"))
    run_due(b)
    time.sleep(0.55)
    run_due(b)
    assert len(sent) >= 3
    assert b.schedule["half-second"].total_run_count == len(sent)
    a.close()
    b.close()


def test_a_follower_leaves_its_schedule_file_alone_until_it_leads(local_app, tmp_path):
    leader = LeaderScheduler(local_app, schedule_filename=str(tmp_path / "leader"))
    run_due(leader)
    follower = LeaderScheduler(local_app, schedule_filename=str(tmp_path / "follower"))
    run_due(follower)
    follower.sync()
    assert list(tmp_path.glob("follower*")) == []
    leader.close()
    run_due(follower)
    assert list(tmp_path.glob("follower*")) != []
    follower.close()


# --- configuration and the lease store, checked when beat starts --------------------------


def test_a_store_that_cannot_work_stops_beat_at_start_with_one_line(make_stack, tmp_path):
    stack = make_stack(f"sqlite:///{tmp_path}", worker=False)  # a directory, not a file
    beat = stack.beat("b1")
    assert beat.process.wait(30) != 0
    # The last line of the log, as Celery's logging prefixes what goes to stderr.
    last = beat.output().strip().splitlines()[-1]
    assert "celery-exclusive: ConfigurationError:" in last and "names a directory" in last
    assert "Traceback" not in beat.output()


def test_a_beat_meeting_a_layout_it_cannot_share_stops_at_start_with_one_line(make_stack):
    stack = make_stack("redis", worker=False)
    record_layout(stack.store, "exclusive:", 99)
    beat = stack.beat("b1")
    assert beat.process.wait(30) != 0
    last = beat.output().strip().splitlines()[-1]
    assert "celery-exclusive: LayoutMismatch:" in last and "layout version 99" in last
    assert "Traceback" not in beat.output()
    assert stack.ticks() == []


def test_a_beat_started_while_its_store_is_down_warns_once_and_leads_when_it_answers(
    make_stack,
):
    store = RedisServer()  # not started yet: nothing listens on its port
    try:
        stack = make_stack(store.url_for_db(1))
        beat = stack.beat("b1")
        beat.wait_for_log("does not answer at start", timeout=30)
        time.sleep(3 * RETRY)  # several more attempts while it is down
        store.start()
        stack.wait_for_sends(beat.pid, 2, timeout=30)
        warnings = [line for line in beat.output().splitlines() if "WARNING" in line]
        assert len(warnings) == 1 and "sends nothing until it answers" in warnings[0]
        assert "answers again" in beat.output()
        assert "Traceback" not in beat.output()
    finally:
        store.cleanup()


class NoRecordsBackend(MemoryBackend):
    """A store that has not implemented records yet."""

    capabilities = replace(MemoryBackend.capabilities, records=False)
    read_record = Backend.read_record
    write_record = Backend.write_record


def test_a_store_that_keeps_no_records_is_refused_at_start_with_one_line():
    register_scheme("norecords", "tests.beat.test_beat:NoRecordsBackend")
    app = Celery("refuse", set_as_current=False)
    app.conf.exclusive_backend_url = "norecords://"
    with pytest.raises(SystemExit, match="ConfigurationError: .*exclusive_beat_backend_url"):
        LeaderScheduler(app, lazy=True)


def test_an_inner_scheduler_that_cannot_be_imported_is_refused_at_start_with_one_line():
    app = Celery("refuse", set_as_current=False)
    app.conf.exclusive_backend_url = "memory://"
    app.conf.exclusive_beat_scheduler = "no_such_module.schedulers:DatabaseScheduler"
    with pytest.raises(SystemExit, match="ConfigurationError: .*exclusive_beat_scheduler"):
        LeaderScheduler(app, lazy=True)


# --- what a beat says ---------------------------------------------------------------


def test_a_standby_beat_says_once_which_beat_it_waits_for_and_when_it_takes_over(make_stack):
    stack = make_stack("sqlite", worker=False)
    leader = stack.beat("b1")
    leading = stack.wait_for_new_leader(old_pid=-1, timeout=30).holder
    standby = stack.beat("b2")
    standby.wait_for_log("standing by", timeout=30)
    time.sleep(4 * RETRY)  # several more attempts to take the lease, each silent
    leader.stop(signal.SIGTERM)
    standby.wait_for_log("leading as", timeout=30)

    lines = standby.output().splitlines()
    [waiting] = [line for line in lines if "standing by" in line]
    assert "INFO" in waiting
    assert (
        f"celery beat on {leading['hostname']} (pid {leader.pid}) holds the leader lease "
        f"{LEASE_KEY}" in waiting
    )
    after = lines[lines.index(waiting) + 1 :]
    took_over = next(i for i, line in enumerate(after) if "leading as" in line)
    assert "INFO" in after[took_over]
    assert after[:took_over] == [], "a standby beat logged while it waited"


def test_a_leader_counts_the_entries_it_caught_up_in_words(local_app, tmp_path, caplog):
    first = LeaderScheduler(local_app, schedule_filename=str(tmp_path / "first"))
    run_due(first)  # leads; its new entry counts as run now
    time.sleep(0.55)
    run_due(first)  # sends its one entry, and records the send
    die(first)
    second = LeaderScheduler(local_app, schedule_filename=str(tmp_path / "second"))
    with caplog.at_level(logging.INFO, "celery_exclusive"):
        run_due(second)
    assert "caught up 1 entry with the records" in caplog.text
    first.close()
    second.close()


def test_a_takeover_and_every_tick_sent_are_traced(local_app, tmp_path, sent):
    spans = otel.install()
    beat = LeaderScheduler(local_app, schedule_filename=str(tmp_path / "traced"))
    run_due(beat)  # leads; its new entry counts as run now
    for _ in range(2):
        time.sleep(0.55)
        run_due(beat)
    beat.close()
    finished = spans.get_finished_spans()
    takeover = [s for s in finished if s.name == "exclusive.acquire"]
    assert len(takeover) == 1
    assert [e.name for e in takeover[0].events] == ["exclusive.beat.takeover"]
    assert takeover[0].attributes["exclusive.policy"] == "leader"
    sends = [s for s in finished if s.name == "exclusive.beat.send"]
    assert len(sends) == len(sent) >= 2
    assert all(s.attributes["exclusive.beat.entry"] == "half-second" for s in sends)
    assert all(s.attributes["exclusive.beat.sent"] is True for s in sends)
    token = takeover[0].attributes["exclusive.fencing_token"]
    assert {s.attributes["exclusive.fencing_token"] for s in sends} == {token}
