"""The Redis store's own layout: every entry of a key under its hash tag (:mod:`.layout`).

The scripts, the client and the store's clock are the connection's
(:class:`~.connection.RedisConnection`), shared with Redis's lock recipe (``?recipe=set-nx``,
:mod:`.recipe`); the start-up check is :mod:`.checks`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

from ..base import (
    NO_END,
    Backend,
    Capabilities,
    End,
    HeldKey,
    HoldersPage,
    LayoutVersion,
    Lease,
    LeaseInfo,
    MarkRead,
)
from . import checks, layout
from .connection import RedisConnection
from .layout import as_text, leases_of

#: Names a page of held keys looks at, at most, inside one script: with SCAN's
#: COUNT 100 a few milliseconds of Redis time, however few of them are leases.
PAGE_BUDGET = 2000


class RedisBackend(Backend):
    """Leases, fences, lines, marks and records, each key's in one hash slot."""

    capabilities = Capabilities(
        limits=True,
        records=True,
        marks=True,
        final_writes=True,
        event_log=True,
        windows=True,
    )
    layout_version = LayoutVersion("redis", 1)
    connection_class = RedisConnection
    connection: RedisConnection
    recipes = {"set-nx": "celery_exclusive.backends.redis.recipe:SetNxBackend"}

    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
        read: Optional[MarkRead] = None,
    ) -> Optional[Lease]:
        return self.connection.acquire(layout, key, owner, ttl, limit, holder, claimant, read)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        return self.connection.renew(layout, leases)

    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        if end != NO_END and self.connection.cluster:
            return super().release(lease, end)  # its mark may live in another hash slot
        return self.connection.release(layout, lease, end)

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        self.connection.wait(layout, key, timeout, claimant)

    def force_release(self, key: str) -> int:
        names = layout.entries(key)
        keys = [names.lease, names.holders, names.line, names.signal, names.waiting]
        return self.connection.run("force_release", f"force-releasing {key!r}", key, keys, [30_000])

    # --- what the operators see ------------------------------------------------------

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        keys = self.connection.held_keys(layout, prefix)
        return [info for key in keys for info in self.holders_of(key)]

    def holders_of(self, key: str) -> list[LeaseInfo]:
        return leases_of(key, *self.connection.describe(layout, key), other=_unparsed)

    def holders_page(
        self,
        prefix: str = "",
        cursor: Optional[str] = None,
        count: int = 100,
        kinds: Sequence[str] = (),
    ) -> HoldersPage:
        # One script off Cluster: SCAN's order, pages of about ``count`` keys. A
        # cluster scans node by node, which one script cannot: the default reads there.
        if self.connection.cluster:
            return super().holders_page(prefix, cursor, count, kinds)
        args = [layout.lease_pattern(prefix), cursor or "0", count, PAGE_BUDGET, *kinds]
        action = f"listing holders under {prefix!r}"
        found = self.connection.run("holders_page", action, prefix, [], args)
        next_cursor, now_ms = as_text(found[0]), int(found[1])
        keys = []
        for name, kind, held, marks in found[2:]:
            key = layout.key_of(as_text(name))
            if key is None or not key.startswith(prefix):
                continue
            leases = leases_of(key, as_text(kind), now_ms, held, other=_unparsed)
            values = {kind: as_text(v) for kind, v in zip(kinds, marks) if v is not None}
            keys.append(HeldKey(key, tuple(leases), values))
        keys.sort(key=lambda held_key: held_key.key)
        return HoldersPage(keys, None if next_cursor == "0" else next_cursor)

    # --- records and marks ---------------------------------------------------------

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        action = f"reading the record {name!r} of {lease_key!r}"
        return self.connection.get(layout.record(lease_key, name), action, lease_key)

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        return self.connection.write_record(layout, lease, name, value)

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        action = f"reading the {kind} mark of {key!r}"
        return self.connection.get(layout.mark(key, kind), action, key)

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        return self.connection.swap_mark(layout, key, kind, expected, new, ttl)

    # --- the store's clock, the start-up check ------------------------------------

    def store_time(self) -> float:
        return self.connection.store_time()

    def check(self, probe_key: str) -> list[str]:
        warnings = checks.server_warnings(self.connection)
        warnings += super().check(probe_key)
        checks.exercise(self, probe_key, self.connection.delete)
        return warnings


def _unparsed(value: str) -> tuple[str, Optional[int], dict]:
    """A lease value not written by this store: shown as it is, never crashing the CLI."""
    return value, 0, {}
