"""A small client of etcd v3's JSON gateway (``/v3/kv/range``, ``/v3/kv/txn``,
``/v3/lease/*``, ``/v3/watch``) over ``requests``, and the one place its failures
become ExclusiveErrors.

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
"""

from __future__ import annotations

import base64
import email.utils
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import parse_qs, unquote, urlsplit

import requests

from ...errors import ConfigurationError, ExclusiveError

#: Seconds to connect, and to wait for an answer (a watch sets its own read timeout).
CONNECT_TIMEOUT, READ_TIMEOUT = 3.0, 5.0
OPTIONS = ("cacert", "cert", "key", "recipe")
TLS_OPTIONS = ("cacert", "cert", "key")
#: ``?recipe=``: etcd's own lock recipes the store can speak (recipe.py).
RECIPES = ("mutex",)

# gRPC status codes the gateway puts in its error bodies (google.golang.org/grpc/codes).
INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED, UNIMPLEMENTED, UNAUTHENTICATED = 3, 5, 7, 12, 16


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: tuple[str, ...]
    root: str = "celery-exclusive/"
    user: Optional[str] = None
    password: Optional[str] = None
    cacert: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None
    #: ``mutex``: leases by etcd's concurrency mutex on the key's own name (recipe.py).
    recipe: Optional[str] = None


def settings_from_url(url: str) -> EtcdSettings:
    parts = urlsplit(url)
    scheme = "https" if parts.scheme == "etcds" else "http"
    hosts = parts.netloc.rsplit("@", 1)[-1] or "127.0.0.1:2379"
    endpoints = tuple(f"{scheme}://{_with_port(h)}" for h in hosts.split(","))
    query = {name: values[-1] for name, values in parse_qs(parts.query).items()}
    unknown = sorted(set(query) - set(OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"exclusive_backend_url has unknown option(s) {', '.join(unknown)}; "
            f"an etcd:// URL accepts: {', '.join(OPTIONS)}."
        )
    if query.get("recipe") not in (None, *RECIPES):
        raise ConfigurationError(
            f"exclusive_backend_url has recipe={query['recipe']!r}; use mutex (etcd's "
            "concurrency mutex, as etcdctl lock takes it), or leave it out."
        )
    if scheme == "http" and any(query.get(o) for o in TLS_OPTIONS):
        raise ConfigurationError(
            "exclusive_backend_url gives TLS files (cacert/cert/key) to an etcd:// URL; "
            "write etcds:// to use TLS."
        )
    root = unquote(parts.path).strip("/")
    user = unquote(parts.username) if parts.username else None
    return EtcdSettings(
        endpoints=endpoints,
        root=(root + "/") if root else "celery-exclusive/",
        user=user,
        password=unquote(parts.password) if parts.password else None,
        cacert=query.get("cacert"),
        cert=query.get("cert"),
        key=query.get("key"),
        recipe=query.get("recipe"),
    )


def _with_port(host: str) -> str:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``, with etcd's port if none."""
    if host.startswith("["):
        return host if "]:" in host else host + ":2379"
    return host if ":" in host else host + ":2379"


class EtcdError(Exception):
    """An answer of the gateway that is an error, with its gRPC code."""

    def __init__(self, code: int, message: str, status: int) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: Optional[str]) -> bytes:
    return base64.b64decode(text or "")


class Gateway:
    """Requests to one etcd cluster, one HTTP session per process."""

    def __init__(self, settings: EtcdSettings, safe_url: str) -> None:
        self.settings = settings
        self.safe_url = safe_url
        self._local_pid: Optional[int] = None
        self._session: Optional[requests.Session] = None
        self._token: Optional[str] = None
        self._lock = threading.Lock()
        self._endpoint = 0
        self.clock = ServerClock()

    def session(self) -> requests.Session:
        if self._local_pid != os.getpid() or self._session is None:
            with self._lock:
                if self._local_pid != os.getpid() or self._session is None:
                    session = requests.Session()
                    if self.settings.cacert:
                        session.verify = self.settings.cacert
                    if self.settings.cert:
                        session.cert = (
                            (self.settings.cert, self.settings.key)
                            if self.settings.key
                            else self.settings.cert
                        )
                    self._session, self._token = session, None
                    self._local_pid = os.getpid()
        return self._session

    def call(self, path: str, body: dict, timeout: float = READ_TIMEOUT) -> dict:
        """POST ``body`` to ``/v3/<path>``; the decoded answer, or EtcdError / a requests
        exception. An expired auth token is renewed once."""
        for attempt in (1, 2):
            try:
                return self._post(path, body, timeout)
            except EtcdError as exc:
                if exc.code == UNAUTHENTICATED and self.settings.user and attempt == 1:
                    self._token = None
                    continue
                raise
        raise AssertionError("unreachable")

    def _post(self, path: str, body: dict, timeout: float) -> dict:
        session = self.session()
        headers = {}
        if self.settings.user:
            headers["Authorization"] = self._auth_token(session)
        response = self._send(session, path, body, timeout, headers)
        return self._decode(response)

    def _send(self, session, path, body, timeout, headers, stream=False) -> requests.Response:
        """Try each endpoint in turn, starting with the last one that answered."""
        count = len(self.settings.endpoints)
        for i in range(count):
            index = (self._endpoint + i) % count
            try:
                sent = time.monotonic()
                response = session.post(
                    f"{self.settings.endpoints[index]}/v3/{path}",
                    data=json.dumps(body),
                    headers=headers,
                    timeout=(CONNECT_TIMEOUT, timeout),
                    stream=stream,
                )
                self.clock.observe(response.headers.get("Date"), sent, time.monotonic())
                self._endpoint = index
                return response
            except (requests.ConnectionError, requests.Timeout) as exc:
                if i == count - 1 or isinstance(exc, requests.exceptions.SSLError):
                    raise
        raise AssertionError("unreachable")

    def _decode(self, response: requests.Response) -> dict:
        try:
            answer = response.json()
        except ValueError:
            raise EtcdError(-1, response.text[:200], response.status_code) from None
        if response.status_code != 200 or "error" in answer:
            raise EtcdError(
                int(answer.get("code", -1)),
                answer.get("message") or answer.get("error") or "",
                response.status_code,
            )
        return answer

    def _auth_token(self, session: requests.Session) -> str:
        token = self._token
        if token is None:
            response = self._send(
                session,
                "auth/authenticate",
                {"name": self.settings.user, "password": self.settings.password or ""},
                READ_TIMEOUT,
                {},
            )
            token = self._token = self._decode(response)["token"]
        return token

    def watch(self, body: dict, timeout: float) -> requests.Response:
        """Open a watch stream (``/v3/watch``); its lines are JSON messages."""
        session = self.session()
        headers = {"Authorization": self._auth_token(session)} if self.settings.user else {}
        response = self._send(session, "watch", body, timeout, headers, stream=True)
        if response.status_code != 200:
            self._decode(response)
        return response

    def close(self) -> None:
        if self._session is not None and self._local_pid == os.getpid():
            self._session.close()
        self._session = None


class ServerClock:
    """The etcd server's clock, learned from its answers' ``Date`` headers.

    etcd has no call that tells the time, but every gateway answer carries an HTTP
    ``Date`` (whole seconds) stamped by the server between our send and our receipt.
    Each answer bounds ``server time - our monotonic time``; intersecting the bounds
    of many answers narrows it to about a round trip once answers have straddled a
    second boundary (the heartbeat's renewals, at random phases, do that). If the
    bounds ever disagree (the server's clock was stepped), the newest one wins.

    ``now()`` uses the lower bound, which only rises as answers come: the clock never
    runs backwards, and it is behind the server by at most a second at first, about a
    round trip later. (The middle of the bounds would jump both ways as they narrow.)
    """

    def __init__(self) -> None:
        self.low = float("-inf")
        self.high = float("inf")
        self._lock = threading.Lock()

    def observe(self, date: Optional[str], sent: float, received: float) -> None:
        if not date:
            return
        try:
            stamp = email.utils.parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError):
            return
        # server time in [stamp, stamp + 1) at some instant in [sent, received]
        low, high = stamp - received, stamp + 1 - sent
        with self._lock:
            if low > self.high or high < self.low:
                self.low, self.high = low, high
            else:
                self.low, self.high = max(self.low, low), min(self.high, high)

    @property
    def known(self) -> bool:
        return self.high != float("inf")

    def now(self) -> float:
        with self._lock:
            return time.monotonic() + self.low


def translate(exc: BaseException, action: str, backend) -> ExclusiveError:
    """The one place an etcd or HTTP failure becomes an ExclusiveError, which keeps the
    failure (:func:`cause_of`) for the store's own decisions (a lease to grant again,
    an answer to read back) without chaining it."""
    error = _translated(exc, action, backend)
    error.etcd_error = exc  # type: ignore[attr-defined]
    return error


def cause_of(error: ExclusiveError) -> Optional[BaseException]:
    """The etcd or HTTP failure :func:`translate` made ``error`` from."""
    return getattr(error, "etcd_error", None)


def maybe_sent(exc: Optional[BaseException]) -> bool:
    """Whether a failed request may have reached etcd (so its write may have happened):
    everything but a connection that was never made."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return False
    if isinstance(exc, requests.ConnectionError):
        text = str(exc)
        return not any(
            s in text for s in ("NewConnectionError", "Connection refused", "Name or service")
        )
    if isinstance(exc, EtcdError):
        return exc.status >= 500
    return isinstance(exc, (requests.Timeout, OSError))


def _translated(exc: BaseException, action: str, backend) -> ExclusiveError:
    if isinstance(exc, requests.exceptions.SSLError):
        return _refused(backend, action, exc, "check cacert/cert/key and etcds:// in the URL")
    if isinstance(exc, (requests.ConnectionError, requests.Timeout, OSError)):
        return backend.unavailable(action, exc)
    if isinstance(exc, EtcdError):
        message = exc.message.lower()
        if exc.code == PERMISSION_DENIED:
            return _refused(
                backend,
                action,
                exc,
                f"grant the etcd user's role readwrite on the prefix {backend.root!r} "
                "(etcdctl role grant-permission <role> --prefix=true readwrite <prefix>)",
            )
        if exc.code == UNAUTHENTICATED or "authentication failed" in message:
            return _refused(backend, action, exc, "check the user and password in the URL")
        if "user name is empty" in message or "token" in message and exc.code == INVALID_ARGUMENT:
            return _refused(backend, action, exc, "auth is enabled: give user:password@ in the URL")
        if "too many operations" in message or "too large" in message:
            return _refused(backend, action, exc, "raise the server's --max-txn-ops/request size")
        if (exc.status == 404 and exc.code == -1) or exc.code in (INVALID_ARGUMENT, UNIMPLEMENTED):
            # No such path, or a request this server does not understand.
            return _refused(backend, action, exc, "use etcd 3.4 or later (its /v3/ gateway)")
        # Anything else (no leader, a request timed out, the server shutting down and
        # closing its connections, canceled, unavailable): retrying can fix it.
        return backend.unavailable(action, exc)
    return backend.unavailable(action, exc)


def _refused(backend, action: str, exc: BaseException, fix: str) -> ConfigurationError:
    text = (str(exc).strip().splitlines() or [""])[0]
    return ConfigurationError(
        f"the etcd store at {backend.safe_url} refused {action} ({type(exc).__name__}: "
        f"{text}): {fix}."
    )


def header_revision(answer: dict) -> int:
    return int(answer["header"]["revision"])


def parse_json(value: bytes) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return {}
