"""In-process lease store: one Python process, for eager mode and unit tests.

``memory://`` URLs with the same name share one store inside a process; nothing is
shared across processes, so this store excludes nothing between workers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlsplit

from .. import runtime
from .base import NO_END, Backend, Capabilities, End, LayoutVersion, Lease, LeaseInfo, MarkRead
from .limits import check_limit
from .line import LINE, admit, first_in_line


@dataclass
class _Grant:
    fencing_token: int
    expires_at: float
    limit: int
    holder: Mapping[str, Any]


#: Values a holder record keeps as they are: JSON would give them back unchanged.
_PLAIN = frozenset({str, int, float, bool, type(None)})


def _stored(holder: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """The holder record as a store that keeps JSON gives it back: a copy the caller
    cannot change afterwards, and an error now for what JSON cannot hold. A record of
    plain values (what the library writes) is copied without the round trip."""
    record = dict(holder or {})
    plain = _PLAIN
    for name, value in record.items():
        if type(name) is not str or type(value) not in plain:
            return json.loads(json.dumps(record))
    return record


class _Store:
    def __init__(self) -> None:
        self.grants: dict[str, dict[str, _Grant]] = {}
        self.fences: dict[str, int] = {}
        #: (key, kind) -> (value, expires_at)
        self.marks: dict[tuple[str, str], tuple[str, float]] = {}
        #: (lease key, name) -> value
        self.records: dict[tuple[str, str], str] = {}
        self.changed = runtime.Condition()

    @staticmethod
    def clock() -> float:
        """The store's clock for line entries (epoch seconds, like every store's)."""
        return runtime.wall()

    def mark(self, name: tuple[str, str], now: float) -> Optional[str]:
        value, expires_at = self.marks.get(name, (None, 0.0))
        if value is not None and expires_at <= now:
            del self.marks[name]
            return None
        return value

    def set_mark(self, name: tuple[str, str], value: Optional[str], expires_at: float) -> None:
        if value is None:
            self.marks.pop(name, None)
        else:
            self.marks[name] = (value, expires_at)
        self.changed.notify_all()  # a line that moved may let a waiter in

    def free_for(self, key: str, claimant: Optional[str], now: float) -> bool:
        """Whether ``claimant`` would find a free slot and be first in line."""
        grants = self.live(key, now)
        limits = {g.limit for g in grants.values()}
        if grants and len(grants) >= min(limits):
            return False
        # Line entries carry the store's epoch time, grants the monotonic clock.
        return first_in_line(self.mark((key, LINE), now), claimant, self.clock())

    def live(self, key: str, now: float) -> dict[str, _Grant]:
        grants = self.grants.get(key, {})
        for owner in [o for o, g in grants.items() if g.expires_at <= now]:
            del grants[owner]
        if not grants:
            self.grants.pop(key, None)
        return grants


_stores: dict[str, _Store] = {}
_stores_lock = runtime.Lock()


class MemoryBackend(Backend):
    capabilities = Capabilities(limits=True, records=True, marks=True, windows=True)
    layout_version = LayoutVersion("memory", 1)

    def __init__(self, url: str) -> None:
        super().__init__(url)
        name = urlsplit(url).netloc or "default"
        with _stores_lock:
            self._store = _stores.setdefault(name, _Store())

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
        store = self._store
        with store.changed:
            now = runtime.monotonic()
            grants = store.live(key, now)
            if grants:
                check_limit(key, limit, {g.limit for g in grants.values()})
            line = store.mark((key, LINE), now)
            admitted, rest = admit(line, claimant, limit - len(grants), store.clock())
            if not admitted:
                return None
            if rest != line:
                store.set_mark((key, LINE), rest, store.marks[(key, LINE)][1])
            token = store.fences[key] = store.fences.get(key, 0) + 1
            store.grants.setdefault(key, {})[owner] = _Grant(
                token, runtime.monotonic() + ttl, limit, _stored(holder)
            )
            return Lease(key, owner, token, ttl, limit)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        lost = set()
        store = self._store
        with store.changed:
            now = runtime.monotonic()
            for lease in leases:
                grant = store.live(lease.key, now).get(lease.owner)
                if grant is None:
                    lost.add(lease)
                else:
                    grant.expires_at = now + lease.ttl
        return lost

    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        if end.write is not None:
            return super().release(lease, end)  # refused: no final writes here
        store = self._store
        with store.changed:
            now = runtime.monotonic()
            mark = end.mark
            if mark is not None:
                current = store.mark((mark.key, mark.kind), now)
                if current not in (mark.expected, mark.new):
                    return None
                store.set_mark((mark.key, mark.kind), mark.new, now + mark.ttl)
            grants = store.live(lease.key, now)
            if grants.pop(lease.owner, None) is None:
                return False
            if not grants:
                store.grants.pop(lease.key, None)
            store.changed.notify_all()
            return True

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        store = self._store
        deadline = runtime.monotonic() + timeout
        with store.changed:
            while not store.free_for(key, claimant, runtime.monotonic()):
                remaining = deadline - runtime.monotonic()
                if remaining <= 0:
                    return
                store.changed.wait(remaining)

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        store = self._store
        now = runtime.monotonic()
        with store.changed:
            return [
                LeaseInfo(key, owner, g.fencing_token, g.expires_at - now, g.holder)
                for key in sorted(k for k in store.grants if k.startswith(prefix))
                for owner, g in store.live(key, now).items()
            ]

    def force_release(self, key: str) -> int:
        store = self._store
        with store.changed:
            released = len(store.live(key, runtime.monotonic()))
            store.grants.pop(key, None)
            store.changed.notify_all()
            return released

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        with self._store.changed:
            return self._store.records.get((lease_key, name))

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        store = self._store
        with store.changed:
            if lease.owner not in store.live(lease.key, runtime.monotonic()):
                return False
            store.records[(lease.key, name)] = value
            return True

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        with self._store.changed:
            return self._store.mark((key, kind), runtime.monotonic())

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        store = self._store
        with store.changed:
            now = runtime.monotonic()
            if store.mark((key, kind), now) != expected:
                return False
            store.set_mark((key, kind), new, now + ttl)
            return True
