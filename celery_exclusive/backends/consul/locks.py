"""Granting, renewing and releasing leases: Consul locks held by the process's session.

A limit-1 lease is the key's ``lock`` entry, locked in one transaction guarded by the
key's line; its fencing token is the ModifyIndex the transaction wrote. A limit > 1
lease follows Consul's semaphore recipe. Releases delete what they held.

Ambiguity is reconciled: an acquire or release whose answer was lost is read back
(``?consistent``) and retried until its outcome is known. What stays unknown becomes
an *orphan* (``session.Orphan``): the next heartbeat frees it if it turns up under this
process's session, so a session kept alive for other leases never keeps an abandoned
lock with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from ...errors import ConfigurationError
from ..base import Lease
from ..limits import check_limit
from ..line import LINE, admit
from ..readback import settle_acquire, settle_release
from .core import CAS_ATTEMPTS, MAX_TXN_OPS, ConsulCore, SessionGone, TxnConflict
from .http import Ambiguous, Unavailable
from .kv import Entry, Layout, op, pack_mark, unpack_mark

logger = logging.getLogger("celery_exclusive")

#: How long a lock whose acquire answer was lost is watched for: Consul holds a request
#: up to 7 s for a leader, and a commit can land that much after the client gave up.
ORPHAN_WATCH = 30.0


class Locks(ConsulCore):
    """The lease half of the backend protocol."""

    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
    ) -> Optional[Lease]:
        record = {"owner": owner, "limit": limit, "holder": dict(holder or {})}
        acquire = self._acquire_mutex if limit == 1 else self._acquire_slot
        action = f"acquiring {key!r}"
        try:
            return self._call(action, acquire, key, owner, ttl, record, claimant)
        except SessionGone:
            # The session died since we last used it: open a new one and try once more.
            try:
                return self._call(action, acquire, key, owner, ttl, record, claimant)
            except SessionGone:
                return None

    def _acquire_mutex(
        self, key: str, owner: str, ttl: float, record: dict, claimant: Optional[str]
    ) -> Optional[Lease]:
        if not self._reserve(key, owner):
            return None
        state = self._process()
        token = 0
        try:
            session_id, session_ttl = self._session(ttl)
            token = self._lock_mutex(key, owner, record, session_id, claimant) or 0
            if not token:
                return None
            with state.lock:
                state.held[key] = (owner, token)
            return Lease(key, owner, token, min(ttl, session_ttl), 1)
        finally:
            if not token:
                with state.lock:
                    if state.held.get(key) == (owner, 0):
                        del state.held[key]

    def _lock_mutex(
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
        lock, sem, line = self.layout.lock(key), self.layout.sem(key), self.layout.mark(key, LINE)
        guard: Optional[dict] = op("check-not-exists", line)
        leftover: dict = op("check-not-exists", lock)
        for _ in range(CAS_ATTEMPTS):
            grant = op("lock", lock, record, session_id)
            ops = [guard, op("check-not-exists", sem), leftover, grant]
            try:
                entries = self._txn(ops)
            except TxnConflict as failed:
                if failed.session_invalid:
                    self._process().forget_session(session_id)
                    raise SessionGone() from None
                if 3 in failed.failed:
                    return None  # held by another session, or in its lock delay
                if 2 in failed.failed:
                    leftover = self._leftover_guard(key, lock)
                    continue
                if 1 in failed.failed:
                    self._clear_stale_semaphore(key, 1)
                    continue
                guard = self._line_guard(line, self._get(line), claimant, free=1)
                if guard is None:
                    return None  # others are in line first
                continue
            except Ambiguous as lost:
                return self._settle_acquire(lock, owner, session_id, lost)
            # The grant's own result is the last for its path (a guard's comes first).
            return [e.modify_index for e in entries if e.key == lock][-1]
        return None  # the line kept changing under us: treat it as not our turn yet

    def _leftover_guard(self, key: str, path: str) -> dict[str, Any]:
        """The guard that lets a lock take over the unlocked entry found at ``path``:
        ``check-index`` on it if this library wrote it, ``check-not-exists`` if it is
        gone (or locked again: the lock then fails as held). An entry another client
        wrote there is refused with an error naming it: it is not ours to overwrite."""
        entry = self._get(path)
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

    def _settle_acquire(self, path: str, owner: str, session_id: str, lost: Ambiguous) -> int:
        """The lock's answer was lost: read the lock back (:mod:`..readback`). Ours: the
        grant's token. Not known to be ours in time: the lock may still land later, so
        it is watched for as an orphan, and the store did not answer (the caller
        requeues; never "held")."""
        state = self._process()
        state.add_orphan(path, owner, ORPHAN_WATCH)

        def token() -> Optional[int]:
            entry = self._get(path, consistent=True)
            mine = entry is not None and entry.session == session_id
            return entry.modify_index if mine and entry.record().get("owner") == owner else None

        granted = settle_acquire(token, lost, *self._settling)
        with state.lock:
            state.orphans.pop(path, None)
        return granted

    def _reserve(self, key: str, owner: str) -> bool:
        """Claim ``key`` for ``owner`` among this process's leases, before asking Consul.

        If another lease of this process is on record for it, ask Consul whether the
        key still carries that grant (it may have expired or been force-released).
        """
        state = self._process()
        with state.lock:
            previous = state.held.get(key)
            if previous is None:
                state.held[key] = (owner, 0)
                return True
        if previous[1] == 0 or self._still_granted(key, previous[1]):
            return False
        with state.lock:
            if state.held.get(key) == previous:
                state.held[key] = (owner, 0)
                return True
        return False

    def _still_granted(self, key: str, token: int) -> bool:
        try:
            self._txn([op("check-index", self.layout.lock(key), index=token)])
        except TxnConflict:
            return False
        return True

    def _clear_stale_semaphore(self, key: str, limit: int) -> None:
        """A mutex acquire found ``K/sem``: refuse if it has live holders with another
        limit, else delete it (and its dead contenders) so the mutex can be taken.
        Only entries this library wrote: another client's entry is never deleted."""
        entries = self._read(self.layout.sem(key))
        slots = _Slots.of(self.layout, key, entries)
        if slots.live:
            check_limit(key, limit, [slots.limit])
        sem = entries.get(self.layout.sem(key))
        mine = [sem] if sem is not None and sem.is_semaphore else []
        doomed = [op("delete-cas", e.key, index=e.modify_index) for e in mine + slots.dead]
        for start in range(0, len(doomed), MAX_TXN_OPS):
            try:
                self._txn(doomed[start : start + MAX_TXN_OPS])
            except TxnConflict:
                return  # changed meanwhile: the caller reads again

    def _line_guard(
        self, line_path: str, entry: Optional[Entry], claimant: Optional[str], free: int
    ) -> Optional[dict[str, Any]]:
        """The operation that pins a grant to the line as read, or None when the line
        puts others ahead of ``claimant`` for the ``free`` slots.

        No line: ``check-not-exists``. An expired one: a ``delete-cas`` tidying it. A line
        admitting ``claimant``: a ``cas`` (or, for its last entry, a ``delete-cas``) on
        the ModifyIndex read, taking the claimant out with the grant, or a
        ``check-index`` if the claimant was not in it.
        """
        if entry is None:
            return op("check-not-exists", line_path)
        now = self.store_time()
        mark = unpack_mark(entry.value)
        if mark is None or mark[1] <= now:
            return op("delete-cas", line_path, index=entry.modify_index)
        line, expires_at = mark
        admitted, rest = admit(line, claimant, free, now)
        if not admitted:
            return None
        if rest == line:
            return op("check-index", line_path, index=entry.modify_index)
        if rest is None:
            return op("delete-cas", line_path, index=entry.modify_index)
        return op("cas", line_path, pack_mark(rest, expires_at), index=entry.modify_index)

    def _acquire_slot(
        self, key: str, owner: str, ttl: float, record: dict, claimant: Optional[str]
    ) -> Optional[Lease]:
        """Consul's semaphore recipe: read the key's folder, then one transaction that
        locks our contender entry and CASes ``K/sem`` with the live holders plus us,
        guarded by the line as read and by the absence of a mutex holder."""
        session_id, session_ttl = self._session(ttl)
        limit = record["limit"]
        lock, sem, line = self.layout.lock(key), self.layout.sem(key), self.layout.mark(key, LINE)
        slot = self.layout.slot(key, owner)
        for _ in range(CAS_ATTEMPTS):
            entries = self._read(lock, sem, line)
            mutex = entries.get(lock)
            if mutex is not None and mutex.session:
                check_limit(key, limit, [1])
            slots = _Slots.of(self.layout, key, entries)
            if slots.live:
                check_limit(key, limit, [slots.limit])
            if len(slots.live) >= limit:
                return None
            line_guard = self._line_guard(
                line, entries.get(line), claimant, limit - len(slots.live)
            )
            if line_guard is None:
                return None  # others are in line first
            mutex_guard = (
                op("check-not-exists", lock)
                if mutex is None
                else op("delete-cas", lock, index=mutex.modify_index)  # an unlocked leftover
            )
            ops = [
                mutex_guard,
                line_guard,
                op("lock", slot, record, session_id),
                op(
                    "cas", sem, {"Limit": limit, "Holders": slots.live + [owner]}, index=slots.index
                ),
            ]
            # Tidy the contender entries of holders found dead, while we are writing.
            room = MAX_TXN_OPS - len(ops)
            ops += [op("delete-cas", e.key, index=e.modify_index) for e in slots.dead[:room]]
            try:
                results = self._txn(ops)
            except TxnConflict as failed:
                if failed.session_invalid:
                    self._process().forget_session(session_id)
                    raise SessionGone() from None
                continue  # someone else changed the folder first: read again
            except Ambiguous as lost:
                # Our contender entry was written with K/sem, at one Raft index.
                token = self._settle_acquire(slot, owner, session_id, lost)
                return Lease(key, owner, token, min(ttl, session_ttl), limit)
            token = next(e.modify_index for e in results if e.key == sem)
            return Lease(key, owner, token, min(ttl, session_ttl), limit)
        return None

    # -- renew ----------------------------------------------------------------

    def _proof(self, lease: Lease, session_id: str) -> dict[str, Any]:
        """The read-only operation that holds exactly when ``lease`` is still held."""
        if lease.limit == 1:
            return op("check-index", self.layout.lock(lease.key), index=lease.fencing_token)
        return op("check-session", self.layout.slot(lease.key, lease.owner), session=session_id)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        if not leases:
            return set()
        state = self._process()
        self._settle_orphans()
        session_id = state.session_id
        if session_id is None:
            return set(leases)
        action = f"renewing {len(leases)} lease(s)"
        if not self._keep_session_alive(session_id, action):
            return set(leases)
        # A live session does not mean every key is still ours (an operator's
        # force_release deletes the key): one check per lease, in as few transactions
        # as Consul allows; a failed check names its operation.
        lost = set()
        for start in range(0, len(leases), MAX_TXN_OPS):
            chunk = leases[start : start + MAX_TXN_OPS]
            try:
                self._call(action, self._txn, [self._proof(lease, session_id) for lease in chunk])
            except TxnConflict as failed:
                lost |= {chunk[i] for i in failed.failed if i < len(chunk)}
        with state.lock:
            for lease in lost:
                if state.held.get(lease.key) == (lease.owner, lease.fencing_token):
                    del state.held[lease.key]
        return lost

    # -- release --------------------------------------------------------------

    def release(self, lease: Lease) -> bool:
        release = self._release_mutex if lease.limit == 1 else self._release_slot
        return self._call(f"releasing {lease.key!r}", release, lease)

    def _release_mutex(self, lease: Lease) -> bool:
        """Delete ``K/lock`` if it still carries this grant (``check-index`` on the
        fencing token): one transaction. The key is deleted, not just unlocked, so KV
        keeps nothing of a free key, and no lock delay applies.

        A lease of another process (the worker's main process freeing a killed child's
        lease) is first read back: the record must name its owner.
        """
        state = self._process()
        lock = self.layout.lock(lease.key)
        with state.lock:
            mine = state.held.get(lease.key) == (lease.owner, lease.fencing_token)
            if mine:
                del state.held[lease.key]
        if not mine:
            entry = self._get(lock, consistent=True)
            if entry is None or entry.modify_index != lease.fencing_token:
                return False
            if entry.record().get("owner") != lease.owner:
                return False
        ops = [op("check-index", lock, index=lease.fencing_token), op("delete", lock)]
        return self._settle_release(lock, lease, ops)

    def _settle_release(self, path: str, lease: Lease, ops: list[dict], guarded=False) -> bool:
        """Run a release transaction until its outcome is known: a lost answer is read
        back (the grant still there: try again). Unknown after SETTLE_BUDGET: an orphan
        the heartbeat frees, and BackendUnavailable. A conflict means the grant is gone,
        unless the transaction is ``guarded`` by other reads (then the caller reads again)."""

        def send() -> bool:
            try:
                self._txn(ops)
                return True
            except TxnConflict:
                if guarded:
                    raise
                return False  # no longer this grant: released, expired or taken

        def held() -> bool:  # False: gone, our delete landed (or it expired meanwhile)
            entry = self._get(path, consistent=True)
            return entry is not None and entry.record().get("owner") == lease.owner

        try:
            return send()
        except Unavailable as lost:  # not applied, or not known to be: read back
            try:
                return settle_release(held, send, lost, *self._settling)
            except Unavailable:
                self._process().add_orphan(path, lease.owner)
                raise Unavailable(f"the release of {lease.key!r} was not answered") from None

    def _release_slot(self, lease: Lease) -> bool:
        """Delete our contender entry and take us out of ``K/sem`` (deleting it with
        the last holder), in one transaction guarded by what was read."""
        sem, slot = self.layout.sem(lease.key), self.layout.slot(lease.key, lease.owner)
        for _ in range(CAS_ATTEMPTS):
            entries = self._read(sem)
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
                return self._settle_release(slot, lease, ops, guarded=True)
            except TxnConflict:
                continue
        return False


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


def _mark_value(entry: Optional[Entry], now: float) -> Optional[str]:
    """The live value of a mark entry: None when absent, expired or not a mark."""
    mark = unpack_mark(entry.value) if entry is not None else None
    return mark[0] if mark is not None and mark[1] > now else None
