"""The MongoDB store's connection: one pymongo client per process, the URL's options,
the server's clock, and the one place a pymongo exception becomes the library's error
(:meth:`MongoDBConnection.translate`).

Transient (no server selected in time, a network error, a primary stepping down, a
write concern not yet satisfied): :class:`BackendUnavailable`. Permanent (the
password, the role's privileges, TLS, a server too old for update pipelines, a bad
URL): :class:`ConfigurationError` naming what to fix. A write sent whose answer did not
come is read back (:mod:`..readback`), never guessed at.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Optional, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pymongo
import pymongo.errors as mongo_errors
from pymongo import ReturnDocument
from pymongo.collection import Collection
from pymongo.read_concern import ReadConcern
from pymongo.write_concern import WriteConcern

from ...errors import ConfigurationError, ExclusiveError
from ..base import Backend, Connection, Lease, unavailable
from ..readback import LostAnswer, budget, settle_acquire, settle_release, token_of
from . import expressions as x

T = TypeVar("T")

#: The store's own collection: one document per key (see :mod:`.expressions`).
COLLECTION = "exclusive_leases"
DEFAULT_DATABASE = "celery_exclusive"
#: URL options of the store's own, which pymongo never sees.
OPTIONS = ("recipe", "collection")
#: Client timeouts (ms) unless the URL sets them: a dead server never hangs a worker.
CLIENT_DEFAULTS = {
    "serverSelectionTimeoutMS": 5000,
    "connectTimeoutMS": 3000,
    "socketTimeoutMS": 10000,
}
#: Server error codes of an index that exists already with other options or another
#: name (IndexOptionsConflict, IndexKeySpecsConflict): the one there serves.
INDEX_CONFLICTS = (85, 86)
#: Times an upsert is tried again after meeting a document created meanwhile, and a
#: compare-and-swap after the document changed in between.
CAS_ATTEMPTS = 8
#: wait() polls between these bounds (seconds), doubling each time.
POLL_MIN, POLL_MAX = 0.01, 0.2

#: Server error codes retrying cannot fix (src/mongo/base/error_codes.yml), with the fix.
_PERMANENT_CODES = {
    18: "check the user, password and authSource in exclusive_backend_url",  # AuthenticationFailed
    13: "grant the user the readWrite role on the store's database",  # Unauthorized
    8000: "check the user, password and authSource in exclusive_backend_url",  # Atlas auth
    # Update pipelines and $$NOW need MongoDB 4.2 or later:
    9: "use MongoDB 4.2 or later (update pipelines, $$NOW)",  # FailedToParse
    14: "use MongoDB 4.2 or later (update pipelines, $$NOW)",  # TypeMismatch
    40324: "use MongoDB 4.2 or later (update pipelines, $$NOW)",  # unrecognized stage
}
#: Server error codes of a moment's trouble: a failover under way (NotWritablePrimary),
#: InterruptedAtShutdown, PrimarySteppedDown, ShutdownInProgress, WriteConcernFailed,
#: ExceededTimeLimit.
_TRANSIENT_CODES = (10107, 11600, 189, 91, 64, 262)
_TLS_WORDS = ("certificate", "ssl", "tls")


class MongoDBConnection(Connection):
    """A pymongo client of the URL's database (connected on first use, one per process:
    pymongo clients must not cross a fork), with majority write and read concern so
    that a grant acknowledged to a worker survives the failover of a replica set."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
        rest = [(name, value) for name, value in query if name not in OPTIONS]
        #: The URL pymongo is given: this one, less the options of the store's own.
        self.client_url = (
            url if len(rest) == len(query) else urlunsplit(parts._replace(query=urlencode(rest)))
        )
        #: The URL's options of the store's own (``recipe``, ``collection``), by name.
        self.options = {name: value for name, value in query if name in OPTIONS}
        self._lock = threading.Lock()
        self._pid: Optional[int] = None
        self._client: Optional[pymongo.MongoClient] = None
        self._collections: dict[str, Collection] = {}

    # --- the client ---------------------------------------------------------------------

    def collection(self, name: str = COLLECTION, expires_by: str = "gc_at") -> Collection:
        """This process's handle on the collection ``name``, with a TTL index on its date
        field ``expires_by``, made on first use in the process unless one is there
        already (one of the user's own, with other options or another name, serves)."""
        handle = self._collections.get(name) if self._pid == os.getpid() else None
        if handle is not None:
            return handle
        with self._lock:
            if self._pid != os.getpid() or self._client is None:
                url = self.client_url
                options = {k: v for k, v in CLIENT_DEFAULTS.items() if k not in url}
                self._client = pymongo.MongoClient(url, **options, connect=False)
                self._collections, self._pid = {}, os.getpid()
            if name in self._collections:  # made by another thread meanwhile
                return self._collections[name]
            handle = self._client.get_default_database(default=DEFAULT_DATABASE).get_collection(
                name, write_concern=WriteConcern("majority"), read_concern=ReadConcern("majority")
            )
            index: dict[str, Any] = {"name": "gc_at_ttl"} if name == COLLECTION else {}
            try:
                handle.create_index(expires_by, expireAfterSeconds=0, **index)
            except mongo_errors.OperationFailure as exc:
                if exc.code not in INDEX_CONFLICTS:
                    raise
            self._collections[name] = handle
            return handle

    def run(
        self,
        action: str,
        work: Callable[[Collection], T],
        on: tuple[str, str] = (COLLECTION, "gc_at"),
        write: bool = False,
    ) -> T:
        """``work`` on this process's handle of the collection ``on`` (its name and its
        TTL field), every pymongo exception translated. A ``write`` sent whose answer
        did not come raises :class:`.LostAnswer`, for the caller to read back (not one
        to a server that could not even be selected: nothing was sent)."""
        try:
            return work(self.collection(*on))
        except mongo_errors.PyMongoError as exc:
            error = self.translate(exc, action)
            sent = isinstance(exc, (mongo_errors.AutoReconnect, mongo_errors.WriteConcernError))
            if write and sent and not isinstance(exc, mongo_errors.ServerSelectionTimeoutError):
                raise LostAnswer(error) from None
            raise error from None

    def aggregate(
        self, action: str, match: dict, project: dict, on: tuple[str, str] = (COLLECTION, "gc_at")
    ) -> list[dict]:
        """The documents ``match`` finds, as ``project`` shows them, each with ``now``:
        the server's clock as it read them."""
        pipeline = [{"$match": match}, {"$project": {"now": x.NOW, **project}}]
        return self.run(action, lambda c: list(c.aggregate(pipeline)), on)

    def translate(
        self, exc: BaseException, action: str, key: Optional[str] = None
    ) -> ExclusiveError:
        if isinstance(exc, (mongo_errors.ConfigurationError, mongo_errors.InvalidURI)):
            return self._refused(exc, action, "fix exclusive_backend_url")
        if isinstance(exc, mongo_errors.OperationFailure) and exc.code in _PERMANENT_CODES:
            return self._refused(exc, action, _PERMANENT_CODES[exc.code])
        if isinstance(exc, mongo_errors.ServerSelectionTimeoutError) and any(
            word in str(exc).lower() for word in _TLS_WORDS
        ):
            return self._refused(exc, action, "check tls, tlsCAFile and tlsCertificateKeyFile")
        if isinstance(exc, (mongo_errors.ConnectionFailure, mongo_errors.WriteConcernError)) or (
            isinstance(exc, mongo_errors.OperationFailure) and exc.code in _TRANSIENT_CODES
        ):
            return unavailable(self.safe_url, action, exc)
        if isinstance(exc, mongo_errors.PyMongoError):
            return self._refused(exc, action, "check the server's version (4.2 or later)")
        return unavailable(self.safe_url, action, exc)

    def _refused(self, exc: BaseException, action: str, fix: str) -> ConfigurationError:
        text = (str(exc).strip().splitlines() or [""])[0][:300]
        return ConfigurationError(
            f"the MongoDB store at {self.safe_url} refused {action} "
            f"({type(exc).__name__}: {text}): {fix}."
        )

    def close(self) -> None:
        with self._lock:
            if self._client is not None and self._pid == os.getpid():
                self._client.close()
            self._client, self._collections = None, {}

    # --- what every layout asks of the server ---------------------------------------------

    def now(self) -> float:
        """The server's clock, in epoch seconds."""
        hello = self.run("reading the time", lambda c: c.database.command("hello"))
        return seconds(hello["localTime"])

    def warnings(self) -> list[str]:
        """What the start-up check says of the server: a standalone keeps a grant on one
        disk only."""
        hello = self.run("reading the topology", lambda c: c.database.command("hello"))
        if hello.get("setName") or hello.get("msg") == "isdbgrid":
            return []
        return [
            f"the MongoDB server at {self.safe_url} is a standalone: a grant is on one "
            "disk only, and a restore from backup can hand out a key twice (fencing "
            "tokens still rise, floored by the server clock). Use a replica set."
        ]

    @staticmethod
    def poll(free: Callable[[], bool], timeout: float) -> None:
        """Return once ``free()`` says so, or ``timeout`` passes. Change streams would
        push, but they need a replica set: polling works on any."""
        deadline = time.monotonic() + timeout
        delay = POLL_MIN
        while not free():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, POLL_MAX)

    # --- a write whose answer was lost, read back -----------------------------------------

    @staticmethod
    def acquired(store: Backend, asked: Lease, lost: LostAnswer) -> Lease:
        """The lease ``asked`` for (all but its token), whose acquire's answer was lost,
        as ``store`` reads it back; the lost answer's error if it is not there in time.
        A grant that lands later is renewed by nobody and expires after its ttl."""
        read = lambda: token_of(store, asked.key, asked.owner)  # noqa: E731
        token = settle_acquire(read, lost.error, budget(asked.ttl))
        return replace(asked, fencing_token=token)

    @staticmethod
    def released(store: Backend, lease: Lease, send: Callable[[], bool]) -> bool:
        """``send()`` a release until its outcome is known: a lost answer is read back
        (the owner gone: released; still there: sent again), or its error raised."""
        try:
            return send()
        except LostAnswer as lost:
            return settle_release(
                lambda: token_of(store, lease.key, lease.owner) is not None,
                send,
                lost.error,
                budget(lease.ttl),
            )


def upsert(collection: Collection, key: str, update: list, projection: dict) -> Optional[dict]:
    """``find_one_and_update`` of ``key``'s document, created if absent; the document
    after it, as ``projection`` shows it. Two upserts creating the document at once may
    meet a duplicate key: that means it exists, and the update is tried again on it
    (the server retries an ``_id``-only upsert itself), never reported as an error."""
    for _ in range(CAS_ATTEMPTS):
        try:
            return collection.find_one_and_update(
                {"_id": key},
                update,
                projection=projection,
                upsert=True,
                return_document=ReturnDocument.AFTER,
            )
        except mongo_errors.DuplicateKeyError:
            continue
    return None


def seconds(value: datetime.datetime) -> float:
    """A BSON date (a timezone-aware or naive UTC datetime) as epoch seconds."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.timezone.utc)
    return value.timestamp()
