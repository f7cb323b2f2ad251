"""The MongoDB lease store: one document per key, every change one atomic command.

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

Writes use majority write concern and reads majority read concern, so a grant
acknowledged to a worker survives the failover of a replica set. A TTL index on
``gc_at`` deletes documents idle for a day; it decides nothing about leases, and a
deleted document's fencing counter is floored by the server clock.
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Optional, TypeVar
from urllib.parse import urlsplit

import pymongo
import pymongo.errors as mongo_errors
from pymongo import ReturnDocument
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from ...errors import BackendUnavailable
from ..base import Backend, Capabilities, HoldersPage, Lease, LeaseInfo, page_of
from ..limits import check_limit
from ..line import LINE, admit, first_in_line
from ..readback import LostAnswer, budget, settle_acquire, settle_release, token_of
from . import expressions as x
from .errors import translate, translate_write

T = TypeVar("T")

COLLECTION = "exclusive_leases"
DEFAULT_DATABASE = "celery_exclusive"
#: Client timeouts (ms) unless the URL sets them: a dead server never hangs a worker.
CLIENT_DEFAULTS = {
    "serverSelectionTimeoutMS": 5000,
    "connectTimeoutMS": 3000,
    "socketTimeoutMS": 10000,
}
#: Times a grant retries its compare-and-swap when the document changed in between.
CAS_ATTEMPTS = 8
#: wait() polls between these bounds (seconds), doubling each time.
POLL_MIN, POLL_MAX = 0.01, 0.2


def _field(kind: str) -> str:
    """A mark kind as a field name: kinds are short lowercase words; anything else is
    hex-encoded, so no kind can name a path."""
    return kind if re.fullmatch(r"[a-z][a-z0-9_]*", kind) else "x" + kind.encode().hex()


class MongoDBBackend(Backend):
    capabilities = Capabilities(limits=True, records=True, marks=True)

    def __new__(cls, url: str) -> MongoDBBackend:
        # ?recipe=ttl-lease: the lease document of MongoDB's TTL-lease recipe (recipe.py).
        if cls is MongoDBBackend and "recipe=" in urlsplit(url).query:
            cls = cls.speaking_recipe()
        return super().__new__(cls)

    def __init__(self, url: str) -> None:
        super().__init__(url)
        #: The URL pymongo is given: this one, less options of the store's own.
        self.client_url = url
        self._lock = threading.Lock()
        self._pid: Optional[int] = None
        self._client: Optional[pymongo.MongoClient] = None
        self._collection = None

    # --- the client -------------------------------------------------------------------

    def collection(self):
        """This process's collection handle (pymongo clients must not cross a fork)."""
        if self._pid != os.getpid() or self._collection is None:
            with self._lock:
                if self._pid != os.getpid() or self._collection is None:
                    url = self.client_url
                    options = {k: v for k, v in CLIENT_DEFAULTS.items() if k not in url}
                    client = pymongo.MongoClient(url, **options, connect=False)
                    database = client.get_default_database(default=DEFAULT_DATABASE)
                    collection = database.get_collection(
                        COLLECTION,
                        write_concern=WriteConcern("majority"),
                        read_concern=ReadConcern("majority"),
                    )
                    collection.create_index("gc_at", expireAfterSeconds=0, name="gc_at_ttl")
                    self._client, self._collection, self._pid = client, collection, os.getpid()
        return self._collection

    def _call(self, action: str, work: Callable[[Any], T]) -> T:
        try:
            return work(self.collection())
        except mongo_errors.PyMongoError as exc:
            raise translate(exc, action, self) from None

    def _aggregate(self, action: str, match: dict, project: dict) -> list[dict]:
        pipeline = [{"$match": match}, {"$project": {"now": x.NOW, **project}}]
        return self._call(action, lambda c: list(c.aggregate(pipeline)))

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
        update = x.grant(owner, ttl_ms, limit, dict(holder or {}), free)
        try:
            token = self._grant(action, {"_id": key}, update, owner, upsert=True)
        except LostAnswer as lost:
            return self._settle_acquire(key, owner, ttl, limit, lost)
        if token is not None:
            return Lease(key, owner, token, ttl, limit)
        update = x.grant(owner, ttl_ms, limit, dict(holder or {}))
        for _ in range(CAS_ATTEMPTS):
            found = self._aggregate(
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
            admitted, rest = admit(line, claimant, limit - len(held), _seconds(doc["now"]))
            if not admitted:
                return None
            steps = list(update)
            if rest != line:  # the grant takes the claimant out of the line
                steps.append(
                    {"$unset": f"marks.{LINE}"}
                    if rest is None
                    else {"$set": {f"marks.{LINE}.v": {"$literal": rest}}}
                )
            guard = {
                "_id": key,
                "rev": doc.get("rev"),
                "$expr": {"$lt": [{"$size": x.LIVE}, limit]},
            }
            try:
                token = self._grant(action, guard, steps, owner, upsert=False)
            except LostAnswer as lost:
                return self._settle_acquire(key, owner, ttl, limit, lost)
            if token is not None:
                return Lease(key, owner, token, ttl, limit)
        raise BackendUnavailable(
            f"the key {key!r} in {self.safe_url} kept changing under {CAS_ATTEMPTS} grant "
            "attempts; try again.",
            self.safe_url,
        )

    def _grant(
        self, action: str, query: dict, update: list, owner: str, upsert: bool
    ) -> Optional[int]:
        """Run a grant; its token if ``owner`` now holds the key, else None.

        A duplicate key (two upserts creating the document at once; the server retries
        an ``_id``-only upsert itself) is tried again: it means the document exists,
        never an error.
        """

        def grant(collection) -> Optional[int]:
            for _ in range(CAS_ATTEMPTS):
                try:
                    doc = collection.find_one_and_update(
                        query,
                        update,
                        projection={"holders": 1},
                        upsert=upsert,
                        return_document=ReturnDocument.AFTER,
                    )
                except mongo_errors.DuplicateKeyError:
                    continue
                for entry in (doc or {}).get("holders") or []:
                    if entry.get("o") == owner:
                        return int(entry["t"])
                return None
            return None

        try:
            return grant(self.collection())
        except mongo_errors.PyMongoError as exc:
            raise translate_write(exc, action, self) from None

    def _settle_acquire(self, key, owner, ttl, limit, lost: LostAnswer) -> Lease:
        """The acquire's answer was lost: read back whether it was granted. A grant
        that lands later is not renewed by anyone and expires after its ttl."""
        token = settle_acquire(lambda: token_of(self, key, owner), lost.error, budget(ttl))
        return Lease(key, owner, token, ttl, limit)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        if not leases:
            return set()
        keys = sorted({lease.key for lease in leases})
        owners = [lease.owner for lease in leases]
        extend = {
            "$map": {
                "input": {"$ifNull": ["$holders", []]},
                "as": "h",
                "in": {
                    "$cond": [
                        {
                            "$and": [
                                {"$in": ["$$h.o", {"$literal": owners}]},
                                {"$gt": ["$$h.exp", x.NOW]},
                            ]
                        },
                        {"$mergeObjects": ["$$h", {"exp": {"$add": [x.NOW, "$$h.ttl"]}}]},
                        "$$h",
                    ]
                },
            }
        }
        longest = max(math.ceil(lease.ttl * 1000) for lease in leases)
        update = [{"$set": {"holders": extend, "gc_at": x.gc_at(longest)}}]
        action = f"renewing {len(leases)} lease(s)"
        self._call(action, lambda c: c.update_many({"_id": {"$in": keys}}, update))
        found = self._aggregate(action, {"_id": {"$in": keys}}, {"owners": x.LIVE_OWNERS})
        alive = {(doc["_id"], owner) for doc in found for owner in doc.get("owners") or []}
        return {lease for lease in leases if (lease.key, lease.owner) not in alive}

    def release(self, lease: Lease) -> bool:
        query = {"_id": lease.key, "$expr": x.holds(lease.owner)}
        update = [
            {
                "$set": {
                    "holders": {
                        "$filter": {
                            "input": "$holders",
                            "as": "h",
                            "cond": {"$ne": ["$$h.o", {"$literal": lease.owner}]},
                        }
                    }
                }
            }
        ]
        action = f"releasing {lease.key!r}"

        def send() -> bool:
            try:
                return self.collection().update_one(query, update).matched_count > 0
            except mongo_errors.PyMongoError as exc:
                raise translate_write(exc, action, self) from None

        return self._settle_release(lease, send)

    def _settle_release(self, lease: Lease, send: Callable[[], bool]) -> bool:
        """``send()`` a release until its outcome is known: a lost answer is read back
        (the owner gone: released; still there: sent again), or its error raised."""
        try:
            return send()
        except LostAnswer as lost:
            return settle_release(
                lambda: token_of(self, lease.key, lease.owner) is not None,
                send,
                lost.error,
                budget(lease.ttl),
            )

    def _free_for(self, key: str, claimant: Optional[str]) -> bool:
        found = self._aggregate(
            f"reading {key!r}",
            {"_id": key},
            {"held": {"$size": x.LIVE}, "limit": 1, "line": x.live_mark(LINE)},
        )
        if not found:
            return True
        [doc] = found
        if doc["held"] and doc["held"] >= doc.get("limit", 1):
            return False
        return first_in_line(doc.get("line"), claimant, _seconds(doc["now"]))

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        # Change streams would push, but they need a replica set: polling works on any.
        deadline = time.monotonic() + timeout
        delay = POLL_MIN
        while not self._free_for(key, claimant):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, POLL_MAX)

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        match: dict = {"_id": {"$gte": prefix}}
        if prefix and ord(prefix[-1]) < 0x10FFFF:  # every key starting with it sorts below
            match["_id"]["$lt"] = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        infos = self._holders(match, f"listing holders under {prefix!r}")
        return [info for info in infos if info.key.startswith(prefix)]

    def holders_of(self, key: str) -> list[LeaseInfo]:
        return self._holders({"_id": key}, f"reading {key!r}")

    def _holders(self, match: dict, action: str) -> list[LeaseInfo]:
        describe = {
            "$map": {
                "input": x.LIVE,
                "as": "h",
                "in": {
                    "o": "$$h.o",
                    "t": "$$h.t",
                    "h": "$$h.h",
                    "left": {"$subtract": ["$$h.exp", x.NOW]},
                },
            }
        }
        found = self._aggregate(action, match, {"holders": describe})
        return [
            LeaseInfo(doc["_id"], h["o"], int(h["t"]), h["left"] / 1000, h.get("h") or {})
            for doc in sorted(found, key=lambda d: d["_id"])
            for h in sorted(doc.get("holders") or [], key=lambda h: h["t"])
        ]

    def holders_page(
        self,
        prefix: str = "",
        cursor: Optional[str] = None,
        count: int = 100,
        kinds: Sequence[str] = (),
    ) -> HoldersPage:
        # One aggregate: a key's document holds its holders and its marks.
        match: dict = {"_id": {"$gte": prefix}}
        if cursor is not None:
            match["_id"]["$gt"] = cursor
        if prefix and ord(prefix[-1]) < 0x10FFFF:
            match["_id"]["$lt"] = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        match["$expr"] = {"$gt": [{"$size": x.LIVE}, 0]}
        describe = {
            "$map": {
                "input": x.LIVE,
                "as": "h",
                "in": {
                    "o": "$$h.o",
                    "t": "$$h.t",
                    "h": "$$h.h",
                    "left": {"$subtract": ["$$h.exp", x.NOW]},
                },
            }
        }
        marks = {f"m{i}": x.live_mark(_field(kind)) for i, kind in enumerate(kinds)}
        pipeline = [
            {"$match": match},
            {"$sort": {"_id": 1}},
            {"$limit": count + 1},
            {"$project": {"holders": describe, **marks}},
        ]
        found = self._call(
            f"listing holders under {prefix!r}", lambda c: list(c.aggregate(pipeline))
        )
        rows = [
            (
                doc["_id"],
                LeaseInfo(doc["_id"], h["o"], int(h["t"]), h["left"] / 1000, h.get("h") or {}),
                [doc.get(f"m{i}") for i in range(len(kinds))],
            )
            for doc in found
            if doc["_id"].startswith(prefix)
            for h in sorted(doc.get("holders") or [], key=lambda h: h["t"])
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

        return self._call(f"force-releasing {key!r}", force)

    # --- records and marks ------------------------------------------------------------

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        doc = self._call(
            f"reading the record {name!r} of {lease_key!r}",
            lambda c: c.find_one({"_id": lease_key}, {"records": 1}),
        )
        for record in (doc or {}).get("records") or []:
            if record.get("n") == name:
                return record.get("v")
        return None

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        others = {
            "$filter": {
                "input": {"$ifNull": ["$records", []]},
                "as": "r",
                "cond": {"$ne": ["$$r.n", {"$literal": name}]},
            }
        }
        entry = {"n": {"$literal": name}, "v": {"$literal": value}}
        update = [
            {"$set": {"records": {"$concatArrays": [others, [entry]]}}},
            {"$unset": "gc_at"},  # a document with records is never collected
        ]
        query = {"_id": lease.key, "$expr": x.holds(lease.owner)}
        result = self._call(
            f"writing the record {name!r} of {lease.key!r}", lambda c: c.update_one(query, update)
        )
        return result.matched_count > 0

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        found = self._aggregate(
            f"reading the {kind} mark of {key!r}", {"_id": key}, {"v": x.live_mark(_field(kind))}
        )
        return found[0].get("v") if found else None

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        field = _field(kind)
        ttl_ms = max(1, math.ceil(ttl * 1000))
        action = f"changing the {kind} mark of {key!r}"
        live = x.mark_is_live(field)
        if expected is not None:
            # The document exists (its mark is live): an update, no upsert, may say so in
            # its query.
            query = {
                "_id": key,
                "$expr": {"$and": [live, {"$eq": [f"$marks.{field}.v", {"$literal": expected}]}]},
            }
            if new is None:
                update = [{"$unset": f"marks.{field}"}, {"$set": {"rev": x.bump_rev()}}]
            else:
                mark = {"v": {"$literal": new}, "exp": {"$add": [x.NOW, ttl_ms]}}
                changes = {f"marks.{field}": mark, "rev": x.bump_rev(), "gc_at": x.gc_at(ttl_ms)}
                update = [{"$set": changes}]
            result = self._call(action, lambda c: c.update_one(query, update))
            return result.matched_count > 0
        if new is None:  # "delete it if absent": only a live mark makes it false
            query = {"_id": key, "$expr": live}
            return self._call(action, lambda c: c.find_one(query, {"_id": 1})) is None
        # Create where there is none: an upsert, so the test is in the pipeline, and a
        # token of this call's own in the mark tells whether it was this call that set it.
        token = uuid.uuid4().hex
        mark = {"v": {"$literal": new}, "exp": {"$add": [x.NOW, ttl_ms]}, "s": token}
        update = [
            {"$set": {"_swap": {"$not": [live]}}},
            {
                "$set": {
                    f"marks.{field}": x.when("_swap", mark, f"marks.{field}"),
                    "rev": x.when("_swap", x.bump_rev(), "rev"),
                    "gc_at": x.when("_swap", x.gc_at(ttl_ms), "gc_at"),
                }
            },
            {"$unset": "_swap"},
        ]

        def swap(collection) -> bool:
            for _ in range(CAS_ATTEMPTS):
                try:
                    doc = collection.find_one_and_update(
                        {"_id": key},
                        update,
                        projection={f"marks.{field}.s": 1},
                        upsert=True,
                        return_document=ReturnDocument.AFTER,
                    )
                except mongo_errors.DuplicateKeyError:
                    continue  # created by another call meanwhile: try again on it
                return ((doc or {}).get("marks") or {}).get(field, {}).get("s") == token
            return False

        return self._call(action, swap)

    # --- the store's clock, the start-up check ---------------------------------------

    def store_time(self) -> float:
        def now(collection) -> float:
            return _seconds(collection.database.command("hello")["localTime"])

        return self._call("reading the time", now)

    def check(self, probe_key: str) -> list[str]:
        warnings = super().check(probe_key)

        def topology(collection) -> dict:
            return collection.database.command("hello")

        hello = self._call("reading the topology", topology)
        if not hello.get("setName") and hello.get("msg") != "isdbgrid":
            warnings.append(
                f"the MongoDB server at {self.safe_url} is a standalone: a grant is on one "
                "disk only, and a restore from backup can hand out a key twice (fencing "
                "tokens still rise, floored by the server clock). Use a replica set."
            )
        return warnings

    def close(self) -> None:
        with self._lock:
            if self._client is not None and self._pid == os.getpid():
                self._client.close()
            self._client = self._collection = None


def _seconds(value) -> float:
    """A BSON date (a timezone-aware or naive UTC datetime) as epoch seconds."""
    if value.tzinfo is None:
        import datetime

        value = value.replace(tzinfo=datetime.timezone.utc)
    return value.timestamp()
