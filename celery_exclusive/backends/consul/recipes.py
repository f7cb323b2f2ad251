"""Consul's own lock recipes, spoken by the store when its URL says ``?recipe=``, so
that other clients of the same Consul and this library exclude each other on one key.

``?recipe=api`` (:class:`ApiRecipe`)
    HashiCorp's Go client (``github.com/hashicorp/consul/api``): a limit-1 lease is
    ``api.Lock`` on the key's path (``client.LockKey(path)``), a limit-N lease a slot
    of ``api.Semaphore`` on it as a prefix (``client.SemaphorePrefix(path, N)``).
``?recipe=consul-lock`` (:class:`ConsulLockRecipe`)
    The ``consul lock [-n N] path cmd`` command: limit 1 is ``api.Lock`` on
    ``path/.lock``; limit N is ``api.Semaphore`` on ``path``.
``?recipe=acquire`` (:class:`AcquireRecipe`)
    The leader-election guide's plain ``KV().Acquire(path, session)`` (no flags), limit
    1 only.

The three are one mechanism, HashiCorp's, named three ways: each recipe's class is
:class:`HashiCorpRecipe` with its own naming (where its lock lives, the flags its
entries carry) and capabilities.

A lease key is a KV path, used as it is (no encoding) under the URL's folder:
``consul://host:8500/<folder>?recipe=api`` and the key ``exclusive_key_prefix`` +
``exclusive_key`` lock ``<folder>/<key>``. What only this library keeps (a key's line
of waiters, reruns, beat records) lives apart, in ``<folder>/.celery-exclusive/``, in
the store's own encoding (``kv.py``).

Each rule copies the Go source (paths relative to hashicorp/consul):

- api/lock.go ``lockEntry``: the lock entry carries ``Flags: LockFlagValue``
  (0x2ddccbc058a50c18); ``Lock``: ``if pair != nil && pair.Flags != LockFlagValue
  { return nil, ErrLockConflict }``: a key with other flags is never locked (here: a
  ConfigurationError naming it); a locked key is waited for; ``Unlock``:
  ``kv.Release(lockEnt)``, the key stays, unlocked.
- api/semaphore.go: contender entries ``path.Join(prefix, session)`` locked by the
  holder's session, and the record ``path.Join(prefix, ".lock")``
  ``{"Limit": N, "Holders": {"<session>": true}}``, both with ``SemaphoreFlagValue``
  (0xe0f69a2baa414de0); ``Acquire``: the record's flags must be the semaphore's
  (``ErrSemaphoreConflict``), its limit ours (``semaphore limit conflict``);
  ``pruneDeadHolders``: a holder is alive while any entry under the prefix carries its
  session; ``len(lock.Holders) >= lock.Limit`` waits; the record is written by
  check-and-set on its ModifyIndex (``kv.CAS``). ``Release``: our session leaves the
  record by check-and-set, then the contender entry is deleted; the record stays.
  Holders are sessions, so each slot here has a session of its own (behavior delete,
  as ``Semaphore.createSession``).

Our fencing token stays ours: the ModifyIndex of the grant (the lock entry's, or the
record's for a slot), which rises with every grant whoever makes it. A foreign holder
takes no token of ours: its writes are fenced only by what it does itself.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Optional

from ...errors import ConfigurationError
from ..base import NO_END, Backend, Capabilities, End, LayoutVersion, Lease, LeaseInfo, MarkRead
from ..limits import check_limit
from ..line import LINE, first_in_line
from .connection import CAS_ATTEMPTS, ConsulConnection, TxnConflict
from .http import Ambiguous
from .kv import Entry, Layout, line_guard, mark_value, op
from .session import SessionLeaseInfo, ttl_seconds

#: api/lock.go LockFlagValue and api/semaphore.go SemaphoreFlagValue.
LOCK_FLAG, SEMAPHORE_FLAG = 0x2DDCCBC058A50C18, 0xE0F69A2BAA414DE0
#: api/semaphore.go DefaultSemaphoreKey.
SEMAPHORE_KEY = ".lock"
#: The folder, under the URL's, of what only this library keeps for a key (its line of
#: waiters, reruns, beat records): never a path another client names for a lock.
OWN_FOLDER = ".celery-exclusive/"
#: A blocking query on a recipe's path waits at most this long (changes to the line,
#: which lives elsewhere, are seen at the next one).
MAX_BLOCK = 3.0
#: api/lock.go DefaultLockRetryTime: how long a lock refused though the key was free (a
#: lock delay) is not tried again, "so that once a lock-delay is in affect, we do not hot
#: loop retrying the acquisition".
LOCK_RETRY_TIME = 5.0


def go_path_join(*parts: str) -> str:
    """Go's ``path.Join`` for the clean paths ``recipe_path`` admits."""
    return "/".join(part.strip("/") for part in parts if part.strip("/"))


def recipe_path(key: str, recipe: str) -> str:
    """``key`` as a KV path other clients name as they are, or a ConfigurationError.

    Consul's HTTP router rewrites a path with an empty, ``.`` or ``..`` segment (a 301
    to the cleaned path), and Go's ``path.Join`` cleans it: such a key would lock one
    path here and another there.
    """
    segments = key.split("/")
    if not key or any(segment in ("", ".", "..") for segment in segments):
        raise ConfigurationError(
            f"the lease key {key!r} is used as a Consul KV path as it is (?recipe={recipe}), "
            "and Consul rewrites paths with a leading '/', or an empty, '.' or '..' segment: "
            "give the task a key that is a clean path, such as 'service/billing/invoice-7' "
            "(exclusive_key_prefix plus exclusive_key)."
        )
    if any(ord(char) < 0x20 or char == "\x7f" for char in key):
        raise ConfigurationError(
            f"the lease key {key!r} has control characters, which no Consul KV path may "
            f"hold (?recipe={recipe})."
        )
    return key


def _holders_of(entry: Optional[Entry], key: str, path: str) -> tuple[int, dict[str, bool]]:
    """api/semaphore.go decodeLock: ``(Limit, Holders)`` of a ``.lock`` record; none
    without one."""
    if entry is None or not entry.value:
        return 0, {}
    try:
        record = json.loads(entry.value)
        holders = record.get("Holders") or {}
        if not isinstance(holders, dict):
            raise ValueError("Holders is not a map")
        return int(record.get("Limit") or 0), {str(h): bool(v) for h, v in holders.items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise ConfigurationError(
            f"the Consul semaphore record {path!r} of {key!r} cannot be read as "
            f"api.Semaphore's {{'Limit': N, 'Holders': {{...}}}} ({exc})."
        ) from None


def _pruned(holders: Mapping[str, bool], entries: Mapping[str, Entry]) -> dict[str, bool]:
    """api/semaphore.go pruneDeadHolders: holders whose session some entry under the
    prefix still carries."""
    alive = {entry.session for entry in entries.values() if entry.session}
    return {holder: True for holder in holders if holder in alive}


def _encode(limit: int, holders: Mapping[str, bool]) -> bytes:
    """api/semaphore.go encodeLock: ``json.Marshal`` of semaphoreLock (map keys sorted)."""
    return json.dumps({"Limit": limit, "Holders": dict(sorted(holders.items()))}).encode()


class HashiCorpRecipe:
    """The lease protocol over HashiCorp's recipes on a key's KV path (see the module's
    docstring); each recipe's class adds its naming and its capabilities to
    :class:`~celery_exclusive.backends.base.Backend`."""

    recipe: ClassVar[Optional[str]]
    connection_class = ConsulConnection
    connection: ConsulConnection
    #: The flags of the lock entry (api/lock.go LockFlagValue): written with it, and
    #: required of an entry found there. None: the plain acquire, which neither writes
    #: nor checks any.
    lock_flag: ClassVar[Optional[int]] = LOCK_FLAG
    #: Where the lock lives under the key's path ("": the path itself).
    lock_key: ClassVar[str] = ""
    #: The flags of a semaphore record this recipe shares slots of (None: it has none).
    semaphore_flag: ClassVar[Optional[int]] = SEMAPHORE_FLAG

    def __init__(self, url: str) -> None:
        super().__init__(url)  # type: ignore[call-arg]  # Backend's, next in each recipe
        # What only this library keeps, apart from the paths other clients name.
        self.layout = Layout(self.connection.settings.root + OWN_FOLDER)

    # -- where a key lives ---------------------------------------------------------------

    def _path(self, key: str) -> str:
        """The KV path of ``key``: the URL's folder, then the key as it is."""
        return self.connection.settings.root + recipe_path(key, self.recipe or "")

    def _mutex_path(self, key: str) -> str:
        return go_path_join(self._path(key), self.lock_key)

    def _locked(self, key: str, entries: Mapping[str, Entry]) -> Optional[Entry]:
        """``key``'s lock entry among the entries under its path, if a session holds it."""
        mutex = entries.get(self._mutex_path(key))
        held = mutex is not None and mutex.session and mutex.flags != SEMAPHORE_FLAG
        return mutex if held else None

    def _semaphore(
        self, key: str, entries: Mapping[str, Entry]
    ) -> tuple[Optional[Entry], int, dict[str, bool]]:
        """``key``'s semaphore record among the entries under its path, if this recipe
        shares one, with its limit and its live holders (pruned as Go prunes them)."""
        sem = entries.get(go_path_join(self._path(key), SEMAPHORE_KEY))
        if sem is None or sem.flags != self.semaphore_flag:
            return None, 0, {}
        limit, holders = _holders_of(sem, key, sem.key)
        return sem, limit, _pruned(holders, entries)

    # -- acquire -------------------------------------------------------------------------

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
        seen = connection.process().seen.pop(key, None)

        def lock(session_id: str) -> Optional[int]:
            return self._lock(key, owner, record, session_id, claimant, seen)

        def attempt() -> Optional[Lease]:
            if limit > 1:
                return self._acquire_slot(key, owner, ttl, record, claimant)
            return connection.lock(key, owner, ttl, self._mutex_path(key), lock)

        return connection.acquire(f"acquiring {key!r}", attempt)

    def _lock(
        self,
        key: str,
        owner: str,
        record: dict,
        session_id: str,
        claimant: Optional[str],
        seen: Optional[tuple[dict[str, Entry], Optional[Entry]]],
    ) -> Optional[int]:
        """api/lock.go Lock, as one transaction pinned to the entry as read: a locked
        key is held (None), a key with another recipe's flags is refused; then
        ``lock`` with the recipe's flags, guarded by the key's line.

        The entry and the line are read, unless this process's :meth:`wait` just saw
        them free (``seen``): then, as Go's waiter acquires as soon as its blocking
        query returns with the key's session empty, the grant is the one request after
        the wake, and whatever changed since fails its pins and is read.
        """
        connection = self.connection
        path, line = self._mutex_path(key), self.layout.mark(key, LINE)
        guard = seen and line_guard(line, seen[1], claimant, 1, connection.store_time())
        if seen is None or guard is None:
            guard = op("check-not-exists", line)
            entries = connection.read(self._path(key))
        else:
            entries = seen[0]
        entry = entries.get(path)
        for _ in range(CAS_ATTEMPTS):
            self._check_no_semaphore(key, entries)
            if entry is not None and entry.session:
                return None
            self._check_flags(key, path, entry)
            pin = (
                op("check-not-exists", path)
                if entry is None
                else op("check-index", path, index=entry.modify_index)
            )
            grant = op("lock", path, record, session_id, flags=self.lock_flag or 0)
            try:
                results = connection.txn([guard, pin, grant])
            except TxnConflict as failed:
                connection.check_session(failed, session_id)
                if 1 in failed.failed:
                    entries = connection.read(self._path(key))  # changed since read: look again
                    entry = entries.get(path)
                    continue
                if 2 in failed.failed:
                    # In the lock delay of a session that held it: api/lock.go waits
                    # DefaultLockRetryTime before it tries again, and so do our waiters.
                    connection.process().delayed[key] = time.monotonic() + LOCK_RETRY_TIME
                    return None
                now = connection.store_time()
                guard = line_guard(line, connection.get(line), claimant, 1, now)
                if guard is None:
                    return None
                continue
            except Ambiguous as lost:
                return connection.settle_acquire(path, owner, session_id, lost)
            return [e.modify_index for e in results if e.key == path][-1]  # the lock's
        return None

    def _check_no_semaphore(self, key: str, entries: Mapping[str, Entry]) -> None:
        """A limit-1 lease on a key whose semaphore has live holders: the limits differ."""
        _, limit, live = self._semaphore(key, entries)
        if live:
            check_limit(key, 1, [limit])

    def _check_flags(self, key: str, path: str, entry: Optional[Entry]) -> None:
        """api/lock.go Lock: ``pair.Flags != LockFlagValue`` is ErrLockConflict."""
        if entry is None or self.lock_flag is None or entry.flags == self.lock_flag:
            return
        what = (
            "a semaphore's record (consul lock -n, api.Semaphore)"
            if entry.flags == SEMAPHORE_FLAG
            else f"an entry with flags {entry.flags:#x}"
        )
        raise ConfigurationError(
            f"the Consul key {path!r} of the lease {key!r} is {what}, not an api.Lock "
            f"(flags {LOCK_FLAG:#x}): Consul's own clients refuse it too (\"Existing key "
            'does not match lock use"). Give every client of the key the same limit, '
            "or the task a key of its own."
        )

    def _acquire_slot(
        self, key: str, owner: str, ttl: float, record: dict, claimant: Optional[str]
    ) -> Optional[Lease]:
        """api/semaphore.go Acquire, as one transaction per attempt: read the prefix;
        refuse another recipe's record or another limit; full after pruning: None;
        else lock our contender entry and CAS the record with our session added."""
        connection = self.connection
        limit = record["limit"]
        prefix, line = self._path(key), self.layout.mark(key, LINE)
        lock_path = go_path_join(prefix, SEMAPHORE_KEY)
        session_id: Optional[str] = None
        session_ttl = 0.0
        try:
            for _ in range(CAS_ATTEMPTS):
                entries = connection.read(prefix, line)
                line_entry = entries.pop(line, None)
                sem = entries.get(lock_path)
                mutex = entries.get(self._mutex_path(key))
                if mutex is not None and mutex.session and mutex.flags == LOCK_FLAG:
                    check_limit(key, limit, [1])  # an api.Lock holds the key
                if sem is not None and sem.flags != SEMAPHORE_FLAG:
                    raise ConfigurationError(
                        f"the Consul key {lock_path!r} of the lease {key!r} has flags "
                        f"{sem.flags:#x}, not api.Semaphore's {SEMAPHORE_FLAG:#x} (an "
                        "api.Lock, consul lock without -n?): Consul's own clients refuse it "
                        "too. Give every client of the key the same limit."
                    )
                held_with, holders = _holders_of(sem, key, lock_path)
                if sem is not None and sem.value:
                    check_limit(key, limit, [held_with])
                holders = _pruned(holders, entries)
                if len(holders) >= limit:
                    return None
                now = connection.store_time()
                guard = line_guard(line, line_entry, claimant, limit - len(holders), now)
                if guard is None:
                    return None
                if session_id is None:
                    session_ttl = connection.session_ttl(ttl)
                    # api/semaphore.go createSession: Behavior: SessionBehaviorDelete
                    session_id = connection.create_session(session_ttl, "delete", f" slot of {key}")
                contender = go_path_join(prefix, session_id)
                value = _encode(limit, {**holders, session_id: True})
                index = sem.modify_index if sem is not None else 0
                ops = [
                    guard,
                    op("lock", contender, record, session_id, flags=SEMAPHORE_FLAG),
                    op("cas", lock_path, value, index=index, flags=SEMAPHORE_FLAG),
                ]
                try:
                    results = connection.txn(ops)
                except TxnConflict:
                    continue  # another contender changed the prefix first: read again
                except Ambiguous as lost:
                    token = connection.settle_acquire(contender, owner, session_id, lost)
                else:
                    token = next(e.modify_index for e in results if e.key == lock_path)
                state = connection.process()
                with state.lock:
                    state.slot_sessions[owner] = session_id
                session_id = None  # the lease keeps it
                return Lease(key, owner, token, min(ttl, session_ttl), limit)
            return None
        finally:
            if session_id is not None:
                connection.destroy(session_id)

    # -- renew, release ------------------------------------------------------------------

    def _proof(self, lease: Lease, session_id: Optional[str] = None) -> dict[str, Any]:
        """The read-only operation that holds exactly when ``lease`` is still held: its
        lock at its token, or its contender entry locked by its slot's session."""
        if lease.limit == 1:
            return op("check-index", self._mutex_path(lease.key), index=lease.fencing_token)
        slot = self.connection.process().slot_sessions.get(lease.owner, "")
        contender = go_path_join(self._path(lease.key), slot or "-")
        return op("check-session", contender, session=slot)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        """This process's session for its locks; each slot's own session for its slot."""
        connection = self.connection
        leases = list(leases)
        mutexes = [lease for lease in leases if lease.limit == 1]
        lost = connection.renew(mutexes, self._proof) if mutexes else set()
        sessions, alive = connection.process().slot_sessions, []
        for lease in leases:
            slot = sessions.get(lease.owner) if lease.limit > 1 else None
            if slot is not None and connection.call(
                "renewing a slot's session", connection.renew_session, slot
            ):
                alive.append(lease)
            elif lease.limit > 1:
                lost.add(lease)
        return lost | connection.prove(alive, self._proof, "renewing slots")

    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        if end.mark or end.write:
            return super().release(lease, end)  # type: ignore[misc]
        release = self._unlock if lease.limit == 1 else self._release_slot
        return self.connection.call(f"releasing {lease.key!r}", release, lease)

    def _unlock(self, lease: Lease) -> bool:
        """api/lock.go Unlock: ``kv.Release`` with the recipe's flags; the key stays,
        unlocked (and empty: no holder to name). Pinned to our grant (check-index)."""
        connection = self.connection
        path = self._mutex_path(lease.key)
        session_id = connection.process().session_id
        if not connection.held_by_this_process(lease):  # another process's (a killed child's)
            entry = connection.granted(path, lease)
            if entry is None or not entry.session:
                return False
            session_id = entry.session
        ops = [
            op("check-index", path, index=lease.fencing_token),
            op("unlock", path, session=session_id, flags=self.lock_flag or 0),
        ]
        return connection.settle_release(path, lease, ops, orphan=False)

    def _release_slot(self, lease: Lease) -> bool:
        """api/semaphore.go Release: our session out of the record by check-and-set,
        our contender entry deleted, in one transaction; then our slot's session is
        destroyed. The record stays for the other holders."""
        connection = self.connection
        prefix = self._path(lease.key)
        lock_path = go_path_join(prefix, SEMAPHORE_KEY)
        state = connection.process()
        with state.lock:
            slot = state.slot_sessions.pop(lease.owner, None)
        try:
            for _ in range(CAS_ATTEMPTS):
                entries = connection.read(prefix)
                if slot is None:  # another process's lease: find its contender entry
                    slot = next(
                        (
                            e.session
                            for e in entries.values()
                            if e.flags == SEMAPHORE_FLAG
                            and e.session
                            and e.record().get("owner") == lease.owner
                        ),
                        None,
                    )
                    if slot is None:
                        return False
                contender = entries.get(go_path_join(prefix, slot))
                if contender is None or contender.record().get("owner") != lease.owner:
                    return False
                ops = [
                    op("check-index", contender.key, index=contender.modify_index),
                    op("delete", contender.key),
                ]
                sem = entries.get(lock_path)
                limit, holders = _holders_of(sem, lease.key, lock_path)
                if sem is not None and slot in holders:
                    del holders[slot]
                    value = _encode(limit, holders)
                    index = sem.modify_index
                    ops.append(op("cas", lock_path, value, index=index, flags=SEMAPHORE_FLAG))
                try:
                    connection.txn(ops)
                    return True
                except TxnConflict:
                    continue
                except Ambiguous:
                    entry = connection.settled_read(contender.key)
                    if entry is None or entry.record().get("owner") != lease.owner:
                        return True
            return False
        finally:
            if slot is not None:
                connection.destroy(slot)

    # -- who holds a key, waiting for it ---------------------------------------------------

    def _holders(self, key: str, entries: Mapping[str, Entry]) -> list[LeaseInfo]:
        """Holders of ``key`` among the entries under its path (as Go's
        ``kv.List(prefix)`` reads them: pruneDeadHolders counts their sessions alive
        too): of its lock entry, or the pruned holders of its semaphore record."""
        mutex = self._locked(key, entries)
        infos = [] if mutex is None else [self._info(key, mutex, mutex.session or "")]
        for session_id in self._semaphore(key, entries)[2]:
            contender = entries.get(go_path_join(self._path(key), session_id))
            if contender is None:
                contender = next(e for e in entries.values() if e.session == session_id)
            infos.append(self._info(key, contender, session_id))
        return infos

    def _info(self, key: str, entry: Entry, session_id: str) -> LeaseInfo:
        """This library's holder, described by its record; another client's by its
        Consul session (``holder["foreign"]``)."""
        record = entry.record()
        if isinstance(record.get("owner"), str) and isinstance(record.get("holder"), dict):
            expiry = {session_id: self.connection.expires_in(session_id)}
            return self.connection.lease_info(key, record["owner"], entry, record["holder"], expiry)
        session = self.connection.session_info(session_id)
        name, node = session.get("Name") or "", session.get("Node") or "?"
        ttl = session.get("TTL")
        return SessionLeaseInfo(
            key,
            f"consul-session:{session_id}",
            entry.modify_index,
            ttl_seconds(ttl) if ttl else None,
            {"foreign": f"Consul session {session_id} ({name!r} on node {node})"},
        )

    def holders_of(self, key: str) -> list[LeaseInfo]:
        def read() -> list[LeaseInfo]:
            return self._holders(key, self.connection.read(self._path(key)))

        return self.connection.call(f"reading the holders of {key!r}", read)

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        """The holders of every key under the KV path ``prefix``, from one listing."""
        root = self.connection.settings.root

        def read() -> list[LeaseInfo]:
            _, listed = self.connection.list(root + prefix)
            entries = {e.key: e for e in listed if not e.key.startswith(root + OWN_FOLDER)}
            keys = {self._key_of(path[len(root) :], e) for path, e in entries.items()}
            return [
                info
                for key in sorted(k for k in keys if k and k.startswith(prefix))
                for info in self._holders(
                    key, {p: e for p, e in entries.items() if p.startswith(self._path(key))}
                )
            ]

        return self.connection.call(f"listing holders under {prefix!r}", read)

    def _key_of(self, path: str, entry: Entry) -> Optional[str]:
        """The lease key whose lock or semaphore record ``entry`` (at ``path`` under the
        URL's folder) is; None for a contender entry (or an entry of no lease)."""
        folder, _, last = path.rpartition("/")
        if last == SEMAPHORE_KEY and (self.lock_key or entry.flags == self.semaphore_flag):
            return folder
        return path if not self.lock_key and entry.flags != SEMAPHORE_FLAG else None

    def _free_for(
        self, key: str, entries: Mapping[str, Entry], line: Optional[Entry], claimant
    ) -> bool:
        """Whether ``claimant`` would find a slot free and be first in line."""
        _, limit, live = self._semaphore(key, entries)
        if self._locked(key, entries) is not None or (live and len(live) >= limit):
            return False
        now = self.connection.store_time()
        return first_in_line(mark_value(line, now), claimant, now)

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        """Blocking queries on the key's path, in api/lock.go Lock's order: each answers
        with what lives there, and returns at once when it shows a slot free (the key's
        session empty) for ``claimant``, first in line; what it saw is the next grant's
        pin (:meth:`_lock`). The line lives elsewhere: read at the start, and again
        whenever a query ends without a change. A key whose lock was refused though
        free (Consul's lock delay) is not tried again for LOCK_RETRY_TIME, as Go's
        waiter does not."""
        connection = self.connection
        path, line = self._path(key), self.layout.mark(key, LINE)
        state = connection.process()

        def wait() -> None:
            deadline = time.monotonic() + timeout
            index, listed = connection.list(path)
            line_entry = connection.get(line)
            while True:
                entries = {entry.key: entry for entry in listed}
                delayed = state.delayed.get(key, 0.0) - time.monotonic()
                if delayed <= 0:
                    state.delayed.pop(key, None)
                if delayed <= 0 and self._free_for(key, entries, line_entry, claimant):
                    state.seen[key] = (entries, line_entry)
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                connection.refresh()  # so that a grant right after the wake is one request
                block = min(remaining, MAX_BLOCK, delayed if delayed > 0 else MAX_BLOCK)
                new, listed = connection.list(path, index, block)
                if new == index:
                    line_entry = connection.get(line)
                index = new if new >= index else 0

        connection.call(f"waiting on {key!r}", wait)

    def force_release(self, key: str) -> int:
        """Free this library's holders of ``key`` (a lock unlocked, a slot given up);
        another client's holder is left alone: never touch what we did not write. A
        semaphore record left without holders is deleted, as api/semaphore.go Destroy
        does (DeleteCAS once no live holder is in it): the key is then free for a lock
        too, which `consul lock` takes at that very path."""
        connection = self.connection

        def force() -> int:
            entries = connection.read(self._path(key))
            mutex = entries.get(self._mutex_path(key))
            freed = 0
            for info in self._holders(key, entries):
                if "foreign" in info.holder:
                    continue
                ours = mutex is not None and mutex.record().get("owner") == info.owner
                lease = Lease(key, info.owner, info.fencing_token or 0, 0.0, 1 if ours else 2)
                freed += bool(self.release(lease))
            sem, _, live = self._semaphore(key, connection.read(self._path(key)))
            if sem is not None and not live:
                with contextlib.suppress(TxnConflict):  # a holder came meanwhile
                    connection.txn([op("delete-cas", sem.key, index=sem.modify_index)])
            return freed

        return self.connection.call(f"force-releasing {key!r}", force)

    def store_time(self) -> float:
        return self.connection.store_time()

    # -- records, marks --------------------------------------------------------------------

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        path = self.layout.record(lease_key, name)
        action = f"reading the record {name!r} of {lease_key!r}"
        entry = self.connection.call(action, self.connection.get, path)
        return None if entry is None else entry.value.decode("utf-8", "surrogatepass")

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        """A fenced write: one transaction checks that the lease still holds (its proof
        as in ``renew``; a slot's by its own session) and sets the record."""
        state = self.connection.process()
        if lease.limit == 1 and state.held.get(lease.key) != (lease.owner, lease.fencing_token):
            return False  # another lease of this process, or none
        return self.connection.write_fenced(
            f"writing the record {name!r} of {lease.key!r}",
            self._proof(lease),
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

    # -- the start-up check, close ---------------------------------------------------------

    def check(self, probe_key: str) -> list[str]:
        """The protocol's default check, then the probe's key deleted (it is left
        unlocked, as api.Lock's release leaves it: api/lock.go Destroy, our flags, no
        session, DeleteCAS), plus what only Consul has."""
        warnings: list[str] = super().check(probe_key)  # type: ignore[misc]
        path = self._mutex_path(probe_key)

        def tidy() -> None:
            entry = self.connection.get(path)
            if entry is not None and not entry.session and entry.flags == (self.lock_flag or 0):
                query = {"cas": entry.modify_index}
                self.connection.http.call("DELETE", f"/v1/kv/{path}", query=query, write=True)

        self.connection.call("tidying the start-up check", tidy)
        return warnings + self.connection.warnings()

    def close(self) -> None:
        """Unlock what this process still holds (no lock delay, unlike a destroyed
        session), give up its slots, then destroy its sessions."""

        def free(key: str, token: int, session_id: str) -> None:
            path = self._mutex_path(key)
            unlock = op("unlock", path, session=session_id, flags=self.lock_flag or 0)
            self.connection.txn([op("check-index", path, index=token), unlock])

        self.connection.close(free)


class ApiRecipe(HashiCorpRecipe, Backend):
    """``?recipe=api``: HashiCorp's ``api.Lock`` on the key's path, ``api.Semaphore`` on
    it as a prefix."""

    recipe = "api"
    layout_version = LayoutVersion("consul+api", 1)
    capabilities = Capabilities(limits=True, records=True, marks=True)


class ConsulLockRecipe(HashiCorpRecipe, Backend):
    """``?recipe=consul-lock``: the ``consul lock`` command, which takes ``api.Lock`` on
    ``path/.lock`` and (``-n N``) ``api.Semaphore`` on ``path``."""

    recipe = "consul-lock"
    layout_version = LayoutVersion("consul+consul-lock", 1)
    capabilities = Capabilities(limits=True, records=True, marks=True)
    lock_key = SEMAPHORE_KEY  # command/lock/lock.go setupLock: path.Join(prefix, ".lock")


class AcquireRecipe(HashiCorpRecipe, Backend):
    """``?recipe=acquire``: the leader-election guide's plain ``KV().Acquire(path,
    session)``: no flags, one holder at a time."""

    recipe = "acquire"
    layout_version = LayoutVersion("consul+acquire", 1)
    capabilities = Capabilities(records=True, marks=True)
    lock_flag = None
    semaphore_flag = None
