"""Consul lease store: leases are KV locks held by one Consul session per process.

URL: ``consul://host:8500[/root/path]`` or ``consuls://host:8501`` (HTTPS), with the
query options ``token=``, ``dc=``, ``behavior=release|delete`` and ``lock_delay=``
(seconds). An empty host falls back to ``CONSUL_HTTP_ADDR`` and a missing token to
``CONSUL_HTTP_TOKEN``; values in the URL win over the environment. A path names a KV
folder every key lives under, so one ACL policy on that prefix covers the library.

Layout for a lease key ``K`` (under the root path):

``K``           limit 1: locked (``?acquire``) by the holder's session; the value is
                JSON ``{"owner", "limit", "holder"}``.
``K/.lock``     limit > 1 (Consul's semaphore recipe): ``{"Limit": N, "Holders": [...]}``,
                only ever changed by a check-and-set on its ModifyIndex.
``K/<owner>``   limit > 1: one contender key per holder, locked by its session.
``R/.record``   the value of record ``R`` (``write_record``): a plain string, written
                in a transaction that first checks the writer's lease.
``M``           mark ``M`` (names contain ``:~``, so they never clash with the above):
                JSON ``{"value", "expires_at"}`` (unix time). KV has no TTL: an expired
                mark reads as absent and is overwritten or tidied by the next change.
                ``swap_mark`` reads it, compares the value, then writes with a
                ``cas``/``delete-cas`` on the ModifyIndex read (retried if another
                writer won in between): two round trips. Clocks of the workers must
                roughly agree for mark TTLs.
``K:~line``     the line of ``K`` (see ``backends/line.py``), a mark: an acquire guards
                its grant transaction with it. A limit-1 acquire bets on there being
                none (``check-not-exists``: one round trip); if there is one it reads
                the mark and retries guarded by its ModifyIndex (a ``cas`` taking the
                claimant out of the line, or a ``delete-cas`` for its last entry or an
                expired line), atomically with the grant: three round trips. A
                semaphore acquire already reads it with ``K``'s tree.

Sessions. A process opens one session, on its first acquire, and renews it once per
heartbeat for all its leases; a forked child opens its own. The session TTL comes
from the first lease the process takes, clamped to Consul's 10 s-86400 s range (a
WARNING says so), and each granted Lease reports ``min(requested ttl, session ttl)``
so the heartbeat renews often enough for the session. Consul may let an unrenewed
session live up to twice its TTL, so a dead worker's lease outlives it by up to
2 x the session TTL.

Lock delay. Consul's default is 15 s: after a session is invalidated (TTL expiry,
destroy), nobody can lock its keys for that long, a grace period in which a holder
that lost its session can notice before someone else starts. It costs 15 s of
unavailability for the key after every worker crash. Here it defaults to 0 because
the heartbeat and fencing tokens already cover a holder that lost its lease; set
``?lock_delay=15`` to get Consul's behaviour back.

Fencing tokens are ModifyIndex values (Consul's raft index), read back in the
transaction that grants the lease. Unlike LockIndex they keep increasing when a key
is deleted and created again, so they strictly increase across grants.

``wait()`` is a blocking query on the key's prefix: the store wakes it up.
"""

from __future__ import annotations

import base64
import inspect
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional
from urllib.parse import parse_qs, unquote, urlsplit

import consul
import requests

from ..errors import ConfigurationError
from .base import Backend, Lease, LeaseInfo
from .limits import check_limit
from .line import admit, first_in_line, line_mark

logger = logging.getLogger("celery_exclusive")

#: Seconds any request may take (connect or answer), blocking queries included.
REQUEST_TIMEOUT = 5.0
#: A blocking query waits at most this long, so with Consul's jitter (up to wait/16)
#: it answers inside REQUEST_TIMEOUT even with python-consul2, whose timeout is fixed.
MAX_BLOCK = 3.0
#: Consul's session TTL bounds (the session documentation: "between 10s and 86400s").
MIN_SESSION_TTL, MAX_SESSION_TTL = 10.0, 86400.0
#: Consul refuses transactions with more operations than this.
MAX_TXN_OPS = 64
#: How often a semaphore acquire retries when another contender changed ``K/.lock`` first.
CAS_ATTEMPTS = 8

LOCK_SUFFIX, RECORD_SUFFIX = "/.lock", "/.record"
_QUERY_OPTIONS = ("token", "dc", "behavior", "lock_delay")


@dataclass(frozen=True)
class ConsulSettings:
    """Everything a ``consul://`` URL (plus the environment) says."""

    scheme: str
    host: str
    port: int
    root: str = ""
    token: Optional[str] = None
    dc: Optional[str] = None
    behavior: str = "release"
    lock_delay: float = 0.0


def settings_from_url(url: str, environ: Mapping[str, str] = os.environ) -> ConsulSettings:
    """Parse a ``consul://``/``consuls://`` URL, falling back to CONSUL_HTTP_* variables."""
    parts = urlsplit(url)
    scheme = "https" if parts.scheme == "consuls" else "http"
    host, port = parts.hostname, parts.port
    if not host and environ.get("CONSUL_HTTP_ADDR"):
        scheme, host, port = _parse_addr(environ["CONSUL_HTTP_ADDR"], scheme)
    query = {name: values[-1] for name, values in parse_qs(parts.query).items()}
    unknown = sorted(set(query) - set(_QUERY_OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"exclusive_backend_url has unknown option(s) {', '.join(unknown)}; "
            f"a consul:// URL accepts: {', '.join(_QUERY_OPTIONS)}."
        )
    behavior = query.get("behavior", "release")
    if behavior not in ("release", "delete"):
        raise ConfigurationError(
            f"exclusive_backend_url has behavior={behavior!r}; use release or delete."
        )
    try:
        lock_delay = float(query.get("lock_delay", 0))
    except ValueError:
        lock_delay = -1.0
    if lock_delay < 0:
        raise ConfigurationError(
            f"exclusive_backend_url has lock_delay={query['lock_delay']!r}; "
            "give a number of seconds, 0 or more."
        )
    root = unquote(parts.path).strip("/")
    return ConsulSettings(
        scheme=scheme,
        host=host or "127.0.0.1",
        port=port or (8501 if scheme == "https" else 8500),
        root=root + "/" if root else "",
        token=query.get("token") or environ.get("CONSUL_HTTP_TOKEN") or None,
        dc=query.get("dc"),
        behavior=behavior,
        lock_delay=lock_delay,
    )


def _parse_addr(addr: str, scheme: str) -> tuple[str, str, Optional[int]]:
    """CONSUL_HTTP_ADDR is ``host:port`` or ``http(s)://host:port``."""
    parts = urlsplit(addr if "//" in addr else "//" + addr)
    try:
        return parts.scheme or scheme, parts.hostname or "127.0.0.1", parts.port
    except ValueError:
        raise ConfigurationError(
            f"CONSUL_HTTP_ADDR={addr!r} is not host:port or http(s)://host:port."
        ) from None


def timeout_keyword(client_class: type = consul.Consul) -> str:
    """The keyword that sets the request timeout of the installed ``consul`` client.

    python-consul2 and py-consul install the same module: python-consul2 passes
    ``timeout`` through ``**kwargs`` to ``http_connect``; py-consul names it
    ``connections_timeout``. Without either, requests could block forever.
    """
    if "connections_timeout" in inspect.signature(client_class.__init__).parameters:
        return "connections_timeout"
    if "timeout" in inspect.signature(client_class.__init__).parameters:
        return "timeout"
    if "timeout" in inspect.signature(client_class.http_connect).parameters:
        return "timeout"
    raise ConfigurationError(
        "the installed consul client cannot set a request timeout; install "
        "python-consul2 (pip install 'celery-exclusive[consul]') or py-consul."
    )


def client_from_settings(settings: ConsulSettings) -> consul.Consul:
    """A consul client talking to exactly the address and token in ``settings``.

    Both clients let CONSUL_HTTP_TOKEN override an explicit token, and
    python-consul2 lets CONSUL_HTTP_ADDR override an explicit host; the URL must win.
    """
    timeout = {timeout_keyword(): REQUEST_TIMEOUT}
    try:
        client = consul.Consul(
            host=settings.host,
            port=settings.port,
            scheme=settings.scheme,
            token=settings.token,
            dc=settings.dc,
            **timeout,
        )
    except consul.ConsulException as exc:
        raise ConfigurationError(f"the consul client refused its settings: {exc}") from None
    client.token = settings.token
    http = client.http
    if http.base_uri != f"{settings.scheme}://{settings.host}:{settings.port}":
        client.http = type(http)(
            settings.host, settings.port, settings.scheme, http.verify, http.cert, **timeout
        )
    return client


@dataclass
class _Entry:
    """One KV entry, from a KV read or a transaction result."""

    key: str
    modify_index: int
    session: Optional[str]
    value: bytes

    def record(self) -> dict[str, Any]:
        try:
            record = json.loads(self.value or b"null")
        except ValueError:
            return {}
        return record if isinstance(record, dict) else {}


def _from_kv(raw: Mapping[str, Any]) -> _Entry:
    """An entry from the client's KV read (Value already base64-decoded)."""
    return _Entry(raw["Key"], raw["ModifyIndex"], raw.get("Session") or None, raw["Value"] or b"")


def _from_txn(raw: Mapping[str, Any]) -> _Entry:
    """An entry from a /v1/txn result (Value still base64, absent for writes)."""
    value = base64.b64decode(raw["Value"]) if raw.get("Value") else b""
    return _Entry(raw["Key"], raw["ModifyIndex"], raw.get("Session") or None, value)


def _op(verb: str, key: str, **fields: Any) -> dict[str, Any]:
    kv = {"Verb": verb, "Key": key}
    if "value" in fields:
        value = fields["value"]
        raw = value if isinstance(value, bytes) else json.dumps(value).encode()
        kv["Value"] = base64.b64encode(raw).decode()
    if "session" in fields:
        kv["Session"] = fields["session"]
    if "index" in fields:
        kv["Index"] = fields["index"]
    return {"KV": kv}


@dataclass
class _ProcessState:
    """The session of one process. A forked child starts with a fresh one."""

    pid: int = field(default_factory=lambda: os.getpid())
    lock: threading.Lock = field(default_factory=threading.Lock)
    session_id: Optional[str] = None
    session_ttl: float = 0.0
    renewed_at: float = 0.0
    #: limit-1 keys this session locks -> (owner, fencing token; 0 while acquiring).
    #: Consul lets a session lock a key it already holds again (overwriting the
    #: value), so leases of one process must be kept apart here, before the request.
    held: dict[str, tuple[str, int]] = field(default_factory=dict)


class _SessionInvalid(Exception):
    """Raised to retry an acquire once after Consul said our session no longer exists."""


class ConsulBackend(Backend):
    pushes_wakeups = True
    #: The shortest session TTL the server accepts. Consul's is 10 s; only a test
    #: emulator configured with a shorter minimum may lower it.
    min_session_ttl: float = MIN_SESSION_TTL

    def __init__(self, url: str, client: Optional[consul.Consul] = None) -> None:
        super().__init__(url)
        self.settings = settings_from_url(url)
        self._given_client = client
        self._local = threading.local()
        self._state = _ProcessState()

    # -- plumbing -------------------------------------------------------------

    def _client(self) -> consul.Consul:
        """One client per thread and process: requests sessions must not cross either."""
        if self._given_client is not None:
            return self._given_client
        client = getattr(self._local, "client", None)
        if client is None or self._local.pid != os.getpid():
            client = client_from_settings(self.settings)
            self._local.client, self._local.pid = client, os.getpid()
        return client

    def _process(self) -> _ProcessState:
        if self._state.pid != os.getpid():
            self._state = _ProcessState()
        return self._state

    def _call(self, action: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (consul.ConsulException, requests.RequestException, ValueError, KeyError) as exc:
            raise self.unavailable(action, exc) from None

    def _kv(self, key: str) -> str:
        return self.settings.root + key

    def _params(self) -> list[tuple[str, str]]:
        return [("dc", self.settings.dc)] if self.settings.dc else []

    def _headers(self) -> dict[str, str]:
        return {"X-Consul-Token": self.settings.token} if self.settings.token else {}

    def _put(self, path: str, body: Any) -> Any:
        """PUT raw JSON; the response as the client saw it (code, headers, body)."""
        return self._client().http.put(
            lambda response: response,
            path,
            params=self._params(),
            data=json.dumps(body),
            headers=self._headers(),
        )

    def _txn(self, ops: list[dict[str, Any]]) -> list[_Entry]:
        """Run one transaction: its KV results, or ``_TxnFailed`` with Consul's reasons.

        The clients' own ``Txn.put`` sends no token and turns the 409 that carries
        the per-operation errors into an opaque exception, hence the raw request.
        """
        response = self._put("/v1/txn", ops)
        if response.code == 200:
            results = json.loads(response.body).get("Results") or []
            return [_from_txn(result["KV"]) for result in results if result.get("KV")]
        if response.code == 409:
            errors = json.loads(response.body).get("Errors") or []
            raise _TxnFailed(
                [error.get("What", "") for error in errors],
                {error.get("OpIndex") for error in errors},
            )
        if response.code == 500 and "invalid session" in response.body.lower():
            # What a KV acquire answers for a session that no longer exists.
            raise _TxnFailed([response.body.lower()])
        raise consul.ConsulException(f"{response.code} {response.body}")

    # -- the session ----------------------------------------------------------

    def _session(self, ttl: float) -> tuple[str, float]:
        """This process's session id and TTL, created with ``ttl`` if there is none."""
        state = self._process()
        with state.lock:
            if state.session_id is None:
                state.session_ttl = self._session_ttl(ttl)
                state.session_id = self._create_session(state.session_ttl)
                state.renewed_at = time.monotonic()
            return state.session_id, state.session_ttl

    def _session_ttl(self, ttl: float) -> float:
        clamped = min(max(ttl, self.min_session_ttl), MAX_SESSION_TTL)
        if clamped != ttl:
            logger.warning(
                "Consul session TTLs must be %gs-%gs: the lease ttl %gs became a session "
                "TTL of %gs, so a dead worker's leases expire after %gs-%gs.",
                self.min_session_ttl,
                MAX_SESSION_TTL,
                ttl,
                clamped,
                clamped,
                2 * clamped,
            )
        return clamped

    def _create_session(self, ttl: float) -> str:
        # Raw request: the clients assert 10 <= ttl (gone under -O) and send whole seconds.
        body = {
            "Name": f"celery-exclusive {socket.gethostname()} pid {os.getpid()}",
            "TTL": f"{ttl:g}s",
            "Behavior": self.settings.behavior,
            "LockDelay": f"{self.settings.lock_delay:g}s",
        }
        response = self._put("/v1/session/create", body)
        if response.code != 200:
            raise consul.ConsulException(f"{response.code} {response.body}")
        return json.loads(response.body)["ID"]

    def _forget_session(self, session_id: str) -> None:
        """The session is gone: its locks are released; the next acquire opens a new one."""
        state = self._process()
        with state.lock:
            if state.session_id == session_id:
                state.session_id = None
                state.held.clear()

    # -- the protocol ---------------------------------------------------------

    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
    ) -> Optional[Lease]:
        record = {"owner": owner, "limit": limit, "holder": dict(holder or {})}
        acquire = self._acquire_mutex if limit == 1 else self._acquire_slot
        action = f"acquiring {key!r}"
        try:
            return self._call(action, lambda: acquire(key, owner, ttl, record, claimant))
        except _SessionInvalid:
            # The session died since we last used it (HTTP 500 / "invalid session"):
            # open a new one and try once more.
            return self._call(
                action, lambda: acquire(key, owner, ttl, record, claimant, retry=False)
            )

    def _acquire_mutex(
        self,
        key: str,
        owner: str,
        ttl: float,
        record: dict,
        claimant: Optional[str],
        retry: bool = True,
    ) -> Optional[Lease]:
        kv = self._kv(key)
        if not self._reserve(key, owner):
            return None
        state = self._process()
        granted = False
        try:
            session_id, session_ttl = self._session(ttl)
            entries = self._lock_mutex(key, record, session_id, claimant, retry)
            if entries is None:
                return None
            by_key = {entry.key: entry for entry in entries}
            slots = _Slots.of(kv, by_key)
            if slots.live:
                self._txn([_op("unlock", kv, session=session_id)])
                check_limit(key, 1, [slots.limit])
            token = by_key[kv].modify_index
            with state.lock:
                state.held[key] = (owner, token)
            granted = True
            return Lease(key, owner, token, min(ttl, session_ttl), 1)
        finally:
            if not granted:
                with state.lock:
                    if state.held.get(key) == (owner, 0):
                        del state.held[key]

    def _lock_mutex(
        self,
        key: str,
        record: dict,
        session_id: str,
        claimant: Optional[str],
        retry: bool,
    ) -> Optional[list[_Entry]]:
        """Lock ``K`` (reading it and its subtree back) in a transaction guarded by
        the key's line; None if the key is held, in lock-delay or others are in line first.

        The first attempt bets on there being no line (``check-not-exists``),
        so the common acquire is one round trip. Only when that guard alone failed
        is the mark read and the grant retried guarded by what was read.
        """
        kv, mark_kv = self._kv(key), self._kv(line_mark(key))
        grant = [
            _op("lock", kv, value=record, session=session_id),
            _op("get", kv),
            _op("get-tree", kv + "/"),
        ]
        guard: Optional[dict[str, Any]] = _op("check-not-exists", mark_kv)
        for _ in range(CAS_ATTEMPTS):
            try:
                return self._txn([guard, *grant])
            except _TxnFailed as failed:
                if failed.session_invalid:
                    self._forget_session(session_id)
                    if retry:
                        raise _SessionInvalid(str(failed)) from None
                    return None
                if failed.op_indexes != {0}:
                    return None  # held by another session, or in its lock-delay
            guard = _line_guard(mark_kv, self._read_key(mark_kv), claimant, free=1)
            if guard is None:
                return None  # others are in line first
        return None  # the line kept changing under us: treat it as not our turn yet

    def _reserve(self, key: str, owner: str) -> bool:
        """Claim ``key`` for ``owner`` among this process's leases, before asking Consul.

        If another lease of this process is on record for it, ask Consul whether the
        key still carries that grant (it may have expired or been force-released).
        """
        state = self._process()
        with state.lock:
            previous = state.held.get(key)
            if previous is None:
                state.held[key] = (owner, 0)
                return True
            session_id = state.session_id
        if previous[1] == 0 or self._still_granted(self._kv(key), previous[1], session_id):
            return False
        with state.lock:
            if state.held.get(key) == previous:
                state.held[key] = (owner, 0)
                return True
        return False

    def _still_granted(self, kv: str, token: int, session_id: Optional[str]) -> bool:
        """Whether ``kv`` is unchanged since the grant with ``token`` and still ours."""
        if session_id is None:
            return False
        checks = [_op("check-index", kv, index=token), _op("check-session", kv, session=session_id)]
        try:
            self._txn(checks)
        except _TxnFailed:
            return False
        return True

    def _acquire_slot(
        self,
        key: str,
        owner: str,
        ttl: float,
        record: dict,
        claimant: Optional[str],
        retry: bool = True,
    ) -> Optional[Lease]:
        """Consul's semaphore recipe: read the tree, then one transaction that locks our
        contender key and CASes ``K/.lock`` with the pruned holders plus us.

        The tree read (a prefix) also returns the line ``K:~line``, so guarding the
        grant with it costs no extra round trip.
        """
        session_id, session_ttl = self._session(ttl)
        kv, mark_kv = self._kv(key), self._kv(line_mark(key))
        for _ in range(CAS_ATTEMPTS):
            by_key = {entry.key: entry for entry in self._read_tree(kv)[1]}
            mutex = by_key.get(kv)
            if mutex is not None and mutex.session:
                check_limit(key, record["limit"], [1])
            slots = _Slots.of(kv, by_key)
            if slots.live:
                check_limit(key, record["limit"], [slots.limit])
            if len(slots.live) >= record["limit"]:
                return None
            free = record["limit"] - len(slots.live)
            line_guard = _line_guard(mark_kv, by_key.get(mark_kv), claimant, free)
            if line_guard is None:
                return None  # others are in line first
            mutex_guard = (
                _op("check-not-exists", kv)
                if mutex is None
                else _op("check-index", kv, index=mutex.modify_index)
            )
            ops = [
                mutex_guard,
                line_guard,
                _op("lock", f"{kv}/{owner}", value=record, session=session_id),
                _op(
                    "cas",
                    kv + LOCK_SUFFIX,
                    value={"Limit": record["limit"], "Holders": slots.live + [owner]},
                    index=slots.index,
                ),
                _op("get", kv + LOCK_SUFFIX),
            ]
            # Tidy the contender keys of holders found dead, while we are writing.
            room = MAX_TXN_OPS - len(ops)
            ops += [_op("delete-cas", e.key, index=e.modify_index) for e in slots.dead[:room]]
            try:
                entries = self._txn(ops)
            except _TxnFailed as failed:
                if failed.session_invalid:
                    self._forget_session(session_id)
                    if retry:
                        raise _SessionInvalid(str(failed)) from None
                    return None
                continue  # someone else changed K/.lock, K or the mark first: read again
            token = next(e.modify_index for e in entries if e.key == kv + LOCK_SUFFIX)
            return Lease(key, owner, token, min(ttl, session_ttl), record["limit"])
        return None

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        if not leases:
            return set()
        state = self._process()
        session_id = state.session_id
        if session_id is None:
            return set(leases)
        action = f"renewing {len(leases)} lease(s)"
        if not self._call(action, lambda: self._renew_session(session_id)):
            self._forget_session(session_id)
            return set(leases)
        state.renewed_at = time.monotonic()
        # A live session does not mean every key is still ours: an operator's
        # force_release deletes the key. Check each one, in as few transactions as Consul allows.
        lost = set()
        for start in range(0, len(leases), MAX_TXN_OPS):
            chunk = leases[start : start + MAX_TXN_OPS]
            ops = [_op("get-tree", self._lease_kv(lease)) for lease in chunk]
            try:
                entries = self._call(action, self._txn, ops)
            except _TxnFailed as failed:  # reads only: not expected, but never silent
                raise self.unavailable(action, failed) from None
            by_key = {entry.key: entry for entry in entries}
            for lease in chunk:
                entry = by_key.get(self._lease_kv(lease))
                if not _held_by(entry, session_id, lease.owner):
                    lost.add(lease)
        with state.lock:
            for lease in lost:
                if state.held.get(lease.key) == (lease.owner, lease.fencing_token):
                    del state.held[lease.key]
        return lost

    def _renew_session(self, session_id: str) -> bool:
        """Renew the session; False if Consul no longer knows it (HTTP 404)."""
        try:
            self._client().session.renew(session_id)
        except consul.NotFound:
            return False
        return True

    def _lease_kv(self, lease: Lease) -> str:
        """The KV key a lease's session locks: the key itself, or its contender key."""
        kv = self._kv(lease.key)
        return kv if lease.limit == 1 else f"{kv}/{lease.owner}"

    def release(self, lease: Lease) -> bool:
        state = self._process()
        session_id = state.session_id
        if session_id is None:
            return False
        kv = self._kv(lease.key)
        if lease.limit == 1:
            with state.lock:
                if state.held.get(lease.key) != (lease.owner, lease.fencing_token):
                    return False  # not ours, or already released
                del state.held[lease.key]
            # The key's ModifyIndex is still the fencing token unless it was granted again.
            ops = [
                _op("check-index", kv, index=lease.fencing_token),
                _op("unlock", kv, session=session_id),
            ]
        else:
            # K/.lock keeps naming us until the next acquirer prunes holders without a
            # locked contender key: one round trip here instead of a read and a CAS.
            contender = f"{kv}/{lease.owner}"
            ops = [_op("check-session", contender, session=session_id), _op("delete", contender)]
        try:
            self._call(f"releasing {lease.key!r}", lambda: self._txn(ops))
        except (_TxnFailed, _SessionInvalid):
            return False
        return True

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        """A blocking query on the key's prefix, which also covers its line ``K:~line``:
        every waiter wakes on a change and goes back to sleep unless it is first in
        line and a slot is free."""
        kv, mark_kv = self._kv(key), self._kv(line_mark(key))
        deadline = time.monotonic() + timeout
        index, entries = self._call(f"waiting on {key!r}", lambda: self._read_tree(kv))
        while not _free_for(kv, mark_kv, {entry.key: entry for entry in entries}, claimant):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            block = min(remaining, MAX_BLOCK)
            index, entries = self._call(
                f"waiting on {key!r}", self._read_tree, kv, index=index, wait=block
            )

    def _read_tree(
        self, prefix: str, index: int = 0, wait: Optional[float] = None
    ) -> tuple[int, list[_Entry]]:
        """Every entry under ``prefix``; a blocking query when ``index`` is given."""
        kwargs = {"recurse": True}
        if index:
            kwargs.update(index=index, wait=f"{max(1, int(wait * 1000))}ms")
        new_index, raw = self._client().kv.get(prefix, **kwargs)
        new_index = int(new_index or 0)
        # Consul's blocking-query rules: an index that goes backwards must be reset.
        if new_index < index:
            new_index = 0
        return new_index, [_from_kv(item) for item in raw or []]

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        return self._call("listing holders", lambda: self._holders(prefix))

    def _holders(self, prefix: str) -> list[LeaseInfo]:
        _, entries = self._read_tree(self._kv(prefix))
        ttls: dict[str, Optional[float]] = {}
        infos = []
        for entry in sorted(entries, key=lambda e: e.key):
            record = entry.record()
            if not entry.session or "owner" not in record:
                continue
            kv = entry.key if record.get("limit", 1) == 1 else entry.key.rsplit("/", 1)[0]
            key = kv[len(self.settings.root) :]
            if not key.startswith(prefix):
                continue
            if entry.session not in ttls:
                ttls[entry.session] = self._expires_in(entry.session)
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
        _, info = self._client().session.info(session_id)
        return parse_duration(info["TTL"]) if info and info.get("TTL") else None

    def force_release(self, key: str) -> int:
        return self._call(f"force-releasing {key!r}", lambda: self._force_release(key))

    def _force_release(self, key: str) -> int:
        """Delete the key, its contender keys and ``K/.lock``: whoever held them loses
        them (their renewals report it), and the next grant gets a higher ModifyIndex."""
        kv = self._kv(key)
        _, entries = self._read_tree(kv)
        doomed = [
            entry
            for entry in entries
            if entry.key in (kv, kv + LOCK_SUFFIX) or _is_contender(kv, entry)
        ]
        count = sum(1 for entry in doomed if entry.session and entry.key != kv + LOCK_SUFFIX)
        for start in range(0, len(doomed), MAX_TXN_OPS):
            self._txn([_op("delete", entry.key) for entry in doomed[start : start + MAX_TXN_OPS]])
        state = self._process()
        with state.lock:
            state.held.pop(key, None)
        return count

    stores_records = True

    def read_record(self, key: str) -> Optional[str]:
        _, raw = self._call(
            f"reading the record {key!r}", self._client().kv.get, self._kv(key) + RECORD_SUFFIX
        )
        return None if raw is None else (raw["Value"] or b"").decode()

    def write_record(self, lease: Lease, key: str, value: str) -> bool:
        """A fenced write: one transaction checks that our session still locks the
        lease's key (unchanged since the grant, for limit 1) and sets the record."""
        state = self._process()
        session_id = state.session_id
        if session_id is None:
            return False
        lease_kv = self._lease_kv(lease)
        checks = [_op("check-session", lease_kv, session=session_id)]
        if lease.limit == 1:
            with state.lock:
                if state.held.get(lease.key) != (lease.owner, lease.fencing_token):
                    return False  # another lease of this process, or none
            checks.append(_op("check-index", lease_kv, index=lease.fencing_token))
        ops = [*checks, _op("set", self._kv(key) + RECORD_SUFFIX, value=value.encode())]
        try:
            self._call(f"writing the record {key!r}", self._txn, ops)
        except _TxnFailed:
            return False
        return True

    stores_marks = True

    def read_mark(self, name: str) -> Optional[str]:
        entry = self._call(f"reading the mark {name!r}", self._read_key, self._kv(name))
        return _mark_value(entry, time.time())

    def swap_mark(self, name: str, expected: Optional[str], new: Optional[str], ttl: float) -> bool:
        return self._call(
            f"changing the mark {name!r}", self._swap_mark, self._kv(name), expected, new, ttl
        )

    def _swap_mark(self, kv: str, expected: Optional[str], new: Optional[str], ttl: float) -> bool:
        """Read, compare in Python (Consul cannot compare values), then write guarded by
        the ModifyIndex read. A lost race is no answer: the winner may have left a value
        that still equals ``expected`` (a refresh, an A-B-A), so compare again."""
        for _ in range(CAS_ATTEMPTS):
            entry = self._read_key(kv)
            now = time.time()
            if _mark_value(entry, now) != expected:
                return False
            if new is None and entry is None:
                return True  # nothing to delete
            index = entry.modify_index if entry is not None else 0  # 0: create only
            if new is None:
                op = _op("delete-cas", kv, index=index)
            else:
                op = _op("cas", kv, value={"value": new, "expires_at": now + ttl}, index=index)
            try:
                self._txn([op])
            except _TxnFailed:
                continue  # another writer changed it since the read
            return True
        raise consul.ConsulException(
            f"the mark changed under {CAS_ATTEMPTS} compare-and-swaps in a row"
        )

    def _read_key(self, kv: str) -> Optional[_Entry]:
        _, raw = self._client().kv.get(kv)
        return None if raw is None else _from_kv(raw)

    def close(self) -> None:
        """Destroy this process's session, releasing (or deleting) whatever it still holds."""
        state = self._process()
        with state.lock:
            session_id, state.session_id = state.session_id, None
            state.held.clear()
        if session_id is not None:
            try:
                self._client().session.destroy(session_id)
            except (consul.ConsulException, requests.RequestException, ConfigurationError) as exc:
                logger.warning(
                    "Could not destroy Consul session %s at %s (%s); it expires on its own.",
                    session_id,
                    self.safe_url,
                    exc,
                )
        client = getattr(self._local, "client", None)
        if client is not None and self._local.pid == os.getpid():
            http_session = getattr(client.http, "session", None)
            if http_session is not None:
                http_session.close()
        self._local = threading.local()


class _TxnFailed(Exception):
    """Consul rolled a transaction back (HTTP 409); ``reasons`` are its per-operation
    errors and ``op_indexes`` the positions of the operations that failed, which tell
    a failed guard from a failed lock without parsing Consul's messages."""

    def __init__(self, reasons: list[str], op_indexes: Optional[set] = None) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons
        self.op_indexes = op_indexes or set()

    @property
    def session_invalid(self) -> bool:
        return any("invalid session" in reason for reason in self.reasons)


@dataclass
class _Slots:
    """What ``K/.lock`` and the contender keys say about a semaphore."""

    index: int  # ModifyIndex of K/.lock, 0 if absent (a CAS with 0 creates it)
    limit: int
    live: list[str]  # holders whose contender key is locked
    dead: list[_Entry]  # contender keys no session holds any more

    @classmethod
    def of(cls, kv: str, by_key: Mapping[str, _Entry]) -> _Slots:
        lock = by_key.get(kv + LOCK_SUFFIX)
        record = lock.record() if lock is not None else {}
        live = [
            owner
            for owner in record.get("Holders") or []
            if (entry := by_key.get(f"{kv}/{owner}")) is not None and entry.session
        ]
        dead = [e for e in by_key.values() if _is_contender(kv, e) and not e.session]
        return cls(lock.modify_index if lock else 0, int(record.get("Limit") or 0), live, dead)


def _is_contender(kv: str, entry: _Entry) -> bool:
    name = entry.key[len(kv) + 1 :]
    return (
        entry.key.startswith(kv + "/")
        and "/" not in name
        and name != LOCK_SUFFIX[1:]
        and entry.record().get("owner") == name
    )


def _mark_value(entry: Optional[_Entry], now: float) -> Optional[str]:
    """The live value of a mark entry: None when absent, expired or not a mark."""
    record = entry.record() if entry is not None else {}
    value, expires_at = record.get("value"), record.get("expires_at")
    if not isinstance(value, str) or not isinstance(expires_at, (int, float)):
        return None
    return value if expires_at > now else None


def _line_guard(
    mark_kv: str, entry: Optional[_Entry], claimant: Optional[str], free: int
) -> Optional[dict[str, Any]]:
    """The transaction operation that pins a grant to the line as read, or None when
    the line puts others ahead of ``claimant`` for the ``free`` slots.

    No line: ``check-not-exists``. An expired one: a ``delete-cas`` tidying it. A line
    admitting ``claimant``: a ``cas`` (or, for its last entry, a ``delete-cas``) on
    the ModifyIndex read, taking the claimant out with the grant, or a
    ``check-index`` if the claimant was not in it. Each fails the grant if anyone
    changed the line since the read.
    """
    if entry is None:
        return _op("check-not-exists", mark_kv)
    line = _mark_value(entry, time.time())
    if line is None:
        return _op("delete-cas", mark_kv, index=entry.modify_index)
    admitted, rest = admit(line, claimant, free)
    if not admitted:
        return None
    if rest == line:
        return _op("check-index", mark_kv, index=entry.modify_index)
    if rest is None:
        return _op("delete-cas", mark_kv, index=entry.modify_index)
    value = {"value": rest, "expires_at": entry.record()["expires_at"]}
    return _op("cas", mark_kv, value=value, index=entry.modify_index)


def _held_by(entry: Optional[_Entry], session_id: str, owner: str) -> bool:
    return (
        entry is not None and entry.session == session_id and entry.record().get("owner") == owner
    )


def _free_for(kv: str, mark_kv: str, by_key: Mapping[str, _Entry], claimant: Optional[str]) -> bool:
    """Whether ``claimant`` would find a free slot and be first in the line."""
    mutex = by_key.get(kv)
    if mutex is not None and mutex.session:
        return False
    slots = _Slots.of(kv, by_key)
    if slots.live and len(slots.live) >= slots.limit:
        return False
    return first_in_line(_mark_value(by_key.get(mark_kv), time.time()), claimant)


_DURATION = re.compile(r"([\d.]+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds in a Go duration such as ``10s``, ``1m30s`` or ``500ms``."""
    return sum(float(number) * _UNITS[unit] for number, unit in _DURATION.findall(text))
