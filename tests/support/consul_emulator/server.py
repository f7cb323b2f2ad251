"""The emulator's HTTP agent: Go's ServeMux, ACLs, limits, a leader that can be missing.

Each rule names the hashicorp/consul (or Go standard library) source it copies.
"""

from __future__ import annotations

import base64
import copy
import json
import threading
import time
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import parse_qs, quote, unquote, urlsplit

from .durations import parse_go_duration
from .store import WRITE_VERBS, BadRequest, ServerError, Store

#: agent/consul/rpc.go blockingQuery: "wait" defaults to 5 minutes, capped at 10.
DEFAULT_WAIT, MAX_WAIT = 300.0, 600.0
#: agent/txn_endpoint.go maxTxnOps (64; servers from 1.x raise it to 128).
MAX_TXN_OPS = 64
#: agent/config default txn_max_req_len and kv_max_value_size (raft's suggested size).
MAX_TXN_BYTES = MAX_VALUE_BYTES = 512 * 1024
#: go-connlimit connlimit.go tooManyConnsMsg, the body of its 429.
TOO_MANY_CONNS = (
    "Your IP is issuing too many concurrent connections, please rate limit your calls\n"
)


@dataclass
class Policy:
    """An ACL token's rules: ``key_prefix`` and ``session_prefix`` blocks, the longest
    matching prefix winning (acl/policy_authorizer.go), anything unmatched denied
    (the default policy "deny")."""

    key_prefix: dict[str, str] = field(default_factory=dict)
    session_prefix: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def _allows(rules: dict[str, str], name: str, write: bool) -> bool:
        matches = [p for p in rules if name.startswith(p)]
        if not matches:
            return False
        policy = rules[max(matches, key=len)]
        return policy == "write" or (policy == "read" and not write)

    def key(self, key: str, write: bool) -> bool:
        return self._allows(self.key_prefix, key, write)

    def session(self, node: str, write: bool) -> bool:
        return self._allows(self.session_prefix, node, write)


class ConsulEmulator:
    """A threaded HTTP server on a free loopback port speaking Consul's agent API.

    Knobs a test turns: ``leaderless`` (and ``rpc_hold``, how long the agent holds an RPC
    waiting for a leader), ``throttle(n)``, ``add_token()``, ``deregister_node()``,
    ``set_check()``, ``clock_offset`` (the agent's clock, as its ``Date`` header tells).
    """

    def __init__(
        self,
        min_session_ttl: float = 10.0,
        ttl_multiplier: float = 2.0,
        acl: bool = False,
        enterprise: bool = False,
        node: str = "emulated-node",
        datacenter: str = "dc1",
        other_datacenters: tuple[str, ...] = ("dc2",),
        host: str = "127.0.0.1",
        tls: Optional[dict[str, str]] = None,
    ) -> None:
        self.min_session_ttl = min_session_ttl
        self.ttl_multiplier = ttl_multiplier
        self.acl = acl
        self.enterprise = enterprise
        self.node = node
        self.datacenter = datacenter
        self.datacenters = (datacenter, *other_datacenters)
        self.host = host
        #: {"certfile", "keyfile", "client_ca"}: serve HTTPS (verify_incoming with a client CA).
        self.tls = tls
        self.tokens: dict[str, Policy] = {}
        self.leaderless = False
        #: agent/consul/config.go RPCHoldTimeout (7 s): how long a request waits for a leader.
        self.rpc_hold = 7.0
        self.clock_offset = 0.0
        self.changed = threading.Condition(threading.RLock())
        self.requests: list[tuple[str, str]] = []
        self.queries: list[dict[str, str]] = []
        #: Bytes of every answer's body, and the client (host, port) of every request.
        self.answer_sizes: list[int] = []
        self.peers: set[tuple] = set()
        self._stores: dict[tuple[str, str, str], Store] = {}
        self._throttled = 0
        self._server: Optional[ThreadingHTTPServer] = None
        self._stopping = threading.Event()
        self.store(datacenter)  # the local datacenter, where this agent's node lives

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> ConsulEmulator:
        emulator = self

        class Handler(_Handler):
            pass

        Handler.emulator = emulator
        server_class = ThreadingHTTPServer
        if ":" in self.host:
            import socket

            class V6Server(ThreadingHTTPServer):
                address_family = socket.AF_INET6

            server_class = V6Server
        self._server = server_class((self.host, 0), Handler)
        self._server.daemon_threads = True
        if self.tls:
            import ssl

            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(self.tls["certfile"], self.tls["keyfile"])
            if self.tls.get("client_ca"):
                context.verify_mode = ssl.CERT_REQUIRED
                context.load_verify_locations(self.tls["client_ca"])
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
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
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'consuls' if self.tls else 'consul'}://{host}:{self.port}"

    def _reaper(self) -> None:
        while not self._stopping.wait(0.01):
            with self.changed:
                for store in self._stores.values():
                    before = len(store.sessions)
                    store.expire_sessions()
                    if len(store.sessions) != before:
                        self.changed.notify_all()

    # -- the state, per datacenter / partition / namespace ----------------------------

    def store(self, dc: str = "", partition: str = "", ns: str = "") -> Store:
        key = (dc or self.datacenter, partition or "default", ns or "default")
        if key not in self._stores:
            store = Store(self.node, self.min_session_ttl, self.ttl_multiplier)
            # Another datacenter's servers never saw this agent's node.
            store.node_registered = key[0] == self.datacenter
            self._stores[key] = store
        return self._stores[key]

    @property
    def state(self) -> Store:
        """The local datacenter's default namespace."""
        return self.store()

    @property
    def sessions(self):
        return self.state.sessions

    @property
    def kv(self) -> dict[str, dict[str, Any]]:
        return self.state.kv.entries

    # -- test knobs ------------------------------------------------------------------

    def add_token(self, secret: str, key_prefix=None, session_prefix=None) -> None:
        self.tokens[secret] = Policy(dict(key_prefix or {}), dict(session_prefix or {}))

    def throttle(self, count: int) -> None:
        """Answer the next ``count`` requests 429, as an agent over its
        ``http_max_conns_per_client`` does (go-connlimit HTTPConnStateFuncWithDefault429Handler)."""
        self._throttled = count

    def deregister_node(self) -> None:
        with self.changed:
            self.state.deregister_node()
            self.changed.notify_all()

    def register_node(self) -> None:
        with self.changed:
            self.state.register_node()

    def set_check(self, check: str, status: str) -> None:
        with self.changed:
            self.state.set_check(check, status)
            self.changed.notify_all()

    def invalidate(self, session_id: str) -> None:
        with self.changed:
            self.state.destroy_session(session_id)
            self.changed.notify_all()

    def set_leaderless(self, leaderless: bool) -> None:
        with self.changed:
            self.leaderless = leaderless
            self.changed.notify_all()

    def now(self) -> float:
        return time.time() + self.clock_offset


class _Handler(BaseHTTPRequestHandler):
    emulator: ConsulEmulator
    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: without TCP_NODELAY, Nagle's algorithm and
    # the client's delayed ACK add 40 ms to every keep-alive answer.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def date_time_string(self, timestamp=None) -> str:
        # Go's net/http stamps every answer with the agent's clock, to the second.
        return formatdate(self.emulator.now() if timestamp is None else timestamp, usegmt=True)

    def _reply(
        self,
        code: int,
        body: Any = b"",
        index: Optional[int] = None,
        headers=None,
        meta: bool = False,
    ) -> None:
        """``meta``: a read's answer, with what agent/http.go setMeta adds besides the
        index: setKnownLeader ("true"/"false") and setLastContact (milliseconds since
        the serving server last heard from the leader; 0 on the leader itself, which
        is where a one-agent cluster serves every read)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.emulator.answer_sizes.append(len(data))
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if index is not None:
                # agent/http.go setMeta: blocking-capable endpoints report X-Consul-Index.
                self.send_header("X-Consul-Index", str(index))
            if meta:
                known = "false" if self.emulator.leaderless else "true"
                self.send_header("X-Consul-KnownLeader", known)
                self.send_header("X-Consul-LastContact", "0")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client gave up (its timeout); the work was done all the same

    def _route(self, method: str) -> None:
        emulator = self.emulator
        parts = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        path = unquote(parts.path)  # Go's URL.Path is the decoded path
        emulator.requests.append((method, path))
        emulator.queries.append(query)
        emulator.peers.add(self.client_address[:2])
        if emulator._throttled > 0:
            emulator._throttled -= 1
            return self._reply(429, TOO_MANY_CONNS.encode(), headers={"Connection": "close"})
        clean = clean_path(path)
        if clean != path:
            # net/http server.go ServeMux.Handler: "path cleaned" -> RedirectHandler(301).
            location = quote(clean) + (f"?{parts.query}" if parts.query else "")
            return self._reply(301, b"", headers={"Location": location})
        try:
            store = self._store_for(query)
            token = query.get("token") or self.headers.get("X-Consul-Token") or ""
            policy = self._policy(token)
            if not ("stale" in query and method == "GET"):
                self._await_leader()
            with emulator.changed:
                store.expire_sessions()
            self._dispatch(method, path, query, body, store, policy)
        except Forbidden as exc:
            self._reply(403, str(exc).encode())
        except BadRequest as exc:
            self._reply(400, str(exc).encode())
        except TooLarge as exc:
            self._reply(413, str(exc).encode())
        except ServerError as exc:
            self._reply(500, str(exc).encode())

    def _store_for(self, query: dict[str, str]) -> Store:
        emulator = self.emulator
        for name, what in (("ns", "Namespaces"), ("partition", "Partitions")):
            if query.get(name) and not emulator.enterprise:
                # agent/http_ce.go parseEntMeta: CE refuses Enterprise query parameters.
                raise BadRequest(
                    f'Invalid query parameter: "{name}" - {what} are a Consul Enterprise feature'
                )
        dc = query.get("dc") or emulator.datacenter
        if dc not in emulator.datacenters:
            raise ServerError("No path to datacenter")  # structs.ErrNoDCPath
        with emulator.changed:
            return emulator.store(dc, query.get("partition", ""), query.get("ns", ""))

    def _policy(self, token: str) -> Optional[Policy]:
        """None: ACLs disabled. An unknown token is acl.ErrNotFound, answered 403."""
        emulator = self.emulator
        if not emulator.acl:
            return None
        if token and token not in emulator.tokens:
            raise Forbidden("ACL not found")
        return emulator.tokens.get(token, Policy())

    def _await_leader(self) -> None:
        """agent/consul/rpc.go forward: without a leader, an RPC is held up to
        RPCHoldTimeout, then fails with structs.ErrNoLeader ("No cluster leader"). If a
        leader appears in time, the request goes on, whether or not its client is still
        waiting: a commit can land after the client's timeout."""
        emulator = self.emulator
        with emulator.changed:
            if not emulator.changed.wait_for(lambda: not emulator.leaderless, emulator.rpc_hold):
                raise ServerError("No cluster leader")

    def _dispatch(self, method, path, query, body, store: Store, policy) -> None:
        emulator = self.emulator
        if path == "/v1/status/leader":
            return self._reply(200, "" if emulator.leaderless else "127.0.0.1:8300")
        if method == "GET" and path == "/v1/agent/self":
            # agent/agent_endpoint.go AgentSelf: the agent's Config (what api/agent.go
            # NodeName reads, as `consul lock` does first). Its agent:read ACL is not
            # modelled.
            config = {"Datacenter": emulator.datacenter, "NodeName": emulator.node}
            return self._reply(200, {"Config": config, "Member": {"Name": emulator.node}})
        if path.startswith("/v1/session/"):
            return self._session(method, path, query, body, store, policy)
        if path.startswith("/v1/kv/"):
            return self._kv(method, path[len("/v1/kv/") :], query, body, store, policy)
        if method == "PUT" and path == "/v1/txn":
            return self._txn(body, store, policy)
        self._reply(404, b"no such endpoint in the emulator")

    # -- sessions ----------------------------------------------------------------------

    def _session(self, method, path, query, body, store: Store, policy) -> None:
        """agent/consul/session_endpoint.go Apply and Renew: create, destroy and renew need
        session:write on the node (acl.ErrPermissionDenied, HTTP 403); Get filters."""
        emulator = self.emulator
        may_write = policy is None or policy.session(store.node, write=True)
        session_id = path.rsplit("/", 1)[1]
        with emulator.changed:
            if method == "PUT" and path == "/v1/session/create":
                if not may_write:
                    raise Forbidden("Permission denied")
                try:
                    request = json.loads(body or b"{}")
                except ValueError as exc:
                    raise BadRequest(f"Request decode failed: {exc}") from None
                return self._reply(200, {"ID": store.create_session(request).id})
            if method == "PUT" and path.startswith("/v1/session/renew/"):
                session = store.sessions.get(session_id)
                if session is not None and not may_write:
                    raise Forbidden("Permission denied")
                if store.renew_session(session_id) is None:
                    # agent/session_endpoint.go SessionRenew: 404 for an unknown session.
                    return self._reply(404, f"Session id '{session_id}' not found".encode())
                return self._reply(200, [session.as_json()])
            if method == "PUT" and path.startswith("/v1/session/destroy/"):
                if session_id in store.sessions and not may_write:
                    raise Forbidden("Permission denied")
                store.destroy_session(session_id)
                emulator.changed.notify_all()
                return self._reply(200, True)
            if method == "GET" and path.startswith("/v1/session/info/"):
                session = store.sessions.get(session_id)
                readable = policy is None or policy.session(store.node, write=False)
                found = [session.as_json()] if session and readable else []
                return self._reply(200, found, store.kv.sessions_index, meta=True)
        if method == "GET" and path == "/v1/session/list":
            return self._session_list(query, store, policy, node=None)
        if method == "GET" and path.startswith("/v1/session/node/"):
            node = path[len("/v1/session/node/") :]
            if not node:
                # agent/session_endpoint.go SessionsForNode: "Missing node name".
                raise BadRequest("Missing node name")
            return self._session_list(query, store, policy, node=node)
        self._reply(404, b"no such endpoint in the emulator")

    def _session_list(self, query, store: Store, policy, node: Optional[str]) -> None:
        """agent/session_endpoint.go SessionList and SessionsForNode: agent/consul's
        Session.List / Session.NodeSessions as blocking queries on the "sessions" table
        index (state/session.go SessionList, NodeSessions), sessions the token may not
        read on their node filtered out (ACLFilter: session:read), an empty list as
        ``[]``, with setMeta's headers."""
        emulator = self.emulator
        wait = parse_go_duration(query["wait"]) if "wait" in query else DEFAULT_WAIT
        min_index = int(query.get("index") or 0)
        deadline = time.monotonic() + min(wait or 0.0, MAX_WAIT)
        with emulator.changed:
            while True:
                store.expire_sessions()
                index = store.kv.sessions_index
                remaining = deadline - time.monotonic()
                if not min_index or index > min_index or remaining <= 0:
                    break
                emulator.changed.wait(min(remaining, 0.05))
            found = [
                session.as_json()
                for session in sorted(store.sessions.values(), key=lambda s: s.id)
                if (node is None or session.node == node)
                and (policy is None or policy.session(session.node, write=False))
            ]
        self._reply(200, found, index, meta=True)

    # -- KV ------------------------------------------------------------------------------

    def _kv(self, method, key, query, body, store: Store, policy) -> None:
        """agent/kvs_endpoint.go KVSEndpoint and agent/consul/kvs_endpoint.go."""
        emulator = self.emulator
        if method == "GET":
            return self._kv_get(key, query, store, policy)
        if policy is not None and not policy.key(key, write=True):
            raise Forbidden("Permission denied")  # kvsPreApply: key:write
        if method == "PUT":
            if len(body) > MAX_VALUE_BYTES:
                # agent/kvs_endpoint.go KVSPut: "Request body(%d bytes) too large".
                raise TooLarge(
                    f"Request body({len(body)} bytes) too large, max size: {MAX_VALUE_BYTES} bytes."
                )
            flags = _parse_uint(query["flags"]) if "flags" in query else 0
            with emulator.changed:
                index = store.kv.index + 1
                if "acquire" in query:
                    if store.in_lock_delay(key):
                        return self._reply(200, False)
                    try:
                        ok = store.lock(key, body, query["acquire"], index, flags)
                    except Exception as exc:  # state/kvs.go kvsLockTxn's error: HTTP 500
                        raise ServerError(str(exc)) from None
                elif "release" in query:
                    ok = store.unlock(key, body, query["release"], index, flags)
                elif "cas" in query:
                    ok = store.cas(key, body, int(query["cas"]), index, flags)
                else:
                    store.set(key, body, index, flags)
                    ok = True
                if ok:
                    store.kv.index = index
                    emulator.changed.notify_all()
                return self._reply(
                    200,
                    ok if ("cas" in query or "acquire" in query or "release" in query) else True,
                )
        if method == "DELETE":
            with emulator.changed:
                index = store.kv.index + 1
                if "recurse" in query:
                    store.delete_tree(key, index)
                    ok = True
                elif "cas" in query:
                    ok = store.delete_cas(key, int(query["cas"]), index)
                else:
                    store._delete(key, index)
                    ok = True
                store.kv.index = index
                emulator.changed.notify_all()
                return self._reply(200, ok)
        self._reply(405, b"method not allowed")

    def _kv_get(self, key, query, store: Store, policy) -> None:
        """KVS.Get (403 if the key is not readable) and KVS.List / ListKeys (entries the
        token cannot read are filtered out, FilterDirEnt), as blocking queries: with
        ``index``, answer once the result's index exceeds it or ``wait`` runs out."""
        emulator = self.emulator
        listing = "recurse" in query or "keys" in query
        if not listing and policy is not None and not policy.key(key, write=False):
            raise Forbidden("Permission denied")
        wait = parse_go_duration(query["wait"]) if "wait" in query else DEFAULT_WAIT
        min_index = int(query.get("index") or 0)
        deadline = time.monotonic() + min(wait or 0.0, MAX_WAIT)
        with emulator.changed:
            while True:
                store.expire_sessions()
                if listing:
                    index, entries = store.list(key)
                else:
                    index, entry = store.get(key)
                    entries = [entry] if entry else []
                if policy is not None:
                    entries = [e for e in entries if policy.key(e["Key"], write=False)]
                remaining = deadline - time.monotonic()
                if not min_index or index > min_index or remaining <= 0:
                    break
                emulator.changed.wait(min(remaining, 0.05))
            entries = copy.deepcopy(entries)
        if "keys" in query:
            separator = query.get("separator", "")
            names: list[str] = []
            for entry in entries:
                name = entry["Key"]
                if separator and separator in name[len(key) :]:
                    cut = name.index(separator, len(key)) + len(separator)
                    name = name[:cut]
                if name not in names:
                    names.append(name)
            if not names and key:
                return self._reply(404, b"", index, meta=True)
            return self._reply(200, names, index, meta=True)
        if not entries:
            # KVSGet: setMeta, then a 404 for no entries.
            return self._reply(404, b"", index, meta=True)
        self._reply(200, [_public(e) for e in entries], index, meta=True)

    # -- transactions ----------------------------------------------------------------------

    def _txn(self, body: bytes, store: Store, policy) -> None:
        """agent/txn_endpoint.go convertOps (413 past TxnMaxReqLen, maxTxnOps operations or
        KVMaxValueSize per value) and Txn; a transaction with failed operations answers 409
        with their errors; results the token cannot read are dropped (FilterTxnResults)."""
        emulator = self.emulator
        if len(body) > MAX_TXN_BYTES:
            raise TooLarge(f"Request body too large, max size: {MAX_TXN_BYTES} bytes")
        try:
            ops = json.loads(body or b"[]")
        except ValueError as exc:
            raise BadRequest(f"Failed to parse body: {exc}") from None
        if len(ops) > MAX_TXN_OPS:
            raise TooLarge(f"Transaction contains too many operations ({len(ops)} > {MAX_TXN_OPS})")
        for op in ops:
            value = (op.get("KV") or {}).get("Value")
            if value and len(base64.b64decode(value)) > MAX_VALUE_BYTES:
                raise TooLarge(f"Value for key {op['KV']['Key']!r} is too large")

        def can(verb: str, key: str) -> bool:
            if policy is None or verb in ("get", "get-tree", "get-or-empty"):
                return True
            # kvsPreApply: check-session/check-index need key:read, every other verb
            # (check-not-exists included) key:write.
            return policy.key(key, write=verb not in ("check-session", "check-index"))

        # agent/txn_endpoint.go Txn: a read-only transaction (Txn.Read) answers with
        # setLastContact and setKnownLeader; one that writes (Txn.Apply) without them.
        read_only = not any((op.get("KV") or {}).get("Verb") in WRITE_VERBS for op in ops)
        with emulator.changed:
            results, errors = store.txn(ops, can)
            if errors:
                answer = {"Results": None, "Errors": errors}
                return self._reply(409, answer, store.kv.index, meta=read_only)
            if not read_only:
                emulator.changed.notify_all()
            if policy is not None:
                results = [r for r in results if policy.key(r["Key"], write=False)]
            answer = {"Results": [{"KV": _public(r)} for r in results], "Errors": None}
            self._reply(200, answer, store.kv.index, meta=read_only)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._route("GET")

    def do_PUT(self) -> None:  # noqa: N802
        self._route("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._route("DELETE")


class Forbidden(Exception):
    """acl.ErrPermissionDenied / acl.ErrNotFound: agent/http.go answers 403."""


class TooLarge(Exception):
    """http.StatusRequestEntityTooLarge (413)."""


def _public(entry: dict[str, Any]) -> dict[str, Any]:
    value = entry.get("Value")
    return {
        **entry,
        "Value": base64.b64encode(value).decode() if value else None,
        "Session": entry.get("Session") or None,
    }


def _parse_uint(text: str) -> int:
    """strconv.ParseUint(text, 10, 64), as agent/kvs_endpoint.go KVSPut reads ``?flags=``;
    its error is returned as is, which agent/http.go answers with HTTP 500."""
    if text.isdigit() and text.isascii() and int(text) < 2**64:
        return int(text)
    reason = "value out of range" if text.isdigit() and text.isascii() else "invalid syntax"
    raise ServerError(f'strconv.ParseUint: parsing "{text}": {reason}')


def clean_path(p: str) -> str:
    """net/http server.go cleanPath: path.Clean (no empty, "." or ".." elements), rooted,
    keeping a trailing slash."""
    if not p:
        return "/"
    if not p.startswith("/"):
        p = "/" + p
    parts: list[str] = []
    for part in p.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if parts:
                parts.pop()
            continue
        parts.append(part)
    cleaned = "/" + "/".join(parts)
    if p.endswith("/") and cleaned != "/":
        cleaned += "/"
    return cleaned
