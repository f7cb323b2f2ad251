"""Settings: one naming rule, defaults kept here, every value checked.

The fields of :class:`Settings` are the list of settings, written once: the task
attributes ``exclusive_<name>``, the RQ decorator's arguments and the checks here all
come from it (:data:`NAMES`).

Every setting ``<name>`` is read from, in order: the per-task override (task
attribute ``exclusive_<name>``, or an RQ decorator argument), the app setting
``exclusive_<name>`` (Django: ``CELERY_EXCLUSIVE_<NAME>``), then the field's default
in :class:`Settings`. Defaults live in this package rather than in
``app.add_defaults``, which would hide a user's namespaced value.

Without a Redis broker to share, leases default to a SQLite file private to the app
and the user (:func:`default_store_path`): two apps, or two users, on one host never
see each other's keys by accident.

A task resolves its settings once and keeps them while :func:`generation` stays the
same. The generation moves whenever a watched ``app.conf`` is changed
(:func:`celery_exclusive.celery.settings.watch`), a task's ``exclusive_<name>``
attribute is set, or :func:`force` changes what tests force: a change made after the
first call is seen at the next call, and a call in production pays one integer
comparison for it. Nothing here knows Celery: how an ``app.conf`` is read is
:mod:`celery_exclusive.celery.settings`'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Callable, Literal, Optional, get_args
from urllib.parse import urlsplit

from .. import runtime
from ..backends import SCHEMES
from ..errors import BackendUnavailable, ConfigurationError
from .keys import KeySpec, is_storable

#: Celery's Redis broker schemes whose URL can serve as the lease store too.
REDIS_SCHEMES = ("redis", "rediss")

#: The values of the settings that take one of a few words, as types (for type checkers,
#: the RQ decorator's signature and ExclusiveTask's attributes) and as tuples (checked here).
OnDuplicate = Literal["skip", "requeue", "wait", "rerun", "replace"]
OnBackendError = Literal["requeue", "run"]
OnLeaseLost = Literal["terminate", "abort", "log"]
RerunArgs = Literal["latest", "first"]
Scope = Literal["run", "enqueue", "both"]
SkipState = Literal["failure", "success"]
TraceKeys = Literal["hash", "prefix", "key"]
UniqueAfter = Literal["success", "end"]

ON_DUPLICATE: tuple[str, ...] = get_args(OnDuplicate)
ON_BACKEND_ERROR: tuple[str, ...] = get_args(OnBackendError)
ON_LEASE_LOST: tuple[str, ...] = get_args(OnLeaseLost)
RERUN_ARGS: tuple[str, ...] = get_args(RerunArgs)
SCOPES: tuple[str, ...] = get_args(Scope)
SKIP_STATES: tuple[str, ...] = get_args(SkipState)
TRACE_KEYS: tuple[str, ...] = get_args(TraceKeys)
UNIQUE_AFTER: tuple[str, ...] = get_args(UniqueAfter)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The resolved settings of one task (or RQ job function)."""

    #: Where leases live: a store's URL, whose scheme names the store (`redis://`,
    #: `postgresql://`, `sqlite:///path`...). Tasks exclude each other only when
    #: their leases live in the same store.
    backend_url: str
    #: What a call's lease is taken on: a format string filled from the call's arguments
    #: ("invoice:{invoice_id}"), a list of argument names (the task's name and those
    #: arguments), or a callable (args, kwargs) -> str. None: the task's name and all
    #: its arguments.
    key: KeySpec = None
    #: Put before every key in the store, keeping the leases apart from other data
    #: there; tasks exclude each other only with the same prefix.
    key_prefix: str = "exclusive:"
    #: Seconds a lease lives without a renewal. The heartbeat renews it every
    #: lease_ttl / 3; a holder that dies without releasing frees its key this long after
    #: its last renewal.
    lease_ttl: float = 30.0
    #: How many calls may hold one key at once: 1 is a lock, N a semaphore. Tasks that
    #: share a key must give it the same limit.
    limit: int = 1
    #: What a call whose key is held gets: "skip" (it ends at once without running),
    #: "requeue" (it is sent again after a backoff), "wait" (it waits in the key's line,
    #: then runs), "rerun" (the duplicates of one run become one follow-up run) or
    #: "replace" (it stops the running holder and runs instead).
    on_duplicate: OnDuplicate = "skip"
    #: Seconds a call waits in the key's line for its turn ("wait", a pending rerun, a
    #: priority caller) before it is requeued; outside a worker, before it raises
    #: DuplicateSkipped.
    wait_timeout: float = 10.0
    #: What a call gets when the store does not answer: "requeue" (it is sent again with
    #: a backoff until the store answers; it never runs unlocked) or "run" (it runs
    #: without a lease, and a WARNING says so).
    on_backend_error: OnBackendError = "requeue"
    #: What a holder whose lease is lost gets: "terminate" (stopped at once, see
    #: terminate.py), "abort" (fails with LeaseLost when it returns) or "log".
    on_lease_lost: OnLeaseLost = "terminate"
    #: "terminate": seconds an interrupted body has to stop before its process is killed.
    terminate_grace: float = 5.0
    #: Whether a call whose body was stopped by the loss of its lease (LeaseLost raised
    #: into it, or the loss found when it returned) is sent again, to run under a fresh
    #: lease and its duplicate policy. False: it fails with LeaseLost. Calls with no queue
    #: to go back to (direct, eager, a synchronous RQ queue) always fail.
    requeue_lost: bool = True
    #: First requeue delay in seconds; doubles with each requeue, with full jitter.
    requeue_delay: float = 1.0
    #: Seconds: the longest requeue delay, where the doubling stops.
    requeue_max_delay: float = 60.0
    #: None: requeue until the key frees up, never drop the duplicate.
    requeue_max_retries: Optional[int] = None
    #: rerun policy: the follow-up runs with the latest duplicate's arguments, or the first's.
    rerun_args: RerunArgs = "latest"
    #: A priority caller that finds its key held takes the next turn and waits for it.
    priority: bool = False
    #: "enqueue"/"both": apply_async() of a key already queued or running returns that
    #: call's AsyncResult instead of sending again. The run-time lease is always taken.
    scope: Scope = "run"
    #: How long an enqueue mark outlives a message nobody ran (a lost message).
    enqueue_ttl: float = 3600.0
    #: The state a skipped or coalesced duplicate ends in: "failure" (it raises
    #: DuplicateSkipped, task_failure fires) or "success" (it returns a dict saying
    #: so; nothing counts it as a failure). Either is ready at once for .get().
    skip_state: SkipState = "failure"
    #: What OpenTelemetry spans show of a key (keys may name a person: "user:42"):
    #: "hash" (sha256: and 16 hex digits of its SHA-256, the same for every call of one
    #: key), "prefix" (the key prefix and the key's part before its first ":", as
    #: "exclusive:invoice:") or "key" (the key itself). See the tracing how-to.
    trace_keys: TraceKeys = "hash"
    #: Seconds the key stays taken after a run of it ends (a uniqueness window: Oban's
    #: ``unique period``, Sidekiq's ``unique_for``): the run's lease is kept that long,
    #: then lapses, and a call meeting it is a duplicate under ``on_duplicate``. 0: the
    #: key is free as the run ends. Needs a store with the ``windows`` capability.
    unique_for: float = 0.0
    #: Which runs keep the window: "success" (a run that raised frees the key at once,
    #: so that a call sent again after a fix runs) or "end" (every run, whatever it did).
    unique_after: UniqueAfter = "success"
    #: At most N runs of a key start in any period, on every worker: "N/s", "N/m", "N/h"
    #: or "N/<number><s|m|h>" ("3/10s"). A run holds one of N slots from its grant to a
    #: period later (its end, if later); a call that finds none is a duplicate under
    #: ``on_duplicate``: "skip" drops it (a rate limit), "requeue" and "wait" delay it
    #: (a throttle). None: no rate. Sets ``limit`` to N.
    rate: Optional[str] = None
    #: Seconds a queued call waits for a later one of its key (a debounce: Inngest's
    #: ``debounce period``, BullMQ's debounce ``delay``): of a burst of calls, only the
    #: last runs, with its arguments, this long after it came; the others end coalesced
    #: into it. 0: no debounce. Calls that cannot be sent again (direct, eager) run at once.
    debounce: float = 0.0
    #: Seconds from a burst's first call after which its latest call runs even if calls
    #: keep coming (Inngest's debounce ``timeout``). 0: no bound.
    debounce_max_wait: float = 0.0

    @functools.cached_property
    def keeps_lease(self) -> bool:
        """Whether a run's lease may be kept past its end (a window after it, a rate's
        slot): the store must then let a renewal give it another ttl (``windows``)."""
        return bool(self.unique_for) or self.rate is not None

    def kept_after(self, failed: bool, since_grant: float, window: bool = True) -> float:
        """Seconds a run's lease is kept once the run is over, ``since_grant`` seconds
        after its grant (``failed``: it raised, or its process died): its uniqueness
        window (after a success, or after every end; none where the call comes again,
        ``window=False``: it is not over), and under a rate what is left of the period
        since its grant (a start counts however its run ended). 0: freed at once."""
        keep = 0.0
        if window and self.unique_for and not (failed and self.unique_after == "success"):
            keep = self.unique_for
        if self.rate is not None:
            _, period = parse_rate(self.rate) or (0, 0.0)
            keep = max(keep, period - since_grant + RATE_MARGIN)
        return keep


#: Every setting's name: the one list that task attributes, app settings and the RQ
#: decorator's arguments are checked against.
NAMES = tuple(f.name for f in dataclasses.fields(Settings))


def setting_name(name: str) -> str:
    return f"exclusive_{name}"


#: Settings of ``celery beat`` alone (:mod:`celery_exclusive.beat`): the name of the
#: beat's lease key and the scheduler it wraps. Every setting is also
#: ``exclusive_beat_<name>`` there.
BEAT_ONLY = ("beat_key", "beat_scheduler")

#: Every app setting celery-exclusive reads, as Celery spells it.
APP_SETTINGS = tuple(
    setting_name(name) for name in (*NAMES, *(f"beat_{name}" for name in NAMES), *BEAT_ONLY)
)


# --- seeing changes made after the first call ---------------------------------------

_generation = 0
_generation_lock = runtime.Lock()

#: Settings forced above every task attribute and app setting (see :func:`force`).
_forced: dict[str, Any] = {}


def generation() -> int:
    """A number that changes whenever a setting may have changed: a task's resolved
    settings are good while it stays the same."""
    return _generation


def invalidate() -> None:
    """Make every task resolve its settings again at its next call."""
    global _generation
    with _generation_lock:
        _generation += 1


def forced(name: str) -> Any:
    """The value :func:`force` forces for setting ``name`` now, or None."""
    return _forced.get(name)


@contextmanager
def force(**settings: Any) -> Iterator[None]:
    """Force ``settings`` (names without the ``exclusive_`` prefix) on every task and
    job of this process, above task attributes and app settings, until the block ends.

    For tests (:mod:`celery_exclusive.testing` forces a private ``backend_url``): a
    task that names its own store must not reach it from a test.
    """
    check_names("celery_exclusive.core.config.force()", settings, spelled=lambda name: name)
    saved = dict(_forced)
    _forced.update(settings)
    invalidate()
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)
        invalidate()


def describe_setting(name: str, value: Any) -> str:
    """How an error shows a setting and its value: as Celery spells it."""
    return f"{setting_name(name)}={value!r}"


def check_names(
    owner: str, names: Iterable[str], spelled: Callable[[str], str] = setting_name
) -> None:
    """Raise :class:`ConfigurationError` for a name that is no setting (a typo would
    otherwise be ignored silently); ``spelled`` shows a name as the user wrote it."""
    for name in names:
        if name not in NAMES:
            close = difflib.get_close_matches(name, NAMES, n=1)
            hint = f"did you mean {spelled(close[0])}?" if close else "see the settings list"
            raise ConfigurationError(
                f"{owner}: {spelled(name)} is not a celery-exclusive setting; {hint} "
                f"(settings: {', '.join(NAMES)})."
            )


def unanswered_in_process(
    call: str, key: str, exc: BackendUnavailable, memory: str = "exclusive_backend_url='memory://'"
) -> BackendUnavailable:
    """The error of a call run in the caller's own process (eager, direct: a test, most
    often) whose lease store does not answer: it points to an in-process store (set as
    ``memory`` says), not to what a worker does meanwhile (``on_backend_error``), which
    such a call never does."""
    store = str(exc).split(". Check that", 1)[0]  # the store's words, without its advice
    return BackendUnavailable(
        f"{call} runs in this process and cannot take the lease on {key!r}: {store}. In a "
        "test, request the exclusive_store fixture (celery-exclusive's pytest plugin: every "
        f"exclusive task then uses a private in-process store), or set {memory}; otherwise "
        "start that store.",
        exc.url,
    )


def default_store_dir() -> str:
    """The directory of the default SQLite stores: the user's own state directory.

    ``$XDG_STATE_HOME/celery-exclusive``, else ``~/.local/state/celery-exclusive``;
    for a user without a home directory, ``<tmp>/celery-exclusive-<uid>``. It is
    created with mode 0700, and a worker refuses to start if someone else owns it.
    """
    state = os.environ.get("XDG_STATE_HOME", "")
    if not os.path.isabs(state):
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            return os.path.join(tempfile.gettempdir(), f"celery-exclusive-{_uid()}")
        state = os.path.join(home, ".local", "state")
    return os.path.join(state, "celery-exclusive")


def default_store_path(app_name: Optional[str]) -> str:
    """The default SQLite store of the app named ``app_name``, for this user.

    One file per app and user: two apps never share keys, nor two users a file one of
    them cannot write. Every process of the app (workers, beat, producers) finds the
    same file, since it depends on nothing but the app's name and the uid.
    """
    return os.path.join(default_store_dir(), f"{app_label(app_name)}-uid{_uid()}.sqlite3")


def app_label(app_name: Optional[str]) -> str:
    """A file-name-safe, stable name for an app.

    ``Celery(__name__)`` in a script run directly is named ``__main__``; its workers
    (``celery -A tasks worker``) import it as ``tasks``. The script's own module name
    (the file's stem) is what both agree on.
    """
    name = app_name or ""
    if name in ("", "__main__"):
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        path = getattr(main, "__file__", None) or ""
        stem = os.path.splitext(os.path.basename(path))[0]
        if stem == "__main__" and spec is not None:  # python -m package
            stem = spec.parent or spec.name
        name = stem or "__main__"
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100]


def _uid() -> int:
    getuid = getattr(os, "getuid", None)
    return getuid() if getuid is not None else 0


def default_backend_url(broker_url: Optional[str], app_name: Optional[str] = None) -> str:
    """The broker's URL when it is Redis, else the private SQLite file of the app named
    ``app_name`` (every command of one app names it, so that all find the same file).
    """
    if broker_url and urlsplit(broker_url).scheme in REDIS_SCHEMES:
        return broker_url
    return "sqlite:///" + default_store_path(app_name)


def resolve(
    owner: str,
    override: Callable[[str], Any],
    app_setting: Callable[[str], Any],
    broker_url: Optional[str] = None,
    app_name: Optional[str] = None,
    describe: Callable[[str, Any], str] = describe_setting,
) -> Settings:
    """Resolve and check every setting for ``owner`` (a task or job name, for errors).

    ``override(name)`` and ``app_setting(name)`` return None where nothing is set.
    ``broker_url`` and ``app_name`` choose the default store (see
    :func:`default_backend_url`). ``describe(name, value)`` is how an error names a
    bad setting, in the words of whoever gave it (RQ's decorator and environment
    variables have their own).
    """
    values: dict[str, Any] = {}
    #: Where each value came from: 0 forced, 1 the task's, 2 the app's.
    levels: dict[str, int] = {}
    sources: tuple[Callable[[str], Any], ...] = (_forced.get, override, app_setting)
    for name in NAMES:
        for level, source in enumerate(sources):
            value = source(name)
            if value is not None:
                values[name], levels[name] = value, level
                break
    if "rate" in values and levels.get("limit", 3) > levels["rate"]:
        values.pop("limit", None)  # a rate sets the limit: a more general one gives way
    values.setdefault("backend_url", default_backend_url(broker_url, app_name))
    return _check(owner, Settings(**values), describe)


#: Seconds a rate's slot is kept beyond its period: a store counts a ttl in whole
#: milliseconds by its clock, and may end it up to two of them early (Redis floors both).
RATE_MARGIN = 0.002

#: A rate: a count, "/", an optional number and a unit.
_RATE = re.compile(r"\s*(\d+)\s*/\s*(\d+(?:\.\d*)?|\.\d+)?\s*([smh])\s*\Z")
_UNIT_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_rate(rate: Any) -> Optional[tuple[int, float]]:
    """``rate`` as (runs, seconds), or None if it is no rate ("10/m" is (10, 60.0))."""
    return _parse_rate(rate) if isinstance(rate, str) else None


@functools.lru_cache(maxsize=256)
def _parse_rate(rate: str) -> Optional[tuple[int, float]]:
    found = _RATE.match(rate)
    if found is None:
        return None
    count, number, unit = found.groups()
    seconds = float(number or 1) * _UNIT_SECONDS[unit]
    return (int(count), seconds) if int(count) >= 1 and seconds > 0 else None


def _check(owner: str, settings: Settings, describe: Callable[[str, Any], str]) -> Settings:
    def bad(name: str, value: Any, allowed: str) -> ConfigurationError:
        return ConfigurationError(f"{owner}: {describe(name, value)} is not allowed; {allowed}.")

    for name, choices in (
        ("on_duplicate", ON_DUPLICATE),
        ("on_backend_error", ON_BACKEND_ERROR),
        ("on_lease_lost", ON_LEASE_LOST),
        ("rerun_args", RERUN_ARGS),
        ("scope", SCOPES),
        ("skip_state", SKIP_STATES),
        ("trace_keys", TRACE_KEYS),
        ("unique_after", UNIQUE_AFTER),
    ):
        value = getattr(settings, name)
        if value not in choices:
            raise bad(name, value, "use one of " + ", ".join(repr(c) for c in choices))

    numbers: dict[str, Any] = {}
    for name in (
        "lease_ttl",
        "wait_timeout",
        "requeue_delay",
        "requeue_max_delay",
        "enqueue_ttl",
        "terminate_grace",
        "unique_for",
        "debounce",
        "debounce_max_wait",
    ):
        value = getattr(settings, name)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = -1.0
        if (
            not math.isfinite(number)
            or number < 0
            or (name == "lease_ttl" and number <= 0)
            or isinstance(value, bool)
        ):
            raise bad(name, value, "use a positive number of seconds")
        numbers[name] = number

    if numbers["debounce_max_wait"] and not numbers["debounce"]:
        raise bad(
            "debounce_max_wait",
            settings.debounce_max_wait,
            "it bounds a debounce: give the task a debounce period too",
        )
    if settings.on_duplicate == "replace":
        _check_replace(settings, numbers, bad)
    if numbers["debounce"] and settings.on_duplicate == "rerun":
        raise bad(
            "on_duplicate",
            settings.on_duplicate,
            f"a debounce already runs the latest of its calls once: choose 'requeue' or "
            f"'wait' for the run that meets the previous one with "
            f"{describe('debounce', settings.debounce)}",
        )
    if numbers["debounce"] and settings.scope != "run":
        raise bad(
            "scope",
            settings.scope,
            f"a debounced task's calls all go out to be coalesced at run time: leave it "
            f"'run' with {describe('debounce', settings.debounce)}",
        )
    limit = settings.limit
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise bad("limit", limit, "use a whole number of at least 1")
    if settings.rate is not None:
        rate = parse_rate(settings.rate)
        if rate is None:
            raise bad("rate", settings.rate, "use runs per period: '10/m', '3/10s'")
        if limit not in (1, rate[0]):
            raise bad("limit", limit, f"leave it out with {describe('rate', settings.rate)}")
        numbers["limit"] = rate[0]
    retries = settings.requeue_max_retries
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int)):
        raise bad("requeue_max_retries", retries, "use a whole number, or None for no limit")
    if not isinstance(settings.priority, bool):
        raise bad("priority", settings.priority, "use True or False")
    if not isinstance(settings.requeue_lost, bool):
        raise bad("requeue_lost", settings.requeue_lost, "use True or False")
    if not isinstance(settings.key_prefix, str) or not is_storable(settings.key_prefix):
        raise bad("key_prefix", settings.key_prefix, "use a string such as 'exclusive:'")
    key = settings.key
    if not (key is None or isinstance(key, (str, list, tuple)) or callable(key)):
        raise bad("key", key, "use a format string, a list of argument names or a callable")

    url = settings.backend_url
    scheme = urlsplit(url).scheme if isinstance(url, str) else None
    if scheme not in SCHEMES:
        raise bad(
            "backend_url",
            url,
            "use a URL whose scheme is one of " + ", ".join(s + "://" for s in sorted(SCHEMES)),
        )
    return dataclasses.replace(settings, **numbers)


def _check_replace(
    settings: Settings, numbers: dict[str, Any], bad: Callable[..., ConfigurationError]
) -> None:
    """``replace`` stops the holder through the loss of its lease: only a holder that a
    loss stops (``terminate``), of a key held by one (a lock), whose lease goes when its
    run ends (no window, no rate), and which nothing else reorders (no priority)."""
    why = "a replaced run is stopped as a lost lease stops it"
    if settings.on_lease_lost != "terminate":
        raise bad("on_lease_lost", settings.on_lease_lost, f"use 'terminate' with replace: {why}")
    if settings.rate is not None:
        raise bad("rate", settings.rate, "replace runs the newest call at once: leave it out")
    if settings.limit != 1:
        raise bad("limit", settings.limit, "replace stops the one holder of a key: leave it 1")
    if settings.scope != "run":
        raise bad("scope", settings.scope, "a newer call must be sent to replace: leave it 'run'")
    if numbers["unique_for"] or numbers["debounce"] or settings.priority:
        name = next(n for n in ("unique_for", "debounce", "priority") if getattr(settings, n))
        raise bad(
            name, getattr(settings, name), "replace runs the newest call at once: leave it out"
        )
