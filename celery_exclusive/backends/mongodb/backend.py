"""The MongoDB lease store's own layout: one document per key, every change one atomic
command.

A grant is a single ``find_one_and_update({_id: key}, upsert=True)`` whose update
pipeline grants only while the key has a free slot and no live line of waiters: it
drops expired holders, adds the new one and raises the fencing counter, all by
``$$NOW``, the server's clock (see :mod:`.expressions`). The test is in the pipeline,
not the query, because MongoDB refuses ``$expr`` (the only way to name ``$$NOW``) in
an upsert's query. The document returned says whether this owner now holds the key.
Two upserts creating the document at once may meet a duplicate key: that means the
document exists, and the grant is tried again on it, never reported as an error.
When the key is held or has a line, the document is read with the server's time, the
line decides (:func:`~..line.admit`), and a compare-and-swap on the document's ``rev``
(an update without upsert, whose query may use ``$expr``) grants.

Writes use majority write concern and reads majority read concern (the connection's),
so a grant acknowledged to a worker survives the failover of a replica set. A TTL index
on ``gc_at`` deletes documents idle for a day; it decides nothing about leases, and a
deleted document's fencing counter is floored by the server clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Optional

from pymongo import ReturnDocument

from ...errors import BackendUnavailable, ConfigurationError
from ..base import (
    NO_END,
    Backend,
    Capabilities,
    End,
    HoldersPage,
    LayoutVersion,
    Lease,
    LeaseInfo,
    MarkRead,
    page_of,
)
from ..limits import check_limit
from ..line import LINE, admit, first_in_line
from ..readback import LostAnswer
from . import expressions as x
from . import marks
from .connection import CAS_ATTEMPTS, MongoDBConnection, seconds, upsert

#: Each live holder as :meth:`MongoDBBackend.holders` reads it, with its time left (ms).
DESCRIBED = {
    "$map": {
        "input": x.LIVE,
        "as": "h",
        "in": {"o": "$$h.o", "t": "$$h.t", "h": "$$h.h", "left": {"$subtract": ["$$h.exp", x.NOW]}},
    }
}


class MongoDBBackend(Backend):
    capabilities = Capabilities(limits=True, records=True, marks=True)
    layout_version = LayoutVersion("mongodb", 1)
    connection_class = MongoDBConnection
    recipes = {"ttl-lease": "celery_exclusive.backends.mongodb.recipe:TtlLeaseBackend"}
    connection: MongoDBConnection

    def __init__(self, url: str) -> None:
        super().__init__(url)
        if "collection" in self.connection.options:
            raise ConfigurationError(
                f"exclusive_backend_url {self.safe_url} names collection=, the collection of "
                "lease documents of ?recipe=ttl-lease: add recipe=ttl-lease, or remove it "
                "(the store's own documents are in exclusive_leases)."
            )

    # --- leases -----------------------------------------------------------------------

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
        ttl_ms = max(1, math.ceil(ttl * 1000))
        action = f"acquiring {key!r}"
        # First bet, one command: a free slot and nobody in line, judged by the server.
        free = {
            "$and": [
                {"$lt": [{"$size": x.LIVE}, limit]},
                {"$or": [{"$eq": [{"$size": x.LIVE}, 0]}, {"$eq": ["$limit", limit]}]},
                {"$not": [x.mark_is_live(LINE)]},
            ]
        }
        asked = Lease(key, owner, 0, ttl, limit)
        granted = self._grant(
            action, asked, x.grant(owner, ttl_ms, limit, dict(holder or {}), free)
        )
        if granted is not None:
            return granted
        update = x.grant(owner, ttl_ms, limit, dict(holder or {}))
        for _ in range(CAS_ATTEMPTS):
            found = self.connection.aggregate(
                action,
                {"_id": key},
                {"holders": x.LIVE, "limit": 1, "rev": 1, "line": x.live_mark(LINE)},
            )
            if not found:  # the document was deleted since: bet again
                return self.try_acquire(key, owner, ttl, limit, holder, claimant)
            [doc] = found
            held = doc.get("holders") or []
            check_limit(key, limit, [doc.get("limit", limit)] if held else [])
            line = doc.get("line")
            admitted, rest = admit(line, claimant, limit - len(held), seconds(doc["now"]))
            if not admitted:
                return None
            # The grant takes the claimant out of the line.
            steps = update if rest == line else [*update, x.line_set_to(rest)]
            fewer = {"$lt": [{"$size": x.LIVE}, limit]}
            granted = self._grant(
                action, asked, steps, {"_id": key, "rev": doc.get("rev"), "$expr": fewer}
            )
            if granted is not None:
                return granted
        raise BackendUnavailable(
            f"the key {key!r} in {self.safe_url} kept changing under {CAS_ATTEMPTS} grant "
            "attempts; try again.",
            self.safe_url,
        )

    def _grant(
        self, action: str, asked: Lease, update: list, guard: Optional[dict] = None
    ) -> Optional[Lease]:
        """Run a grant of what ``asked`` names (all but its token), an upsert of the key's
        document or, with ``guard``, an update of the document it finds; the lease if
        its owner now holds the key, else None. A lost answer is read back."""

        def grant(collection) -> Optional[int]:
            shown = {"holders": 1}
            doc = (
                upsert(collection, asked.key, update, shown)
                if guard is None
                else collection.find_one_and_update(
                    guard, update, projection=shown, return_document=ReturnDocument.AFTER
                )
            )
            mine = [h for h in (doc or {}).get("holders") or [] if h.get("o") == asked.owner]
            return int(mine[0]["t"]) if mine else None

        try:
            token = self.connection.run(action, grant, write=True)
        except LostAnswer as lost:
            return self.connection.acquired(self, asked, lost)
        return None if token is None else replace(asked, fencing_token=token)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        if not leases:
            return set()
        keys = sorted({lease.key for lease in leases})
        owners = [lease.owner for lease in leases]
        mine = {"$and": [{"$in": ["$$h.o", {"$literal": owners}]}, {"$gt": ["$$h.exp", x.NOW]}]}
        extended = {"$mergeObjects": ["$$h", {"exp": {"$add": [x.NOW, "$$h.ttl"]}}]}
        each = {"input": {"$ifNull": ["$holders", []]}, "as": "h"}
        extend = {"$map": {**each, "in": {"$cond": [mine, extended, "$$h"]}}}
        longest = max(math.ceil(lease.ttl * 1000) for lease in leases)
        update = [{"$set": {"holders": extend, "gc_at": x.gc_at(longest)}}]
        action = f"renewing {len(leases)} lease(s)"
        self.connection.run(action, lambda c: c.update_many({"_id": {"$in": keys}}, update))
        found = self.connection.aggregate(action, {"_id": {"$in": keys}}, {"owners": x.LIVE_OWNERS})
        alive = {(doc["_id"], owner) for doc in found for owner in doc.get("owners") or []}
        return {lease for lease in leases if (lease.key, lease.owner) not in alive}

    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        if end != NO_END:
            return super().release(lease, end)  # the mark first, then the plain release
        query = {"_id": lease.key, "$expr": x.holds(lease.owner)}
        others = {"$ne": ["$$h.o", {"$literal": lease.owner}]}
        update = [
            {"$set": {"holders": {"$filter": {"input": "$holders", "as": "h", "cond": others}}}}
        ]

        def send() -> bool:
            return self.connection.run(
                f"releasing {lease.key!r}",
                lambda c: c.update_one(query, update).matched_count > 0,
                write=True,
            )

        return self.connection.released(self, lease, send)

    def _free_for(self, key: str, claimant: Optional[str]) -> bool:
        found = self.connection.aggregate(
            f"reading {key!r}",
            {"_id": key},
            {"held": {"$size": x.LIVE}, "limit": 1, "line": x.live_mark(LINE)},
        )
        if not found:
            return True
        [doc] = found
        if doc["held"] and doc["held"] >= doc.get("limit", 1):
            return False
        return first_in_line(doc.get("line"), claimant, seconds(doc["now"]))

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        self.connection.poll(lambda: self._free_for(key, claimant), timeout)

    # --- who holds what ---------------------------------------------------------------

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        infos = self._holders(x.under(prefix), f"listing holders under {prefix!r}")
        return [info for info in infos if info.key.startswith(prefix)]

    def holders_of(self, key: str) -> list[LeaseInfo]:
        return self._holders({"_id": key}, f"reading {key!r}")

    def _holders(self, match: dict, action: str) -> list[LeaseInfo]:
        found = self.connection.aggregate(action, match, {"holders": DESCRIBED})
        return [info for doc in sorted(found, key=lambda d: d["_id"]) for info in _infos(doc)]

    def holders_page(
        self,
        prefix: str = "",
        cursor: Optional[str] = None,
        count: int = 100,
        kinds: Sequence[str] = (),
    ) -> HoldersPage:
        # One aggregate: a key's document holds its holders and its marks.
        match = {**x.under(prefix, cursor), "$expr": {"$gt": [{"$size": x.LIVE}, 0]}}
        shown = {f"m{i}": x.live_mark(x.field(kind)) for i, kind in enumerate(kinds)}
        pipeline = [
            {"$match": match},
            {"$sort": {"_id": 1}},
            {"$limit": count + 1},
            {"$project": {"holders": DESCRIBED, **shown}},
        ]
        found = self.connection.run(
            f"listing holders under {prefix!r}", lambda c: list(c.aggregate(pipeline))
        )
        rows = [
            (doc["_id"], info, [doc.get(f"m{i}") for i in range(len(kinds))])
            for doc in found
            if doc["_id"].startswith(prefix)
            for info in _infos(doc)
        ]
        return page_of(rows, kinds, count)

    def force_release(self, key: str) -> int:
        update = [{"$set": {"released": {"$size": x.LIVE}, "holders": []}}]

        def force(collection) -> int:
            doc = collection.find_one_and_update(
                {"_id": key},
                update,
                projection={"released": 1},
                return_document=ReturnDocument.AFTER,
            )
            return 0 if doc is None else int(doc["released"])

        return self.connection.run(f"force-releasing {key!r}", force)

    # --- records and marks, the store's clock, the start-up check ---------------------

    read_mark, swap_mark, read_record = marks.read_mark, marks.swap_mark, marks.read_record

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        update = [
            {"$set": {"records": x.with_record(name, value)}},
            {"$unset": "gc_at"},  # a document with records is never collected
        ]
        query = {"_id": lease.key, "$expr": x.holds(lease.owner)}
        return self.connection.run(
            f"writing the record {name!r} of {lease.key!r}",
            lambda c: c.update_one(query, update).matched_count > 0,
        )

    def store_time(self) -> float:
        return self.connection.now()

    def check(self, probe_key: str) -> list[str]:
        return super().check(probe_key) + self.connection.warnings()


def _infos(doc: dict) -> list[LeaseInfo]:
    """The live holders of a key's document, as :data:`DESCRIBED` shows them, by token."""
    return [
        LeaseInfo(doc["_id"], h["o"], int(h["t"]), h["left"] / 1000, h.get("h") or {})
        for h in sorted(doc.get("holders") or [], key=lambda h: h["t"])
    ]
