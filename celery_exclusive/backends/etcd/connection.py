"""The etcd store's connection: a client of etcd v3's JSON gateway (``/v3/kv/*``,
``/v3/lease/*``, ``/v3/watch``) over ``requests``, the process's etcd leases, and the
one place its failures become the library's errors (:meth:`EtcdConnection.translate`).

Why the gateway and not gRPC: the gRPC clients on PyPI are either unmaintained
(python-etcd3, last released 2020, fails to import with protobuf 4+) or pull grpcio
(tens of MB of native wheels, fork-unsafe in prefork workers unless configured). The
gateway is part of every etcd v3 server (3.4 serves it at ``/v3/`` and ``/v3beta/``,
3.5 and later at ``/v3/``), speaks plain JSON over HTTP/1.1, and needs only
``requests``, which is fork-safe when each process makes its own session.

URL: ``etcd://[user:password@]host:2379[,host2:2379][/root/prefix][?options]``;
``etcds://`` for TLS, with ``cacert=``, ``cert=`` and ``key=`` (file paths). Several
hosts are tried in turn. A user and password are exchanged for a token at
``/v3/auth/authenticate``; an expired token is renewed once and the call retried.

Each process keeps one etcd lease per distinct lease ttl (whole seconds, rounded up),
granted on its first acquire and kept alive by ``renew()`` (the heartbeat); every
holder entry of the process is attached to it. A process that dies stops renewing it,
and etcd deletes every key attached to it after its ttl. A key put on that shared lease
lives only as long as the lease has left, so the lease is granted LEASE_SLACK seconds
longer than the ttl and an acquire first keeps it alive when it was last kept alive
more than LEASE_SLACK ago: every grant outlives its ttl.

A holder entry's mod revision (the revision of the write that granted it) is the
grant's fencing token: etcd revisions are cluster-wide and only rise. Renewals and
releases compare it, so an entry written again under the same name is never taken for
the grant it was.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Callable, Optional
from urllib.parse import parse_qs, unquote, urlsplit

import requests

from ...errors import BackendUnavailable, ConfigurationError, ExclusiveError
from ..base import Connection, Lease, LeaseInfo, recipe_of, unavailable
from ..readback import budget, settle_acquire, settle_release
from . import kv
from .clock import ServerClock

#: Seconds to connect, and to wait for an answer (a watch sets its own read timeout).
CONNECT_TIMEOUT, READ_TIMEOUT = 3.0, 5.0
OPTIONS = ("cacert", "cert", "key", "recipe")
#: Times a grant retries when another contender changed the key between read and write.
CAS_ATTEMPTS = 8
#: Operations per transaction (etcd's default --max-txn-ops is 128).
MAX_TXN_OPS = 100
#: Seconds a key whose acquire answer was lost stays on the list of keys to delete: a
#: write etcd had in its pipeline lands within that. A key whose release failed stays
#: on it until a delete succeeds: this process keeps its etcd lease alive, and so the key.
ORPHAN_SECONDS = 60.0
#: Seconds a process's etcd lease outlives the ttl it serves: a key put on it within
#: that long after the lease was last kept alive still lives a full ttl.
LEASE_SLACK = 1
# gRPC status codes the gateway puts in its error bodies (google.golang.org/grpc/codes).
INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED, UNIMPLEMENTED, UNAUTHENTICATED = 3, 5, 7, 12, 16


class EtcdError(Exception):
    """An answer of the gateway that is an error, with its gRPC code."""

    def __init__(self, code: int, message: str, status: int) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


class EtcdConnection(Connection):
    """Requests to one etcd cluster: one HTTP session and one set of etcd leases per
    process."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        parts = urlsplit(url)
        query = {name: values[-1] for name, values in parse_qs(parts.query).items()}
        unknown = sorted(set(query) - set(OPTIONS))
        if unknown:
            raise ConfigurationError(
                f"exclusive_backend_url has unknown option(s) {', '.join(unknown)}; "
                f"an etcd:// URL accepts: {', '.join(OPTIONS)}."
            )
        self.cacert, self.cert, self.key = (query.get(o) for o in ("cacert", "cert", "key"))
        scheme = "https" if parts.scheme == "etcds" else "http"
        if scheme == "http" and (self.cacert or self.cert or self.key):
            raise ConfigurationError(
                "exclusive_backend_url gives TLS files (cacert/cert/key) to an etcd:// URL; "
                "write etcds:// to use TLS."
            )
        hosts = parts.netloc.rsplit("@", 1)[-1] or "127.0.0.1:2379"
        # host, host:port, [v6] or [v6]:port, with etcd's port if none
        ports = [h if ":" in h.rpartition("]")[2] else h + ":2379" for h in hosts.split(",")]
        self.endpoints = tuple(f"{scheme}://{host}" for host in ports)
        self.user = unquote(parts.username) if parts.username else None
        self.password = unquote(parts.password) if parts.password else None
        path = unquote(parts.path).strip("/")
        #: The prefix of every key the store writes: the URL's path; without one, the
        #: library's layout keeps to ``celery-exclusive/``, a recipe locks the bare name.
        self.root = path + "/" if path else ("" if recipe_of(url) else "celery-exclusive/")
        self.clock = ServerClock()
        self._lock = threading.Lock()
        self._pid: Optional[int] = None
        self._session: Optional[requests.Session] = None
        self._token: Optional[str] = None
        self._endpoint = 0
        #: lease ttl in whole seconds -> this process's etcd lease id for it
        self._leases: dict[int, str] = {}
        #: etcd lease id -> monotonic time its last grant or keepalive was sent
        self._kept_alive: dict[str, float] = {}
        #: entries an answer was lost about -> (until when to delete them, the condition
        #: that they are still the lost write's)
        self._orphans: dict[bytes, tuple[float, dict]] = {}

    # --- requests ---------------------------------------------------------------------

    def _here(self) -> requests.Session:
        """This process's session. A forked child starts afresh: its parent's socket and
        etcd leases are not its own (its keys must die with it, not with its parent)."""
        with self._lock:
            if self._pid != os.getpid():
                self._pid, self._session, self._token = os.getpid(), None, None
                self._leases, self._kept_alive, self._orphans = {}, {}, {}
            if self._session is None:
                self._session = requests.Session()
                self._session.verify = self.cacert or True
                if self.cert:
                    self._session.cert = (self.cert, self.key) if self.key else self.cert
            return self._session

    def call(self, action: str, path: str, body: dict, key: Optional[str] = None) -> dict:
        """POST ``body`` to ``/v3/<path>``; the decoded answer. An expired auth token is
        renewed once; every failure leaves as :meth:`translate` makes it."""
        try:
            try:
                return _decode(self._post(path, body))
            except EtcdError as exc:
                if exc.code != UNAUTHENTICATED or not self.user:
                    raise
                self._token = None
                return _decode(self._post(path, body))
        except (EtcdError, requests.RequestException, OSError) as exc:
            raise self.translate(exc, action, key) from None

    def txn(self, action: str, compare: list, success: list, failure: Sequence = ()) -> dict:
        body = {"compare": compare, "success": success, "failure": list(failure)}
        return self.call(action, "kv/txn", body)

    def get(self, name: bytes, action: str) -> Optional[str]:
        found = self.call(action, "kv/range", kv.ranged(name)).get("kvs", [])
        return kv.text_of(found[0]) if found else None

    def _post(self, path: str, body: dict, timeout=READ_TIMEOUT, stream=False):
        """Try each endpoint in turn, starting with the last one that answered."""
        session, headers = self._here(), {}
        if self.user and path != "auth/authenticate":
            if self._token is None:
                login = {"name": self.user, "password": self.password or ""}
                self._token = _decode(self._post("auth/authenticate", login))["token"]
            headers["Authorization"] = self._token
        for i in range(len(self.endpoints)):
            index = (self._endpoint + i) % len(self.endpoints)
            try:
                sent = time.monotonic()
                response = session.post(
                    f"{self.endpoints[index]}/v3/{path}",
                    data=json.dumps(body),
                    headers=headers,
                    timeout=(CONNECT_TIMEOUT, timeout),
                    stream=stream,
                )
                self.clock.observe(response.headers.get("Date"), sent, time.monotonic())
                self._endpoint = index
                return response
            except (requests.ConnectionError, requests.Timeout) as exc:
                if i == len(self.endpoints) - 1 or isinstance(exc, requests.exceptions.SSLError):
                    raise
        raise AssertionError("unreachable")

    def watch(self, request: dict, timeout: float, action: str) -> None:
        """Block until the watch ``request`` reports a change, or ``timeout`` passes.

        ``timeout`` is what is left of the caller's wait, not a bound on how long etcd
        may take to answer: a watch whose answer comes after it saw no change in time,
        and returns. Whether etcd answers at all, the caller's next read says.
        """
        try:
            response = self._post("watch", {"create_request": request}, max(timeout, 0.05), True)
            if response.status_code != 200:
                _decode(response)
        except requests.exceptions.ReadTimeout:
            return
        except (EtcdError, requests.RequestException, OSError) as exc:
            raise self.translate(exc, action) from None
        try:
            for line in response.iter_lines():
                result = json.loads(line).get("result", {}) if line else {}
                if result.get("events") or result.get("canceled"):
                    return
        except (requests.RequestException, ValueError, OSError):
            return  # the read timed out (no change), or the stream broke: read again
        finally:
            response.close()

    def translate(self, exc: BaseException, action: str, key=None) -> ExclusiveError:
        """The library's error for an etcd or HTTP failure; it keeps the failure
        (:func:`cause_of`) for the store's own decisions (a lease to grant again, an
        answer to read back) without chaining it."""
        fix = _fix(exc, self.root)
        if fix is None:  # no leader, a timeout, a server shutting down: retrying can cure it
            error: ExclusiveError = unavailable(self.safe_url, action, exc)
        else:
            text = (str(exc).strip().splitlines() or [""])[0]
            error = ConfigurationError(
                f"the etcd store at {self.safe_url} refused {action} "
                f"({type(exc).__name__}: {text}): {fix}."
            )
        error.etcd_error = exc  # type: ignore[attr-defined]
        return error

    # --- holder entries on this process's etcd leases -----------------------------------

    def acquire(
        self,
        owner: str,
        ttl: float,
        value: str,
        names: Sequence[bytes],
        grant: Callable[[str], Optional[tuple[int, bytes]]],
    ) -> Optional[tuple[int, bytes]]:
        """``grant(etcd lease id)``, which writes the holder entry ``value`` on this
        process's etcd lease for ``ttl``: (the grant's token, the entry's name), or None.

        An etcd lease that expired meanwhile is granted again; a lost answer is read
        back among ``names`` (where the grant may have written), and a write that may
        still land is deleted by the heartbeat later.
        """
        for attempt in (1, 2):
            lease_id = self._lease_for(ttl)
            try:
                return grant(lease_id)
            except ExclusiveError as error:
                cause = cause_of(error)
                if isinstance(cause, EtcdError) and cause.code == NOT_FOUND and attempt == 1:
                    self._forget_lease(lease_id)  # the process's etcd lease expired
                    continue
                if not (isinstance(error, BackendUnavailable) and maybe_sent(cause)):
                    raise

                def written() -> Optional[tuple[int, bytes]]:
                    answer = self.txn("reading back", [], [kv.read(name) for name in names])
                    for name, response in zip(names, answer["responses"]):
                        for entry in kv.kvs(response):
                            if kv.owner_of(entry) == owner:
                                return kv.token(entry), name
                    return None

                try:
                    return settle_acquire(written, error, budget(ttl))
                except BackendUnavailable:
                    for name in names:
                        self._orphan(name, kv.compare(name, "VALUE", kv.b64(value.encode())))
                    raise
        raise AssertionError("unreachable")

    def contended(self, key: str) -> BackendUnavailable:
        """The error of a grant that found ``key`` changed under every attempt."""
        return BackendUnavailable(
            f"the key {key!r} in {self.safe_url} kept changing under {CAS_ATTEMPTS} grant "
            "attempts; try again.",
            self.safe_url,
        )

    def renew(self, held: Sequence[tuple[Lease, bytes]]) -> set[Lease]:
        """Keep this process's etcd leases alive, then tell which of ``held`` (each lease
        with its holder entry's name) are gone."""
        self._here()
        with self._lock:
            lease_ids = {self._leases.get(_seconds(lease.ttl)) for lease, _ in held}
        self._delete_orphans()
        for lease_id in lease_ids - {None}:
            self._keep_alive(lease_id)
        lost = set()
        for start in range(0, len(held), MAX_TXN_OPS):
            chunk = held[start : start + MAX_TXN_OPS]
            reads = [kv.read(name, keys_only=True) for _, name in chunk]
            answer = self.txn(f"renewing {len(held)} lease(s)", [], reads)
            for (lease, _), response in zip(chunk, answer.get("responses", [])):
                if not any(kv.token(e) == lease.fencing_token for e in kv.kvs(response)):
                    lost.add(lease)
        return lost

    def release(self, lease: Lease, name: bytes) -> bool:
        """Delete the holder entry ``name`` of ``lease``, if it is still the grant's."""
        granted = kv.compare(name, "MOD", str(lease.fencing_token))

        def send() -> bool:
            action = f"releasing {lease.key!r}"
            return bool(self.txn(action, [granted], [kv.delete(name)]).get("succeeded"))

        def held() -> bool:
            found = self.call("reading back", "kv/range", kv.ranged(name)).get("kvs", [])
            return any(kv.token(entry) == lease.fencing_token for entry in found)

        try:
            return send()
        except BackendUnavailable as error:
            # Deleted later, by the heartbeat or the next acquire: this process keeps its
            # etcd lease alive, so the key would not expire by itself.
            self._orphan(name, granted, math.inf)
            if not maybe_sent(cause_of(error)):
                raise
            return settle_release(held, send, error, budget(lease.ttl))

    def _lease_for(self, ttl: float) -> str:
        """This process's etcd lease for ``ttl``, with at least ``ttl`` seconds left."""
        seconds = _seconds(ttl)
        self._here()
        with self._lock:
            lease_id = self._leases.get(seconds)
            sent = self._kept_alive.get(lease_id or "", 0.0)
        if lease_id is not None and time.monotonic() - sent > LEASE_SLACK:
            self._delete_orphans()  # kept alive with the lease: delete them first
            if not self._keep_alive(lease_id):
                lease_id = None
        if lease_id is None:
            sent = time.monotonic()
            lease_id = self.grant_lease(seconds + LEASE_SLACK, "granting an etcd lease")
            with self._lock:
                lease_id = self._leases.setdefault(seconds, lease_id)
                self._kept_alive.setdefault(lease_id, sent)
        return lease_id

    def grant_lease(self, ttl: float, action: str) -> str:
        """A new etcd lease of ``ttl`` seconds (rounded up, one at least)."""
        return self.call(action, "lease/grant", {"TTL": _seconds(ttl)})["ID"]

    def _keep_alive(self, lease_id: str) -> bool:
        """Keep an etcd lease alive; False (and forgotten) if it had expired."""
        sent = time.monotonic()
        answer = self.call("renewing the etcd lease", "lease/keepalive", {"ID": lease_id})
        if int(answer.get("result", {}).get("TTL", 0)) <= 0:
            self._forget_lease(lease_id)  # expired: every key on it is gone
            return False
        with self._lock:
            self._kept_alive[lease_id] = sent
        return True

    def _forget_lease(self, lease_id: str) -> None:
        with self._lock:
            self._kept_alive.pop(lease_id, None)
            self._leases = {s: known for s, known in self._leases.items() if known != lease_id}

    def _orphan(self, name: bytes, still: dict, until: Optional[float] = None) -> None:
        with self._lock:
            self._orphans[name] = (until or time.monotonic() + ORPHAN_SECONDS, still)

    def _delete_orphans(self) -> None:
        """Delete the entries left by lost answers and failed releases, each if it is
        still the lost write's; a failed release's is forgotten once etcd answered."""
        self._here()
        with self._lock:
            now = time.monotonic()
            self._orphans = {k: o for k, o in self._orphans.items() if o[0] > now}
            orphans = list(self._orphans.items())
        for name, (until, still) in orphans:  # no orphans: no request
            self.txn("deleting keys left by failed releases", [still], [kv.delete(name)])
            with self._lock:
                if until == math.inf and self._orphans.get(name) == (until, still):
                    del self._orphans[name]

    # --- what both layouts read and write ---------------------------------------------

    def holders(self, rows: Sequence[tuple[str, dict]], action: str) -> list[LeaseInfo]:
        """The live leases of holder entries of ours, each row ``(its key, the entry)``,
        with what the time to live of each process's etcd lease says."""
        lives: dict[Optional[str], tuple[Optional[float], Optional[float]]] = {}
        infos = []
        for key, entry in rows:
            lease_id = entry.get("lease")
            if lease_id not in lives:
                lives[lease_id] = self.time_to_live(lease_id, action)
            expires_in, since = lives[lease_id]
            if expires_in is not None and expires_in <= 0:
                continue  # expiring as we read
            record = kv.record_of(entry)
            holder = record.get("holder", {})
            # Told, as every store tells it, for a holder that records its lease's ttl.
            since = since if "ttl" in holder else None
            owner = record.get("owner", "")
            infos.append(LeaseInfo(key, owner, kv.token(entry), expires_in, holder, since))
        return infos

    def time_to_live(self, lease_id: Optional[str], action: str) -> tuple:
        """(seconds an etcd lease has left, seconds since it was last kept alive);
        (None, None) for a key on no lease."""
        if not lease_id:
            return None, None
        answer = self.call(action, "lease/timetolive", {"ID": lease_id})
        left = float(answer.get("TTL", 0))
        return left, max(0.0, float(answer.get("grantedTTL", 0)) - left)

    def force_release(self, prefix: bytes, action: str) -> int:
        """Delete the holder entries of ours right under ``prefix``: another client's
        keys there, and entries under a longer name, are left alone."""
        found = self.call(action, "kv/range", kv.ranged(prefix, prefix=True)).get("kvs", [])
        names = [kv.unb64(entry["key"]) for entry in found if kv.owner_of(entry) is not None]
        mine = [name for name in names if b"/" not in name[len(prefix) :]]
        for start in range(0, len(mine), MAX_TXN_OPS):
            self.txn(action, [], [kv.delete(name) for name in mine[start : start + MAX_TXN_OPS]])
        return len(mine)

    def write_if_held(self, lease: Lease, holder: bytes, name: bytes, value: str) -> bool:
        """Write ``value`` to the record ``name`` if ``holder`` is still ``lease``'s."""
        granted = kv.compare(holder, "MOD", str(lease.fencing_token))
        answer = self.txn(f"writing a record of {lease.key!r}", [granted], [kv.put(name, value)])
        return bool(answer.get("succeeded"))

    def swap(self, name: bytes, expected, new, ttl: float, action: str, also=()) -> bool:
        """Set the mark ``name`` from ``expected`` to ``new`` (None: absent), on an etcd
        lease of its own ttl: etcd, not any worker's clock, ends a mark. ``also`` is
        (conditions, writes) that go with the swap, as a function of that lease."""
        condition = (
            kv.compare(name, "CREATE", "0")
            if expected is None
            else kv.compare(name, "VALUE", kv.b64(expected.encode()))
        )
        lease = None if new is None else self.grant_lease(ttl, action)
        guards, writes = also(lease) if also else ([], [])
        change = kv.delete(name) if new is None else kv.put(name, new, lease)
        return bool(self.txn(action, [condition, *guards], [change, *writes]).get("succeeded"))

    def store_time(self) -> float:
        if not self.clock.known:
            self.call("reading the time", "kv/range", kv.ranged(self.root.encode()))
        return self.clock.now()

    def warnings(self) -> list[str]:
        """What a start-up check adds for this connection."""
        if self.user and any(e.startswith("http:") for e in self.endpoints):
            return [f"{self.safe_url} sends the etcd password in clear text; use etcds://."]
        return []

    def close(self) -> None:
        with self._lock:
            if self._session is not None and self._pid == os.getpid():
                self._session.close()
            self._session = None


def _seconds(ttl: float) -> int:
    """An etcd lease's ttl: whole seconds, one at least."""
    return max(1, math.ceil(ttl))


def _decode(response: requests.Response) -> dict:
    try:
        answer = response.json()
    except ValueError:
        raise EtcdError(-1, response.text[:200], response.status_code) from None
    if response.status_code != 200 or "error" in answer:
        message = answer.get("message") or answer.get("error") or ""
        raise EtcdError(int(answer.get("code", -1)), message, response.status_code)
    return answer


def _fix(exc: BaseException, root: str) -> Optional[str]:
    """What to change for a failure that retrying cannot cure; None for the others."""
    if isinstance(exc, requests.exceptions.SSLError):
        return "check cacert/cert/key and etcds:// in the URL"
    if not isinstance(exc, EtcdError):
        return None
    message = exc.message.lower()
    if exc.code == PERMISSION_DENIED:
        return (
            f"grant the etcd user's role readwrite on the prefix {root!r} "
            "(etcdctl role grant-permission <role> --prefix=true readwrite <prefix>)"
        )
    if exc.code == UNAUTHENTICATED or "authentication failed" in message:
        return "check the user and password in the URL"
    if "user name is empty" in message or "token" in message and exc.code == INVALID_ARGUMENT:
        return "auth is enabled: give user:password@ in the URL"
    if "too many operations" in message or "too large" in message:
        return "raise the server's --max-txn-ops/request size"
    if (exc.status == 404 and exc.code == -1) or exc.code in (INVALID_ARGUMENT, UNIMPLEMENTED):
        return "use etcd 3.4 or later (its /v3/ gateway)"  # no such path, or request
    return None


def cause_of(error: ExclusiveError) -> Optional[BaseException]:
    """The etcd or HTTP failure :meth:`EtcdConnection.translate` made ``error`` from."""
    return getattr(error, "etcd_error", None)


def maybe_sent(exc: Optional[BaseException]) -> bool:
    """Whether a failed request may have reached etcd (so its write may have happened):
    everything but a connection that was never made."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return False
    if isinstance(exc, requests.ConnectionError):
        text = str(exc)
        refused = ("NewConnectionError", "Connection refused", "Name or service")
        return not any(s in text for s in refused)
    if isinstance(exc, EtcdError):
        return exc.status >= 500
    return isinstance(exc, (requests.Timeout, OSError))
