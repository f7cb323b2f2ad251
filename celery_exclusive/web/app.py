"""The web view as an ASGI application: one page, its JSON, a stream, and a release.

Routes, relative to wherever the application is mounted:

``GET /``                the page (static HTML, CSS and JavaScript shipped in the package)
``GET /api/config``      what the page needs to know: the store, the key prefix, whether
                         releasing is on
``GET /api/page``        one page of held keys (``?filter=`` after the key prefix,
                         ``?cursor=``), with the beat leaders and the feed
``GET /api/stream``      the same, pushed as server-sent events every ``refresh`` seconds
``POST /api/release``    only when started with a release token: frees one key

Every viewer of the same page shares one store read per refresh (:class:`Snapshots`).

Releasing is off unless a token was given; then no route changes anything. A release
must carry the token in a header and a JSON body, which a page of another site cannot
send without the browser asking this server first (CORS), and this server never agrees.
It names the fencing tokens of the holders the operator confirmed: if the key changed
hands since, nothing is released. Each release is logged with who asked.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, Callable, Optional, Union

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..backends import Backend, backend_for_url
from ..cli.commands import Released, held_by, left_alone, release_key
from ..cli.display import counted
from ..core import feed, holders
from ..errors import ExclusiveError
from . import views

logger = logging.getLogger("celery_exclusive.web")

#: Who is asking, from the request: a name for the log, or None to refuse the request.
Identify = Callable[[Request], Union[Optional[str], Awaitable[Optional[str]]]]

#: A release token shorter than this is refused at start: it would be guessable.
MIN_TOKEN_LENGTH = 16
#: Held keys per page, at most.
MAX_PAGE = 1000
#: The header a release carries its token in.
TOKEN_HEADER = "x-release-token"

STATIC = __package__, "static"


class ViewSettings:
    """What one web view was started with."""

    def __init__(
        self,
        backend_url: str,
        key_prefix: str,
        release_token: Optional[str],
        refresh: float,
        page_size: int,
        beat_entries: Sequence[str],
        identify: Identify,
    ) -> None:
        self.backend_url = backend_url
        self.key_prefix = key_prefix
        self.release_token = release_token
        self.refresh = refresh
        self.page_size = page_size
        self.beat_entries = tuple(beat_entries)
        self.identify = identify

    @property
    def backend(self) -> Backend:
        return backend_for_url(self.backend_url)


def create_app(
    backend_url: str,
    key_prefix: str = "exclusive:",
    *,
    release_token: Optional[str] = None,
    refresh: float = 1.0,
    page_size: int = 100,
    beat_entries: Sequence[str] = (),
    identify: Optional[Identify] = None,
) -> Starlette:
    """The web view of the leases in ``backend_url`` under ``key_prefix``, as an ASGI app.

    ``release_token``: releasing keys from the page is on, for whoever gives this token
    (at least 16 characters); off (the default), the page is read-only. ``refresh``:
    seconds between two reads of the store. ``page_size``: held keys per page.
    ``beat_entries``: the names of the schedule entries whose last sends the beat panel
    shows. ``identify(request)``: who is asking, for the log of releases (sync or
    async); returning None refuses the request. The default names the user set by an
    authentication middleware of the application it is mounted in, else the client's
    address.
    """
    if release_token is not None and len(release_token) < MIN_TOKEN_LENGTH:
        raise ExclusiveError(
            f"the web view's release token has {len(release_token)} characters; use at "
            f"least {MIN_TOKEN_LENGTH} random ones (python -c 'import secrets; "
            "print(secrets.token_urlsafe())'), or none to keep the page read-only."
        )
    if not 0 < page_size <= MAX_PAGE:
        raise ExclusiveError(f"page_size={page_size!r}: use 1 to {MAX_PAGE} keys per page.")
    if not refresh > 0:
        raise ExclusiveError(f"refresh={refresh!r}: use a number of seconds above 0.")
    backend_for_url(backend_url)  # an unknown scheme or a missing client: say so now
    settings = ViewSettings(
        backend_url,
        key_prefix,
        release_token,
        refresh,
        page_size,
        beat_entries,
        identify or default_identify,
    )
    snapshots = Snapshots(settings)
    routes = [
        Route("/", index),
        Route("/api/config", config),
        Route("/api/page", page_once),
        Route("/api/stream", stream),
        Mount("/static", StaticFiles(packages=[STATIC]), name="static"),
    ]
    if release_token is not None:
        routes.append(Route("/api/release", release, methods=["POST"]))
    app = Starlette(routes=routes)
    app.state.settings = settings
    app.state.snapshots = snapshots
    app.add_middleware(Guard, settings=settings)
    return app


def default_identify(request: Request) -> Optional[str]:
    """The authenticated user of the enclosing application, or the client's address."""
    user = request.scope.get("user")
    if user is not None and getattr(user, "is_authenticated", False):
        return str(getattr(user, "display_name", None) or user)
    client = request.client
    return f"{client.host}:{client.port}" if client else "unknown client"


class Guard:
    """Asks ``identify`` about every request, and sets the headers that keep the page
    from being framed, sniffed or made to load anything but its own files."""

    HEADERS = [
        (
            b"content-security-policy",
            b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
            b"img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        ),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
        (b"x-frame-options", b"DENY"),
        (b"cache-control", b"no-store"),
    ]

    def __init__(self, app: ASGIApp, settings: ViewSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        who = self.settings.identify(request)
        if inspect.isawaitable(who):
            who = await who
        if who is None:
            await JSONResponse({"error": "not allowed"}, 403)(scope, receive, self._headed(send))
            return
        scope.setdefault("state", {})["who"] = who
        await self.app(scope, receive, self._headed(send))

    def _headed(self, send: Send) -> Send:
        async def send_headed(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name for name, _ in message.get("headers", [])}
                message["headers"] = [
                    *message.get("headers", []),
                    *(header for header in self.HEADERS if header[0] not in names),
                ]
            await send(message)

        return send_headed


class Snapshots:
    """What the store holds, read at most once per ``refresh`` for each page and shared
    by everyone watching it: ten viewers of a page cost the store what one does."""

    def __init__(self, settings: ViewSettings) -> None:
        self.settings = settings
        self._cache: dict[tuple, tuple[float, dict]] = {}
        self._locks: dict[tuple, asyncio.Lock] = {}

    async def get(self, kind: str, *args: Any) -> dict:
        name = (kind, *args)
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            cached = self._cache.get(name)
            if cached is not None and time.monotonic() - cached[0] < self.settings.refresh * 0.9:
                return cached[1]
            value = await run_in_threadpool(getattr(self, "_" + kind), *args)
            self._cache[name] = (time.monotonic(), value)
            if len(self._cache) > 256:  # pages nobody watches any more
                oldest = min(self._cache, key=lambda n: self._cache[n][0])
                self._cache.pop(oldest)
                self._locks.pop(oldest, None)
            return value

    def _page(self, prefix: str, cursor: Optional[str]) -> dict:
        return _read(
            lambda: views.page(self.settings.backend, prefix, cursor, self.settings.page_size)
        )

    def _beat(self) -> dict:
        settings = self.settings
        return _read(
            lambda: {
                "leaders": views.beat(settings.backend, settings.key_prefix, settings.beat_entries)
            }
        )

    def _feed(self) -> dict:
        settings = self.settings
        return _read(lambda: {"events": views.events(settings.backend, settings.key_prefix)})


def _read(read: Callable[[], dict]) -> dict:
    """A read of the store, or what kept it from answering (the page shows it)."""
    try:
        return {**read(), "error": None}
    except ExclusiveError as exc:
        return {"error": str(exc)}


async def index(request: Request) -> Response:
    if not request.url.path.endswith("/"):
        # The page's links are relative: mounted at /ops/locks, it must be /ops/locks/.
        return RedirectResponse(request.url.replace(path=request.url.path + "/"), 307)
    return FileResponse(_static_path("index.html"), media_type="text/html; charset=utf-8")


def _static_path(name: str) -> str:
    from importlib.resources import files

    return str(files(__package__).joinpath("static", name))


async def config(request: Request) -> Response:
    settings: ViewSettings = request.app.state.settings
    return JSONResponse(
        {
            "store": settings.backend.safe_url,
            "key_prefix": settings.key_prefix,
            "release": settings.release_token is not None,
            "refresh": settings.refresh,
            "page_size": settings.page_size,
            "who": request.scope["state"].get("who"),
        }
    )


def _where(request: Request) -> tuple[str, Optional[str]]:
    """The page asked for: the key prefix with the viewer's filter after it, and the
    cursor of the page (none: the first)."""
    settings: ViewSettings = request.app.state.settings
    text = request.query_params.get("filter", "")
    cursor = request.query_params.get("cursor") or None
    return settings.key_prefix + text, cursor


async def _snapshot(request: Request, prefix: str, cursor: Optional[str]) -> dict:
    snapshots: Snapshots = request.app.state.snapshots
    page, beat, feed = await asyncio.gather(
        snapshots.get("page", prefix, cursor), snapshots.get("beat"), snapshots.get("feed")
    )
    return {"at": time.time(), "page": page, "beat": beat, "feed": feed}


async def page_once(request: Request) -> Response:
    prefix, cursor = _where(request)
    return JSONResponse(await _snapshot(request, prefix, cursor))


async def stream(request: Request) -> Response:
    """Server-sent events: a ``snapshot`` every refresh, with only the events of the
    feed not sent before."""
    prefix, cursor = _where(request)
    settings: ViewSettings = request.app.state.settings

    async def snapshots() -> AsyncIterator[str]:
        sent: set[str] = set()
        yield f"retry: {int(max(1.0, settings.refresh) * 2000)}\n\n"
        while not await request.is_disconnected():
            snapshot = await _snapshot(request, prefix, cursor)
            new = [e for e in snapshot["feed"].get("events", []) if e["id"] not in sent]
            sent.update(e["id"] for e in new)
            snapshot["feed"] = {**snapshot["feed"], "events": new}
            yield f"event: snapshot\ndata: {json.dumps(snapshot)}\n\n"
            await asyncio.sleep(settings.refresh)

    return StreamingResponse(
        snapshots(),
        media_type="text/event-stream",
        headers={"x-accel-buffering": "no"},
    )


async def release(request: Request) -> Response:
    """Free one key: ``{"key": ..., "tokens": [fencing tokens confirmed]}`` with the
    release token in the ``X-Release-Token`` header."""
    settings: ViewSettings = request.app.state.settings
    who = request.scope["state"].get("who")
    given = request.headers.get(TOKEN_HEADER, "")
    if not hmac.compare_digest(given.encode(), (settings.release_token or "").encode()):
        logger.warning("web: release refused (wrong token) for %s", who)
        return JSONResponse({"error": "wrong release token"}, 403)
    if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
        return JSONResponse({"error": "cross-site requests are refused"}, 403)
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        return JSONResponse({"error": "send JSON"}, 415)
    try:
        body = await request.json()
        key, tokens = body["key"], body["tokens"]
        if not isinstance(key, str) or not isinstance(tokens, list):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return JSONResponse({"error": 'send {"key": "...", "tokens": [...]}'}, 400)
    if not key.startswith(settings.key_prefix):
        return JSONResponse({"error": "that key is not under this view's key prefix"}, 400)
    confirmed = sorted(t for t in tokens if isinstance(t, int))

    def confirm(infos: list) -> bool:
        # The holders the operator saw, or nobody is released: the key may have passed
        # to a healthy holder since.
        return sorted(info.fencing_token or 0 for info in infos) == confirmed

    def free() -> Optional[Released]:
        return release_key(settings.backend, key, confirm)

    try:
        released = await run_in_threadpool(free)
    except ExclusiveError as exc:
        return JSONResponse({"error": str(exc)}, 503)
    if released is None:
        return JSONResponse(
            {"error": "its holders changed since you confirmed (or it was freed): look again"},
            409,
        )
    done = [counted(released.count, "lease", "leases")]
    if released.holders:
        done.append(f"held by {held_by(released.holders)}")
    if released.left:
        done.append(left_alone(released.left))
    logger.warning(
        "web: released key=%r (%s; fencing tokens %s) for %s", key, "; ".join(done), confirmed, who
    )
    await run_in_threadpool(_report_release, settings, key, released, who)
    return JSONResponse(
        {
            "released": released.count,
            "key": key,
            "left_alone": [holders.describe(info) for info in released.left],
        }
    )


def _report_release(settings: ViewSettings, key: str, released: Released, who: Any) -> None:
    """Put the release in the feed, for everyone watching; a store that does not
    take it leaves it in the log only."""
    event = {
        "id": os.urandom(8).hex(),
        "at": time.time(),
        "kind": "released",
        "key": key,
        "count": released.count,
        "holder": holders.all_described(released.holders) if released.holders else None,
        "left_alone": holders.all_described(released.left) if released.left else None,
        "by": str(who),
    }
    try:
        feed.append_events(
            settings.backend, settings.key_prefix, [json.dumps(event)], feed.CAPACITY, feed.TTL
        )
    except ExclusiveError as exc:
        logger.warning("web: the release of %r is not in the feed: %s", key, exc)
