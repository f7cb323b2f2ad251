"""The library's own layout on Consul: leases are KV locks held by one session per
process, in a folder per key (``kv.py``).

A limit-1 lease is the key's ``lock`` entry, locked in one transaction guarded by the
key's line; its fencing token is the ModifyIndex the transaction wrote (Consul's raft
index), which keeps increasing when a key is deleted and created again, so tokens
strictly increase across grants. Such a lease is proved by its token alone
(``check-index``): every change of a key's session writes a new ModifyIndex
(``kvsLockTxn``/``kvsUnlockTxn``/``deleteSessionTxn``), so no other grant can carry
it. A limit > 1 lease follows Consul's semaphore recipe. Releases delete what they held.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from ...errors import ConfigurationError
from ..base import NO_END, Backend, Capabilities, End, LayoutVersion, Lease, LeaseInfo, MarkRead
from ..limits import check_limit
from ..line import LINE, first_in_line
from .connection import CAS_ATTEMPTS, MAX_TXN_OPS, ConsulConnection, TxnConflict
from .http import Ambiguous
from .kv import LOCK, SEM, Entry, Layout, line_guard, mark_value, op

#: A blocking query waits at most this long, so with Consul's jitter (up to wait/16)
#: it answers well inside the request timeout.
MAX_BLOCK = 3.0


class ConsulBackend(Backend):
    """Leases as Consul locks: see the module's docstring."""

    capabilities = Capabilities(limits=True, records=True, marks=True)
    layout_version = LayoutVersion("consul", 1)
    connection_class = ConsulConnection
    recipes = {
        "api": "celery_exclusive.backends.consul.recipes:ApiRecipe",
        "consul-lock": "celery_exclusive.backends.consul.recipes:ConsulLockRecipe",
        "acquire": "celery_exclusive.backends.consul.recipes:AcquireRecipe",
    }
    connection: ConsulConnection

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.layout = Layout(self.connection.settings.root)

    # -- acquire ---------------------------------------------------------------------------

    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
        read: Optional[MarkRead] = None,  # read by the caller, after the grant
    ) -> Optional[Lease]:
        record = {"owner": owner, "limit": limit, "holder": dict(holder or {})}
        connection = self.connection

        def lock(session_id: str) -> Optional[int]:
            return self._lock(key, owner, record, session_id, claimant)

        def attempt() -> Optional[Lease]:
            if limit > 1:
                return self._acquire_slot(key, owner, ttl, record, claimant)
            return connection.lock(key, owner, ttl, self.layout.lock(key), lock)

        return connection.acquire(f"acquiring {key!r}", attempt)

    def _lock(
        self, key: str, owner: str, record: dict, session_id: str, claimant: Optional[str]
    ) -> Optional[int]:
        """Lock ``K/lock`` in a transaction guarded by the key's line and by the absence
        of a semaphore on it; the grant's fencing token, or None if the key is held, in
        lock delay, or others are in line first.

        The first attempt bets on there being no line (``check-not-exists``) and no
        entry left at ``K/lock``, so the common acquire is one round trip. Only when a
        guard failed is what it guarded read, and the grant retried guarded by what was
        read. An unlocked entry at ``K/lock`` is taken over only if this library wrote
        it (a ``behavior=release`` session's leftover); another client's is refused.
        """
        connection = self.connection
        lock, sem, line = self.layout.lock(key), self.layout.sem(key), self.layout.mark(key, LINE)
        guard: Optional[dict] = op("check-not-exists", line)
        leftover: dict = op("check-not-exists", lock)
        for _ in range(CAS_ATTEMPTS):
            grant = op("lock", lock, record, session_id)
            try:
                entries = connection.txn([guard, op("check-not-exists", sem), leftover, grant])
            except TxnConflict as failed:
                connection.check_session(failed, session_id)
                if 3 in failed.failed:
                    return None  # held by another session, or in its lock delay
                if 2 in failed.failed:
                    leftover = self._leftover_guard(key, lock)
                elif 1 in failed.failed:
                    self._clear_stale_semaphore(key, 1)
                else:
                    now = connection.store_time()
                    guard = line_guard(line, connection.get(line), claimant, 1, now)
                    if guard is None:
                        return None  # others are in line first
                continue
            except Ambiguous as lost:
                return connection.settle_acquire(lock, owner, session_id, lost)
            # The grant's own result is the last for its path (a guard's comes first).
            return [e.modify_index for e in entries if e.key == lock][-1]
        return None  # the line kept changing under us: treat it as not our turn yet

    def _leftover_guard(self, key: str, path: str) -> dict[str, Any]:
        """The guard that lets a lock take over the unlocked entry found at ``path``:
        ``check-index`` on it if this library wrote it, ``check-not-exists`` if it is
        gone (or locked again: the lock then fails as held). An entry another client
        wrote there is refused with an error naming it: it is not ours to overwrite."""
        entry = self.connection.get(path)
        if entry is None or entry.session:
            return op("check-not-exists", path)
        if not entry.is_lease:
            raise ConfigurationError(
                f"the Consul entry {path!r}, where the lease of {key!r} lives, was written "
                f"by another client (flags {entry.flags:#x}, not a celery-exclusive "
                "record); celery-exclusive never overwrites an entry it did not write. "
                "Point that client at a key of its own, or share the key with it through "
                "Consul's own recipe (?recipe=api, consul-lock or acquire on the store URL)."
            )
        return op("check-index", path, index=entry.modify_index)

    def _clear_stale_semaphore(self, key: str, limit: int) -> None:
        """A mutex acquire found ``K/sem``: refuse if it has live holders with another
        limit, else delete it (and its dead contenders) so the mutex can be taken.
        Only entries this library wrote: another client's entry is never deleted."""
        entries = self.connection.read(self.layout.sem(key))
        slots = _Slots.of(self.layout, key, entries)
        if slots.live:
            check_limit(key, limit, [slots.limit])
        sem = entries.get(self.layout.sem(key))
        mine = [sem] if sem is not None and sem.is_semaphore else []
        try:
            self.connection.txns(
                [op("delete-cas", e.key, index=e.modify_index) for e in mine + slots.dead]
            )
        except TxnConflict:
            return  # changed meanwhile: the caller reads again

    def _acquire_slot(
        self, key: str, owner: str, ttl: float, record: dict, claimant: Optional[str]
    ) -> Optional[Lease]:
        """Consul's semaphore recipe: read the key's folder, then one transaction that
        locks our contender entry and CASes ``K/sem`` with the live holders plus us,
        guarded by the line as read and by the absence of a mutex holder."""
        connection = self.connection
        session_id, session_ttl = connection.session(ttl)
        limit = record["limit"]
        lock, sem, line = self.layout.lock(key), self.layout.sem(key), self.layout.mark(key, LINE)
        slot = self.layout.slot(key, owner)
        for _ in range(CAS_ATTEMPTS):
            entries = connection.read(lock, sem, line)
            mutex = entries.get(lock)
            if mutex is not None and mutex.session:
                check_limit(key, limit, [1])
            slots = _Slots.of(self.layout, key, entries)
            if slots.live:
                check_limit(key, limit, [slots.limit])
            if len(slots.live) >= limit:
                return None
            now = connection.store_time()
            guard = line_guard(line, entries.get(line), claimant, limit - len(slots.live), now)
            if guard is None:
                return None  # others are in line first
            mutex_guard = (
                op("check-not-exists", lock)
                if mutex is None
                else op("delete-cas", lock, index=mutex.modify_index)  # an unlocked leftover
            )
            holders = {"Limit": limit, "Holders": slots.live + [owner]}
            ops = [
                mutex_guard,
                guard,
                op("lock", slot, record, session_id),
                op("cas", sem, holders, index=slots.index),
            ]
            # Tidy the contender entries of holders found dead, while we are writing.
            room = MAX_TXN_OPS - len(ops)
            ops += [op("delete-cas", e.key, index=e.modify_index) for e in slots.dead[:room]]
            try:
                results = connection.txn(ops)
            except TxnConflict as failed:
                connection.check_session(failed, session_id)
                continue  # someone else changed the folder first: read again
            except Ambiguous as lost:
                # Our contender entry was written with K/sem, at one Raft index.
                token = connection.settle_acquire(slot, owner, session_id, lost)
                return Lease(key, owner, token, min(ttl, session_ttl), limit)
            token = next(e.modify_index for e in results if e.key == sem)
            return Lease(key, owner, token, min(ttl, session_ttl), limit)
        return None

    # -- renew, release ----------------------------------------------------------------------

    def _proof(self, lease: Lease, session_id: Optional[str]) -> dict[str, Any]:
        """The read-only operation that holds exactly when ``lease`` is still held."""
        if lease.limit == 1:
            return op("check-index", self.layout.lock(lease.key), index=lease.fencing_token)
        return op("check-session", self.layout.slot(lease.key, lease.owner), session=session_id)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        return self.connection.renew(leases, self._proof) if leases else set()

    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        if end.mark or end.write:
            return super().release(lease, end)
        release = self._release_mutex if lease.limit == 1 else self._release_slot
        return self.connection.call(f"releasing {lease.key!r}", release, lease)

    def _release_mutex(self, lease: Lease) -> bool:
        """Delete ``K/lock`` if it still carries this grant (``check-index`` on the
        fencing token): one transaction. The key is deleted, not just unlocked, so KV
        keeps nothing of a free key, and no lock delay applies. A lease of another
        process is read back first: the record must name its owner."""
        lock = self.layout.lock(lease.key)
        mine = self.connection.held_by_this_process(lease)
        if not mine and self.connection.granted(lock, lease) is None:
            return False
        ops = [op("check-index", lock, index=lease.fencing_token), op("delete", lock)]
        return self.connection.settle_release(lock, lease, ops)

    def _release_slot(self, lease: Lease) -> bool:
        """Delete our contender entry and take us out of ``K/sem`` (deleting it with
        the last holder), in one transaction guarded by what was read."""
        sem, slot = self.layout.sem(lease.key), self.layout.slot(lease.key, lease.owner)
        for _ in range(CAS_ATTEMPTS):
            entries = self.connection.read(sem)
            mine = entries.get(slot)
            if mine is None or mine.record().get("owner") != lease.owner:
                return False
            slots = _Slots.of(self.layout, lease.key, entries)
            rest = [holder for holder in slots.live if holder != lease.owner]
            ops = [op("check-index", slot, index=mine.modify_index), op("delete", slot)]
            if rest:
                value = {"Limit": slots.limit, "Holders": rest}
                ops.append(op("cas", sem, value, index=slots.index))
            elif slots.index:
                ops.append(op("delete-cas", sem, index=slots.index))
            room = MAX_TXN_OPS - len(ops)
            ops += [op("delete-cas", e.key, index=e.modify_index) for e in slots.dead[:room]]
            try:
                return self.connection.settle_release(slot, lease, ops, mine.modify_index, True)
            except TxnConflict:
                continue
        return False

    # -- wait ------------------------------------------------------------------------------

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        """Blocking queries on the key's folder (its keys only, not their values): every
        waiter wakes on a change and goes back to sleep unless a slot is free and it is
        first in line."""
        connection = self.connection
        lock, sem, line = self.layout.lock(key), self.layout.sem(key), self.layout.mark(key, LINE)

        def wait() -> None:
            deadline = time.monotonic() + timeout
            folder = self.layout.folder(key)
            index, _ = connection.list(folder, keys=True)
            while not self._free_for(key, connection.read(lock, sem, line), claimant):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                new, _ = connection.list(folder, index, min(remaining, MAX_BLOCK), keys=True)
                # Consul's blocking-query rules: an index that goes backwards must be reset.
                index = new if new >= index else 0

        connection.call(f"waiting on {key!r}", wait)

    def _free_for(self, key: str, entries: Mapping[str, Entry], claimant: Optional[str]) -> bool:
        """Whether ``claimant`` would find a free slot and be first in the line."""
        mutex = entries.get(self.layout.lock(key))
        if mutex is not None and mutex.session:
            return False
        slots = _Slots.of(self.layout, key, entries)
        if slots.live and len(slots.live) >= slots.limit:
            return False
        now = self.connection.store_time()
        return first_in_line(
            mark_value(entries.get(self.layout.mark(key, LINE)), now), claimant, now
        )

    # -- the operators' view ---------------------------------------------------------------

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        def read() -> list[LeaseInfo]:
            _, entries = self.connection.list(self.layout.prefix(prefix))
            return self._holders({entry.key: entry for entry in entries}, prefix)

        return self.connection.call("listing holders", read)

    def holders_of(self, key: str) -> list[LeaseInfo]:
        def read() -> list[LeaseInfo]:
            entries = self.connection.read(self.layout.lock(key), self.layout.sem(key))
            return [info for info in self._holders(entries, key) if info.key == key]

        return self.connection.call(f"reading the holders of {key!r}", read)

    def _holders(self, entries: Mapping[str, Entry], prefix: str) -> list[LeaseInfo]:
        infos: list[LeaseInfo] = []
        expiries: dict[str, Optional[float]] = {}  # one read per session
        for path in sorted(entries):
            entry = entries[path]
            parsed = self.layout.parse(path)
            record = entry.record()
            if parsed is None or not entry.session or "owner" not in record:
                continue
            key, what = parsed
            if what != LOCK and not what.startswith(SEM + "/") or not key.startswith(prefix):
                continue
            # A contender entry is locked in the transaction that CASes K/sem: at one
            # Raft index, so its ModifyIndex is its holder's fencing token too.
            infos.append(
                self.connection.lease_info(
                    key, record["owner"], entry, record.get("holder") or {}, expiries
                )
            )
        return infos

    def force_release(self, key: str) -> int:
        """Delete the key's lock, semaphore and contender entries: whoever held them loses
        them (their renewals report it), and the next grant gets a higher ModifyIndex.
        Its marks (line, rerun) and records stay, and so does any entry another client
        wrote under the key's folder: only this library's entries are deleted."""

        def force() -> int:
            entries = self.connection.read(self.layout.lock(key), self.layout.sem(key))
            count = sum(1 for info in self._holders(entries, key) if info.key == key)
            mine = [path for path, e in entries.items() if e.is_lease or e.is_semaphore]
            self.connection.txns([op("delete", path) for path in sorted(mine)])
            state = self.connection.process()
            with state.lock:
                state.held.pop(key, None)
            return count

        return self.connection.call(f"force-releasing {key!r}", force)

    def store_time(self) -> float:
        return self.connection.store_time()

    # -- records, marks ----------------------------------------------------------------------

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        path = self.layout.record(lease_key, name)
        action = f"reading the record {name!r} of {lease_key!r}"
        entry = self.connection.call(action, self.connection.get, path)
        return None if entry is None else entry.value.decode("utf-8", "surrogatepass")

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        """A fenced write: one transaction checks that the lease still holds (its proof
        as in ``renew``) and sets the record."""
        state = self.connection.process()
        if state.session_id is None:
            return False
        if lease.limit == 1 and state.held.get(lease.key) != (lease.owner, lease.fencing_token):
            return False  # another lease of this process, or none
        return self.connection.write_fenced(
            f"writing the record {name!r} of {lease.key!r}",
            self._proof(lease, state.session_id),
            self.layout.record(lease.key, name),
            value,
        )

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        path = self.layout.mark(key, kind)
        return self.connection.read_mark(path, f"reading the {kind} mark of {key!r}")

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        path, action = self.layout.mark(key, kind), f"changing the {kind} mark of {key!r}"
        return self.connection.swap_mark(path, expected, new, ttl, action)

    # -- the start-up check, close ------------------------------------------------------------

    def check(self, probe_key: str) -> list[str]:
        """The protocol's default check (acquire, renew, release, a mark: every kind of
        write, so a token without ``key:write`` or ``session:write`` or an agent of the
        wrong datacenter fails here with its named error), plus what only Consul has."""
        return super().check(probe_key) + self.connection.warnings()

    def close(self) -> None:
        """Delete what this process still holds, then destroy its session: deleted keys
        are free at once, while keys of a destroyed session would wait out its lock delay."""

        def free(key: str, token: int, _session_id: str) -> None:
            lock = self.layout.lock(key)
            self.connection.txn([op("check-index", lock, index=token), op("delete", lock)])

        self.connection.close(free)


@dataclass
class _Slots:
    """What ``K/sem`` and the contender entries say about a semaphore."""

    index: int  # ModifyIndex of K/sem, 0 if absent (a CAS with 0 creates it)
    limit: int
    live: list[str]  # holders whose contender entry is locked
    dead: list[Entry]  # contender entries no session holds any more

    @classmethod
    def of(cls, layout: Layout, key: str, entries: Mapping[str, Entry]) -> _Slots:
        """Only this library's entries count, and only they are ever tidied: a contender
        entry is ours if it sits at ``sem/<encoded owner>`` and is a lease record, so
        another client's entries under the folder (a Go semaphore's ``sem/.lock``, its
        contender entries) are neither holders nor dead."""
        sem = entries.get(layout.sem(key))
        record = sem.record() if sem is not None and sem.is_semaphore else {}
        contenders = {
            path: e
            for path, e in entries.items()
            if e.is_lease and _is_slot_path(layout, key, path, e.record().get("owner"))
        }
        live = [
            owner
            for owner in record.get("Holders") or []
            if (entry := contenders.get(layout.slot(key, owner))) is not None and entry.session
        ]
        dead = [e for e in contenders.values() if not e.session]
        return cls(sem.modify_index if sem else 0, int(record.get("Limit") or 0), live, dead)


def _is_slot_path(layout: Layout, key: str, path: str, owner: Any) -> bool:
    return isinstance(owner, str) and path == layout.slot(key, owner)
