"""HashiCorp's Go client for Consul (``github.com/hashicorp/consul/api``, v1.20), its
``Lock`` and ``Semaphore`` recipes and the ``consul lock`` command, transcribed to
Python statement by statement: a foreign client for tests, since no Go toolchain
installs on the test machines. Not part of the package.

Each step quotes the Go statement it transcribes, in the file and function named in the
docstring above it (paths relative to hashicorp/consul). Go's ``goto WAIT`` loops become
``while True`` loops; goroutines become daemon threads; a closed channel is a set
``threading.Event``; ``(nil, nil)`` is ``None``; an ``error`` is raised as
:class:`ConsulAPIError` (or the named ``Err...`` instances below).

Wire format, as ``api/kv.go`` and ``api/api.go`` send it: flags in decimal
(``strconv.FormatUint(p.Flags, 10)``), ``?wait=`` in milliseconds (``durToMsec``),
``?index=``, ``?consistent``, the body of a write as given, and a write's answer read as
``strings.Contains(body, "true")``.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional
from urllib.parse import quote

import requests

# -- api/lock.go and api/semaphore.go constants -----------------------------------------

DEFAULT_LOCK_SESSION_NAME = "Consul API Lock"
DEFAULT_LOCK_SESSION_TTL = "15s"
DEFAULT_LOCK_WAIT_TIME = 15.0
#: api/lock.go DefaultLockRetryTime: the pause after a refused acquire (a lock delay).
DEFAULT_LOCK_RETRY_TIME = 5.0
DEFAULT_MONITOR_RETRY_TIME = 2.0
#: api/lock.go LockFlagValue: "a magic flag we set to indicate a key is being used for a lock".
LOCK_FLAG_VALUE = 0x2DDCCBC058A50C18

DEFAULT_SEMAPHORE_SESSION_NAME = "Consul API Semaphore"
DEFAULT_SEMAPHORE_SESSION_TTL = "15s"
DEFAULT_SEMAPHORE_WAIT_TIME = 15.0
#: api/semaphore.go DefaultSemaphoreKey: "the key used within the prefix to use for
#: coordination between all the contenders".
DEFAULT_SEMAPHORE_KEY = ".lock"
SEMAPHORE_FLAG_VALUE = 0xE0F69A2BAA414DE0


class ConsulAPIError(Exception):
    """A Go ``error`` (``fmt.Errorf``) returned by the client."""


ErrLockHeld = ConsulAPIError("Lock already held")
ErrLockNotHeld = ConsulAPIError("Lock not held")
ErrLockInUse = ConsulAPIError("Lock in use")
ErrLockConflict = ConsulAPIError("Existing key does not match lock use")
ErrSemaphoreHeld = ConsulAPIError("Semaphore already held")
ErrSemaphoreNotHeld = ConsulAPIError("Semaphore not held")
ErrSemaphoreInUse = ConsulAPIError("Semaphore in use")
ErrSemaphoreConflict = ConsulAPIError("Existing key does not match semaphore use")
ErrSessionExpired = ConsulAPIError("session expired")


# -- api/api.go, api/kv.go, api/session.go -----------------------------------------------


@dataclass
class KVPair:
    """api/kv.go KVPair."""

    Key: str
    CreateIndex: int = 0
    ModifyIndex: int = 0
    LockIndex: int = 0
    Flags: int = 0
    Value: Optional[bytes] = None
    Session: str = ""

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> KVPair:
        import base64

        value = raw.get("Value")
        return cls(
            Key=raw["Key"],
            CreateIndex=int(raw.get("CreateIndex") or 0),
            ModifyIndex=int(raw.get("ModifyIndex") or 0),
            LockIndex=int(raw.get("LockIndex") or 0),
            Flags=int(raw.get("Flags") or 0),
            Value=None if value is None else base64.b64decode(value),
            Session=raw.get("Session") or "",
        )


@dataclass
class QueryOptions:
    """api/api.go QueryOptions: the parts the recipes set."""

    WaitIndex: int = 0
    WaitTime: float = 0.0
    RequireConsistent: bool = False


@dataclass
class QueryMeta:
    LastIndex: int = 0
    LastContact: float = 0.0
    KnownLeader: bool = False


def parse_query_meta(headers) -> tuple[QueryMeta, Optional[ConsulAPIError]]:
    """api/api.go parseQueryMeta: X-Consul-Index if set; X-Consul-LastContact must parse
    (``strconv.ParseUint(header.Get("X-Consul-LastContact"), 10, 64)``, an error if absent);
    ``X-Consul-KnownLeader`` is true only when it says "true"."""
    meta = QueryMeta()
    if headers.get("X-Consul-Index"):
        meta.LastIndex = int(headers["X-Consul-Index"])
    last = headers.get("X-Consul-LastContact", "")
    if not last.isdigit():
        return meta, ConsulAPIError(
            f'Failed to parse X-Consul-LastContact: strconv.ParseUint: parsing "{last}": '
            "invalid syntax"
        )
    meta.LastContact = int(last) / 1000
    meta.KnownLeader = headers.get("X-Consul-KnownLeader") == "true"
    return meta, None


def go_path_join(*parts: str) -> str:
    """Go's path.Join: the non-empty parts joined by "/", then path.Clean."""
    joined = "/".join(p for p in parts if p)
    if not joined:
        return ""
    rooted = joined.startswith("/")
    out: list[str] = []
    for part in joined.split("/"):
        if part in ("", "."):
            continue
        if part == ".." and out and out[-1] != "..":
            out.pop()
        elif part != ".." or not rooted:
            out.append(part)
    cleaned = ("/" if rooted else "") + "/".join(out)
    return cleaned or ("/" if rooted else ".")


def _ms(seconds: float) -> str:
    """api/api.go durToMsec: ``fmt.Sprintf("%dms", ms)``, at least 1 ms if non-zero."""
    ms = int(seconds * 1000)
    if seconds > 0 and ms == 0:
        ms = 1
    return f"{ms}ms"


class Client:
    """api/api.go Client against one agent (``http://host:port``)."""

    def __init__(self, address: str) -> None:
        self.address = address.rstrip("/")
        self.http = requests.Session()

    def _url(self, path: str) -> str:
        # net/url EscapedPath keeps these unescaped in a path.
        return self.address + quote(path, safe="/-_.~$&+,:;=@")

    def do(
        self,
        method: str,
        path: str,
        params: Optional[dict[str, str]] = None,
        q: Optional[QueryOptions] = None,
        body: Optional[bytes] = None,
    ) -> requests.Response:
        """api/api.go setQueryOptions (``index``, ``wait``, ``consistent``) and doRequest."""
        params = dict(params or {})
        if q is not None:
            if q.RequireConsistent:
                params["consistent"] = ""
            if q.WaitIndex:
                params["index"] = str(q.WaitIndex)
            if q.WaitTime:
                params["wait"] = _ms(q.WaitTime)
        wait = q.WaitTime if q is not None and q.WaitIndex else 0.0
        return self.http.request(
            method,
            self._url(path),
            params={k: v for k, v in sorted(params.items())},
            data=body,
            timeout=30 + wait * 1.1,
        )

    def query(self, path: str, q: Optional[QueryOptions] = None) -> tuple[Any, QueryMeta]:
        """api/api.go Client.query: requireOK, then parseQueryMeta, whose error is returned."""
        resp = _require_ok(self.do("GET", path, q=q))
        meta, err = parse_query_meta(resp.headers)
        if err is not None:
            raise err
        return resp.json(), meta

    def write(self, path: str, obj: Any) -> Any:
        """api/api.go Client.write: a PUT of ``obj`` as JSON, requireOK, the JSON answer."""
        body = None if obj is None else json.dumps(obj).encode()
        resp = _require_ok(self.do("PUT", path, body=body))
        return resp.json() if resp.content else None

    def kv(self) -> KV:
        return KV(self)

    def session(self) -> Session:
        return Session(self)

    def agent_node_name(self) -> str:
        """api/agent.go Agent.NodeName: ``Self()["Config"]["NodeName"]``; Self is a plain
        GET (requireOK, decodeBody), no query meta."""
        return _require_ok(self.do("GET", "/v1/agent/self")).json()["Config"]["NodeName"]


def _require_ok(resp: requests.Response) -> requests.Response:
    """api/api.go requireOK: any status but 200 is an error naming it."""
    if resp.status_code != 200:
        raise ConsulAPIError(f"Unexpected response code: {resp.status_code} ({resp.text})")
    return resp


class KV:
    """api/kv.go KV."""

    def __init__(self, c: Client) -> None:
        self.c = c

    def _get_internal(self, key: str, params, q) -> tuple[Optional[requests.Response], QueryMeta]:
        """kv.go getInternal: ``parseQueryMeta(resp, qm)`` (its error unchecked); 404 is
        "no entry", any other status but 200 an error."""
        resp = self.c.do("GET", "/v1/kv/" + key, params, q)
        meta, _ = parse_query_meta(resp.headers)
        if resp.status_code == 404:
            return None, meta
        if resp.status_code != 200:
            raise ConsulAPIError(f"Unexpected response code: {resp.status_code}")
        return resp, meta

    def Get(self, key: str, q: Optional[QueryOptions] = None):  # noqa: N802 - Go's names
        resp, meta = self._get_internal(key, None, q)
        if resp is None:
            return None, meta
        entries = resp.json()
        return (KVPair.from_json(entries[0]) if entries else None), meta

    def List(self, prefix: str, q: Optional[QueryOptions] = None):  # noqa: N802
        resp, meta = self._get_internal(prefix, {"recurse": ""}, q)
        if resp is None:
            return [], meta
        return [KVPair.from_json(e) for e in resp.json()], meta

    def _put(self, key: str, params: dict[str, str], body: Optional[bytes]) -> bool:
        """kv.go put: ``if len(key) > 0 && key[0] == '/'`` is an error; requireOK; the
        answer is ``strings.Contains(string(buf.Bytes()), "true")``."""
        if key.startswith("/"):
            raise ConsulAPIError(f"Invalid key. Key must not begin with a '/': {key}")
        resp = _require_ok(self.c.do("PUT", "/v1/kv/" + key, params, body=body or b""))
        return "true" in resp.text

    def _flags(self, p: KVPair) -> dict[str, str]:
        # kv.go: if p.Flags != 0 { params["flags"] = strconv.FormatUint(p.Flags, 10) }
        return {"flags": str(p.Flags)} if p.Flags != 0 else {}

    def Put(self, p: KVPair) -> None:  # noqa: N802
        self._put(p.Key, self._flags(p), p.Value)

    def CAS(self, p: KVPair) -> bool:  # noqa: N802
        return self._put(p.Key, {**self._flags(p), "cas": str(p.ModifyIndex)}, p.Value)

    def Acquire(self, p: KVPair) -> bool:  # noqa: N802
        return self._put(p.Key, {**self._flags(p), "acquire": p.Session}, p.Value)

    def Release(self, p: KVPair) -> bool:  # noqa: N802
        return self._put(p.Key, {**self._flags(p), "release": p.Session}, p.Value)

    def _delete(self, key: str, params: dict[str, str]) -> bool:
        resp = _require_ok(self.c.do("DELETE", "/v1/kv/" + key, params))
        return "true" in resp.text

    def Delete(self, key: str) -> None:  # noqa: N802
        self._delete(key, {})

    def DeleteCAS(self, p: KVPair) -> bool:  # noqa: N802
        return self._delete(p.Key, {"cas": str(p.ModifyIndex)})


@dataclass
class SessionEntry:
    """api/session.go SessionEntry: the fields Create sends when set."""

    Name: str = ""
    TTL: str = ""
    Behavior: str = ""
    LockDelay: float = 0.0
    Checks: list[str] = field(default_factory=list)


class Session:
    """api/session.go Session."""

    def __init__(self, c: Client) -> None:
        self.c = c

    def Create(self, se: SessionEntry) -> str:  # noqa: N802
        """session.go Create: only the fields that are set (``if se.Name != ""``, ...);
        ``LockDelay`` as ``durToMsec``. Unset, the agent's defaults apply
        (agent/session_endpoint.go SessionCreate: serfHealth, 15 s lock delay, release)."""
        body: dict[str, Any] = {}
        if se.Name:
            body["Name"] = se.Name
        if se.LockDelay:
            body["LockDelay"] = _ms(se.LockDelay)
        if se.Checks:
            body["Checks"] = se.Checks
        if se.Behavior:
            body["Behavior"] = se.Behavior
        if se.TTL:
            body["TTL"] = se.TTL
        return self.c.write("/v1/session/create", body)["ID"]

    def Destroy(self, session_id: str) -> None:  # noqa: N802
        self.c.write(f"/v1/session/destroy/{session_id}", None)

    def Renew(self, session_id: str) -> Optional[dict[str, Any]]:  # noqa: N802
        """session.go Renew: 404 is ``nil`` (the session is gone), other non-200 an error."""
        resp = self.c.do("PUT", f"/v1/session/renew/{session_id}")
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise ConsulAPIError(f"Unexpected response code: {resp.status_code}")
        entries = resp.json()
        return entries[0] if entries else None

    def Info(self, session_id: str) -> Optional[dict[str, Any]]:  # noqa: N802
        entries, _ = self.c.query(f"/v1/session/info/{session_id}")
        return entries[0] if entries else None

    def List(self) -> list[dict[str, Any]]:  # noqa: N802
        return self.c.query("/v1/session/list")[0]

    def Node(self, node: str) -> list[dict[str, Any]]:  # noqa: N802
        return self.c.query(f"/v1/session/node/{node}")[0]

    def RenewPeriodic(self, initial_ttl: str, session_id: str, done: threading.Event):  # noqa: N802
        """session.go RenewPeriodic: renew every TTL/2 (``waitDur := ttl / 2``); after an
        error retry every second (``waitDur = time.Second``) until a TTL has passed since
        the last renewal; ``entry == nil`` is ErrSessionExpired; on done, Destroy."""
        ttl = parse_duration(initial_ttl)
        wait_dur, last_renew = ttl / 2, time.monotonic()
        while True:
            if time.monotonic() - last_renew > ttl:
                return
            if done.wait(wait_dur):
                with contextlib.suppress(ConsulAPIError, requests.RequestException):
                    self.Destroy(session_id)
                return
            try:
                entry = self.Renew(session_id)
            except (ConsulAPIError, requests.RequestException):
                wait_dur = 1.0
                continue
            if entry is None:
                return  # ErrSessionExpired
            ttl = parse_duration(entry["TTL"]) or ttl
            wait_dur, last_renew = ttl / 2, time.monotonic()


def parse_duration(text: str) -> float:
    from tests.support.consul_emulator import parse_go_duration

    return parse_go_duration(text) or 0.0


def _go(target: Callable, *args: Any) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


# -- api/lock.go --------------------------------------------------------------------------


@dataclass
class LockOptions:
    """api/lock.go LockOptions (defaults applied by LockOpts)."""

    Key: str
    Value: Optional[bytes] = None
    Session: str = ""
    SessionName: str = DEFAULT_LOCK_SESSION_NAME
    SessionTTL: str = DEFAULT_LOCK_SESSION_TTL
    MonitorRetries: int = 0
    MonitorRetryTime: float = DEFAULT_MONITOR_RETRY_TIME
    LockWaitTime: float = DEFAULT_LOCK_WAIT_TIME
    LockTryOnce: bool = False
    LockDelay: float = 0.0


class Lock:
    """api/lock.go Lock: client-side leader election on one key."""

    def __init__(self, c: Client, opts: LockOptions) -> None:
        # lock.go LockOpts: "missing key"; SessionTTL must parse.
        if not opts.Key:
            raise ConsulAPIError("missing key")
        self.c, self.opts = c, opts
        self.is_held = False
        self.session_renew: Optional[threading.Event] = None
        self.lock_session = ""
        self.l = threading.Lock()

    def Lock(self, stop: Optional[threading.Event] = None) -> Optional[threading.Event]:  # noqa: N802
        """lock.go Lock: the returned event is set when the lock is lost; None when
        ``stop`` was set (or LockTryOnce ran out) before the lock was taken."""
        stop = stop or threading.Event()
        with self.l:
            if self.is_held:  # "if l.isHeld { return nil, ErrLockHeld }"
                raise ErrLockHeld
            self.lock_session = self.opts.Session
            created = False
            if self.lock_session == "":
                try:
                    session = self._create_session()
                except (ConsulAPIError, requests.RequestException) as err:
                    raise ConsulAPIError(f"failed to create session: {err}") from None
                self.session_renew = threading.Event()
                self.lock_session = session
                # "go session.RenewPeriodic(l.opts.SessionTTL, s, &wOpts, l.sessionRenew)"
                _go(
                    self.c.session().RenewPeriodic,
                    self.opts.SessionTTL,
                    session,
                    self.session_renew,
                )
                created = True
            try:
                return self._lock(stop)
            finally:
                # "If we fail to acquire the lock, cleanup the session"
                if created and not self.is_held and self.session_renew is not None:
                    self.session_renew.set()
                    self.session_renew = None

    def _lock(self, stop: threading.Event) -> Optional[threading.Event]:
        kv = self.c.kv()
        q_opts = QueryOptions(WaitTime=self.opts.LockWaitTime)
        start, attempts = time.monotonic(), 0
        while True:  # WAIT:
            if stop.is_set():  # "case <-stopCh: return nil, nil"
                return None
            # "Handle the one-shot mode."
            if self.opts.LockTryOnce and attempts > 0:
                elapsed = time.monotonic() - start
                if elapsed > self.opts.LockWaitTime:
                    return None
                q_opts.WaitTime = self.opts.LockWaitTime - elapsed
            attempts += 1
            # "pair, meta, err := kv.Get(l.opts.Key, &qOpts)"
            try:
                pair, meta = kv.Get(self.opts.Key, q_opts)
            except (ConsulAPIError, requests.RequestException) as err:
                raise ConsulAPIError(f"failed to read lock: {err}") from None
            # "if pair != nil && pair.Flags != LockFlagValue { return nil, ErrLockConflict }"
            if pair is not None and pair.Flags != LOCK_FLAG_VALUE:
                raise ErrLockConflict
            # "if pair != nil && pair.Session == l.lockSession { goto HELD }"
            if pair is not None and pair.Session == self.lock_session:
                return self._held()
            # "if pair != nil && pair.Session != "" { qOpts.WaitIndex = meta.LastIndex; goto WAIT }"
            if pair is not None and pair.Session != "":
                q_opts.WaitIndex = meta.LastIndex
                continue
            # "pair = l.lockEntry(l.lockSession); locked, _, err = kv.Acquire(pair, &wOpts)"
            try:
                locked = kv.Acquire(self._lock_entry(self.lock_session))
            except (ConsulAPIError, requests.RequestException) as err:
                raise ConsulAPIError(f"failed to acquire lock: {err}") from None
            if locked:
                return self._held()
            # "Determine why the lock failed": qOpts.WaitIndex = 0; kv.Get again.
            q_opts.WaitIndex = 0
            pair, meta = kv.Get(self.opts.Key, q_opts)
            if pair is not None and pair.Session != "":
                q_opts.WaitIndex = meta.LastIndex  # "a wait can safely happen using a long poll"
                continue
            # "a lock-delay is in effect and a timed wait must be used"
            if stop.wait(DEFAULT_LOCK_RETRY_TIME):
                return None

    def _held(self) -> threading.Event:
        """lock.go HELD: "go l.monitorLock(l.lockSession, leaderCh)"; isHeld = true."""
        leader = threading.Event()
        _go(self._monitor_lock, self.lock_session, leader)
        self.is_held = True
        return leader

    def Unlock(self) -> None:  # noqa: N802
        """lock.go Unlock: stop renewing, then ``kv.Release(lockEnt)``; the key stays."""
        with self.l:
            if not self.is_held:
                raise ErrLockNotHeld
            self.is_held = False
            lock_ent = self._lock_entry(self.lock_session)
            self.lock_session = ""
            try:
                self.c.kv().Release(lock_ent)
            except (ConsulAPIError, requests.RequestException) as err:
                raise ConsulAPIError(f"failed to release lock: {err}") from None
            finally:
                # "defer func() { close(l.sessionRenew) ... }": the session is destroyed.
                if self.session_renew is not None:
                    self.session_renew.set()
                    self.session_renew = None

    def Destroy(self) -> None:  # noqa: N802
        """lock.go Destroy: only a key with the lock's flags and no session, by DeleteCAS."""
        with self.l:
            if self.is_held:
                raise ErrLockHeld
            kv = self.c.kv()
            try:
                pair, _ = kv.Get(self.opts.Key)
            except (ConsulAPIError, requests.RequestException) as err:
                raise ConsulAPIError(f"failed to read lock: {err}") from None
            if pair is None:
                return
            if pair.Flags != LOCK_FLAG_VALUE:
                raise ErrLockConflict
            if pair.Session != "":
                raise ErrLockInUse
            if not kv.DeleteCAS(pair):
                raise ErrLockInUse

    def _create_session(self) -> str:
        """lock.go createSession: Name, TTL, LockDelay (0: the agent's 15 s)."""
        entry = SessionEntry(
            Name=self.opts.SessionName, TTL=self.opts.SessionTTL, LockDelay=self.opts.LockDelay
        )
        return self.c.session().Create(entry)

    def _lock_entry(self, session: str) -> KVPair:
        """lock.go lockEntry: Key, Value, Session and ``Flags: LockFlagValue``."""
        return KVPair(
            Key=self.opts.Key, Value=self.opts.Value, Session=session, Flags=LOCK_FLAG_VALUE
        )

    def _monitor_lock(self, session: str, stop: threading.Event) -> None:
        """lock.go monitorLock: consistent blocking reads while the key carries our
        session; "defer close(stopCh)" once it does not (or a read fails, after
        MonitorRetries retries of server errors)."""
        kv = self.c.kv()
        opts = QueryOptions(RequireConsistent=True)
        try:
            while True:  # WAIT:
                retries = self.opts.MonitorRetries
                while True:  # RETRY:
                    try:
                        pair, meta = kv.Get(self.opts.Key, opts)
                        break
                    except (ConsulAPIError, requests.RequestException):
                        if retries > 0:
                            time.sleep(self.opts.MonitorRetryTime)
                            retries -= 1
                            opts.WaitIndex = 0
                            continue
                        return
                if pair is not None and pair.Session == session:
                    opts.WaitIndex = meta.LastIndex
                    continue
                return
        finally:
            stop.set()


# -- api/semaphore.go ------------------------------------------------------------------------


@dataclass
class SemaphoreOptions:
    """api/semaphore.go SemaphoreOptions (defaults applied by SemaphoreOpts)."""

    Prefix: str
    Limit: int
    Value: Optional[bytes] = None
    Session: str = ""
    SessionName: str = DEFAULT_SEMAPHORE_SESSION_NAME
    SessionTTL: str = DEFAULT_SEMAPHORE_SESSION_TTL
    MonitorRetries: int = 0
    MonitorRetryTime: float = DEFAULT_MONITOR_RETRY_TIME
    SemaphoreWaitTime: float = DEFAULT_SEMAPHORE_WAIT_TIME
    SemaphoreTryOnce: bool = False


@dataclass
class SemaphoreLock:
    """semaphore.go semaphoreLock: ``{"Limit": N, "Holders": {"<session>": true}}``."""

    Limit: int
    Holders: dict[str, bool]


class Semaphore:
    """api/semaphore.go Semaphore: up to Limit holders under one KV prefix."""

    def __init__(self, c: Client, opts: SemaphoreOptions) -> None:
        # semaphore.go SemaphoreOpts: "missing prefix"; "semaphore limit must be positive".
        if not opts.Prefix:
            raise ConsulAPIError("missing prefix")
        if opts.Limit <= 0:
            raise ConsulAPIError("semaphore limit must be positive")
        self.c, self.opts = c, opts
        self.is_held = False
        self.session_renew: Optional[threading.Event] = None
        self.lock_session = ""
        self.l = threading.Lock()

    def Acquire(self, stop: Optional[threading.Event] = None) -> Optional[threading.Event]:  # noqa: N802
        """semaphore.go Acquire."""
        stop = stop or threading.Event()
        with self.l:
            if self.is_held:
                raise ErrSemaphoreHeld
            self.lock_session = self.opts.Session
            created = False
            if self.lock_session == "":
                try:
                    session = self._create_session()
                except (ConsulAPIError, requests.RequestException) as err:
                    raise ConsulAPIError(f"failed to create session: {err}") from None
                self.session_renew = threading.Event()
                self.lock_session = session
                _go(
                    self.c.session().RenewPeriodic,
                    self.opts.SessionTTL,
                    session,
                    self.session_renew,
                )
                created = True
            try:
                return self._acquire(stop)
            finally:
                if created and not self.is_held and self.session_renew is not None:
                    self.session_renew.set()
                    self.session_renew = None

    def _acquire(self, stop: threading.Event) -> Optional[threading.Event]:
        kv = self.c.kv()
        # "Create the contender entry": made, _, err := kv.Acquire(s.contenderEntry(...))
        made, err = False, None
        try:
            made = kv.Acquire(self._contender_entry(self.lock_session))
        except (ConsulAPIError, requests.RequestException) as exc:
            err = exc
        if err is not None or not made:
            raise ConsulAPIError(f"failed to make contender entry: {err or '<nil>'}")
        q_opts = QueryOptions(WaitTime=self.opts.SemaphoreWaitTime)
        start, attempts = time.monotonic(), 0
        while True:  # WAIT:
            if stop.is_set():
                return None
            if self.opts.SemaphoreTryOnce and attempts > 0:
                elapsed = time.monotonic() - start
                if elapsed > q_opts.WaitTime:
                    return None
                q_opts.WaitTime -= elapsed
            attempts += 1
            # "pairs, meta, err := kv.List(s.opts.Prefix, qOpts)"
            try:
                pairs, meta = kv.List(self.opts.Prefix, q_opts)
            except (ConsulAPIError, requests.RequestException) as exc:
                raise ConsulAPIError(f"failed to read prefix: {exc}") from None
            # "lockPair := s.findLock(pairs); if lockPair.Flags != SemaphoreFlagValue"
            lock_pair = self._find_lock(pairs)
            if lock_pair.Flags != SEMAPHORE_FLAG_VALUE:
                raise ErrSemaphoreConflict
            lock = self._decode_lock(lock_pair)
            # "Verify we agree with the limit"
            if lock.Limit != self.opts.Limit:
                raise ConsulAPIError(
                    f"semaphore limit conflict (lock: {lock.Limit}, local: {self.opts.Limit})"
                )
            self._prune_dead_holders(lock, pairs)
            # "if len(lock.Holders) >= lock.Limit { qOpts.WaitIndex = meta.LastIndex; goto WAIT }"
            if len(lock.Holders) >= lock.Limit:
                q_opts.WaitIndex = meta.LastIndex
                continue
            # "lock.Holders[s.lockSession] = true; newLock, err := s.encodeLock(lock, ...)"
            lock.Holders[self.lock_session] = True
            new_lock = self._encode_lock(lock, lock_pair.ModifyIndex)
            try:
                did_set = kv.CAS(new_lock)
            except (ConsulAPIError, requests.RequestException) as exc:
                raise ConsulAPIError(f"failed to update lock: {exc}") from None
            if not did_set:
                continue  # "could have been a race with another contender, retry"
            held = threading.Event()
            _go(self._monitor_lock, self.lock_session, held)
            self.is_held = True
            return held

    def Release(self) -> None:  # noqa: N802
        """semaphore.go Release: take our session out of ``.lock`` by CAS (reading again
        on a lost race), then delete our contender entry."""
        with self.l:
            if not self.is_held:
                raise ErrSemaphoreNotHeld
            self.is_held = False
            lock_session, self.lock_session = self.lock_session, ""
            try:
                kv = self.c.kv()
                key = go_path_join(self.opts.Prefix, DEFAULT_SEMAPHORE_KEY)
                while True:  # READ:
                    pair, _ = kv.Get(key)
                    if pair is None:
                        pair = KVPair(Key="")
                    lock = self._decode_lock(pair)
                    if lock_session not in lock.Holders:
                        break
                    del lock.Holders[lock_session]
                    try:
                        did_set = kv.CAS(self._encode_lock(lock, pair.ModifyIndex))
                    except (ConsulAPIError, requests.RequestException) as exc:
                        raise ConsulAPIError(f"failed to update lock: {exc}") from None
                    if did_set:
                        break
                # "Destroy the contender entry": kv.Delete(path.Join(prefix, lockSession))
                kv.Delete(go_path_join(self.opts.Prefix, lock_session))
            finally:
                if self.session_renew is not None:
                    self.session_renew.set()
                    self.session_renew = None

    def Destroy(self) -> None:  # noqa: N802
        """semaphore.go Destroy: delete ``.lock`` by DeleteCAS once no live holder is in it."""
        with self.l:
            if self.is_held:
                raise ErrSemaphoreHeld
            kv = self.c.kv()
            try:
                pairs, _ = kv.List(self.opts.Prefix)
            except (ConsulAPIError, requests.RequestException) as exc:
                raise ConsulAPIError(f"failed to read prefix: {exc}") from None
            lock_pair = self._find_lock(pairs)
            if lock_pair.ModifyIndex == 0:
                return
            if lock_pair.Flags != SEMAPHORE_FLAG_VALUE:
                raise ErrSemaphoreConflict
            lock = self._decode_lock(lock_pair)
            self._prune_dead_holders(lock, pairs)
            if lock.Holders:
                raise ErrSemaphoreInUse
            if not kv.DeleteCAS(lock_pair):
                raise ErrSemaphoreInUse

    def _create_session(self) -> str:
        """semaphore.go createSession: Name, TTL, ``Behavior: SessionBehaviorDelete``."""
        entry = SessionEntry(
            Name=self.opts.SessionName, TTL=self.opts.SessionTTL, Behavior="delete"
        )
        return self.c.session().Create(entry)

    def _contender_entry(self, session: str) -> KVPair:
        """semaphore.go contenderEntry: ``path.Join(s.opts.Prefix, session)``, our session,
        ``Flags: SemaphoreFlagValue``."""
        return KVPair(
            Key=go_path_join(self.opts.Prefix, session),
            Value=self.opts.Value,
            Session=session,
            Flags=SEMAPHORE_FLAG_VALUE,
        )

    def _find_lock(self, pairs: list[KVPair]) -> KVPair:
        """semaphore.go findLock: the ``<prefix>/.lock`` pair, else an empty one carrying
        ``Flags: SemaphoreFlagValue``."""
        key = go_path_join(self.opts.Prefix, DEFAULT_SEMAPHORE_KEY)
        for pair in pairs:
            if pair.Key == key:
                return pair
        return KVPair(Key="", Flags=SEMAPHORE_FLAG_VALUE)

    def _decode_lock(self, pair: Optional[KVPair]) -> SemaphoreLock:
        """semaphore.go decodeLock: no value is a fresh lock with our limit; otherwise
        ``json.Unmarshal`` ("lock decoding failed: ...")."""
        if pair is None or pair.Value is None:
            return SemaphoreLock(self.opts.Limit, {})
        try:
            raw = json.loads(pair.Value)
        except ValueError as exc:
            raise ConsulAPIError(f"lock decoding failed: {exc}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("Holders") or {}, dict):
            raise ConsulAPIError("lock decoding failed: json: cannot unmarshal")
        return SemaphoreLock(int(raw.get("Limit") or 0), dict(raw.get("Holders") or {}))

    def _encode_lock(self, lock: SemaphoreLock, old_index: int) -> KVPair:
        """semaphore.go encodeLock: the JSON at ``<prefix>/.lock`` with our flag and the
        ModifyIndex read, for a CAS."""
        enc = json.dumps({"Limit": lock.Limit, "Holders": lock.Holders}, separators=(",", ":"))
        return KVPair(
            Key=go_path_join(self.opts.Prefix, DEFAULT_SEMAPHORE_KEY),
            Value=enc.encode(),
            Flags=SEMAPHORE_FLAG_VALUE,
            ModifyIndex=old_index,
        )

    @staticmethod
    def _prune_dead_holders(lock: SemaphoreLock, pairs: list[KVPair]) -> None:
        """semaphore.go pruneDeadHolders: a holder is alive while *any* pair under the
        prefix carries its session (``if pair.Session != "" { alive[pair.Session] = ... }``)."""
        alive = {pair.Session for pair in pairs if pair.Session != ""}
        for holder in list(lock.Holders):
            if holder not in alive:
                del lock.Holders[holder]

    def _monitor_lock(self, session: str, stop: threading.Event) -> None:
        """semaphore.go monitorLock: consistent blocking lists while our session is
        among the (pruned) holders."""
        kv = self.c.kv()
        opts = QueryOptions(RequireConsistent=True)
        try:
            while True:
                retries = self.opts.MonitorRetries
                while True:
                    try:
                        pairs, meta = kv.List(self.opts.Prefix, opts)
                        break
                    except (ConsulAPIError, requests.RequestException):
                        if retries > 0:
                            time.sleep(self.opts.MonitorRetryTime)
                            retries -= 1
                            opts.WaitIndex = 0
                            continue
                        return
                try:
                    lock = self._decode_lock(self._find_lock(pairs))
                except ConsulAPIError:
                    return
                self._prune_dead_holders(lock, pairs)
                if session in lock.Holders:
                    opts.WaitIndex = meta.LastIndex
                    continue
                return
        finally:
            stop.set()


# -- command/lock/lock.go -------------------------------------------------------------------

#: command/lock/lock.go defaultMonitorRetry and defaultMonitorRetryTime.
CONSUL_LOCK_MONITOR_RETRY, CONSUL_LOCK_MONITOR_RETRY_TIME = 3, 1.0


def consul_lock(
    c: Client,
    prefix: str,
    child: Callable[[threading.Event], Any],
    limit: int = 1,
    timeout: float = 0.0,
    name: str = "",
    child_name: str = "child",
) -> dict[str, Any]:
    """``consul lock [-n limit] [-timeout t] prefix child`` (command/lock/lock.go run):
    the agent's node name is read first; with -n 1 an api.Lock on ``path.Join(prefix,
    ".lock")`` ("if a lock and semaphore are both used at the same prefix, we will get a
    conflict"), else an api.Semaphore on ``prefix``; then the child runs (here a callable
    given the lost-lock event), the lock is released and cleaned up (Destroy, its "in use"
    error ignored). Returns what happened: ``{"acquired", "lost", "result", "error"}``."""
    prefix = prefix.lstrip("/")
    name = name or f"Consul lock for '{child_name}' at '{prefix}'"
    c.agent_node_name()  # "_, err = client.Agent().NodeName()"
    oneshot = timeout > 0
    if limit == 1:
        opts = LockOptions(
            Key=go_path_join(prefix, DEFAULT_SEMAPHORE_KEY),
            SessionName=name,
            MonitorRetries=CONSUL_LOCK_MONITOR_RETRY,
            MonitorRetryTime=CONSUL_LOCK_MONITOR_RETRY_TIME,
        )
        if oneshot:
            opts.LockTryOnce, opts.LockWaitTime = True, timeout
        lock = Lock(c, opts)
        lock_fn, unlock_fn, cleanup_fn, in_use = lock.Lock, lock.Unlock, lock.Destroy, ErrLockInUse
    else:
        sem_opts = SemaphoreOptions(
            Prefix=prefix,
            Limit=limit,
            SessionName=name,
            MonitorRetries=CONSUL_LOCK_MONITOR_RETRY,
            MonitorRetryTime=CONSUL_LOCK_MONITOR_RETRY_TIME,
        )
        if oneshot:
            sem_opts.SemaphoreTryOnce, sem_opts.SemaphoreWaitTime = True, timeout
        sem = Semaphore(c, sem_opts)
        lock_fn, unlock_fn, cleanup_fn = sem.Acquire, sem.Release, sem.Destroy
        in_use = ErrSemaphoreInUse
    outcome: dict[str, Any] = {"acquired": False, "lost": False, "result": None, "error": None}
    try:
        lost = lock_fn(None)
    except ConsulAPIError as err:
        outcome["error"] = f"Lock acquisition failed: {err}"
        return outcome
    if lost is None:
        outcome["error"] = "Shutdown triggered or timeout during lock acquisition"
        return outcome
    outcome["acquired"] = True
    try:
        outcome["result"] = child(lost)
    finally:
        outcome["lost"] = lost.is_set()
        unlock_fn()
        try:
            cleanup_fn()
        except ConsulAPIError as err:
            if err is not in_use:
                outcome["error"] = f"Lock cleanup failed: {err}"
    return outcome
