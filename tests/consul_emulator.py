"""A small in-process Consul HTTP API for tests: sessions, KV, blocking queries, /v1/txn.

No Consul server package is reachable from the test machines, so the Consul backend is
tested against this emulator (or a real agent: see :func:`start_consul`). It implements
exactly the documented behaviour the backend relies on; each rule names the Consul doc
section it follows:

- [sessions]  https://developer.hashicorp.com/consul/docs/dynamic-app-config/sessions
- [api-session] https://developer.hashicorp.com/consul/api-docs/session
- [api-kv]    https://developer.hashicorp.com/consul/api-docs/kv
- [api-txn]   https://developer.hashicorp.com/consul/api-docs/txn
- [blocking]  https://developer.hashicorp.com/consul/api-docs/features/blocking

One test-only knob: ``min_session_ttl`` (default 10 s, Consul's minimum) lets tests
create sessions with sub-second TTLs so expiry tests stay fast. Everything else keeps
the documented semantics. Not part of the package: never import it from there.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import parse_qs, unquote, urlsplit

#: [blocking] "wait ... defaults to 5 minutes ... capped at 10 minutes".
DEFAULT_WAIT, MAX_WAIT = 300.0, 600.0
#: [api-session] "TTL ... must be between 10s and 86400s".
MAX_SESSION_TTL = 86400.0

_DURATION = re.compile(r"([\d.]+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

_READ_VERBS = {"get", "get-tree", "check-index", "check-session", "check-not-exists"}


def parse_duration(text: str) -> float:
    """A Go duration ("10s", "1m30s", "500ms") in seconds; bare numbers are seconds."""
    text = str(text).strip()
    if re.fullmatch(r"[\d.]+", text):
        return float(text)
    return sum(float(n) * _UNITS[u] for n, u in _DURATION.findall(text))


@dataclass
class Session:
    id: str
    name: str
    ttl: float
    behavior: str
    lock_delay: float
    create_index: int
    deadline: Optional[float] = None

    def as_json(self) -> dict[str, Any]:
        return {
            "ID": self.id,
            "Name": self.name,
            "TTL": f"{self.ttl:g}s" if self.ttl else "",
            "Behavior": self.behavior,
            "LockDelay": int(self.lock_delay * 1e9),
            "CreateIndex": self.create_index,
            "ModifyIndex": self.create_index,
        }


@dataclass
class State:
    """The replicated state: KV entries, tombstones, sessions, one raft index."""

    index: int = 1
    kv_index: int = 1
    kv: dict[str, dict[str, Any]] = field(default_factory=dict)
    tombstones: dict[str, int] = field(default_factory=dict)


class TxnError(Exception):
    pass


class ConsulEmulator:
    """A threaded HTTP server on a free loopback port speaking a subset of Consul's API."""

    def __init__(self, min_session_ttl: float = 10.0, ttl_multiplier: float = 2.0) -> None:
        self.min_session_ttl = min_session_ttl
        # [sessions] "Consul ... may take up to double the TTL to invalidate a session";
        # Consul's servers arm their timer at exactly TTL x 2, as this does by default.
        self.ttl_multiplier = ttl_multiplier
        self.state = State()
        self.sessions: dict[str, Session] = {}
        self.lock_delays: dict[str, float] = {}
        self.changed = threading.Condition(threading.RLock())
        self.requests: list[tuple[str, str]] = []
        self._server: Optional[ThreadingHTTPServer] = None
        self._stopping = threading.Event()

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> ConsulEmulator:
        emulator = self

        class Handler(_Handler):
            pass

        Handler.emulator = emulator
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        threading.Thread(target=self._reaper, daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"consul://127.0.0.1:{self.port}"

    def _reaper(self) -> None:
        while not self._stopping.wait(0.01):
            with self.changed:
                self._expire_sessions()

    # -- sessions ----------------------------------------------------------------

    def _next_index(self) -> int:
        self.state.index += 1
        return self.state.index

    def create_session(self, body: dict[str, Any]) -> Session:
        # [api-session] Create: LockDelay defaults to 15s, Behavior to "release".
        ttl = parse_duration(body.get("TTL") or "0")
        if ttl and not self.min_session_ttl <= ttl <= MAX_SESSION_TTL:
            raise ValueError(
                f"Invalid Session TTL '{body['TTL']}', must be between "
                f"[{self.min_session_ttl:g}s={MAX_SESSION_TTL:g}s]"
            )
        behavior = body.get("Behavior") or "release"
        if behavior not in ("release", "delete"):
            raise ValueError(f"Invalid Behavior setting '{behavior}'")
        session = Session(
            id=str(uuid.uuid4()),
            name=body.get("Name", ""),
            ttl=ttl,
            behavior=behavior,
            lock_delay=parse_duration(body.get("LockDelay", "15s")),
            create_index=self._next_index(),
        )
        self._arm(session)
        self.sessions[session.id] = session
        return session

    def _arm(self, session: Session) -> None:
        if session.ttl:
            session.deadline = time.monotonic() + session.ttl * self.ttl_multiplier

    def renew_session(self, session_id: str) -> Optional[Session]:
        # [api-session] Renew: 404 when the session no longer exists.
        session = self.sessions.get(session_id)
        if session is not None:
            self._arm(session)
        return session

    def _expire_sessions(self) -> None:
        now = time.monotonic()
        for session in list(self.sessions.values()):
            if session.deadline is not None and session.deadline <= now:
                self.invalidate(session.id)

    def invalidate(self, session_id: str) -> None:
        """[sessions] An invalidated session's locks are released ("release": the key
        stays, Session cleared) or deleted ("delete"), and its keys enter lock-delay."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        index = self._next_index()
        touched = False
        for key, entry in list(self.state.kv.items()):
            if entry["Session"] != session_id:
                continue
            touched = True
            if session.lock_delay > 0:
                self.lock_delays[key] = time.monotonic() + session.lock_delay
            if session.behavior == "delete":
                del self.state.kv[key]
                self.state.tombstones[key] = index
            else:
                entry["Session"] = None
                entry["ModifyIndex"] = index
        if touched:
            self.state.kv_index = index
        self.changed.notify_all()

    # -- KV ----------------------------------------------------------------------

    def _in_lock_delay(self, key: str) -> bool:
        return self.lock_delays.get(key, 0.0) > time.monotonic()

    def read(self, key: str, recurse: bool) -> tuple[int, list[dict[str, Any]]]:
        """Entries and the X-Consul-Index a read reports ([api-kv], [blocking])."""
        state = self.state
        if not recurse:
            entry = state.kv.get(key)
            # A missing key reports the KV table's index (so a blocking read on it
            # returns on any KV write and the client must re-check).
            return (entry["ModifyIndex"], [entry]) if entry else (state.kv_index, [])
        entries = [state.kv[k] for k in sorted(state.kv) if k.startswith(key)]
        # The highest index among the entries and the tombstones under the prefix,
        # else the table index: deleting a key under a watched prefix wakes the watcher.
        index = max(
            [e["ModifyIndex"] for e in entries]
            + [i for k, i in state.tombstones.items() if k.startswith(key)]
            + [0]
        )
        return (index or state.kv_index), entries

    def blocking_read(
        self, key: str, recurse: bool, min_index: int, wait: float
    ) -> tuple[int, list[dict[str, Any]]]:
        """[blocking] With ``index``, answer once the result's index exceeds it, or when
        ``wait`` runs out (the answer is then the unchanged result)."""
        deadline = time.monotonic() + min(wait, MAX_WAIT)
        with self.changed:
            while True:
                index, entries = self.read(key, recurse)
                remaining = deadline - time.monotonic()
                if not min_index or index > min_index or remaining <= 0:
                    return max(index, 1), copy.deepcopy(entries)
                self.changed.wait(remaining)

    def _set(self, key: str, value: Optional[bytes], index: int, **extra: Any) -> dict:
        existing = self.state.kv.get(key)
        entry = {
            "Key": key,
            "Value": value,
            "Flags": 0,
            "Session": existing["Session"] if existing else None,
            "LockIndex": existing["LockIndex"] if existing else 0,
            "CreateIndex": existing["CreateIndex"] if existing else index,
            "ModifyIndex": index,
        }
        entry.update(extra)
        self.state.kv[key] = entry
        self.state.tombstones.pop(key, None)
        self.state.kv_index = index
        return entry

    def _delete(self, key: str, index: int) -> None:
        if self.state.kv.pop(key, None) is not None:
            # ModifyIndex is the raft index: a key created again after a delete gets a
            # higher one (LockIndex, by contrast, starts again at 1).
            self.state.tombstones[key] = index
            self.state.kv_index = index

    def _lock(self, key: str, value: Optional[bytes], session_id: str, index: int) -> bool:
        """[api-kv] acquire: granted if the key is unlocked or already ours; LockIndex
        grows on each new acquisition. Raises for an unknown session."""
        if session_id not in self.sessions:
            raise TxnError(f'invalid session "{session_id}"')
        existing = self.state.kv.get(key)
        if existing is not None and existing["Session"] not in (None, session_id):
            return False
        lock_index = existing["LockIndex"] if existing else 0
        if existing is None or existing["Session"] is None:
            lock_index += 1
        self._set(key, value, index, Session=session_id, LockIndex=lock_index)
        return True

    def _unlock(self, key: str, value: Optional[bytes], session_id: str, index: int) -> bool:
        """[api-kv] release: only by the session holding the lock."""
        existing = self.state.kv.get(key)
        if existing is None or existing["Session"] != session_id:
            return False
        self._set(key, value, index, Session=None)
        return True

    def _cas(self, key: str, value: Optional[bytes], cas: int, index: int) -> bool:
        """[api-kv] cas: 0 creates only if absent; otherwise the ModifyIndex must match."""
        existing = self.state.kv.get(key)
        if (cas == 0 and existing is not None) or (
            cas != 0 and (existing is None or existing["ModifyIndex"] != cas)
        ):
            return False
        self._set(key, value, index)
        return True

    def kv_put(self, key: str, value: bytes, query: dict[str, str]) -> bool:
        index = self.state.index + 1
        if "acquire" in query:
            # [sessions] lock-delay: an acquire inside it fails.
            if self._in_lock_delay(key):
                return False
            try:
                ok = self._lock(key, value, query["acquire"], index)
            except TxnError as exc:
                # Consul answers an acquire with an invalid session with HTTP 500.
                raise ServerError(str(exc)) from None
        elif "release" in query:
            ok = self._unlock(key, value, query["release"], index)
        elif "cas" in query:
            ok = self._cas(key, value, int(query["cas"]), index)
        else:
            self._set(key, value, index)
            ok = True
        if ok:
            self.state.index = index
            self.changed.notify_all()
        return ok

    def kv_delete(self, key: str, query: dict[str, str]) -> bool:
        index = self.state.index + 1
        if "recurse" in query:
            keys = [k for k in self.state.kv if k.startswith(key)]
        else:
            keys = [key] if key in self.state.kv else []
        if "cas" in query:
            entry = self.state.kv.get(key)
            if entry is None or entry["ModifyIndex"] != int(query["cas"]):
                return False
        if keys:
            for k in keys:
                self._delete(k, index)
            self.state.index = index
            self.changed.notify_all()
        return True

    # -- transactions ------------------------------------------------------------

    def txn(self, ops: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        """[api-txn] All operations apply atomically at one raft index, or none do: a
        failure answers 409 with every failing operation's OpIndex and reason."""
        errors: list[dict[str, Any]] = []
        for i, op in enumerate(ops):
            kv = op.get("KV") or {}
            # Lock-delay is checked before the transaction is applied.
            if kv.get("Verb") == "lock" and self._in_lock_delay(kv.get("Key", "")):
                errors.append(
                    {"OpIndex": i, "What": f"failed to lock key {kv['Key']!r} due to lock delay"}
                )
        if errors:
            return 409, {"Results": None, "Errors": errors}
        read_only = all((op.get("KV") or {}).get("Verb") in _READ_VERBS for op in ops)
        saved = copy.deepcopy(self.state)
        index = self.state.index + 1
        results: list[dict[str, Any]] = []
        for i, op in enumerate(ops):
            try:
                results += self._txn_kv(op["KV"], index)
            except (TxnError, KeyError) as exc:
                errors.append({"OpIndex": i, "What": str(exc)})
        if errors:
            self.state = saved
            return 409, {"Results": None, "Errors": errors}
        if not read_only:
            self.state.index = index
            self.changed.notify_all()
        return 200, {"Results": [{"KV": _public(r)} for r in results], "Errors": None}

    def _txn_kv(self, op: dict[str, Any], index: int) -> list[dict[str, Any]]:
        """One KV operation of a transaction, per the verb table of [api-txn]."""
        verb, key = op["Verb"], op["Key"]
        value = base64.b64decode(op["Value"]) if op.get("Value") else None
        entry = self.state.kv.get(key)
        if verb == "get":
            # [api-txn] get: "fails the transaction if it does not exist".
            if entry is None:
                raise TxnError(f"key {key!r} doesn't exist")
            return [copy.deepcopy(entry)]
        if verb == "get-tree":
            return copy.deepcopy(self.read(key, recurse=True)[1])
        if verb == "check-index":
            if entry is None or entry["ModifyIndex"] != op.get("Index", 0):
                raise TxnError(f"failed index check for key {key!r}")
            return [_blank(entry)]
        if verb == "check-session":
            if entry is None or entry["Session"] != op.get("Session"):
                raise TxnError(f"failed session check for key {key!r}")
            return [_blank(entry)]
        if verb == "check-not-exists":
            # [api-txn] check-not-exists: "Fails the transaction if Key exists".
            if entry is not None:
                raise TxnError(f"key {key!r} exists")
            return []
        if verb == "set":
            return [_blank(self._set(key, value, index))]
        if verb == "cas":
            # [api-txn] cas: as the KV endpoint's ?cas, Index 0 creates only.
            if not self._cas(key, value, op.get("Index", 0), index):
                raise TxnError(f"failed to set key {key!r}, index is stale")
            return [_blank(self.state.kv[key])]
        if verb == "lock":
            if not self._lock(key, value, op.get("Session", ""), index):
                raise TxnError(f"failed to lock key {key!r}, lock is already held")
            return [_blank(self.state.kv[key])]
        if verb == "unlock":
            if not self._unlock(key, value, op.get("Session", ""), index):
                raise TxnError(
                    f"failed to unlock key {key!r}, lock isn't held, or is held by another session"
                )
            return [_blank(self.state.kv[key])]
        if verb == "delete":
            self._delete(key, index)
            return []
        if verb == "delete-cas":
            # [api-txn] delete-cas: "Deletes the key if ModifyIndex matches the Index";
            # like Consul's state store (kvsDeleteCASTxn), an absent key counts as
            # deleted and does not fail the transaction.
            if entry is not None and entry["ModifyIndex"] != op.get("Index", 0):
                raise TxnError(f"failed to delete key {key!r}, index is stale")
            self._delete(key, index)
            return []
        raise TxnError(f"unknown KV verb {verb!r}")


class ServerError(Exception):
    """Answered as HTTP 500, like an RPC error in Consul."""


def _blank(entry: dict[str, Any]) -> dict[str, Any]:
    """[api-txn] write verbs return the entry without its value."""
    return {**entry, "Value": None}


def _public(entry: dict[str, Any]) -> dict[str, Any]:
    value = entry.get("Value")
    return {
        **entry,
        "Value": base64.b64encode(value).decode() if value else None,
        "Session": entry.get("Session") or None,
    }


class _Handler(BaseHTTPRequestHandler):
    emulator: ConsulEmulator
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _reply(self, code: int, body: Any, index: Optional[int] = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if index is not None:
            # [blocking] every blocking-capable endpoint reports X-Consul-Index.
            self.send_header("X-Consul-Index", str(index))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _route(self, method: str) -> None:
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        body = self._body()
        emulator = self.emulator
        emulator.requests.append((method, path))
        try:
            if path.startswith("/v1/kv/") and method == "GET":
                return self._kv_get(path[len("/v1/kv/") :], query)
            with emulator.changed:
                emulator._expire_sessions()
                self._dispatch(method, path, query, body)
        except ServerError as exc:
            self._reply(500, str(exc).encode())
        except ValueError as exc:
            self._reply(500, str(exc).encode())

    def _dispatch(self, method: str, path: str, query: dict, body: bytes) -> None:
        emulator = self.emulator
        if method == "PUT" and path == "/v1/session/create":
            session = emulator.create_session(json.loads(body or b"{}"))
            return self._reply(200, {"ID": session.id})
        if method == "PUT" and path.startswith("/v1/session/renew/"):
            session = emulator.renew_session(path.rsplit("/", 1)[1])
            if session is None:
                return self._reply(404, f"Session id '{path.rsplit('/', 1)[1]}' not found".encode())
            return self._reply(200, [session.as_json()])
        if method == "PUT" and path.startswith("/v1/session/destroy/"):
            emulator.invalidate(path.rsplit("/", 1)[1])
            return self._reply(200, True)
        if method == "GET" and path.startswith("/v1/session/info/"):
            session = emulator.sessions.get(path.rsplit("/", 1)[1])
            return self._reply(200, [session.as_json()] if session else [], emulator.state.index)
        if method == "PUT" and path.startswith("/v1/kv/"):
            return self._reply(200, emulator.kv_put(path[len("/v1/kv/") :], body, query))
        if method == "DELETE" and path.startswith("/v1/kv/"):
            return self._reply(200, emulator.kv_delete(path[len("/v1/kv/") :], query))
        if method == "PUT" and path == "/v1/txn":
            code, result = emulator.txn(json.loads(body or b"[]"))
            return self._reply(code, result, emulator.state.index)
        self._reply(404, b"no such endpoint in the emulator")

    def _kv_get(self, key: str, query: dict[str, str]) -> None:
        emulator = self.emulator
        with emulator.changed:
            emulator._expire_sessions()
        wait = parse_duration(query["wait"]) if "wait" in query else DEFAULT_WAIT
        index, entries = emulator.blocking_read(
            key, "recurse" in query, int(query.get("index") or 0), wait
        )
        if not entries:
            # [api-kv] a missing key (or empty prefix) is a 404, still with X-Consul-Index.
            return self._reply(404, b"", index)
        self._reply(200, [_public(e) for e in entries], index)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._route("GET")

    def do_PUT(self) -> None:  # noqa: N802
        self._route("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._route("DELETE")


# -- a store for the test suite: a real agent when there is one, else the emulator ----


class RealConsul:
    """A Consul agent the tests did not emulate: CONSUL_HTTP_ADDR, or ``consul agent -dev``."""

    min_session_ttl = 10.0
    short_ttl = 10.0

    def __init__(self, url: str, process: Optional[subprocess.Popen] = None) -> None:
        self.url = url
        self.process = process

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)


class EmulatedConsul:
    """The emulator with sub-second session TTLs, so expiry tests take about a second."""

    min_session_ttl = 0.25
    short_ttl = 0.5

    def __init__(self) -> None:
        self.emulator = ConsulEmulator(min_session_ttl=self.min_session_ttl).start()
        self.url = self.emulator.url

    def stop(self) -> None:
        self.emulator.stop()


def start_consul():
    """CONSUL_HTTP_ADDR if set, else a ``consul agent -dev`` if the binary exists, else
    the emulator. Each has ``url``, ``min_session_ttl``, ``short_ttl`` and ``stop()``."""
    addr = os.environ.get("CONSUL_HTTP_ADDR")
    if addr:
        parts = urlsplit(addr if "//" in addr else "//" + addr)
        scheme = "consuls" if parts.scheme == "https" else "consul"
        return RealConsul(f"{scheme}://{parts.hostname}:{parts.port or 8500}")
    binary = shutil.which("consul")
    if binary is None:
        return EmulatedConsul()
    from tests.servers import free_port

    http = free_port()
    ports = [f"-{name}={free_port()}" for name in ("serf-lan-port", "serf-wan-port", "server-port")]
    process = subprocess.Popen(
        [binary, "agent", "-dev", "-bind=127.0.0.1", "-client=127.0.0.1",
         f"-http-port={http}", "-dns-port=-1", "-grpc-port=-1", *ports],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    _wait_for_leader(http)
    return RealConsul(f"consul://127.0.0.1:{http}", process)


def _wait_for_leader(port: int, timeout: float = 30.0) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/v1/status/leader", timeout=1).json():
                return
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"consul agent -dev on port {port} did not elect a leader")
