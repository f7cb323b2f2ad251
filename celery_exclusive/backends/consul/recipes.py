"""Consul's own lock recipes, spoken by the store when its URL says ``?recipe=``, so
that other clients of the same Consul and this library exclude each other on one key.

``?recipe=api``
    HashiCorp's Go client (``github.com/hashicorp/consul/api``): a limit-1 lease is
    ``api.Lock`` on the key's path (``client.LockKey(path)``), a limit-N lease a slot
    of ``api.Semaphore`` on it as a prefix (``client.SemaphorePrefix(path, N)``).
``?recipe=consul-lock``
    The ``consul lock [-n N] path cmd`` command: limit 1 is ``api.Lock`` on
    ``path/.lock``; limit N is ``api.Semaphore`` on ``path``.
``?recipe=acquire``
    The leader-election guide's plain ``KV().Acquire(path, session)`` (no flags), limit
    1 only.

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
import logging
import os
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any, Optional

from ...errors import ConfigurationError, ExclusiveError
from ..base import Lease, LeaseInfo
from ..limits import check_limit
from ..line import LINE, first_in_line
from ..readback import settle_release
from .core import CAS_ATTEMPTS, MAX_TXN_OPS, SessionGone, TxnConflict
from .http import Ambiguous, ConsulError, Unavailable
from .kv import Entry, Layout, op
from .locks import Locks, _mark_value
from .session import create_body, lock_delay_for, ttl_seconds

logger = logging.getLogger("celery_exclusive")

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


class RecipeLocks(Locks):
    """The lease protocol over Consul's own recipes (see the module's docstring)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        if self.recipe:
            # What only this library keeps, apart from the paths other clients name.
            self.layout = Layout(self.settings.root + OWN_FOLDER)
        if self.recipe == "acquire":  # the guide's plain KV acquire: one holder per key
            self.capabilities = replace(self.capabilities, limits=False)

    @property
    def recipe(self) -> Optional[str]:
        return self.settings.recipe

    # -- where a key lives ---------------------------------------------------------

    def _path(self, key: str) -> str:
        """The KV path of ``key``: the URL's folder, then the key as it is."""
        return self.settings.root + recipe_path(key, self.recipe or "")

    def _mutex_path(self, key: str) -> str:
        path = self._path(key)
        return go_path_join(path, SEMAPHORE_KEY) if self.recipe == "consul-lock" else path

    def _still_granted(self, key: str, token: int) -> bool:
        if self.recipe is None:
            return super()._still_granted(key, token)
        try:
            self._txn([op("check-index", self._mutex_path(key), index=token)])
        except TxnConflict:
            return False
        return True

    def _prefix(self, key: str, limit: int) -> str:
        if self.recipe == "acquire":
            raise ConfigurationError(
                f"the key {key!r} has exclusive_limit={limit}, but ?recipe=acquire is the "
                "leader-election guide's plain KV acquire, one holder at a time; use "
                "?recipe=api or consul-lock (Consul's semaphore) for limits above 1."
            )
        return self._path(key)

    def _flag(self) -> int:
        return 0 if self.recipe == "acquire" else LOCK_FLAG

    # -- acquire ---------------------------------------------------------------------

    def try_acquire(self, key, owner, ttl, limit=1, holder=None, claimant=None):
        if self.recipe is None:
            return super().try_acquire(key, owner, ttl, limit, holder, claimant)
        record = {"owner": owner, "limit": limit, "holder": dict(holder or {})}
        acquire = self._recipe_mutex if limit == 1 else self._recipe_slot
        action = f"acquiring {key!r}"
        for _ in range(2):  # a session that died since its last use: once more, anew
            try:
                return self._call(action, acquire, key, owner, ttl, record, claimant)
            except SessionGone:
                continue
        return None

    def _recipe_mutex(self, key, owner, ttl, record, claimant) -> Optional[Lease]:
        path = self._mutex_path(key)
        if not self._reserve(key, owner):
            return None
        state = self._process()
        token = 0
        try:
            session_id, session_ttl = self._session(ttl)
            token = self._lock_path(key, path, owner, record, session_id, claimant) or 0
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

    def _lock_path(self, key, path, owner, record, session_id, claimant) -> Optional[int]:
        """api/lock.go Lock, as one transaction pinned to the entry as read: a locked
        key is held (None), a key with another recipe's flags is refused; then
        ``lock`` with the recipe's flags, guarded by the key's line."""
        line = self.layout.mark(key, LINE)
        guard: Optional[dict] = op("check-not-exists", line)
        entries = self._recipe_entries(key)
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
            grant = op("lock", path, record, session_id, flags=self._flag())
            try:
                results = self._txn([guard, pin, grant])
            except TxnConflict as failed:
                if failed.session_invalid:
                    self._process().forget_session(session_id)
                    raise SessionGone() from None
                if 1 in failed.failed:
                    entries = self._recipe_entries(key)  # changed since read: look again
                    entry = entries.get(path)
                    continue
                if 2 in failed.failed:
                    return None  # in the lock delay of a session that held it
                guard = self._line_guard(line, self._get(line), claimant, free=1)
                if guard is None:
                    return None
                continue
            except Ambiguous as lost:
                return self._settle_acquire(path, owner, session_id, lost)
            return [e.modify_index for e in results if e.key == path][-1]  # the lock's
        return None

    def _check_no_semaphore(self, key: str, entries: Mapping[str, Entry]) -> None:
        """A limit-1 lease on a key whose semaphore has live holders: the limits differ."""
        if self.recipe == "acquire":
            return
        sem = entries.get(go_path_join(self._path(key), SEMAPHORE_KEY))
        if sem is not None and sem.flags == SEMAPHORE_FLAG:
            limit, holders = _holders_of(sem, key, sem.key)
            if _pruned(holders, entries):
                check_limit(key, 1, [limit])

    def _check_flags(self, key: str, path: str, entry: Optional[Entry]) -> None:
        """api/lock.go Lock: ``pair.Flags != LockFlagValue`` is ErrLockConflict."""
        if entry is None or self.recipe == "acquire" or entry.flags == LOCK_FLAG:
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

    def _recipe_slot(self, key, owner, ttl, record, claimant) -> Optional[Lease]:
        """api/semaphore.go Acquire, as one transaction per attempt: read the prefix;
        refuse another recipe's record or another limit; full after pruning: None;
        else lock our contender entry and CAS the record with our session added."""
        limit = record["limit"]
        prefix = self._prefix(key, limit)
        lock_path, line = go_path_join(prefix, SEMAPHORE_KEY), self.layout.mark(key, LINE)
        session_id: Optional[str] = None
        session_ttl = 0.0
        try:
            for _ in range(CAS_ATTEMPTS):
                entries = self._read(prefix, line)
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
                guard = self._line_guard(line, line_entry, claimant, limit - len(holders))
                if guard is None:
                    return None
                if session_id is None:
                    session_id, session_ttl = self._slot_session(key, ttl)
                contender = go_path_join(prefix, session_id)
                value = _encode(limit, {**holders, session_id: True})
                index = sem.modify_index if sem is not None else 0
                ops = [
                    guard,
                    op("lock", contender, record, session_id, flags=SEMAPHORE_FLAG),
                    op("cas", lock_path, value, index=index, flags=SEMAPHORE_FLAG),
                ]
                try:
                    results = self._txn(ops)
                except TxnConflict:
                    continue  # another contender changed the prefix first: read again
                except Ambiguous as lost:
                    token = self._settle_acquire(contender, owner, session_id, lost)
                else:
                    token = next(e.modify_index for e in results if e.key == lock_path)
                state = self._process()
                with state.lock:
                    state.slot_sessions[owner] = session_id
                session_id = None  # the lease keeps it
                return Lease(key, owner, token, min(ttl, session_ttl), limit)
            return None
        finally:
            if session_id is not None:
                self._destroy(session_id)

    def _slot_session(self, key: str, ttl: float) -> tuple[str, float]:
        session_ttl = self._session_ttl(ttl)
        body = create_body(
            f"celery-exclusive {socket.gethostname()} pid {os.getpid()} slot of {key}",
            session_ttl,
            "delete",  # api/semaphore.go createSession: Behavior: SessionBehaviorDelete
            lock_delay_for(session_ttl, self.settings.lock_delay),
        )
        answer = self.http.call("PUT", "/v1/session/create", body=body, write=True)
        return answer.json()["ID"], session_ttl

    def _destroy(self, session_id: str) -> None:
        with contextlib.suppress(ConsulError):
            self.http.call("PUT", f"/v1/session/destroy/{session_id}", write=True)

    # -- renew -------------------------------------------------------------------------

    def _proof(self, lease: Lease, session_id: str) -> dict[str, Any]:
        if self.recipe is None:
            return super()._proof(lease, session_id)
        if lease.limit == 1:
            return op("check-index", self._mutex_path(lease.key), index=lease.fencing_token)
        slot = self._process().slot_sessions.get(lease.owner, "")
        contender = go_path_join(self._prefix(lease.key, lease.limit), slot or "-")
        return op("check-session", contender, session=slot)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        if self.recipe is None or not leases:
            return super().renew(leases)
        slots = [lease for lease in leases if lease.limit > 1]
        mutexes = [lease for lease in leases if lease.limit == 1]
        lost = super().renew(mutexes) if mutexes else set()
        state = self._process()
        alive = []
        for lease in slots:
            slot = state.slot_sessions.get(lease.owner)
            if slot is None or not self._keep_slot_alive(slot):
                lost.add(lease)
            else:
                alive.append(lease)
        for start in range(0, len(alive), MAX_TXN_OPS):
            chunk = alive[start : start + MAX_TXN_OPS]
            try:
                self._call("renewing slots", self._txn, [self._proof(s, "") for s in chunk])
            except TxnConflict as failed:
                lost |= {chunk[i] for i in failed.failed if i < len(chunk)}
        return lost

    def _keep_slot_alive(self, session_id: str) -> bool:
        return self._call("renewing a slot's session", self._renew_session, session_id)

    # -- release -----------------------------------------------------------------------

    def release(self, lease: Lease) -> bool:
        if self.recipe is None:
            return super().release(lease)
        release = self._release_path if lease.limit == 1 else self._release_recipe_slot
        return self._call(f"releasing {lease.key!r}", release, lease)

    def _release_path(self, lease: Lease) -> bool:
        """api/lock.go Unlock: ``kv.Release`` with the recipe's flags; the key stays,
        unlocked (and empty: no holder to name). Pinned to our grant (check-index)."""
        state = self._process()
        path = self._mutex_path(lease.key)
        with state.lock:
            mine = state.held.get(lease.key) == (lease.owner, lease.fencing_token)
            if mine:
                del state.held[lease.key]
            session_id = state.session_id if mine else None
        if session_id is None:  # another process's lease (a killed child's): read it
            entry = self._get(path, consistent=True)
            if entry is None or entry.modify_index != lease.fencing_token:
                return False
            if entry.record().get("owner") != lease.owner or not entry.session:
                return False
            session_id = entry.session
        ops = [
            op("check-index", path, index=lease.fencing_token),
            op("unlock", path, session=session_id, flags=self._flag()),
        ]
        return self._settle_path_release(path, lease, ops)

    def _settle_path_release(self, path: str, lease: Lease, ops: list[dict]) -> bool:
        """Run a release until its outcome is known: after a lost answer, a key no
        longer carrying the grant's index was released (by us, or it expired)."""

        def send() -> bool:
            try:
                self._txn(ops)
                return True
            except TxnConflict:
                return False

        def held() -> bool:
            entry = self._get(path, consistent=True)
            return entry is not None and entry.modify_index == lease.fencing_token

        try:
            return send()
        except Unavailable as lost:
            try:
                return settle_release(held, send, lost, *self._settling)
            except Unavailable:
                raise Unavailable(f"the release of {lease.key!r} was not answered") from None

    def _release_recipe_slot(self, lease: Lease) -> bool:
        """api/semaphore.go Release: our session out of the record by check-and-set,
        our contender entry deleted, in one transaction; then our slot's session is
        destroyed. The record stays for the other holders."""
        prefix = self._prefix(lease.key, lease.limit)
        lock_path = go_path_join(prefix, SEMAPHORE_KEY)
        state = self._process()
        with state.lock:
            slot = state.slot_sessions.pop(lease.owner, None)
        try:
            for _ in range(CAS_ATTEMPTS):
                entries = self._read(prefix)
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
                    self._txn(ops)
                    return True
                except TxnConflict:
                    continue
                except Ambiguous:
                    entry = self._settled_read(contender.key)
                    if entry is None or entry.record().get("owner") != lease.owner:
                        return True
            return False
        finally:
            if slot is not None:
                self._destroy(slot)

    # -- who holds a key, waiting for it -------------------------------------------------

    def _recipe_entries(self, key: str) -> dict[str, Entry]:
        """Every entry under ``key``'s path, as Go's ``kv.List(prefix)`` reads it (any
        key starting with it: pruneDeadHolders counts their sessions alive too)."""
        return self._read(self._path(key))

    def _recipe_holders(self, key: str, entries: Mapping[str, Entry]) -> list[LeaseInfo]:
        """Holders of ``key``: of its lock entry, or the pruned holders of its
        semaphore record. This library's are described by their record; another
        client's by its Consul session (``holder["foreign"]``)."""
        path = self._path(key)
        infos = []
        mutex = entries.get(self._mutex_path(key))
        if mutex is not None and mutex.session and mutex.flags != SEMAPHORE_FLAG:
            infos.append(self._info(key, mutex, mutex.session))
        sem = entries.get(go_path_join(path, SEMAPHORE_KEY))
        if self.recipe != "acquire" and sem is not None and sem.flags == SEMAPHORE_FLAG:
            _, holders = _holders_of(sem, key, sem.key)
            for session_id in _pruned(holders, entries):
                contender = entries.get(go_path_join(path, session_id))
                if contender is None:
                    contender = next(e for e in entries.values() if e.session == session_id)
                infos.append(self._info(key, contender, session_id))
        return infos

    def _info(self, key: str, entry: Entry, session_id: str) -> LeaseInfo:
        record = entry.record()
        if isinstance(record.get("owner"), str) and isinstance(record.get("holder"), dict):
            expires = self._expires_in(session_id)
            return LeaseInfo(key, record["owner"], entry.modify_index, expires, record["holder"])
        answer = self.http.call("GET", f"/v1/session/info/{session_id}")
        session = (answer.json() or [None])[0] or {}
        name, node = session.get("Name") or "", session.get("Node") or "?"
        ttl = session.get("TTL")
        return LeaseInfo(
            key,
            f"consul-session:{session_id}",
            entry.modify_index,
            ttl_seconds(ttl) if ttl else None,
            {"foreign": f"Consul session {session_id} ({name!r} on node {node})"},
        )

    def _recipe_keys(self, prefix: str) -> list[str]:
        """Lease keys with a recipe's entries under the KV path ``prefix``: a ``.lock``
        names its folder (a semaphore, or consul-lock's lock); any other entry not under
        such a folder is a lock key itself (api, acquire)."""

        def listing() -> list[str]:
            query = {"keys": True}
            path = f"/v1/kv/{self.settings.root}{prefix}"
            answer = self.http.call("GET", path, query=query, expect=(200, 404))
            return (answer.json() or []) if answer.status == 200 else []

        root = self.settings.root
        paths = [
            p[len(root) :]
            for p in self._call(f"listing holders under {prefix!r}", listing)
            if p.startswith(root) and not p.startswith(root + OWN_FOLDER)
        ]
        folders = {p[: -len(SEMAPHORE_KEY) - 1] for p in paths if p.endswith("/" + SEMAPHORE_KEY)}
        plain = [p for p in paths if not any(p.startswith(f + "/") for f in folders)]
        return sorted(folders | set(plain))

    def _recipe_free_for(
        self, key: str, entries: Mapping[str, Entry], line: Optional[Entry], claimant
    ) -> bool:
        """Whether ``claimant`` would find a slot free and be first in line."""
        path = self._path(key)
        mutex = entries.get(self._mutex_path(key))
        sem = entries.get(go_path_join(path, SEMAPHORE_KEY))
        if mutex is not None and mutex.session and mutex.flags != SEMAPHORE_FLAG:
            return False
        if sem is not None and sem.flags == SEMAPHORE_FLAG and self.recipe != "acquire":
            limit, holders = _holders_of(sem, key, sem.key)
            if len(_pruned(holders, entries)) >= max(limit, 1):
                return False
        now = self.store_time()
        return first_in_line(_mark_value(line, now), claimant, now)

    def _recipe_wait(self, key: str, timeout: float, claimant: Optional[str]) -> None:
        deadline = time.monotonic() + timeout
        path, line = self._path(key), self.layout.mark(key, LINE)
        index = 0
        while True:
            entries = self._read(path, line)
            line_entry = entries.pop(line, None)
            if self._recipe_free_for(key, entries, line_entry, claimant):
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            block = min(remaining, MAX_BLOCK)
            query: dict[str, Any] = {"keys": True}
            if index:
                query.update(index=index, wait=f"{max(1, int(block * 1000))}ms")
            answer = self.http.call(
                "GET",
                f"/v1/kv/{path}",
                query=query,
                expect=(200, 404),
                timeout=self.http.timeout + block,
            )
            new = answer.index
            index = new if new >= index else 0

    def _recipe_force_release(self, key: str) -> int:
        """Free this library's holders of ``key`` (a lock unlocked, a slot given up);
        another client's holder is left alone: never touch what we did not write."""
        entries = self._recipe_entries(key)
        mutex = entries.get(self._mutex_path(key))
        freed = 0
        for info in self._recipe_holders(key, entries):
            if "foreign" in info.holder:
                continue
            ours = mutex is not None and mutex.record().get("owner") == info.owner
            lease = Lease(key, info.owner, info.fencing_token or 0, 0.0, 1 if ours else 2)
            if self.release(lease):
                freed += 1
        return freed

    def _recipe_check_cleanup(self, probe_key: str) -> None:
        """The start-up check's probe leaves its lock key unlocked, as api.Lock's
        release does: delete it (api/lock.go Destroy: our flags, no session, DeleteCAS)."""
        path = self._mutex_path(probe_key)
        entry = self._get(path)
        if entry is not None and not entry.session and entry.flags == self._flag():
            self.http.call(
                "DELETE", f"/v1/kv/{path}", query={"cas": entry.modify_index}, write=True
            )

    def _recipe_close(self) -> None:
        """Unlock what this process still holds (no lock delay, unlike a destroyed
        session), give up its slots, then destroy its session."""
        state = self._process()
        with state.lock:
            session_id, state.session_id = state.session_id, None
            held = [(key, token) for key, (_owner, token) in state.held.items() if token]
            slots = list(state.slot_sessions.values())
            state.held.clear()
            state.slot_sessions.clear()
        try:
            for key, token in held:
                path = self._mutex_path(key)
                with contextlib.suppress(TxnConflict):
                    unlock = op("unlock", path, session=session_id, flags=self._flag())
                    self._txn([op("check-index", path, index=token), unlock])
            for slot in slots + ([session_id] if session_id else []):
                self._destroy(slot)
        except (ConsulError, ExclusiveError) as exc:
            logger.warning("Could not close Consul sessions at %s (%s).", self.safe_url, exc)
        self.http.close()
