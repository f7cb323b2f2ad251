"""Every lease step as OpenTelemetry spans, span events and metrics, where the API is.

With the ``otel`` extra (``opentelemetry-api``) and nothing but the user's own
OpenTelemetry set-up (an SDK, its exporter), each call of an exclusive task or job and
each entry of an exclusive lock shows, under the span current where it runs (Celery's
``run/<task>`` with opentelemetry-instrumentation-celery):

- an ``exclusive.acquire`` span: taking the key, or deciding what the duplicate gets
  instead; beneath it ``exclusive.wait`` (time in the key's line, or waiting for a
  foreign holder) and, for a SQLite store, one ``exclusive.store`` span per round trip
  (the other stores' clients have instrumentations of their own: see
  :func:`round_trip`);
- span events on the call's span: ``exclusive.renewal.late``, ``exclusive.lease.lost``,
  ``exclusive.lease.released``, and one per outcome that is not a run
  (``exclusive.skipped``, ``exclusive.requeued``, ``exclusive.coalesced``,
  ``exclusive.set_aside``...);
- beat's sends and takeovers (:func:`beat_send`, :func:`beat_takeover`);
- the metrics of :mod:`celery_exclusive.metrics`, same names and labels, as
  OpenTelemetry instruments fed by the same signals.

Where no span is current, a call of a task or job gets one of the library's own
(``exclusive.call``; ``exclusive.lock`` for a lock), so that its events have a span.

The API is imported at the first call, never with the package: without it every hook is
a method of :data:`NO_TRACE`, which does nothing. With it but without an SDK, the API's
own no-op tracer answers. Nothing the user's tracer does may fail or slow a call: every
hook catches what the tracer raises and logs it once, and the key in a span is what
``exclusive_trace_keys`` allows (:func:`shown_key`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from contextvars import ContextVar
from typing import Any, Callable, Optional, TypeVar
from urllib.parse import urlsplit

from . import runtime, signals

logger = logging.getLogger("celery_exclusive")

F = TypeVar("F", bound=Callable[..., Any])

#: The instrumentation scope spans and metrics are made under.
SCOPE = "celery_exclusive"

#: A renewal is late when more than this share of the lease's ttl passed since the
#: last one the store confirmed (the heartbeat renews every third).
LATE_SHARE = 0.5

#: The histograms' bucket bounds, in seconds: Prometheus' defaults, as the
#: histograms of celery_exclusive.metrics have them.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


# --- the API, imported at first use -------------------------------------------------------


class _Api:
    """The parts of the OpenTelemetry API in use, the tracer and the instruments."""

    def __init__(self) -> None:
        from opentelemetry import context, metrics, trace
        from opentelemetry.trace import NoOpTracerProvider, ProxyTracerProvider, Status, StatusCode

        self.context = context
        self.trace = trace
        self.metrics = metrics
        self.error = Status(StatusCode.ERROR)
        self.tracer = trace.get_tracer(SCOPE)
        #: The providers of the API alone: no SDK set (yet) records anything.
        self.no_sdk = (ProxyTracerProvider, NoOpTracerProvider)
        self.no_meter_sdk = (_proxy_meter_provider(metrics), metrics.NoOpMeterProvider)
        #: Whether the metrics are fed from the signals (once an SDK's meter provider is set).
        self.fed = False
        meter = metrics.get_meter(SCOPE)
        # The names, descriptions and labels of celery_exclusive.metrics' Prometheus ones.
        self.acquisitions = meter.create_counter(
            "exclusive_lease_acquisitions", description="Leases granted."
        )
        self.duplicates = meter.create_counter(
            "exclusive_duplicates",
            description="Calls that found their key held, by the policy applied.",
        )
        self.leases_lost = meter.create_counter(
            "exclusive_leases_lost", description="Leases found gone while their holder ran."
        )
        self.hold_seconds = _histogram(
            meter, "exclusive_lease_hold_seconds", "How long leases were held."
        )
        self.wait_seconds = _histogram(
            meter, "exclusive_wait_seconds", "How long calls stood in their key's line."
        )


def _proxy_meter_provider(metrics: Any) -> type:
    """The class of the meter provider the API hands out until an SDK's is set (the API
    names it only privately; the provider set may already be the SDK's, so the one in
    place now cannot tell)."""
    try:
        from opentelemetry.metrics._internal import _ProxyMeterProvider
    except ImportError:  # pragma: no cover - a later API moved it: count none as a proxy
        return metrics.NoOpMeterProvider
    return _ProxyMeterProvider


def _histogram(meter: Any, name: str, description: str) -> Any:
    """A histogram in seconds, with :data:`BUCKETS` where the API can advise them (1.24
    and later; earlier, the SDK's views choose)."""
    try:
        return meter.create_histogram(
            name, unit="s", description=description, explicit_bucket_boundaries_advisory=BUCKETS
        )
    except TypeError:
        return meter.create_histogram(name, unit="s", description=description)


_loaded = False
_api: Optional[_Api] = None
#: Whether a failure of the user's tracer was logged at WARNING already (once a process).
_warned = False


def api() -> Optional[_Api]:
    """The API, imported and set up at the first call; None where it is not installed."""
    global _loaded, _api
    if not _loaded:
        _loaded = True
        try:
            _api = _Api()
        except ImportError:
            _api = None
        except Exception:
            _failed()
            _api = None
    return _api


def _recorded(otel: _Api) -> bool:
    """Whether an SDK is set to record traces; from the first one set on, the metrics
    are fed too. The API alone records nothing: a call then pays this check only."""
    if not otel.fed and not isinstance(otel.metrics.get_meter_provider(), otel.no_meter_sdk):
        otel.fed = True
        _feed_metrics(otel)
    return not isinstance(otel.trace.get_tracer_provider(), otel.no_sdk)


def _failed() -> None:
    """The user's tracer or meter raised: say so once, and let the call go on."""
    global _warned
    if not _warned:
        _warned = True
        logger.warning("OpenTelemetry tracing failed; calls go on untraced", exc_info=True)
    else:
        logger.debug("OpenTelemetry tracing failed", exc_info=True)


def guarded(hook: F) -> F:
    """``hook``, whatever the tracer raises in it logged instead (see :func:`_failed`)."""

    @functools.wraps(hook)
    def guarded_hook(*args: Any, **kwargs: Any) -> Any:
        try:
            return hook(*args, **kwargs)
        except Exception:
            _failed()
            return None

    return guarded_hook  # type: ignore[return-value]


# --- what a span may say ------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def store_label(url: str) -> str:
    """The store as spans name it: its scheme, host and port, never a user, password,
    path or query (``redis://cache.internal:6379``, ``sqlite``)."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return urlsplit(url).scheme or "unknown"
    if not host:
        return parts.scheme
    return f"{parts.scheme}://{host}:{port}" if port else f"{parts.scheme}://{host}"


def shown_key(key: str, prefix: str, mode: str) -> str:
    """``key`` as ``exclusive_trace_keys`` lets a span show it: ``"key"`` as it is;
    ``"hash"`` as ``sha256:`` and the first 16 hex digits of its SHA-256 (the same key
    always looks the same, so one key's calls can be found together); ``"prefix"`` only
    the key prefix and the key's first part, up to its first ``:``
    (``exclusive:invoice:`` for ``exclusive:invoice:7``)."""
    if mode == "key":
        return key
    if mode == "prefix":
        rest = key[len(prefix) :] if key.startswith(prefix) else key
        head, colon, _ = rest.partition(":")
        return prefix + (head + colon if colon else "")
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def outcome_name(outcome: Any) -> str:
    """An outcome's class name as spans spell it: ``SetAside`` is ``set_aside``."""
    name = type(outcome).__name__
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


#: The event an outcome that is not a run gets: its own name, and these fields of it
#: (never one that may hold the key: a holder in words, an error's message).
_OUTCOME_FIELDS = {
    "skipped": ("holder_task_id",),
    "coalesced": ("rerun_task_id", "debounced"),
    "replaced": ("by",),
    "requeue": ("cause", "countdown", "requeues", "holder_task_id"),
    "gave_up": ("cause", "requeues", "holder_task_id"),
    "waited": ("wait_timeout", "holder_task_id"),
    "set_aside": ("countdown", "requeues"),
    "unanswered": ("error",),
    "redelivered": ("error",),
    "dropped": (),
}
#: How an outcome is named in an event (a requeue is ``exclusive.requeued``).
_EVENT_NAMES = {"requeue": "requeued"}


def _attribute(value: Any) -> Any:
    """A value as an attribute can hold it; an error by its class alone (its message
    may hold the key)."""
    if isinstance(value, BaseException):
        return type(value).__name__
    return value if isinstance(value, (str, bool, int, float)) else str(value)


# --- one call's trace ---------------------------------------------------------------------


class Trace:
    """The traces of one call of a task or job, or one entry of a lock: its
    ``exclusive.acquire`` span, and the span its events go on."""

    __slots__ = (
        "api",
        "attributes",
        "own_name",
        "span",
        "own",
        "token",
        "parent",
        "acquire",
        "in_line",
    )

    def __init__(self, api: _Api, attributes: dict[str, Any], own_name: str) -> None:
        self.api = api
        self.attributes = attributes
        #: The name of the span of its own the call gets where no span is current.
        self.own_name = own_name
        #: Where its events go: the span current as it began, or its own.
        self.span: Any = None
        self.own: Any = None
        self.token: Any = None
        #: The context its acquire span starts in (None: the current one).
        self.parent: Any = None
        self.acquire: Any = None
        #: Seconds spent in the key's line while acquiring.
        self.in_line = 0.0

    # --- the call ----------------------------------------------------------------------

    @guarded
    def begin(self, attach: bool = True, own: bool = True) -> None:
        """The call begins: its events go on the current span, or on one of its own
        (with ``own``: whoever begins it ends it), which is made current too with
        ``attach`` (the body runs in this context)."""
        trace = self.api.trace
        current = trace.get_current_span()
        if current.get_span_context().is_valid or not own:
            self.span = current
            return
        self.own = self.span = self.api.tracer.start_span(self.own_name, attributes=self.attributes)
        self.parent = trace.set_span_in_context(self.own)
        if attach:
            self.token = self.api.context.attach(self.parent)

    @guarded
    def end(self, error: Optional[BaseException] = None) -> None:
        """The call ended (raising ``error``): its own span, if it has one, ends."""
        own, self.own = self.own, None
        if own is None:
            return
        if self.token is not None:
            token, self.token = self.token, None
            self.api.context.detach(token)
        if error is not None:
            own.record_exception(error)
            own.set_status(self.api.error)
        own.end()

    def __enter__(self) -> Trace:
        self.begin()
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> bool:
        self.end(exc)
        return False

    # --- taking the key ----------------------------------------------------------------

    def acquiring(self) -> _Acquiring:
        """The ``exclusive.acquire`` span, for the ``with`` block that takes the key."""
        return _Acquiring(self)

    @guarded
    def claimed(self, claimed: Any) -> None:
        """What taking the key came to: ``granted``, ``unlocked``, ``held`` (a lock) or
        the outcome of a call that does not run (``skipped``...)."""
        if self.acquire is not None:
            name = claimed if isinstance(claimed, str) else outcome_name(claimed)
            self.acquire.set_attribute("exclusive.outcome", name)

    @guarded
    def granted(self, fencing_token: int) -> None:
        """A lease was granted to this call (:func:`celery_exclusive.core.lease.acquire`)."""
        if self.acquire is not None:
            self.acquire.set_attribute("exclusive.fencing_token", fencing_token)

    @guarded
    def ended(self, outcome: Any) -> None:
        """The call's outcome: an event for one that is not a run."""
        name = outcome_name(outcome)
        fields = _OUTCOME_FIELDS.get(name)
        if fields is None:
            return
        attributes = {
            f"exclusive.{field}": _attribute(value)
            for field in fields
            if (value := getattr(outcome, field, None)) is not None
        }
        self._event(f"exclusive.{_EVENT_NAMES.get(name, name)}", attributes)

    # --- the lease while it is held ----------------------------------------------------

    @guarded
    def renewed_late(self, since_last: float, time_left: float) -> None:
        self._event(
            "exclusive.renewal.late",
            {"exclusive.renewal.since_last": since_last, "exclusive.renewal.time_left": time_left},
        )

    @guarded
    def lost(self, cause: Optional[str], reason: str) -> None:
        self._event(
            "exclusive.lease.lost",
            {"exclusive.cause": cause or "unknown", "exclusive.reason": reason},
        )

    @guarded
    def released(self, held_for: float, freed: bool, late: bool, answered: bool = True) -> None:
        """The release: ``freed`` (the store had the lease), ``late`` (it reached the
        store after the lease expired, the body having ended in time), ``answered``."""
        self._event(
            "exclusive.lease.released",
            {
                "exclusive.held_for": held_for,
                "exclusive.freed": freed,
                "exclusive.late": late,
                "exclusive.answered": answered,
            },
        )

    def kept(self, held_for: float, seconds: float, kept: bool) -> None:
        """The run ended and its lease is kept ``seconds`` more (a window after the
        run, a rate's slot), not released; ``kept``: the store still had it."""
        self._event(
            "exclusive.lease.kept",
            {
                "exclusive.held_for": held_for,
                "exclusive.kept_for": seconds,
                "exclusive.freed": False,
                "exclusive.kept": kept,
            },
        )

    def _event(self, name: str, attributes: dict[str, Any]) -> None:
        span = self.span
        if span is None:
            span = self.span = self.api.trace.get_current_span()
        if span.is_recording():  # not once the host's span ended
            span.add_event(name, attributes)


class _Acquiring:
    """The ``exclusive.acquire`` span of a :class:`Trace`, current for the ``with``
    block; the trace is :func:`current` there."""

    __slots__ = ("trace", "token", "mine")

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.token: Any = None
        self.mine: Any = None

    def __enter__(self) -> Trace:
        self.mine = _acquiring.set(self.trace)
        self._start()
        return self.trace

    @guarded
    def _start(self) -> None:
        trace = self.trace
        api = trace.api
        if trace.span is None and trace.parent is None:
            trace.span = api.trace.get_current_span()
        span = api.tracer.start_span(
            "exclusive.acquire", context=trace.parent, attributes=trace.attributes
        )
        trace.acquire = span
        self.token = api.context.attach(api.trace.set_span_in_context(span))

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> bool:
        _acquiring.reset(self.mine)
        self._end(exc)
        return False

    @guarded
    def _end(self, error: Optional[BaseException]) -> None:
        trace = self.trace
        span, trace.acquire = trace.acquire, None
        if self.token is not None:
            trace.api.context.detach(self.token)
        if span is None:
            return
        span.set_attribute("exclusive.time_in_line", trace.in_line)
        if error is not None:
            span.record_exception(error)
            span.set_status(trace.api.error)
        span.end()


class _NoTrace:
    """What every hook is without the API: nothing."""

    __slots__ = ()

    def begin(self, attach: bool = True, own: bool = True) -> None: ...

    def end(self, error: Optional[BaseException] = None) -> None: ...

    def __enter__(self) -> _NoTrace:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return False

    def acquiring(self) -> _NoTrace:
        return self

    def claimed(self, claimed: Any) -> None: ...

    def granted(self, fencing_token: int) -> None: ...

    def ended(self, outcome: Any) -> None: ...

    def renewed_late(self, since_last: float, time_left: float) -> None: ...

    def lost(self, cause: Optional[str], reason: str) -> None: ...

    def released(self, held_for: float, freed: bool, late: bool, answered: bool = True) -> None: ...

    def kept(self, held_for: float, seconds: float, kept: bool) -> None: ...


#: The trace of a call where the API is not installed, or of a lease nobody traces.
NO_TRACE: Any = _NoTrace()

#: The trace whose ``exclusive.acquire`` span is open in this context.
_acquiring: ContextVar[Any] = ContextVar("exclusive_acquiring", default=NO_TRACE)


def call(
    name: Optional[str],
    key: str,
    store_url: str,
    policy: str,
    limit: int,
    key_prefix: str = "",
    trace_keys: str = "hash",
    task_id: Optional[str] = None,
    own_name: str = "exclusive.call",
) -> Any:
    """The trace of one call of task (or job, or lock) ``name`` on ``key``:
    :data:`NO_TRACE` where the API is not installed. A lock named by its key gives no
    ``name`` (a span shows the key only as ``trace_keys`` allows)."""
    otel = _api if _loaded else api()
    if otel is None:
        return NO_TRACE
    try:
        if not _recorded(otel):
            return NO_TRACE
        attributes: dict[str, Any] = {
            "exclusive.store": store_label(store_url),
            "exclusive.key": shown_key(key, key_prefix, trace_keys),
            "exclusive.policy": policy,
            "exclusive.limit": limit,
        }
        if name:
            attributes["exclusive.task"] = name
        if task_id:
            attributes["exclusive.task_id"] = task_id
        return Trace(otel, attributes, own_name)
    except Exception:
        _failed()
        return NO_TRACE


def current() -> Any:
    """The trace taking a key in this context (its ``exclusive.acquire`` span is open),
    or :data:`NO_TRACE`: a lease granted here is that trace's."""
    return _acquiring.get()


# --- waiting and the store --------------------------------------------------------------


class _Span:
    """A span of the library's, current for a ``with`` block: whatever the tracer
    raises is logged, whatever the block raises is recorded and goes on."""

    __slots__ = ("name", "attributes", "span", "token", "started")

    def __init__(self, name: str, attributes: dict[str, Any]) -> None:
        self.name = name
        self.attributes = attributes
        self.span: Any = None
        self.token: Any = None

    def __enter__(self) -> _Span:
        self.started = runtime.monotonic()
        self._start()
        return self

    @guarded
    def _start(self) -> None:
        otel = _api if _loaded else api()
        if otel is None:
            return
        self.span = otel.tracer.start_span(self.name, attributes=self.attributes)
        self.token = otel.context.attach(otel.trace.set_span_in_context(self.span))

    def set(self, name: str, value: Any) -> None:
        if self.span is not None:
            self._set(name, value)

    @guarded
    def _set(self, name: str, value: Any) -> None:
        self.span.set_attribute(name, value)

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> bool:
        if self.span is not None:
            self._end(exc)
        return False

    @guarded
    def _end(self, error: Optional[BaseException]) -> None:
        otel = _api
        assert otel is not None
        otel.context.detach(self.token)
        if error is not None:
            self.span.record_exception(error)
            self.span.set_status(otel.error)
        self.span.end()


class _NoSpan:
    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return False

    def set(self, name: str, value: Any) -> None: ...


_NO_SPAN = _NoSpan()


class _Waiting(_Span):
    """The ``exclusive.wait`` span: its time counts as the trace's time in line."""

    __slots__ = ("trace",)

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> bool:
        trace = self.trace
        if trace is not NO_TRACE:
            trace.in_line += runtime.monotonic() - self.started
        return super().__exit__(exc_type, exc, tb)


def waiting(claimant_kind: str) -> Any:
    """The ``exclusive.wait`` span of a call standing in its key's line (``claimant_kind``:
    ``task``, or ``call`` for a direct call or a lock), under the acquire span."""
    otel = _api if _loaded else api()
    if otel is None:
        return _NO_SPAN
    trace = _acquiring.get()
    waited = _Waiting("exclusive.wait", {"exclusive.claimant": claimant_kind})
    waited.trace = trace
    return waited


def round_trip(store: str) -> Callable[[F], F]:
    """Mark a store method as one round trip: it gets an ``exclusive.store`` span where a
    span is being recorded in its thread (inside an ``exclusive.acquire``, a task's run),
    and none elsewhere (the heartbeat's renewals, an operator's command).

    Only for stores whose client no OpenTelemetry instrumentation covers as one span per
    round trip: SQLite, whose round trip is a transaction of several statements in a
    file (the sqlite3 instrumentation, where used, shows each statement alone). Redis
    (redis-py), PostgreSQL (psycopg), MongoDB (pymongo), Consul (urllib3) and etcd
    (requests) each have an instrumentation that makes one span per request already.
    """

    def mark(method: F) -> F:
        operation = method.__name__

        @functools.wraps(method)
        def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
            otel = _api if _loaded else api()
            if otel is None or not _recording(otel):
                return method(self, *args, **kwargs)
            with _Span(
                f"exclusive.store {operation}",
                {"db.system.name": store, "exclusive.store.operation": operation},
            ):
                return method(self, *args, **kwargs)

        return traced  # type: ignore[return-value]

    return mark


def _recording(otel: _Api) -> bool:
    try:
        return bool(otel.trace.get_current_span().is_recording())
    except Exception:
        _failed()
        return False


# --- beat ---------------------------------------------------------------------------------


def beat_send(entry: str, task: str, fencing_token: int) -> Any:
    """The span of one tick a leading beat sends, if its record lets it
    (``exclusive.beat.sent``); its task's publish goes beneath."""
    otel = _api if _loaded else api()
    if otel is None:
        return _NO_SPAN
    return _Span(
        "exclusive.beat.send",
        {
            "exclusive.beat.entry": entry,
            "exclusive.task": task,
            "exclusive.fencing_token": fencing_token,
        },
    )


@guarded
def beat_takeover(trace: Any, fencing_token: int, caught_up: int, took: float) -> None:
    """A beat took the leader lease: an ``exclusive.acquire`` span of the ``took``
    seconds that took, with an ``exclusive.beat.takeover`` event."""
    if trace is NO_TRACE:
        return
    otel = trace.api
    start = int((runtime.wall() - took) * 1e9)
    span = otel.tracer.start_span(
        "exclusive.acquire", attributes=trace.attributes, start_time=start
    )
    span.set_attribute("exclusive.outcome", "granted")
    span.set_attribute("exclusive.fencing_token", fencing_token)
    span.add_event(
        "exclusive.beat.takeover",
        {"exclusive.fencing_token": fencing_token, "exclusive.beat.caught_up": caught_up},
    )
    span.end()


# --- metrics, from the signals as celery_exclusive.metrics' --------------------------------


def _feed_metrics(otel: _Api) -> None:
    """Count what the signals say, as :func:`celery_exclusive.metrics.install` does."""

    @guarded
    def acquired(sender: Any, **kwargs: Any) -> None:
        otel.acquisitions.add(1, {"task": str(sender)})

    @guarded
    def duplicate(sender: Any, policy: str, **kwargs: Any) -> None:
        otel.duplicates.add(1, {"task": str(sender), "policy": policy})

    @guarded
    def lost(sender: Any, **kwargs: Any) -> None:
        otel.leases_lost.add(1, {"task": str(sender)})

    @guarded
    def released(sender: Any, held_for: float, **kwargs: Any) -> None:
        otel.hold_seconds.record(held_for, {"task": str(sender)})

    @guarded
    def waited(sender: Any, waited: float, **kwargs: Any) -> None:
        otel.wait_seconds.record(waited, {"task": str(sender)})

    signals.lease_acquired.connect(acquired, weak=False)
    signals.duplicate_detected.connect(duplicate, weak=False)
    signals.lease_lost.connect(lost, weak=False)
    signals.lease_released.connect(released, weak=False)
    signals.lease_waited.connect(waited, weak=False)
