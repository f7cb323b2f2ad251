"""Consul lease store: leases are KV locks held by one Consul session per process.

URL: ``consul://host:8500[/kv/folder]`` or ``consuls://host:8501`` (HTTPS), IPv6 hosts
in brackets, with the query options ``token``, ``dc``, ``ns``, ``partition``,
``behavior=delete|release``, ``lock_delay`` (seconds), ``cacert``, ``client_cert``,
``client_key`` (``http.py``), and ``recipe=api|consul-lock|acquire`` to speak Consul's
own lock recipes on the key's KV path instead of the store's layout (``recipes.py``).
Where each key's entries live: ``kv.py``. The session and its lock delay: ``session.py``.

Fencing tokens are ModifyIndex values (Consul's raft index), read back from the
transaction that grants the lease: they keep increasing when a key is deleted and
created again, so they strictly increase across grants. A limit-1 lease is proved by
its token alone (``check-index``): every change of a key's session writes a new
ModifyIndex (``kvsLockTxn``/``kvsUnlockTxn``/``deleteSessionTxn``), so no other grant
can carry it.

The parts: ``core.py`` (one transaction, one read, the session), ``locks.py`` (acquire,
renew, release, and the reconciling of lost answers), this module (wait, the CLI's view,
records, marks, the start-up check).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any, Optional

from ...errors import ExclusiveError
from ..base import Capabilities, Lease, LeaseInfo
from ..line import LINE, first_in_line
from .core import CAS_ATTEMPTS, MAX_TXN_OPS, TxnConflict
from .http import Ambiguous, ConsulError, Unavailable
from .kv import LOCK, SEM, Entry, op, pack_mark
from .locks import _mark_value, _Slots
from .recipes import RecipeLocks
from .session import ttl_seconds

logger = logging.getLogger("celery_exclusive")

#: A blocking query waits at most this long, so with Consul's jitter (up to wait/16)
#: it answers well inside the request timeout.
MAX_BLOCK = 3.0


class ConsulBackend(RecipeLocks):
    """Leases as Consul locks: see the module's docstring."""

    capabilities = Capabilities(limits=True, records=True, marks=True)

    # -- wait -----------------------------------------------------------------

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        """Blocking queries on the key's folder (its keys only, not their values): every
        waiter wakes on a change and goes back to sleep unless a slot is free and it is
        first in line."""
        wait = self._recipe_wait if self.recipe else self._wait
        self._call(f"waiting on {key!r}", wait, key, timeout, claimant)

    def _wait(self, key: str, timeout: float, claimant: Optional[str]) -> None:
        deadline = time.monotonic() + timeout
        folder = self.layout.folder(key)
        lock, sem, line = self.layout.lock(key), self.layout.sem(key), self.layout.mark(key, LINE)
        index = self._folder_index(folder)
        while not self._free_for(key, self._read(lock, sem, line), claimant):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            block = min(remaining, MAX_BLOCK)
            new = self._folder_index(folder, index, block)
            # Consul's blocking-query rules: an index that goes backwards must be reset.
            index = new if new >= index else 0

    def _folder_index(self, folder: str, index: int = 0, wait: float = 0.0) -> int:
        query: dict[str, Any] = {"keys": True}
        if index:
            query.update(index=index, wait=f"{max(1, int(wait * 1000))}ms")
        answer = self.http.call(
            "GET",
            f"/v1/kv/{folder}",
            query=query,
            expect=(200, 404),
            timeout=self.http.timeout + wait,
        )
        return answer.index

    def _free_for(self, key: str, entries: Mapping[str, Entry], claimant: Optional[str]) -> bool:
        """Whether ``claimant`` would find a free slot and be first in the line."""
        mutex = entries.get(self.layout.lock(key))
        if mutex is not None and mutex.session:
            return False
        slots = _Slots.of(self.layout, key, entries)
        if slots.live and len(slots.live) >= slots.limit:
            return False
        now = self.store_time()
        return first_in_line(
            _mark_value(entries.get(self.layout.mark(key, LINE)), now), claimant, now
        )

    # -- the CLI's view -------------------------------------------------------

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        if self.recipe:
            return [info for key in self._recipe_keys(prefix) for info in self.holders_of(key)]

        def read() -> list[LeaseInfo]:
            return self._holders(self._list(self.layout.prefix(prefix)), prefix)

        return self._call("listing holders", read)

    def holders_of(self, key: str) -> list[LeaseInfo]:
        if self.recipe:

            def read_recipe() -> list[LeaseInfo]:
                return self._recipe_holders(key, self._recipe_entries(key))

            return self._call(f"reading the holders of {key!r}", read_recipe)

        def read() -> list[LeaseInfo]:
            entries = self._read(self.layout.lock(key), self.layout.sem(key))
            return [info for info in self._holders(entries, key) if info.key == key]

        return self._call(f"reading the holders of {key!r}", read)

    def _holders(self, entries: Mapping[str, Entry], prefix: str) -> list[LeaseInfo]:
        ttls: dict[str, Optional[float]] = {}
        infos = []
        for path in sorted(entries):
            entry = entries[path]
            parsed = self.layout.parse(path)
            record = entry.record()
            if parsed is None or not entry.session or "owner" not in record:
                continue
            key, what = parsed
            if what != LOCK and not what.startswith(SEM + "/") or not key.startswith(prefix):
                continue
            if entry.session not in ttls:
                ttls[entry.session] = self._expires_in(entry.session)
            # A contender entry is locked in the transaction that CASes K/sem: at one
            # Raft index, so its ModifyIndex is its holder's fencing token too.
            infos.append(
                LeaseInfo(
                    key,
                    record["owner"],
                    entry.modify_index,
                    ttls[entry.session],
                    record.get("holder") or {},
                )
            )
        return infos

    def _expires_in(self, session_id: str) -> Optional[float]:
        """Seconds until the session needs renewing: known for ours, its TTL for others.

        Consul does not say when another session was last renewed, and may keep an
        unrenewed session up to twice its TTL: the answer is an approximation.
        """
        state = self._process()
        if session_id == state.session_id:
            return max(0.0, state.session_ttl - (time.monotonic() - state.renewed_at))
        answer = self.http.call("GET", f"/v1/session/info/{session_id}")
        info = (answer.json() or [None])[0]
        ttl = (info or {}).get("TTL")
        return _seconds(ttl) if ttl else None

    def renewed_ago(self, info: LeaseInfo) -> Optional[float]:
        """Unknown: a lease lives as long as its holder's session, and Consul does not say
        when a session was last renewed (see :meth:`_expires_in`)."""
        return None

    def force_release(self, key: str) -> int:
        force = self._recipe_force_release if self.recipe else self._force_release
        return self._call(f"force-releasing {key!r}", force, key)

    def _force_release(self, key: str) -> int:
        """Delete the key's lock, semaphore and contender entries: whoever held them loses
        them (their renewals report it), and the next grant gets a higher ModifyIndex.
        Its marks (line, rerun) and records stay, and so does any entry another client
        wrote under the key's folder: only this library's entries are deleted."""
        entries = self._read(self.layout.lock(key), self.layout.sem(key))
        count = sum(1 for info in self._holders(entries, key) if info.key == key)
        mine = [path for path, e in entries.items() if e.is_lease or e.is_semaphore]
        doomed = [op("delete", path) for path in sorted(mine)]
        for start in range(0, len(doomed), MAX_TXN_OPS):
            self._txn(doomed[start : start + MAX_TXN_OPS])
        state = self._process()
        with state.lock:
            state.held.pop(key, None)
        return count

    # -- records --------------------------------------------------------------

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        path = self.layout.record(lease_key, name)
        entry = self._call(f"reading the record {name!r} of {lease_key!r}", self._get, path)
        return None if entry is None else entry.value.decode("utf-8", "surrogatepass")

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        """A fenced write: one transaction checks that the lease still holds (its proof
        as in ``renew``) and sets the record; a lost answer is retried (the write is
        idempotent)."""
        state = self._process()
        session_id = state.session_id
        if session_id is None and not (self.recipe and lease.limit > 1):
            return False  # a recipe's slot holds a session of its own
        if lease.limit == 1:
            with state.lock:
                if state.held.get(lease.key) != (lease.owner, lease.fencing_token):
                    return False  # another lease of this process, or none
        path = self.layout.record(lease.key, name)
        ops = [
            self._proof(lease, session_id),
            op("set", path, value.encode("utf-8", "surrogatepass")),
        ]
        return self._call(f"writing the record {name!r} of {lease.key!r}", self._retried, ops)

    # -- marks ----------------------------------------------------------------

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        path = self.layout.mark(key, kind)
        entry = self._call(f"reading the {kind} mark of {key!r}", self._get, path)
        return _mark_value(entry, self.store_time())

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        path = self.layout.mark(key, kind)
        return self._call(
            f"changing the {kind} mark of {key!r}", self._swap_mark, path, expected, new, ttl
        )

    def _swap_mark(
        self, path: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        """Read, compare in Python (Consul cannot compare values), then write with the
        KV endpoint's ``?cas=`` on the ModifyIndex read (its raw body: no base64, up to
        Consul's 512 KiB per value). A lost race is no answer: the winner may have left a
        value that still equals ``expected`` (a refresh, an A-B-A), so compare again.
        A write whose answer was lost is read back: finding what it wrote (the expiry
        makes each write's bytes its own) proves it landed, however late."""
        sent: list[Optional[bytes]] = []  # writes whose answers were lost
        for _ in range(CAS_ATTEMPTS):
            entry = self._settled_read(path) if sent else self._get(path)
            if sent and (entry.value if entry is not None else None) in sent:
                return True
            now = self.store_time()
            if _mark_value(entry, now) != expected:
                return False
            if new is None and entry is None:
                return True  # nothing to delete
            index = entry.modify_index if entry is not None else 0  # 0: create only
            data = None if new is None else pack_mark(new, now + ttl)
            method, body = ("DELETE", None) if data is None else ("PUT", data)
            try:
                answer = self.http.call(
                    method, f"/v1/kv/{path}", query={"cas": index}, raw=body, write=True
                )
            except Ambiguous:
                sent.append(data)
                continue
            if answer.json() is True:
                return True
        raise Unavailable(
            f"the mark {path} changed under {CAS_ATTEMPTS} compare-and-swaps in a row"
        )

    # -- the start-up check, close ----------------------------------------------

    def check(self, probe_key: str) -> list[str]:
        """The protocol's default check (acquire, renew, release, a mark: every kind of
        write, so a token without ``key:write`` or ``session:write`` or an agent of the
        wrong datacenter fails here with its named error), plus what only Consul has."""
        warnings = super().check(probe_key)
        if self.recipe:
            self._call("tidying the start-up check", self._recipe_check_cleanup, probe_key)
        if self.settings.lock_delay == 0:
            warnings.append(
                f"{self.safe_url}: lock_delay=0, so when a worker's session is invalidated "
                "(its node deregistered, an operator's destroy) another worker can take its "
                "keys before it notices; leave lock_delay out for the safe default."
            )
        skew = self.store_time() - time.time()
        if abs(skew) > 1.0:
            warnings.append(
                f"{self.safe_url}: the Consul agent's clock is {skew:+.1f}s from this host's; "
                "marks and waiters' places in line follow the agent's."
            )
        return warnings

    def close(self) -> None:
        """Delete what this process still holds, then destroy its session: deleted keys
        are free at once, while keys of a destroyed session would wait out its lock delay."""
        if self.recipe:
            return self._recipe_close()
        state = self._process()
        with state.lock:
            session_id, state.session_id = state.session_id, None
            held = [(key, token) for key, (_owner, token) in state.held.items() if token]
            state.held.clear()
        try:
            for key, token in held:
                lock = self.layout.lock(key)
                with contextlib.suppress(TxnConflict):
                    self._txn([op("check-index", lock, index=token), op("delete", lock)])
            if session_id is not None:
                self.http.call("PUT", f"/v1/session/destroy/{session_id}", write=True)
        except (ConsulError, ExclusiveError) as exc:
            logger.warning(
                "Could not close Consul session %s at %s (%s); it expires on its own.",
                session_id,
                self.safe_url,
                exc,
            )
        self.http.close()


_seconds = ttl_seconds


def parse_duration(text: str) -> float:
    """Seconds in a Go duration such as ``10s``, ``1m30s`` or ``500ms``."""
    return _seconds(text)
