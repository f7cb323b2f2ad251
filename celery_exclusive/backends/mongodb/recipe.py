"""``?recipe=ttl-lease``: leases taken as MongoDB's TTL-lease document, on the key's own
``_id``.

MongoDB has no lock of its own; the one its users build is a lease document, one per
lock, in a collection with a TTL index on its expiry, as "Leader Election with MongoDB
TTL Leases" (sanjuthomas.com, 2026-02-01) lays it out: a collection ``job_leases`` of
documents ::

    {_id: "daily-settlement-job", owner: "node-a", generation: 3,
     expiresAt: ISODate("2026-05-29T18:00:00Z")}

with ``createIndex({expiresAt: 1}, {expireAfterSeconds: 0})``. Whoever inserts the
document holds the lock (the unique ``_id`` refuses everyone else: E11000); its holder
renews by moving ``expiresAt`` where ``owner`` is itself; a lease whose ``expiresAt``
has passed is taken over (``owner`` replaced, ``generation`` + 1); a holder gives it
back by deleting its document. The TTL index only collects what expired: its monitor
runs every ``ttlMonitorSleepSecs`` (60 s by default, src/mongo/db/ttl/ttl.idl) and may
fall behind further, so exclusion never rests on it, only on ``expiresAt`` compared in
the write that takes the lease.

With ``mongodb://.../<db>?recipe=ttl-lease&collection=job_leases``, a lease on ``K`` is
the document ``{_id: K}`` of that collection (``job_leases`` unless named). So:

- **Our holder** makes a foreign client fail or wait as another holder would: we write
  ``owner`` (our lease's owner token), ``generation`` and ``expiresAt`` (the server's
  clock + ttl), and our own record under ``celery_exclusive``. Its insert meets the
  ``_id`` already there; its takeover finds ``expiresAt`` ahead. A renewal moves
  ``expiresAt``; a release deletes the document if its ``owner`` is still ours.
- **One write takes a lease**: an upsert on ``_id`` whose update pipeline writes only if
  the document is new, holds nothing but its ``_id``, or has a date ``expiresAt`` at or
  before ``$$NOW`` (the server's clock), as the recipe's takeover does; otherwise it
  changes nothing. A document without a date ``expiresAt`` is no lease of the recipe:
  never taken, and never expiring.
- **A foreign holder** (a live document whose ``owner`` is not the one our record names)
  makes our duplicates skip, wait or requeue, and is named by what its document says:
  its fields (``owner``, ``generation``, ``expiresAt``, a host or pid its client adds),
  but a record of ours its takeover left behind. Our waiters look every few hundred
  milliseconds, as the store always does.
- **Never touched**: only documents whose ``owner`` is ours are renewed or deleted,
  ``force_release`` included; a foreign document is never rewritten, whatever it holds,
  unless the recipe itself says it is free (expired, or bare).

Our fencing token stays ours: the key's counter in the store's own document (collection
``exclusive_leases``, ``_id`` the key: fence, line, marks, records), raised by every
grant of ours and floored by the server's clock. ``generation`` is the recipe's: it
counts takeovers, and starts again at 1 whenever the document is deleted (a release, the
TTL monitor), so it orders holders only while the document lives. One holder per key:
``exclusive_limit`` must be 1.

Times are the server's (``$$NOW``). A foreign client that compares ``expiresAt`` with its
own clock takes over a lease of ours early by as much as its clock runs ahead.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from bson import json_util

from ...errors import BackendUnavailable, ConfigurationError, ExclusiveError
from ..base import NO_END, Backend, Capabilities, End, LayoutVersion, Lease, LeaseInfo, MarkRead
from ..line import LINE, admit, entries_of, first_in_line
from ..readback import LostAnswer
from . import expressions as x
from . import marks
from .connection import CAS_ATTEMPTS, COLLECTION, MongoDBConnection, seconds, upsert

#: The collection of lease documents unless ``?collection=`` names another (the article's).
DEFAULT_COLLECTION = "job_leases"
#: Where a lease document we write keeps what is ours: owner, token, ttl, holder record.
FIELD = "celery_exclusive"
FOREIGN = "a MongoDB TTL-lease document"
#: A foreign holder is named by this many fields of its document at most, each value
#: cut to this many characters: a lease document may carry anything.
NAMED_FIELDS, NAMED_LENGTH = 8, 60

#: The document has a date ``expiresAt``: it is a lease of the recipe.
HAS_EXPIRY = {"$eq": [{"$type": "$expiresAt"}, "date"]}
#: A lease that has not expired, by the server's clock.
LIVE = {"$and": [HAS_EXPIRY, {"$gt": ["$expiresAt", x.NOW]}]}
#: Free for the taking: a document that holds nothing but its ``_id`` (new, or left so),
#: or a lease whose ``expiresAt`` has come.
FREE = {
    "$or": [
        {"$eq": [{"$size": {"$objectToArray": "$$ROOT"}}, 1]},
        {"$and": [HAS_EXPIRY, {"$lte": ["$expiresAt", x.NOW]}]},
    ]
}
#: Written by us: the owner our record names is the document's owner (a foreign
#: takeover replaces ``owner`` and leaves our record behind).
OURS = {
    "$and": [
        {"$eq": [{"$type": f"${FIELD}.owner"}, "string"]},
        {"$eq": ["$owner", f"${FIELD}.owner"]},
    ]
}
#: A lease document as :meth:`TtlLeaseBackend.holders` reads it, with its time left (ms).
DESCRIBED = {
    "owner": 1,
    FIELD: 1,
    "live": LIVE,
    "free": FREE,
    "ours": OURS,
    "left": {"$cond": [HAS_EXPIRY, {"$subtract": ["$expiresAt", x.NOW]}, None]},
}


def take(owner: str, token: int, ttl_ms: int, holder: dict) -> list[dict]:
    """The update pipeline that takes a lease document for ``owner`` if it is
    :data:`FREE`, as the recipe does (``generation`` + 1), and otherwise changes
    nothing. The test is in the pipeline: an upsert's query may not use ``$expr``."""
    mine = {
        "owner": {"$literal": owner},
        "token": token,
        "ttl": ttl_ms,
        "holder": {"$literal": holder},
    }
    return [
        {"$set": {"_take": FREE}},
        {
            "$set": {
                "owner": x.when("_take", {"$literal": owner}, "owner"),
                "generation": x.when(
                    "_take", {"$add": [{"$ifNull": ["$generation", 0]}, 1]}, "generation"
                ),
                "expiresAt": x.when("_take", {"$add": [x.NOW, ttl_ms]}, "expiresAt"),
                FIELD: x.when("_take", mine, FIELD),
            }
        },
        {"$unset": "_take"},
    ]


class TtlLeaseBackend(Backend):
    """The MongoDB store speaking the TTL-lease document (see the module docstring):
    leases in the lease documents; fence, line, marks and records in the key's document
    of the store's own collection."""

    recipe = "ttl-lease"
    #: One holder per key, as the recipe has.
    capabilities = Capabilities(records=True, marks=True)
    layout_version = LayoutVersion("mongodb+ttl-lease", 1)
    connection_class = MongoDBConnection
    connection: MongoDBConnection

    def __init__(self, url: str) -> None:
        super().__init__(url)
        name = self.connection.options.get("collection") or DEFAULT_COLLECTION
        bad = name == COLLECTION or name.startswith("system.")
        if bad or not re.fullmatch(r"[^$\0]{1,120}", name):
            raise ConfigurationError(
                f"exclusive_backend_url has collection={name!r}: name the collection of "
                f"lease documents your other code uses (not {COLLECTION!r}, where the store "
                "keeps its own documents, nor a system. collection, nor a name with $)."
            )
        #: The collection of lease documents, and its TTL index's field.
        self.lease_documents = (name, "expiresAt")

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
        # 1. The key's own document: the next fencing token, and the line as it stands.
        token, line, now = self._next_token(key, ttl_ms, action)
        if not admit(line, claimant, 1, now)[0]:
            return None
        # 2. The lease document, taken in one write if it is free.
        lease = Lease(key, owner, token, ttl, 1)
        update = take(owner, token, ttl_ms, dict(holder or {}))

        def write(collection) -> bool:
            doc = upsert(collection, key, update, {"owner": 1, FIELD: 1}) or {}
            return doc.get("owner") == owner and (doc.get(FIELD) or {}).get("owner") == owner

        try:
            if not self.connection.run(action, write, self.lease_documents, write=True):
                return None
        except LostAnswer as lost:  # read back: taken, or the lost answer's error
            self.connection.acquired(self, lease, lost)
        # 3. Before anyone runs under it: a former holder's record writes now fail, and
        # the claimant leaves the line.
        try:
            granted = [{"$set": {"granted": {"$max": [{"$ifNull": ["$granted", 0]}, token]}}}]
            self.connection.run(action, lambda c: c.update_one({"_id": key}, granted, upsert=True))
            if claimant is not None:
                self._leave_line(key, claimant, action)
        except BaseException:
            with contextlib.suppress(ExclusiveError):  # else it expires by itself
                self.release(lease)
            raise
        return lease

    def _next_token(self, key: str, ttl_ms: int, action: str) -> tuple[int, Optional[str], float]:
        update = [{"$set": {"fence": x.NEXT_TOKEN, "at": x.NOW, "gc_at": x.gc_at(ttl_ms)}}]
        shown = {"fence": 1, "at": 1, f"marks.{LINE}": 1}
        doc = self.connection.run(action, lambda c: upsert(c, key, update, shown))
        if doc is None:
            raise BackendUnavailable(f"the key {key!r} kept changing", self.safe_url)
        now = seconds(doc["at"])
        mark = (doc.get("marks") or {}).get(LINE) or {}
        live = isinstance(mark.get("exp"), datetime.datetime) and seconds(mark["exp"]) > now
        return int(doc["fence"]), mark.get("v") if live else None, now

    def _leave_line(self, key: str, claimant: str, action: str) -> None:
        """Take ``claimant`` out of the key's line: a compare-and-swap on its value that
        keeps the mark's expiry."""
        for _ in range(CAS_ATTEMPTS):
            line = self.read_mark(key, LINE)
            entries = entries_of(line)
            rest = [entry for entry in entries if entry["id"] != claimant]
            if len(rest) == len(entries):
                return
            update = [
                x.line_set_to(json.dumps(rest) if rest else None),
                {"$set": {"rev": x.bump_rev()}},
            ]
            query = {"_id": key, f"marks.{LINE}.v": line}
            if self.connection.run(
                action, lambda c, q=query, u=update: c.update_one(q, u)
            ).matched_count:
                return
        raise BackendUnavailable(f"the line of {key!r} kept changing", self.safe_url)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        if not leases:
            return set()
        keys = {"$in": sorted({lease.key for lease in leases})}
        owners = [lease.owner for lease in leases]
        mine = {"$and": [{"$in": ["$owner", {"$literal": owners}]}, OURS, LIVE]}
        extend = [{"$set": {"expiresAt": {"$add": [x.NOW, f"${FIELD}.ttl"]}}}]
        action = f"renewing {len(leases)} lease(s)"
        self.connection.run(
            action,
            lambda c: c.update_many({"_id": keys, "$expr": mine}, extend),
            self.lease_documents,
        )
        project = {"owner": 1, "held": mine}
        found = self.connection.aggregate(action, {"_id": keys}, project, self.lease_documents)
        alive = {(doc["_id"], doc.get("owner")) for doc in found if doc.get("held")}
        return {lease for lease in leases if (lease.key, lease.owner) not in alive}

    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        if end != NO_END:
            return super().release(lease, end)  # the mark first, then the plain release
        mine = {"_id": lease.key, "owner": lease.owner, f"{FIELD}.owner": lease.owner}

        def delete(collection) -> bool:
            if collection.delete_one({**mine, "$expr": LIVE}).deleted_count:
                return True
            collection.delete_one(mine)  # a lease of ours that expired: nobody's now
            return False

        action = f"releasing {lease.key!r}"
        send = lambda: self.connection.run(action, delete, self.lease_documents, write=True)  # noqa: E731
        return self.connection.released(self, lease, send)

    def force_release(self, key: str) -> int:
        """Delete the lease document of ``key`` if it is ours and live; a foreign one
        stays (it is not ours to delete): release it with its own client."""
        query = {"_id": key, "$expr": {"$and": [OURS, LIVE]}}
        delete = lambda c: c.delete_one(query).deleted_count  # noqa: E731
        return self.connection.run(f"force-releasing {key!r}", delete, self.lease_documents)

    def _free_for(self, key: str, claimant: Optional[str]) -> bool:
        found = self.connection.aggregate(
            f"reading {key!r}", {"_id": key}, {"free": FREE}, self.lease_documents
        )
        if found and not found[0]["free"]:
            return False
        own = self.connection.aggregate(
            f"reading {key!r}", {"_id": key}, {"line": x.live_mark(LINE)}
        )
        return not own or first_in_line(own[0].get("line"), claimant, seconds(own[0]["now"]))

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        # Polls, as a foreign client's release wakes nobody of ours.
        self.connection.poll(lambda: self._free_for(key, claimant), timeout)

    # --- who holds what ---------------------------------------------------------------

    def holders_of(self, key: str) -> list[LeaseInfo]:
        # The whole document: a foreign holder is named by what it says.
        found = self._documents({"_id": key}, f"reading {key!r}", document="$$ROOT")
        return [self._described(doc) for doc in found if not doc["free"]]

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        # Ours only: under a prefix, a foreign document is somebody else's lock.
        found = self._documents(x.under(prefix), f"listing holders under {prefix!r}")
        return [
            self._described(doc)
            for doc in sorted(found, key=lambda d: d["_id"])
            if isinstance(doc["_id"], str)
            and doc["_id"].startswith(prefix)
            and doc.get("ours")
            and doc.get("live")
        ]

    def _documents(self, match: dict, action: str, **more: str) -> list[dict]:
        return self.connection.aggregate(action, match, {**DESCRIBED, **more}, self.lease_documents)

    def _described(self, doc: dict) -> LeaseInfo:
        left = doc.get("left")
        expires_in = None if left is None else left / 1000
        mine = doc.get(FIELD) or {}
        if doc.get("ours") and doc.get("live"):
            return LeaseInfo(
                doc["_id"], mine["owner"], int(mine["token"]), expires_in, mine.get("holder") or {}
            )
        named = f"{FOREIGN} in {self.lease_documents[0]} ({_fields(doc.get('document') or {})})"
        return LeaseInfo(doc["_id"], str(doc.get("owner")), None, expires_in, {"foreign": named})

    # --- records and marks (the key's own document), the store's clock, the check ------

    read_mark, swap_mark, read_record = marks.read_mark, marks.swap_mark, marks.read_record

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        # The lease document says whether the lease is held; the key's document refuses
        # a holder older than the latest grant, which moved "granted" before it returned.
        if all(info.owner != lease.owner for info in self.holders_of(lease.key)):
            return False
        granted = {"$max": [{"$ifNull": ["$granted", 0]}, lease.fencing_token]}
        update = [
            {"$set": {"records": x.with_record(name, value), "granted": granted}},
            {"$unset": "gc_at"},  # a document with records is never collected
        ]
        latest = {"$lte": [{"$ifNull": ["$granted", 0]}, lease.fencing_token]}
        query = {"_id": lease.key, "$expr": latest}
        return self.connection.run(
            f"writing the record {name!r} of {lease.key!r}",
            lambda c: c.update_one(query, update).matched_count > 0,
        )

    def store_time(self) -> float:
        return self.connection.now()

    def check(self, probe_key: str) -> list[str]:
        return super().check(probe_key) + self.connection.warnings()


def _fields(document: Mapping[str, Any]) -> str:
    """What a foreign lease document says, for people: its fields in its order but its
    ``_id`` (the key) and a record of ours that a takeover left behind (``owner 'node-a',
    host 'billing-7', generation 3, expiresAt 2026-05-29T18:00:00.000Z``)."""
    fields = [(name, value) for name, value in document.items() if name not in ("_id", FIELD)]
    shown = [f"{name} {_value(value)}" for name, value in fields[:NAMED_FIELDS]]
    if len(fields) > NAMED_FIELDS:
        shown.append(f"{len(fields) - NAMED_FIELDS} more fields")
    if not isinstance(document.get("expiresAt"), datetime.datetime):
        shown.append("no expiresAt date: it never expires")
    return ", ".join(shown)


def _value(value: Any) -> str:
    """A BSON value for people: a date in UTC as ISO 8601 (as MongoDB's shell writes
    it), a string quoted, anything else as extended JSON; cut to :data:`NAMED_LENGTH`."""
    if isinstance(value, datetime.datetime):
        moment = value if value.tzinfo else value.replace(tzinfo=datetime.timezone.utc)
        text = moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")
        text = text[:-3] + "Z"
    else:
        text = repr(value) if isinstance(value, str) else json_util.dumps(value)
    return text if len(text) <= NAMED_LENGTH else text[: NAMED_LENGTH - 3] + "..."
