"""The Redis store while a Redis Cluster is resharded under held leases.

Operators move hash slots between the masters of a live cluster. A slot moves in three
steps: the target marks it IMPORTING and the source MIGRATING; the source MIGRATEs the
slot's entries over, a few at a time; every master is told the slot's new NODE. In
between, an entry is on one master or the other, and Redis answers ASK (try the other
master) or TRYAGAIN (some entries of a multi-key command are on each side) to the
scripts of a lease, whose entries all share the slot.

What a lease promises does not change meanwhile: a lease held across a move is
renewed, released and fenced on its new master; while the slot is half-moved an
operation does what it should or reports the store unavailable (a retryable outage)
and never grants a key another owner holds.

The cluster is one of this module's own: moving slots would disturb the session's.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Callable

import pytest
from redis.crc import key_slot
from redis.exceptions import ResponseError

from celery_exclusive.backends.base import Lease
from celery_exclusive.backends.redis import RedisBackend, layout
from celery_exclusive.errors import BackendUnavailable
from tests.support.servers import RedisClusterServers


class Resharding:
    """Moves hash slots between the masters of a cluster, as an operator does: CLUSTER
    SETSLOT IMPORTING / MIGRATING, MIGRATE of the slot's entries, SETSLOT NODE on every
    master (the target first, as ``redis-cli --cluster reshard`` does)."""

    def __init__(self, servers: RedisClusterServers) -> None:
        self.servers = servers
        self.clients = [node.client() for node in servers.nodes]
        self.ids = [c.execute_command("CLUSTER", "MYID").decode() for c in self.clients]

    def master_of(self, slot: int) -> int:
        """The index of the master serving ``slot``, by that master's own account."""
        for index, client in enumerate(self.clients):
            port = self.servers.nodes[index].port
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end and int(master[1]) == port:
                    return index
        raise AssertionError(f"no master claims slot {slot}")

    def slots_of(self, index: int) -> set[int]:
        """The slots the master ``index`` serves, by its own account."""
        port = self.servers.nodes[index].port
        return {
            slot
            for start, end, master, *_ in self.clients[index].execute_command("CLUSTER", "SLOTS")
            if int(master[1]) == port
            for slot in range(start, end + 1)
        }

    def other_master(self, slot: int) -> int:
        return (self.master_of(slot) + 1) % len(self.clients)

    def begin(self, slot: int, to: int) -> int:
        """Mark ``slot`` as moving to the master ``to``; returns the source's index."""
        source = self.master_of(slot)
        self.clients[to].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.ids[source])
        self.clients[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.ids[to])
        return source

    def migrate(self, slot: int, source: int, to: int, names=None) -> None:
        """MIGRATE ``names`` (every entry of the slot left on the source if None)."""
        client = self.clients[source]
        while True:
            batch = names or client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
            if not batch:
                return
            port = self.servers.nodes[to].port
            client.execute_command("MIGRATE", "127.0.0.1", port, "", 0, 5000, "KEYS", *batch)
            if names:
                return

    def finish(self, slot: int, source: int, to: int) -> None:
        """Move what is left of ``slot`` and hand it to ``to`` on every master."""
        self.migrate(slot, source, to)
        others = [i for i in range(len(self.clients)) if i not in (source, to)]
        for index in (to, source, *others):
            self.clients[index].execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.ids[to])

    @contextlib.contextmanager
    def half_moved(self, slot: int, to: int, names=()) -> Iterator[int]:
        """``slot`` marked as moving to ``to`` with only ``names`` moved yet; the move
        is finished on leaving, whatever happened inside. Yields the source's index."""
        source = self.begin(slot, to)
        try:
            if names:
                self.migrate(slot, source, to, list(names))
            yield source
        finally:
            self.finish(slot, source, to)

    def move(self, slot: int, to: int) -> None:
        with self.half_moved(slot, to):
            pass

    def entries_on(self, index: int, slot: int) -> set[str]:
        names = self.clients[index].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        return {name.decode() for name in names}


@pytest.fixture(scope="module")
def servers():
    servers = RedisClusterServers()
    try:
        servers.start()
        yield servers
    finally:
        servers.cleanup()


@pytest.fixture(scope="module")
def resharding(servers):
    return Resharding(servers)


@pytest.fixture
def backend(servers):
    backend = RedisBackend(servers.url)
    yield backend
    backend.close()


@pytest.fixture
def other_backend(servers):
    """A second process's store: a client with a view of the slots of its own."""
    backend = RedisBackend(servers.url)
    yield backend
    backend.close()


def owner() -> str:
    return uuid.uuid4().hex


def slot_of(key: str) -> int:
    return key_slot(layout.lease(key).encode())


def key_in(slots, prefix: str = "acct") -> str:
    """A fresh key whose entries live in one of ``slots``."""
    slots = set(slots)
    while True:
        key = f"{prefix}:{uuid.uuid4().hex[:12]}"
        if slot_of(key) in slots:
            return key


def outcome(call: Callable, *args):
    """What ``call`` returned, or the BackendUnavailable it raised; any other error
    (a raw redis-py exception, a ConfigurationError) propagates and fails the test."""
    try:
        return call(*args)
    except BackendUnavailable as exc:
        return exc


def poll(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not so within {timeout} s"
        time.sleep(0.002)


def progress(log: list, count: int) -> None:
    """Poll until other threads append ``count`` more entries to ``log``."""
    wanted = len(log) + count
    poll(lambda: len(log) >= wanted)


def pttl_on(resharding: Resharding, index: int, name: str) -> int:
    return resharding.clients[index].pttl(name)


# --- a lease held across a completed move ----------------------------------------------


def test_a_lease_whose_slot_moved_is_renewed_on_its_new_master_and_not_reported_lost(
    backend, resharding
):
    """The client's map of slots is stale after the move: the renewal must follow the
    MOVED reply to the new master rather than report a lease it cannot find."""
    key = key_in(range(16384))
    lease = backend.try_acquire(key, owner(), 5)
    to = resharding.other_master(slot_of(key))
    resharding.move(slot_of(key), to)
    assert layout.lease(key) in resharding.entries_on(to, slot_of(key))
    assert backend.renew([Lease(key, lease.owner, lease.fencing_token, 60)]) == set()
    assert pttl_on(resharding, to, layout.lease(key)) > 30_000


def test_a_renewal_batch_with_one_moved_slot_renews_every_lease_on_every_master(
    backend, resharding
):
    """Renewal sends one pipeline per master; the one script whose slot moved must be
    sent again to the new master while the others' answers are kept."""
    keys = [key_in(range(16384)) for _ in range(9)]
    leases = [backend.try_acquire(key, owner(), 5) for key in keys]
    moved = keys[0]
    to = resharding.other_master(slot_of(moved))
    resharding.move(slot_of(moved), to)
    longer = [Lease(lease.key, lease.owner, lease.fencing_token, 60) for lease in leases]
    assert backend.renew(longer) == set()
    for key in keys:
        master = resharding.master_of(slot_of(key))
        assert pttl_on(resharding, master, layout.lease(key)) > 30_000, key


def test_a_lease_whose_slot_moved_is_released_on_its_new_master(backend, resharding):
    key = key_in(range(16384))
    lease = backend.try_acquire(key, owner(), 30)
    to = resharding.other_master(slot_of(key))
    resharding.move(slot_of(key), to)
    assert backend.release(lease) is True
    assert layout.lease(key) not in resharding.entries_on(to, slot_of(key))


def test_the_next_grant_after_a_move_has_a_greater_fencing_token(
    backend, other_backend, resharding
):
    """The fence moves with the lease (one slot). It is set far ahead of every clock
    here, so only the moved fence, not the new master's clock, gives a token that
    passes a storage which saw the old holder's."""
    key = key_in(range(16384))
    lease = backend.try_acquire(key, owner(), 30)
    to = resharding.other_master(slot_of(key))
    resharding.clients[resharding.master_of(slot_of(key))].set(
        layout.fence(key), str(lease.fencing_token + 10**12), keepttl=True
    )
    resharding.move(slot_of(key), to)
    assert other_backend.try_acquire(key, owner(), 30) is None
    backend.release(lease)
    after = other_backend.try_acquire(key, owner(), 30)
    assert after is not None and after.fencing_token > lease.fencing_token + 10**12


def test_a_semaphore_whose_slot_moved_keeps_its_holders_and_its_limit(
    backend, other_backend, resharding
):
    key = key_in(range(16384))
    held = [backend.try_acquire(key, owner(), 30, limit=2) for _ in range(2)]
    resharding.move(slot_of(key), resharding.other_master(slot_of(key)))
    assert other_backend.try_acquire(key, owner(), 30, limit=2) is None
    assert backend.renew(held) == set()
    assert {info.owner for info in other_backend.holders_of(key)} == {h.owner for h in held}
    assert backend.release(held[0]) is True
    assert other_backend.try_acquire(key, owner(), 30, limit=2) is not None


def test_leases_survive_redis_cli_cluster_reshard(backend, other_backend, resharding, servers):
    """The operator's own tool: ``redis-cli --cluster reshard`` moves the lowest slots
    of the source, so the leases are held on keys in those."""
    source, to, count = 0, 1, 8
    moving = sorted(resharding.slots_of(source))[:count]
    leases = [backend.try_acquire(key_in(moving), owner(), 5) for _ in range(4)]
    subprocess.run(
        [shutil.which("redis-cli") or "redis-cli", "--cluster", "reshard"]
        + [f"127.0.0.1:{servers.nodes[source].port}"]
        + ["--cluster-from", resharding.ids[source], "--cluster-to", resharding.ids[to]]
        + ["--cluster-slots", str(count), "--cluster-yes"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert {resharding.master_of(slot_of(lease.key)) for lease in leases} == {to}
    longer = [Lease(lease.key, lease.owner, lease.fencing_token, 60) for lease in leases]
    assert backend.renew(longer) == set()
    assert all(other_backend.try_acquire(lease.key, owner(), 5) is None for lease in leases)
    assert all(backend.release(lease) for lease in leases)
    after = [other_backend.try_acquire(lease.key, owner(), 5) for lease in leases]
    assert all(a.fencing_token > b.fencing_token for a, b in zip(after, leases))


def test_a_waiter_blocked_on_a_key_whose_slot_moves_is_woken_by_the_release_on_its_new_master(
    backend, other_backend, resharding
):
    """The old master turns the blocked BLPOP away once the slot is gone (MOVED); the
    waiter must block again on the new master, where the release wakes it, rather than
    sleep out its whole block."""
    key = key_in(range(16384))
    lease = backend.try_acquire(key, owner(), 30)
    source = resharding.master_of(slot_of(key))
    woken: list[float] = []

    def waiter() -> None:
        began = time.monotonic()
        other_backend.wait(key, 4.0)
        woken.append(time.monotonic() - began)

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    poll(lambda: b"cmd=blpop" in resharding.clients[source].execute_command("CLIENT", "LIST"))
    resharding.move(slot_of(key), resharding.other_master(slot_of(key)))
    assert backend.release(lease) is True
    thread.join(10)
    assert woken and woken[0] < 3.0, woken


# --- while the slot is half-moved -------------------------------------------------------

#: How far the move of the slot has gone: which entries of the held key are moved.
STAGES = {
    "marked, nothing moved": lambda key: [],
    "lease moved, fence not": lambda key: [layout.lease(key)],
    "fence moved, lease not": lambda key: [layout.fence(key)],
    "every entry moved, slot not handed over": lambda key: [
        layout.lease(key),
        layout.fence(key),
        layout.holders(key),
    ],
}
LIMITS = [1, 2]


@pytest.fixture(params=sorted(STAGES))
def stage(request):
    return STAGES[request.param]


@pytest.mark.parametrize("limit", LIMITS)
def test_a_held_key_is_never_granted_to_another_owner_while_its_slot_is_half_moved(
    backend, other_backend, resharding, stage, limit
):
    key = key_in(range(16384))
    held = [backend.try_acquire(key, owner(), 30, limit=limit) for _ in range(limit)]
    to = resharding.other_master(slot_of(key))
    with resharding.half_moved(slot_of(key), to, stage(key)):
        for _ in range(3):
            got = outcome(other_backend.try_acquire, key, owner(), 30, limit)
            assert got is None or isinstance(got, BackendUnavailable), got
    assert other_backend.try_acquire(key, owner(), 30, limit) is None
    assert backend.renew(held) == set()


@pytest.mark.parametrize("limit", LIMITS)
def test_a_renewal_while_its_slot_is_half_moved_renews_or_reports_the_store_unavailable(
    backend, resharding, stage, limit
):
    key = key_in(range(16384))
    held = backend.try_acquire(key, owner(), 30, limit=limit)
    to = resharding.other_master(slot_of(key))
    with resharding.half_moved(slot_of(key), to, stage(key)):
        got = outcome(backend.renew, [held])
        assert got == set() or isinstance(got, BackendUnavailable), got
    assert backend.renew([held]) == set()


@pytest.mark.parametrize("limit", LIMITS)
def test_a_release_while_its_slot_is_half_moved_frees_the_key_or_reports_the_store_unavailable(
    backend, other_backend, resharding, stage, limit
):
    """A release that reported the store unavailable is retried after the move (as a
    holder does); either way the key is then free, and its next token is greater."""
    key = key_in(range(16384))
    held = backend.try_acquire(key, owner(), 30, limit=limit)
    to = resharding.other_master(slot_of(key))
    with resharding.half_moved(slot_of(key), to, stage(key)):
        released = outcome(backend.release, held)
        assert released is True or isinstance(released, BackendUnavailable), released
    if released is not True:
        assert backend.release(held) is True
    after = other_backend.try_acquire(key, owner(), 30, limit)
    assert after is not None and after.fencing_token > held.fencing_token


@pytest.mark.parametrize("limit", LIMITS)
def test_a_grant_of_a_free_key_while_its_slot_is_half_moved_holds_after_the_move(
    backend, other_backend, resharding, stage, limit
):
    """A grant made mid-move must be the one the store keeps: after the move, the
    grantee renews it and the store lists it as the key's one holder."""
    key = key_in(range(16384))
    before = backend.try_acquire(key, owner(), 30, limit=limit)  # leaves a fence behind
    backend.release(before)
    to = resharding.other_master(slot_of(key))
    with resharding.half_moved(slot_of(key), to, stage(key)):
        got = outcome(backend.try_acquire, key, owner(), 30, limit)
        assert isinstance(got, (Lease, BackendUnavailable)), got
    if isinstance(got, Lease):
        assert got.fencing_token > before.fencing_token
        assert backend.renew([got]) == set()
        assert {info.owner for info in other_backend.holders_of(key)} == {got.owner}


def test_a_release_mid_move_frees_the_key_and_wakes_the_first_in_line_on_the_keys_list(
    backend, resharding
):
    """A semaphore with a waiter first in line, one blocking outside it, and a wake-up
    nobody took yet: every entry the release declares exists, so its script runs on
    the source mid-move. The first in line's own list exists nowhere, and the source
    refuses an entry it does not have; the release must stand, and wake the first in
    line on the key's list, which that waiter blocks on too."""
    key = key_in(range(16384))
    held = backend.try_acquire(key, owner(), 30, limit=2)
    backend.try_acquire(key, owner(), 30, limit=2)
    line = f'[{{"id": "{owner()}", "until": {time.time() + 60}, "priority": 0}}]'
    assert backend.swap_mark(key, "line", None, line, 60)
    source = resharding.clients[resharding.master_of(slot_of(key))]
    source.set(layout.waiting(key), 1, px=60_000)
    source.rpush(layout.signal(key), 1)
    to = resharding.other_master(slot_of(key))
    with resharding.half_moved(slot_of(key), to):
        assert backend.release(held) is True
    assert held.owner not in {info.owner for info in backend.holders_of(key)}
    assert resharding.clients[to].llen(layout.signal(key)) == 2


def test_a_script_refused_an_entry_of_its_moving_slot_reports_the_store_unavailable(
    backend, servers, resharding
):
    """Mid-move, a node refuses a script an entry of the slot it does not have ("non
    local key"); after the move the same script runs: an outage, not a wrong setting."""
    key = key_in(range(16384))
    backend.try_acquire(key, owner(), 30)
    touch = "return redis.call('RPUSH', KEYS[1] .. ':elsewhere', 1)"
    moving = resharding.half_moved(slot_of(key), resharding.other_master(slot_of(key)))
    with moving, pytest.raises(ResponseError, match="non local key") as refused:
        backend.connection.client.eval(touch, 1, layout.lease(key))
    error = backend.connection.translate(refused.value, f"releasing {key!r}", key)
    assert isinstance(error, BackendUnavailable)
    assert backend.connection.client.eval(touch, 1, layout.lease(key)) == 1


# --- a workload while slots move back and forth -----------------------------------------


def test_a_workload_while_slots_move_back_and_forth_never_has_two_holders_of_one_key(
    servers, resharding
):
    """Threads acquire, work (renewing once, as the heartbeat does), and release keys
    of two slots that keep moving between two masters. Each run is logged from the
    grant's return to the start of the release that freed it: a span inside the true
    holding, so two overlapping spans of one key are two holders at once."""
    first = key_in(range(16384))
    slots = [slot_of(first)]
    slots.append(slot_of(key_in(resharding.slots_of(0) - set(slots))))
    home = [resharding.master_of(slot) for slot in slots]
    keys = [key_in([slot]) for slot in slots for _ in range(3)]
    backends = [RedisBackend(servers.url) for _ in range(2)]
    ledger: list[dict] = []
    errors: list[BaseException] = []
    losses: list[Lease] = []
    attempts: list[str] = []
    done = threading.Event()

    def work(backend: RedisBackend, seed: int) -> None:
        rng = random.Random(seed)
        while not done.is_set():
            key = rng.choice(keys)
            attempts.append(key)
            try:
                lease = backend.try_acquire(key, owner(), 10)
            except BackendUnavailable as exc:
                errors.append(exc)
                continue
            except Exception as exc:
                errors.append(exc)
                return
            if lease is None:
                continue
            start = time.monotonic()
            time.sleep(0.002)  # the body
            try:
                losses.extend(backend.renew([lease]))
            except BackendUnavailable as exc:
                errors.append(exc)
            except Exception as exc:
                errors.append(exc)
                return
            end = None
            for _ in range(100):
                began = time.monotonic()
                try:
                    freed = backend.release(lease)
                except BackendUnavailable as exc:
                    errors.append(exc)
                    end = began if end is None else end
                    continue
                except Exception as exc:
                    errors.append(exc)
                    return
                if freed:
                    end = began
                elif end is None:
                    losses.append(lease)
                    end = began
                break
            ledger.append({"key": key, "token": lease.fencing_token, "start": start, "end": end})

    threads = [
        threading.Thread(target=work, args=(backends[i % 2], i), daemon=True) for i in range(4)
    ]
    for thread in threads:
        thread.start()
    moves = 0
    try:
        for round_ in range(6):
            for index, slot in enumerate(slots):
                to = (home[index] + 1) % 3 if round_ % 2 == 0 else home[index]
                with resharding.half_moved(slot, to) as source:
                    for name in sorted(resharding.entries_on(source, slot)):
                        resharding.migrate(slot, source, to, [name])
                        progress(attempts, 4)  # the workers meet the half-moved slot
                moves += 1
                progress(ledger, 2)  # and the moved one
    finally:
        done.set()
        for thread in threads:
            thread.join(30)
        for backend in backends:
            backend.close()

    assert moves == 12
    unexpected = [e for e in errors if not isinstance(e, BackendUnavailable)]
    assert unexpected == [], unexpected
    assert errors, "the workers never met a half-moved slot"
    assert losses == []
    assert {entry["key"] for entry in ledger} == set(keys), "some key was never granted"
    by_key: dict[str, list[dict]] = {}
    for entry in sorted(ledger, key=lambda e: e["start"]):
        by_key.setdefault(entry["key"], []).append(entry)
    for runs in by_key.values():
        for earlier, later in zip(runs, runs[1:]):
            assert later["start"] >= earlier["end"], (earlier, later)
            assert later["token"] > earlier["token"], (earlier, later)
