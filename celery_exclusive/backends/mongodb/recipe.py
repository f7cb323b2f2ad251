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
  makes our duplicates skip, wait or requeue, and is named: its ``owner``,
  ``generation`` and ``expiresAt``. Our waiters look every few hundred milliseconds, as
  the store always does.
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

import datetime
import json
import math
import os
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Callable, Optional, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pymongo.errors as mongo_errors
from pymongo import ReturnDocument
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from ...errors import BackendUnavailable, ConfigurationError
from ..base import Backend, HoldersPage, Lease, LeaseInfo
from ..line import LINE, admit, entries_of, first_in_line
from ..readback import LostAnswer
from . import expressions as x
from .backend import (
    CAS_ATTEMPTS,
    COLLECTION,
    MongoDBBackend,
    _seconds,
)
from .errors import translate, translate_write

T = TypeVar("T")

#: The value of ``?recipe=`` this module speaks.
RECIPE = "ttl-lease"
#: The collection of lease documents unless ``?collection=`` names another (the article's).
DEFAULT_COLLECTION = "job_leases"
#: Where a lease document we write keeps what is ours: owner, token, ttl, holder record.
FIELD = "celery_exclusive"
#: Server error codes of an index that exists already with other options or another
#: name (IndexOptionsConflict, IndexKeySpecsConflict): the user's own TTL index serves.
INDEX_CONFLICTS = (85, 86)
FOREIGN = "a MongoDB TTL-lease document"

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


def options_of(url: str) -> tuple[str, str, str]:
    """The recipe, the lease collection, and the URL pymongo gets (without either)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = dict((name, value) for name, value in query if name in ("recipe", "collection"))
    if ours.get("recipe") != RECIPE:
        raise ConfigurationError(
            f"exclusive_backend_url has recipe={ours.get('recipe')!r}; use {RECIPE} "
            "(MongoDB's TTL-lease document), or leave it out for the store's own layout."
        )
    collection = ours.get("collection") or DEFAULT_COLLECTION
    if (
        collection == COLLECTION
        or collection.startswith("system.")
        or not re.fullmatch(r"[^$\0]{1,120}", collection)
    ):
        raise ConfigurationError(
            f"exclusive_backend_url has collection={collection!r}: name the collection of "
            f"lease documents your other code uses (not {COLLECTION!r}, where the store "
            "keeps its own documents, nor a system. collection, nor a name with $)."
        )
    rest = [(name, value) for name, value in query if name not in ("recipe", "collection")]
    return RECIPE, collection, urlunsplit(parts._replace(query=urlencode(rest)))


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


class TtlLeaseBackend(MongoDBBackend, recipe=True):
    """The MongoDB store speaking the TTL-lease document (see the module docstring)."""

    #: One holder per key, as the recipe has.
    capabilities = replace(MongoDBBackend.capabilities, limits=False)

    def __init__(self, url: str) -> None:
        super().__init__(url)
        _, self.lease_collection, self.client_url = options_of(url)
        self._locks_guard = threading.Lock()
        self._locks_handle: Any = None
        self._locks_pid: Optional[int] = None

    # --- the lease collection ---------------------------------------------------------

    def locks(self):
        """This process's handle on the collection of lease documents, with its TTL
        index on ``expiresAt`` (made here unless one is there already)."""
        own = self.collection()
        if self._locks_pid != os.getpid() or self._locks_handle is None:
            with self._locks_guard:
                if self._locks_pid != os.getpid() or self._locks_handle is None:
                    locks = own.database.get_collection(
                        self.lease_collection,
                        write_concern=WriteConcern("majority"),
                        read_concern=ReadConcern("majority"),
                    )
                    try:
                        locks.create_index("expiresAt", expireAfterSeconds=0)
                    except mongo_errors.OperationFailure as exc:
                        if exc.code not in INDEX_CONFLICTS:
                            raise
                    self._locks_handle, self._locks_pid = locks, os.getpid()
        return self._locks_handle

    def _on_locks(self, action: str, work: Callable[[Any], T]) -> T:
        try:
            return work(self.locks())
        except mongo_errors.PyMongoError as exc:
            raise translate(exc, action, self) from None

    def _leases(self, action: str, match: dict, project: dict) -> list[dict]:
        pipeline = [{"$match": match}, {"$project": {"now": x.NOW, **project}}]
        return self._on_locks(action, lambda c: list(c.aggregate(pipeline)))

    # --- leases -----------------------------------------------------------------------

    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
    ) -> Optional[Lease]:
        if limit != 1:
            raise ConfigurationError(
                f"{self.safe_url} speaks MongoDB's TTL-lease document (?recipe={RECIPE}), "
                f"which has one holder per key, but {key!r} was asked for with "
                f"exclusive_limit={limit}: use a store URL without ?recipe= for limits."
            )
        ttl_ms = max(1, math.ceil(ttl * 1000))
        action = f"acquiring {key!r}"
        # 1. The key's own document: the next fencing token, and the line as it stands.
        token, line, now = self._next_token(key, ttl_ms, action)
        admitted, _ = admit(line, claimant, 1, now)
        if not admitted:
            return None
        # 2. The lease document, taken in one write if it is free.
        try:
            taken = self._take(key, owner, token, ttl_ms, dict(holder or {}), action)
        except LostAnswer as lost:  # read back: taken, or the lost answer's error
            self._settle_acquire(key, owner, ttl, 1, lost)
            taken = True
        if not taken:
            return None
        lease = Lease(key, owner, token, ttl, 1)
        # 3. Before anyone runs under it: a former holder's record writes now fail, and
        # the claimant leaves the line.
        try:
            self._fence_records(key, token, action)
            if claimant is not None:
                self._leave_line(key, claimant, action)
        except BaseException:
            self.give_back(lease)
            raise
        return lease

    def _next_token(self, key: str, ttl_ms: int, action: str) -> tuple[int, Optional[str], float]:
        update = [{"$set": {"fence": x.NEXT_TOKEN, "at": x.NOW, "gc_at": x.gc_at(ttl_ms)}}]

        def bump(collection) -> dict:
            for _ in range(CAS_ATTEMPTS):
                try:
                    return collection.find_one_and_update(
                        {"_id": key},
                        update,
                        projection={"fence": 1, "at": 1, f"marks.{LINE}": 1},
                        upsert=True,
                        return_document=ReturnDocument.AFTER,
                    )
                except mongo_errors.DuplicateKeyError:
                    continue  # created by another call meanwhile: again, on it
            raise BackendUnavailable(f"the key {key!r} kept changing", self.safe_url)

        doc = self._call(action, bump)
        now = _seconds(doc["at"])
        mark = (doc.get("marks") or {}).get(LINE) or {}
        live = isinstance(mark.get("exp"), datetime.datetime) and _seconds(mark["exp"]) > now
        return int(doc["fence"]), mark.get("v") if live else None, now

    def _take(self, key: str, owner: str, token: int, ttl_ms: int, holder: dict, action) -> bool:
        update = take(owner, token, ttl_ms, holder)

        def write(collection) -> bool:
            for _ in range(CAS_ATTEMPTS):
                try:
                    doc = collection.find_one_and_update(
                        {"_id": key},
                        update,
                        projection={"owner": 1, FIELD: 1},
                        upsert=True,
                        return_document=ReturnDocument.AFTER,
                    )
                except mongo_errors.DuplicateKeyError:
                    continue  # inserted by someone else meanwhile: look at it again
                mine = (doc or {}).get(FIELD) or {}
                return doc.get("owner") == owner and mine.get("owner") == owner
            return False

        try:
            return write(self.locks())
        except mongo_errors.PyMongoError as exc:
            raise translate_write(exc, action, self) from None

    def _fence_records(self, key: str, token: int, action: str) -> None:
        """Note ``token`` as the key's latest grant: records written under an older one
        are refused from now on."""
        granted = {"$max": [{"$ifNull": ["$granted", 0]}, token]}
        update = [{"$set": {"granted": granted}}]
        self._call(action, lambda c: c.update_one({"_id": key}, update, upsert=True))

    def _leave_line(self, key: str, claimant: str, action: str) -> None:
        """Take ``claimant`` out of the key's line: a compare-and-swap on its value that
        keeps the mark's expiry."""
        for _ in range(CAS_ATTEMPTS):
            line = self.read_mark(key, LINE)
            entries = entries_of(line)
            rest = [entry for entry in entries if entry["id"] != claimant]
            if len(rest) == len(entries):
                return
            path = f"marks.{LINE}"
            change = (
                {"$unset": path}
                if not rest
                else {"$set": {f"{path}.v": {"$literal": json.dumps(rest)}}}
            )
            query = {"_id": key, f"{path}.v": line}
            update = [change, {"$set": {"rev": x.bump_rev()}}]
            swapped = self._call(action, lambda c, q=query, u=update: c.update_one(q, u))
            if swapped.matched_count:
                return
        raise BackendUnavailable(f"the line of {key!r} kept changing", self.safe_url)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        if not leases:
            return set()
        keys = sorted({lease.key for lease in leases})
        owners = [lease.owner for lease in leases]
        mine = {"$and": [{"$in": ["$owner", {"$literal": owners}]}, OURS, LIVE]}
        extend = [{"$set": {"expiresAt": {"$add": [x.NOW, f"${FIELD}.ttl"]}}}]
        action = f"renewing {len(leases)} lease(s)"
        self._on_locks(
            action, lambda c: c.update_many({"_id": {"$in": keys}, "$expr": mine}, extend)
        )
        found = self._leases(action, {"_id": {"$in": keys}}, {"owner": 1, "held": mine})
        alive = {(doc["_id"], doc.get("owner")) for doc in found if doc.get("held")}
        return {lease for lease in leases if (lease.key, lease.owner) not in alive}

    def release(self, lease: Lease) -> bool:
        mine = {"_id": lease.key, "owner": lease.owner, f"{FIELD}.owner": lease.owner}
        action = f"releasing {lease.key!r}"

        def send() -> bool:
            try:
                locks = self.locks()
                if locks.delete_one({**mine, "$expr": LIVE}).deleted_count:
                    return True
                locks.delete_one(mine)  # a lease of ours that expired: nobody's now
                return False
            except mongo_errors.PyMongoError as exc:
                raise translate_write(exc, action, self) from None

        return self._settle_release(lease, send)

    def force_release(self, key: str) -> int:
        """Delete the lease document of ``key`` if it is ours and live; a foreign one
        stays (it is not ours to delete): release it with its own client."""
        query = {"_id": key, "$expr": {"$and": [OURS, LIVE]}}
        return self._on_locks(
            f"force-releasing {key!r}", lambda c: c.delete_one(query).deleted_count
        )

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        # The lease document says whether the lease is held; the key's document refuses
        # a holder older than the latest grant, which moved "granted" before it returned.
        if all(info.owner != lease.owner for info in self.holders_of(lease.key)):
            return False
        others = {
            "$filter": {
                "input": {"$ifNull": ["$records", []]},
                "as": "r",
                "cond": {"$ne": ["$$r.n", {"$literal": name}]},
            }
        }
        entry = {"n": {"$literal": name}, "v": {"$literal": value}}
        update = [
            {
                "$set": {
                    "records": {"$concatArrays": [others, [entry]]},
                    "granted": {"$max": [{"$ifNull": ["$granted", 0]}, lease.fencing_token]},
                }
            },
            {"$unset": "gc_at"},  # a document with records is never collected
        ]
        latest = {"$lte": [{"$ifNull": ["$granted", 0]}, lease.fencing_token]}
        query = {"_id": lease.key, "$expr": latest}
        result = self._call(
            f"writing the record {name!r} of {lease.key!r}", lambda c: c.update_one(query, update)
        )
        return result.matched_count > 0

    # --- waiting (the store's wait() polls this) --------------------------------------

    def _free_for(self, key: str, claimant: Optional[str]) -> bool:
        found = self._leases(f"reading {key!r}", {"_id": key}, {"free": FREE})
        if found and not found[0]["free"]:
            return False
        own = self._aggregate(f"reading {key!r}", {"_id": key}, {"line": x.live_mark(LINE)})
        if not own:
            return True
        return first_in_line(own[0].get("line"), claimant, _seconds(own[0]["now"]))

    # --- who holds what ---------------------------------------------------------------

    def holders_of(self, key: str) -> list[LeaseInfo]:
        project = {
            "owner": 1,
            "generation": 1,
            "expiresAt": 1,
            FIELD: 1,
            "live": LIVE,
            "free": FREE,
            "ours": OURS,
            "left": {"$cond": [HAS_EXPIRY, {"$subtract": ["$expiresAt", x.NOW]}, None]},
        }
        found = self._leases(f"reading {key!r}", {"_id": key}, project)
        if not found or found[0]["free"]:
            return []
        return [self._described(found[0])]

    def _described(self, doc: dict) -> LeaseInfo:
        left = doc.get("left")
        expires_in = None if left is None else left / 1000
        mine = doc.get(FIELD) or {}
        if doc.get("ours") and doc.get("live"):
            return LeaseInfo(
                doc["_id"], mine["owner"], int(mine["token"]), expires_in, mine.get("holder") or {}
            )
        owner = doc.get("owner")
        shown = {
            "owner": owner,
            "generation": doc.get("generation"),
            "expiresAt": doc.get("expiresAt"),
        }
        fields = ", ".join(
            f"{name} {value!r}" for name, value in shown.items() if value is not None
        )
        if not isinstance(doc.get("expiresAt"), datetime.datetime):
            fields += ", no expiresAt date: it never expires"
        described = {"foreign": f"{FOREIGN} in {self.lease_collection} ({fields})"}
        return LeaseInfo(doc["_id"], str(owner), None, expires_in, described)

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        # Ours only: under a prefix, a foreign document is somebody else's lock.
        match: dict = {"_id": {"$gte": prefix}}
        if prefix and ord(prefix[-1]) < 0x10FFFF:
            match["_id"]["$lt"] = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        project = {
            "owner": 1,
            FIELD: 1,
            "live": LIVE,
            "ours": OURS,
            "left": {"$subtract": ["$expiresAt", x.NOW]},
        }
        found = self._leases(f"listing holders under {prefix!r}", match, project)
        return [
            LeaseInfo(
                doc["_id"],
                doc[FIELD]["owner"],
                int(doc[FIELD]["token"]),
                doc["left"] / 1000,
                doc[FIELD].get("holder") or {},
            )
            for doc in sorted(found, key=lambda d: d["_id"])
            if isinstance(doc["_id"], str)
            and doc["_id"].startswith(prefix)
            and doc.get("ours")
            and doc.get("live")
        ]

    def holders_page(
        self,
        prefix: str = "",
        cursor: Optional[str] = None,
        count: int = 100,
        kinds: Sequence[str] = (),
    ) -> HoldersPage:
        return Backend.holders_page(self, prefix, cursor, count, kinds)

    def close(self) -> None:
        with self._locks_guard:
            self._locks_handle = None
        super().close()


__all__ = ["TtlLeaseBackend", "RECIPE", "options_of", "take"]
