"""``?recipe=advisory``: the store and PostgreSQL's session advisory locks exclude each
other, both ways, with real ``psql`` sessions (Debian's postgresql-client) as the
foreign client.

A ``psql`` session locks what the docs tell a user's SQL to lock::

    pg_advisory_lock(('x' || left(md5('exclusive:invoice:7'), 16))::bit(64)::bigint)

Holders of ours that die or hang are real processes, SIGKILLed or SIGSTOPped. Real
workers: test_postgresql_recipe_workers.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import psycopg
import pytest

from celery_exclusive import ConfigurationError, ExclusiveLock, LockHeld, backend_for_url
from celery_exclusive.backends import _load
from celery_exclusive.backends.postgresql import recipe as advisory
from celery_exclusive.backends.postgresql.connection import encoded, key_id
from celery_exclusive.backends.postgresql.recipe import AdvisoryBackend, lock_id
from celery_exclusive.core import outcomes, policies
from celery_exclusive.core.config import Settings
from tests.support.cluster import wait_until

KEY = "exclusive:invoice:7"
#: What the docs give a user's SQL for a key held as text.
LOCK_SQL = "('x' || left(md5({key}), 16))::bit(64)::bigint"


def owner() -> str:
    return uuid.uuid4().hex


def literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def lock_sql(key: str) -> str:
    return LOCK_SQL.format(key=literal(key))


@pytest.fixture
def recipe_url(postgres_server):
    return f"{postgres_server.url}?schema=r_{uuid.uuid4().hex[:10]}&recipe=advisory"


@pytest.fixture
def recipe_store(recipe_url):
    store = _load(recipe_url)
    yield store
    store.close()


class Psql:
    """One ``psql`` session, fed statements on its standard input."""

    def __init__(self, server) -> None:
        self.process = subprocess.Popen(
            ["psql", "-X", "-At", "-h", "127.0.0.1", "-p", str(server.port), "-U", "postgres"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, "PGPASSWORD": server.password, "PGDATABASE": "postgres"},
        )
        self.pid = int(self.run("SELECT pg_backend_pid()"))

    def send(self, sql: str) -> None:
        """Send ``sql`` without waiting for its answer (a ``pg_advisory_lock`` that waits)."""
        self.process.stdin.write(sql.rstrip(";") + ";\n\\echo __done__\n")
        self.process.stdin.flush()

    def answer(self) -> str:
        lines = []
        while True:
            line = self.process.stdout.readline()
            if not line or line.strip() == "__done__":
                return "".join(lines).strip()
            lines.append(line)

    def run(self, sql: str) -> str:
        self.send(sql)
        return self.answer()

    def lock(self, key: str) -> None:
        self.run(f"SELECT pg_advisory_lock({lock_sql(key)})")

    def try_lock(self, key: str) -> bool:
        return self.run(f"SELECT pg_try_advisory_lock({lock_sql(key)})") == "t"

    def unlock(self, key: str) -> bool:
        return self.run(f"SELECT pg_advisory_unlock({lock_sql(key)})") == "t"

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


@pytest.fixture
def psql(postgres_server):
    sessions = []

    def open_session() -> Psql:
        sessions.append(Psql(postgres_server))
        return sessions[-1]

    yield open_session
    for session in sessions:
        session.close()


def held_by_foreign(recipe_store, key: str) -> bool:
    infos = recipe_store.holders_of(key)
    return bool(infos) and infos[0].fencing_token is None


def task_call(url: str, task_id: str, policy: str = "skip"):
    settings = Settings(backend_url=url, lease_ttl=10.0, on_duplicate=policy)
    return policies.claim(settings, backend_for_url(url), KEY, "billing.settle", task_id)


# --- the documented lock number ----------------------------------------------------------


@pytest.mark.parametrize("key", [KEY, "k", "invoice:7/ü€𝄞", "it's", "a" * 300])
def test_the_lock_number_is_the_sql_expression_the_docs_give(psql, key):
    assert int(psql().run(f"SELECT {lock_sql(key)}")) == lock_id(key)


def test_the_recipe_url_makes_a_store_that_speaks_it(recipe_store):
    assert isinstance(recipe_store, AdvisoryBackend)


# --- a foreign holder ---------------------------------------------------------------------


def test_a_psql_session_holding_the_lock_makes_a_task_call_skip_and_name_it(
    recipe_url, recipe_store, psql
):
    theirs = psql()
    theirs.lock(KEY)
    outcome = task_call(recipe_url, "task-1")
    assert isinstance(outcome, outcomes.Skipped)
    assert f"session advisory lock on {lock_id(KEY)} held by backend {theirs.pid}" in (
        outcome.holder
    )
    assert "application 'psql'" in outcome.holder
    with pytest.raises(LockHeld, match="session advisory lock"), ExclusiveLock(KEY, recipe_url):
        pytest.fail("the block ran beside psql's lock")
    assert theirs.unlock(KEY)  # ours never unlocked it


def test_a_foreign_session_is_named_by_its_pid_user_application_and_address(
    postgres_server, recipe_store
):
    with psycopg.connect(
        postgres_server.url, autocommit=True, application_name="nightly-report"
    ) as theirs:
        theirs.execute(f"SELECT pg_advisory_lock({lock_sql(KEY)})")
        [info] = recipe_store.holders_of(KEY)
        pid = theirs.info.backend_pid
    assert (info.owner, info.fencing_token) == (f"pg_backend:{pid}", None)
    assert info.holder == {
        "foreign": f"a PostgreSQL session advisory lock on {lock_id(KEY)} held by backend "
        f"{pid} (user postgres, application 'nightly-report', from 127.0.0.1)"
    }


def left_behind(store, key: str, pid: int) -> None:
    """A row of ours naming the session ``pid`` of another start: what a session of ours
    that held ``key`` and ended leaves until the next grant, its pid free for the next."""
    record = json.dumps({"task": "gone", "pg_backend": {"pid": pid, "started": 1.0}})
    store.connection.call(
        "leaving a row behind",
        lambda conn: conn.execute(
            f"INSERT INTO {store.connection.tables['leases']} VALUES "
            "(%s, 'gone', %s, 1, 1, clock_timestamp() + interval '1 hour', %s)",
            (key_id(key), encoded(key), record),
        ),
    )


def test_a_foreign_session_with_the_pid_a_row_of_ours_names_stays_foreign_and_untouched(
    recipe_store, psql
):
    theirs = psql()
    theirs.lock(KEY)
    left_behind(recipe_store, KEY, theirs.pid)
    [info] = recipe_store.holders_of(KEY)
    assert info.fencing_token is None
    assert (
        f"held by backend {theirs.pid} (user postgres, application 'psql'"
        in (info.holder["foreign"])
    )
    assert recipe_store.holders("exclusive:") == []
    assert recipe_store.force_release(KEY) == 0
    assert theirs.run("SELECT 1") == "1"  # its session lives on, never terminated
    assert theirs.unlock(KEY)


def test_a_waiting_lock_takes_the_key_as_soon_as_psql_unlocks(recipe_url, recipe_store, psql):
    theirs = psql()
    theirs.lock(KEY)
    unlocked_at = []

    def unlock_later() -> None:
        time.sleep(1.0)
        unlocked_at.append(time.time())
        theirs.unlock(KEY)

    threading.Thread(target=unlock_later).start()
    with ExclusiveLock(KEY, recipe_url, wait=20):
        taken_at = time.time()
    assert unlocked_at[0] <= taken_at < unlocked_at[0] + 0.5  # a poll, not a timeout


def test_a_foreign_session_that_ends_frees_the_key_for_our_waiters(recipe_url, recipe_store, psql):
    theirs = psql()
    theirs.lock(KEY)
    threading.Timer(0.5, theirs.close).start()  # psql exits: its session ends
    with ExclusiveLock(KEY, recipe_url, wait=20) as lease:
        assert lease.fencing_token > 0


# --- a waiter takes its turn in PostgreSQL's own queue -----------------------------------

#: How long each foreign re-locker holds the key before it unlocks and locks it again.
HOLD = 0.3


class Relockers:
    """Foreign clients taking one key back to back, each in a loop: ``pg_advisory_lock``,
    hold ``hold`` seconds, ``pg_advisory_unlock``, lock again at once. Two are psycopg
    sessions, one a ``psql`` session; each hold is noted as (client, start, end)."""

    def __init__(self, server, psql, key: str, hold: float = HOLD) -> None:
        self.key, self.hold, self.holds, self.stop = key, hold, [], threading.Event()
        self.connections = [
            psycopg.connect(server.url, autocommit=True, application_name="relocker")
            for _ in range(2)
        ]
        clients = [self._psycopg_client(conn) for conn in self.connections]
        clients.append(self._psql_client(psql()))
        self.threads = [
            threading.Thread(target=self._relock, args=(number, *client))
            for number, client in enumerate(clients)
        ]

    def _psycopg_client(self, conn: psycopg.Connection):
        lock, unlock = (
            f"SELECT pg_advisory_{verb}({lock_sql(self.key)})" for verb in ("lock", "unlock")
        )
        return lambda: conn.execute(lock), lambda: conn.execute(unlock)

    def _psql_client(self, session: Psql):
        return lambda: session.lock(self.key), lambda: session.unlock(self.key)

    def _relock(self, client: int, lock, unlock) -> None:
        while not self.stop.is_set():
            lock()
            start = time.time()
            time.sleep(self.hold)
            self.holds.append((client, start, time.time()))
            unlock()

    def __enter__(self) -> Relockers:
        for thread in self.threads:
            thread.start()
        # Cycling: one holds, the others wait in PostgreSQL's queue for it.
        assert wait_until(lambda: len(self.holds) >= len(self.threads), timeout=10)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)
        for conn in self.connections:
            conn.close()

    def served_in_turn(self, asked: float, granted: float) -> None:
        """Assert that a waiter that asked at ``asked`` and was granted at ``granted`` took
        its turn: no re-locker went twice meanwhile (each was queued ahead of it at most
        once), and it was granted as the one ahead of it let go, not a poll later."""
        went = [client for client, start, _ in self.holds if asked < start < granted]
        assert all(went.count(client) <= 1 for client in went), f"went first: {went}"
        let_go = max(end for _, _, end in self.holds if end <= granted)
        assert granted - let_go < self.hold, "granted a whole foreign hold after its turn came"


def test_a_waiting_lock_takes_its_turn_among_foreign_clients_relocking_back_to_back(
    postgres_server, recipe_url, psql
):
    with Relockers(postgres_server, psql, KEY) as relockers:
        asked = time.time()
        with ExclusiveLock(KEY, recipe_url, wait=9):
            granted = time.time()
            time.sleep(HOLD)
            released = time.time()
        relockers.served_in_turn(asked, granted)
    assert all(end <= granted or start >= released for _, start, end in relockers.holds)


def waiting_for(psql_session: Psql, key: str) -> int:
    """How many sessions wait in PostgreSQL's queue for ``key``'s lock."""
    return int(
        psql_session.run(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            f"AND ((classid::bigint << 32) | objid::bigint) = {lock_sql(key)}"
        )
    )


def test_a_waiting_lock_that_gives_up_leaves_postgresql_s_queue(recipe_url, recipe_store, psql):
    theirs = psql()
    theirs.lock(KEY)
    with pytest.raises(LockHeld), ExclusiveLock(KEY, recipe_url, wait=0.5):
        pytest.fail("the block ran beside psql's lock")
    assert wait_until(lambda: waiting_for(theirs, KEY) == 0, timeout=advisory.KEEP_TURN + 2)
    assert theirs.unlock(KEY)
    assert psql().try_lock(KEY)  # nobody of ours was granted it meanwhile


WAITER = textwrap.dedent(
    """
    import sys, time
    from celery_exclusive.backends import backend_for_url
    backend_for_url(sys.argv[1]).wait(sys.argv[2], 60, "a waiter")
    print("its turn came", flush=True)
    time.sleep(3600)
    """
)


@pytest.fixture
def waiter_in_the_queue(recipe_url, recipe_store, psql):
    """A process of its own waiting for KEY (held by the psql session it yields) in
    PostgreSQL's queue."""
    theirs = psql()
    theirs.lock(KEY)
    process = subprocess.Popen(
        [sys.executable, "-c", WAITER, recipe_url, KEY], stdout=subprocess.PIPE, text=True
    )
    assert wait_until(lambda: waiting_for(theirs, KEY) == 1, timeout=10)
    yield process, theirs
    process.send_signal(signal.SIGCONT)
    process.kill()
    process.wait(10)


def test_a_waiter_that_died_leaves_postgresql_s_queue(waiter_in_the_queue):
    process, theirs = waiter_in_the_queue
    process.kill()
    killed = time.monotonic()
    assert wait_until(lambda: waiting_for(theirs, KEY) == 0, timeout=10)
    assert time.monotonic() - killed < 3  # checked every second, while psql still holds


def test_a_lock_granted_to_a_waiter_that_stopped_is_let_go_by_the_server(waiter_in_the_queue, psql):
    process, theirs = waiter_in_the_queue
    assert theirs.unlock(KEY)
    assert process.stdout.readline() == "its turn came\n"
    process.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    other = psql()
    assert other.try_lock(KEY) is False  # granted to the waiter, which never takes it
    assert wait_until(lambda: other.try_lock(KEY), timeout=10)
    assert time.monotonic() - stopped < advisory.TURN_IDLE_MS / 1000 + 1.5


# --- our holder ---------------------------------------------------------------------------


def test_our_holder_makes_psql_try_lock_fail_and_lock_wait_for_our_release(recipe_url, psql):
    theirs = psql()
    with ExclusiveLock(KEY, recipe_url) as lease:
        assert theirs.try_lock(KEY) is False
        theirs.send(f"SELECT pg_advisory_lock({lock_sql(KEY)})")
        time.sleep(1.0)
        released_at = time.time()
    theirs.answer()  # pg_advisory_lock returned: psql holds it now
    taken_at = time.time()
    assert released_at <= taken_at < released_at + 1.0
    assert lease.released
    assert theirs.unlock(KEY)


HOLDER = textwrap.dedent(
    """
    import sys, time
    from celery_exclusive import ExclusiveLock
    with ExclusiveLock(sys.argv[2], sys.argv[1], ttl=float(sys.argv[3])) as lease:
        print("held", lease.fencing_token, flush=True)
        time.sleep(3600)
    """
)


@pytest.fixture
def holder_process(recipe_url):
    """A process of its own that takes KEY with a lock (heartbeat and all) and keeps it."""
    processes = []

    def start(ttl: float) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, recipe_url, KEY, str(ttl)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=os.getcwd(),
        )
        processes.append(process)
        assert process.stdout.readline().startswith("held")
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
        process.wait(10)


def test_a_killed_holder_frees_the_lock_at_once(recipe_store, psql, holder_process):
    process = holder_process(ttl=60)
    theirs = psql()
    assert theirs.try_lock(KEY) is False
    process.kill()
    started = time.monotonic()
    assert wait_until(lambda: theirs.try_lock(KEY), timeout=10)
    assert time.monotonic() - started < 5  # its session ended with its socket, not its ttl


def test_a_hung_holder_loses_the_lock_by_the_servers_clock_after_its_ttl(
    recipe_store, psql, holder_process
):
    process = holder_process(ttl=2)
    theirs = psql()
    time.sleep(3)  # renewals keep it past its ttl while the holder runs
    assert theirs.try_lock(KEY) is False
    process.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    # psql gets it once the server ends the stopped holder's session.
    assert wait_until(lambda: theirs.try_lock(KEY), timeout=15)
    waited = time.monotonic() - stopped
    assert 0.5 < waited < 4.0  # its last renewal + 2 s of idle_session_timeout
    assert recipe_store.holders_of(KEY)[0].fencing_token is None  # psql's now


def test_a_session_ended_under_a_holder_is_reported_lost_at_its_next_renewal(recipe_store, psql):
    lease = recipe_store.try_acquire(KEY, owner(), 10)
    session = recipe_store._held[lease.owner]
    theirs = psql()
    assert theirs.run(f"SELECT pg_terminate_backend({session.pid}, 5000)") == "t"
    assert recipe_store.renew([lease]) == {lease}
    assert theirs.try_lock(KEY)
    assert recipe_store.release(lease) is False  # it was gone already; psql's lock stays
    assert held_by_foreign(recipe_store, KEY)


def test_a_lease_released_from_another_process_ends_its_session(recipe_url, recipe_store, psql):
    """What a worker's main process does for a child that died: it holds no session of
    the lease, only its owner token."""
    lease = recipe_store.try_acquire(KEY, owner(), 60)
    other = AdvisoryBackend(recipe_url)  # another process's store client
    assert other.release(lease) is True
    assert psql().try_lock(KEY)
    assert recipe_store.renew([lease]) == {lease}
    other.close()


# --- never touching a foreign holder ------------------------------------------------------


def test_force_release_ends_our_sessions_and_leaves_a_foreign_one(recipe_store, psql):
    ours = recipe_store.try_acquire(KEY, owner(), 10)
    assert recipe_store.force_release(KEY) == 1
    assert recipe_store.renew([ours]) == {ours}
    theirs = psql()
    theirs.lock(KEY)
    assert recipe_store.force_release(KEY) == 0
    assert theirs.run("SELECT 1") == "1"  # its session lives on
    assert held_by_foreign(recipe_store, KEY)
    assert theirs.unlock(KEY)


def test_the_store_s_own_transactions_never_wait_on_a_key_s_advisory_lock(
    postgres_server, recipe_store
):
    """A recipe holder's session lock leaves the store's own per-key transaction lock
    free: the store without the recipe, on the same database and key, grants at once."""
    assert recipe_store.try_acquire(KEY, owner(), 10) is not None
    plain = _load(f"{postgres_server.url}?schema=p_{uuid.uuid4().hex[:8]}")
    granted = []
    grant = threading.Thread(target=lambda: granted.append(plain.try_acquire(KEY, owner(), 10)))
    grant.start()
    grant.join(5)
    assert granted and granted[0] is not None, "the store's grant waited on the session lock"
    plain.close()


def test_leases_with_and_without_the_recipe_on_one_schema_exclude_each_other(
    postgres_server, recipe_url
):
    """Moving a URL to the recipe: workers of both kinds meet in one schema meanwhile."""
    recipe = _load(recipe_url)
    plain = _load(recipe_url.replace("&recipe=advisory", ""))
    theirs = plain.try_acquire(KEY, owner(), 10)
    assert recipe.try_acquire(KEY, owner(), 10) is None
    assert [info.owner for info in recipe.holders_of(KEY)] == [theirs.owner]
    plain.release(theirs)
    ours = recipe.try_acquire(KEY, owner(), 10)
    assert ours is not None and ours.fencing_token > theirs.fencing_token
    assert plain.try_acquire(KEY, owner(), 10) is None
    recipe.close()
    plain.close()


# --- what the recipe refuses --------------------------------------------------------------


def test_a_limit_is_refused_naming_the_fix(recipe_url, recipe_store):
    refused = pytest.raises(ConfigurationError, match="does not offer limits.*exclusive_limit > 1")
    with refused, ExclusiveLock(KEY, recipe_url, limit=2):
        pytest.fail("the block ran with a limit the recipe cannot keep")


def test_pgbouncer_transaction_pooling_is_refused_saying_why(postgres_server):
    with pytest.raises(ConfigurationError, match="session advisory lock lives as long as"):
        _load(f"{postgres_server.url}?recipe=advisory&pgbouncer=1")


def test_an_unknown_recipe_is_refused_naming_the_one_there_is(postgres_server):
    with pytest.raises(ConfigurationError, match="its recipes: advisory"):
        _load(f"{postgres_server.url}?recipe=session")


def test_a_server_without_idle_session_timeout_is_refused(recipe_store, monkeypatch):
    monkeypatch.setattr(advisory, "MIN_SERVER_VERSION", 990000)
    with pytest.raises(ConfigurationError, match="PostgreSQL 14 or later"):
        recipe_store.try_acquire(KEY, owner(), 10)


# --- both kinds at once -------------------------------------------------------------------


def test_tasks_and_psql_sessions_on_one_key_never_overlap(recipe_url, psql):
    """Threads of ours (the lease a task takes) and psql sessions contend for one key;
    each notes when it held it."""
    spans, lock = [], ExclusiveLock(KEY, recipe_url, wait=60)

    def ours() -> None:
        with lock:
            start = time.time()
            time.sleep(0.1)
            spans.append((start, time.time()))

    def theirs() -> None:
        session = psql()
        for _ in range(2):
            session.lock(KEY)
            start = time.time()
            time.sleep(0.1)
            spans.append((start, time.time()))
            session.unlock(KEY)

    threads = [threading.Thread(target=f) for f in (ours, theirs) * 4]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    spans.sort()
    assert len(spans) == 12
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))


def test_a_psql_lock_on_another_key_does_not_hold_ours(recipe_url, psql):
    psql().lock("exclusive:invoice:8")
    with ExclusiveLock(KEY, recipe_url) as lease:
        assert lease.fencing_token > 0


def test_our_session_is_ended_if_its_grant_breaks_half_way(recipe_store, psql, monkeypatch):
    """A grant that fails after the lock was taken leaves no lock behind: the session
    that may hold it is closed."""

    def fail(*args, **kwargs):
        raise psycopg.OperationalError("the link broke")

    original = advisory.AdvisoryBackend._grant

    def grant_then_fail(self, session, *args):
        original(self, session, *args)
        fail()

    monkeypatch.setattr(advisory.AdvisoryBackend, "_grant", grant_then_fail)
    with pytest.raises(Exception, match="the link broke"):
        recipe_store.try_acquire(KEY, owner(), 10)
    theirs = psql()
    assert wait_until(lambda: theirs.try_lock(KEY), timeout=5)
