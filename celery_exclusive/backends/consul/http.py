"""Talking to a Consul agent: the URL's options, TLS, one connection pool per process,
retries of answers that say "nothing was done", and what every other answer means.

Plain HTTP (urllib3) rather than python-consul2 or py-consul: the backend needs raw
``/v1/txn`` answers (per-operation errors, which the clients turn into opaque
exceptions), exact control of redirects, timeouts, retries and TLS, and one pool per
process; the two clients install the same module with different signatures, and the
first is archived. urllib3's pools are thread-safe, so threads share one.
"""

from __future__ import annotations

import email.utils
import json
import os
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import parse_qs, quote, unquote, urlsplit

import urllib3

from ...errors import ConfigurationError

#: Seconds one request may take. Above Consul's RPCHoldTimeout (7 s), the time an agent
#: holds a request while the cluster has no leader: such a request then gets its
#: definite "No cluster leader" answer instead of an ambiguous client timeout.
REQUEST_TIMEOUT = 10.0
#: How long answers that say "nothing was done" (429, 503, 500 No cluster leader) are
#: retried, with exponential backoff, before the store counts as unavailable.
RETRY_BUDGET = 10.0
#: Connections a process keeps to its agent, whatever its number of threads or greenlets
#: (Consul answers 429 past http_max_conns_per_client, 200 by default, per client IP).
CONNECTIONS = 8
#: Consul's cap on a session's lock delay (structs.MaxLockDelay).
MAX_LOCK_DELAY = 60.0

QUERY_OPTIONS = (
    "token",
    "dc",
    "ns",
    "partition",
    "behavior",
    "lock_delay",
    "cacert",
    "client_cert",
    "client_key",
    "recipe",  # the layout's (``backends._layout``)
)
#: URL option -> the environment variable Consul's own tools read for it.
ENVIRONMENT = {
    "token": "CONSUL_HTTP_TOKEN",
    "ns": "CONSUL_NAMESPACE",
    "partition": "CONSUL_PARTITION",
    "cacert": "CONSUL_CACERT",
    "client_cert": "CONSUL_CLIENT_CERT",
    "client_key": "CONSUL_CLIENT_KEY",
}


@dataclass(frozen=True)
class ConsulSettings:
    """Everything a ``consul://`` URL (plus the environment) says."""

    scheme: str
    host: str
    port: int
    root: str = ""
    token: Optional[str] = None
    dc: Optional[str] = None
    ns: Optional[str] = None
    partition: Optional[str] = None
    behavior: str = "delete"
    #: Seconds; None: derived from the session TTL (see ``session.lock_delay_for``).
    lock_delay: Optional[float] = None
    cacert: Optional[str] = None
    client_cert: Optional[str] = None
    client_key: Optional[str] = None

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def query(self) -> dict[str, str]:
        """The query parameters every request carries: datacenter, namespace, partition."""
        given = {"dc": self.dc, "ns": self.ns, "partition": self.partition}
        return {name: value for name, value in given.items() if value}


def settings_from_url(url: str, environ: Mapping[str, str] = os.environ) -> ConsulSettings:
    """Parse a ``consul://``/``consuls://`` URL; what it leaves out comes from the
    ``CONSUL_*`` variables Consul's own tools read, and values in the URL win."""
    parts = urlsplit(url)
    scheme = "https" if parts.scheme == "consuls" else "http"
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        raise ConfigurationError(f"exclusive_backend_url {url!r} has an invalid port.") from None
    if not host and environ.get("CONSUL_HTTP_ADDR"):
        scheme, host, port = _parse_addr(environ["CONSUL_HTTP_ADDR"], scheme)
    query = {name: values[-1] for name, values in parse_qs(parts.query).items()}
    unknown = sorted(set(query) - set(QUERY_OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"exclusive_backend_url has unknown option(s) {', '.join(unknown)}; "
            f"a consul:// URL accepts: {', '.join(QUERY_OPTIONS)}."
        )
    option = {
        name: query.get(name) or environ.get(ENVIRONMENT.get(name, ""), "") or None
        for name in QUERY_OPTIONS
    }
    behavior = option["behavior"] or "delete"
    if behavior not in ("release", "delete"):
        raise ConfigurationError(
            f"exclusive_backend_url has behavior={behavior!r}; use delete (the default) or release."
        )
    for name in ("cacert", "client_cert", "client_key"):
        if option[name] and not os.path.isfile(option[name]):
            raise ConfigurationError(
                f"the Consul TLS file {name}={option[name]!r} (exclusive_backend_url option or "
                f"{ENVIRONMENT[name]}) does not exist."
            )
    if bool(option["client_cert"]) != bool(option["client_key"]):
        raise ConfigurationError(
            "a Consul client certificate needs both client_cert and client_key "
            "(or CONSUL_CLIENT_CERT and CONSUL_CLIENT_KEY)."
        )
    return ConsulSettings(
        scheme=scheme,
        host=host or "127.0.0.1",
        port=port or (8501 if scheme == "https" else 8500),
        root=_root(parts.path),
        token=option["token"],
        dc=option["dc"],
        ns=option["ns"],
        partition=option["partition"],
        behavior=behavior,
        lock_delay=_lock_delay(option["lock_delay"]),
        cacert=option["cacert"],
        client_cert=option["client_cert"],
        client_key=option["client_key"],
    )


def _root(path: str) -> str:
    """The KV folder named by the URL's path, ``a/b/`` (or "" for none).

    Go's ServeMux rewrites any path with empty, ``.`` or ``..`` segments (a 301 to the
    cleaned path), so such a root could never be read back: refused here.
    """
    segments = unquote(path).strip("/").split("/") if path.strip("/") else []
    if any(segment in ("", ".", "..") for segment in segments):
        raise ConfigurationError(
            f"the KV folder {path!r} of exclusive_backend_url has an empty, '.' or '..' "
            "segment, which Consul's HTTP router rewrites; name it like team/leases."
        )
    return "/".join(segments) + "/" if segments else ""


def _lock_delay(text: Optional[str]) -> Optional[float]:
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= MAX_LOCK_DELAY:
        raise ConfigurationError(
            f"exclusive_backend_url has lock_delay={text!r}; give seconds from 0 to "
            f"{MAX_LOCK_DELAY:g} (Consul caps every lock delay at {MAX_LOCK_DELAY:g} s)."
        )
    return seconds


def _parse_addr(addr: str, scheme: str) -> tuple[str, str, Optional[int]]:
    """CONSUL_HTTP_ADDR is ``host:port``, ``[v6]:port`` or ``http(s)://host:port``."""
    parts = urlsplit(addr if "//" in addr else "//" + addr)
    try:
        return parts.scheme or scheme, parts.hostname or "127.0.0.1", parts.port
    except ValueError:
        raise ConfigurationError(
            f"CONSUL_HTTP_ADDR={addr!r} is not host:port or http(s)://host:port."
        ) from None


def format_duration(seconds: float) -> str:
    """A duration Go's time.ParseDuration reads back exactly: whole milliseconds.

    ``f"{seconds:g}s"`` gives ``1e-05s`` for small values, which Go refuses; Consul also
    reads any lock delay under 1000 ns as seconds, which whole milliseconds never are.
    """
    return f"{max(0, round(seconds * 1000))}ms"


# -- what an answer means ------------------------------------------------------------


class ConsulError(Exception):
    """Base of the client's own exceptions; the backend translates every one of them."""

    def __init__(self, message: str, status: int = 0, body: str = "", path: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        #: The endpoint that answered (``/v1/txn``, ``/v1/session/create``, ...).
        self.path = path


class Unavailable(ConsulError):
    """The agent did not answer, or answered that nothing was done: retry later."""

    #: Whether the request was sent and its answer lost (a read may simply be sent again).
    retryable = False


class Ambiguous(Unavailable):
    """A write whose outcome is unknown: sent, but no answer came (or an answer that does
    not say whether it was applied). Read back before concluding anything."""


class Denied(ConsulError):
    """HTTP 403: the token lacks a permission (or is unknown)."""


class TooLarge(ConsulError):
    """HTTP 413: past txn_max_req_len, kv_max_value_size or the operations per txn."""


class Refused(ConsulError):
    """An answer retrying cannot change: 400, a redirect, a wrong datacenter, TLS."""


@dataclass
class Answer:
    status: int
    data: bytes
    headers: Mapping[str, str]

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.data) if self.data else None

    @property
    def index(self) -> int:
        try:
            return int(self.headers.get("X-Consul-Index") or 0)
        except ValueError:
            return 0


#: 500 answers whose text says the request was not applied and retrying may succeed.
_NOT_APPLIED = ("No cluster leader", "rate limit exceeded", "Not ready to serve consistent reads")
#: 500 answers that say the datacenter cannot serve this agent's sessions.
_WRONG_DATACENTER = (
    "Missing node registration",
    "cross datacenter lock must be created at server agent",
    "No path to datacenter",
)


class AgentClock:
    """The agent's clock, as the ``Date`` header of its answers tells it, to within the
    round trip once a few answers have been seen.

    Each answer bounds the offset between the agent's clock and this process's monotonic
    clock from below (``Date`` is truncated to the second and stamped before the answer
    arrived). The estimate is the highest lower bound seen, so it never moves backwards
    unless the agent's clock was stepped back (an upper bound falls below it).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._low: Optional[float] = None

    def sample(self, sent: float, received: float, date: Optional[str]) -> None:
        if not date:
            return
        try:
            stamped = email.utils.parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError):
            return
        low, high = stamped - received, stamped + 1.0 - sent
        with self._lock:
            if self._low is None or low > self._low or high < self._low:
                self._low = low

    def now(self) -> Optional[float]:
        with self._lock:
            return None if self._low is None else time.monotonic() + self._low


class ConsulHTTP:
    """One connection pool per process (a forked child opens its own) to one agent."""

    def __init__(self, settings: ConsulSettings) -> None:
        self.settings = settings
        self.clock = AgentClock()
        self.timeout = REQUEST_TIMEOUT
        self.retry_budget = RETRY_BUDGET
        self._lock = threading.Lock()
        self._pid: Optional[int] = None
        self._pool: Optional[urllib3.PoolManager] = None
        self._headers = {"Content-Type": "application/json"}
        if settings.token:
            self._headers["X-Consul-Token"] = settings.token

    def pool(self) -> urllib3.PoolManager:
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._pool, self._pid = self._new_pool(), os.getpid()
        assert self._pool is not None
        return self._pool

    def _new_pool(self) -> urllib3.PoolManager:
        tls: dict[str, Any] = {}
        if self.settings.scheme == "https":
            tls = {"cert_reqs": "CERT_REQUIRED", "ca_certs": self.settings.cacert}
            if self.settings.client_cert:
                tls.update(cert_file=self.settings.client_cert, key_file=self.settings.client_key)
        return urllib3.PoolManager(num_pools=2, maxsize=CONNECTIONS, block=True, **tls)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None and self._pid == os.getpid():
                self._pool.clear()
            self._pool = self._pid = None

    def call(
        self,
        method: str,
        path: str,
        *,
        query: Optional[Mapping[str, Any]] = None,
        body: Any = None,
        raw: Optional[bytes] = None,
        write: bool = False,
        expect: tuple[int, ...] = (200,),
        timeout: Optional[float] = None,
    ) -> Answer:
        """Send one request; retry answers that say nothing was done, within RETRY_BUDGET.

        ``path`` is ``/v1/...`` with every KV name already encoded (``kv.py``): nothing in
        it is rewritten on the way. ``write`` says whether a lost answer leaves the
        outcome unknown (:class:`Ambiguous`). Answers in ``expect`` are returned; any
        other becomes one of this module's exceptions.
        """
        params = {**self.settings.query(), **(query or {})}
        url = self.settings.base_url + quote(path, safe="/-_~")
        if params:
            url += "?" + "&".join(
                quote(k) if v is True else f"{quote(k)}={quote(str(v), safe='')}"
                for k, v in params.items()
            )
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        timeout = self.timeout if timeout is None else timeout
        try:
            return self._call(method, url, data, write, expect, timeout)
        except ConsulError as exc:
            exc.path = path
            raise

    def _call(self, method, url, data, write, expect, timeout) -> Answer:
        deadline = time.monotonic() + self.retry_budget
        for attempt in range(1000):
            try:
                answer = self._send(method, url, data, write, timeout)
            except Unavailable as exc:
                # A read that timed out (a cluster electing a leader holds requests)
                # changed nothing: ask again while the budget lasts.
                if write or not exc.retryable or time.monotonic() > deadline:
                    raise
                continue
            if answer.status in expect:
                return answer
            retry = answer.status in (429, 503) or (
                answer.status == 500 and any(t in answer.text for t in _NOT_APPLIED)
            )
            if not retry:
                raise _failure(answer, write)
            pause = min(1.0, 0.05 * 2**attempt) * random.uniform(0.5, 1.0)
            if time.monotonic() + pause > deadline:
                raise Unavailable(
                    f"HTTP {answer.status} {answer.text.strip()[:200]} (retried for "
                    f"{self.retry_budget:g}s)",
                    answer.status,
                    answer.text,
                )
            time.sleep(pause)
        raise AssertionError("unreachable")

    def _send(self, method: str, url: str, data: Optional[bytes], write: bool, timeout: float):
        sent = time.monotonic()
        try:
            response = self.pool().urlopen(
                method,
                url,
                body=data,
                headers=self._headers,
                timeout=urllib3.Timeout(connect=min(timeout, 5.0), read=timeout),
                retries=False,
                redirect=False,
                pool_timeout=timeout,
            )
        except urllib3.exceptions.SSLError as exc:
            if "CERTIFICATE_VERIFY_FAILED" in str(exc) or "certificate" in str(exc).lower():
                raise Refused(f"TLS verification failed: {exc}") from None
            raise Unavailable(f"TLS error: {exc}") from None
        except (
            urllib3.exceptions.NewConnectionError,
            urllib3.exceptions.ConnectTimeoutError,
            urllib3.exceptions.EmptyPoolError,
        ) as exc:
            raise Unavailable(f"{type(exc).__name__}: {exc}") from None  # nothing was sent
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            kind = Ambiguous if write else Unavailable
            lost = kind(f"{type(exc).__name__}: {exc}")
            lost.retryable = True
            raise lost from None
        headers = {name: value for name, value in response.headers.items()}
        self.clock.sample(sent, time.monotonic(), headers.get("Date"))
        return Answer(response.status, response.data or b"", headers)


def _failure(answer: Answer, write: bool) -> ConsulError:
    """What an unexpected answer means (the one place HTTP statuses are read)."""
    status, text = answer.status, answer.text.strip()
    summary = f"HTTP {status}: {text[:300]}"
    if status == 403:
        return Denied(summary, status, text)
    if status == 413:
        return TooLarge(summary, status, text)
    if 300 <= status < 400:
        location = answer.headers.get("Location", "?")
        return Refused(f"HTTP {status} redirect to {location}", status, text)
    if status == 400 or status == 405:
        return Refused(summary, status, text)
    if status == 500 and any(reason in text for reason in _WRONG_DATACENTER):
        return Refused(summary, status, text)
    if write and status >= 500:
        # leadership lost while committing, a timeout inside the cluster: may have landed.
        return Ambiguous(summary, status, text)
    return Unavailable(summary, status, text)
