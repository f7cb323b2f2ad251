"""Settings: one naming rule, defaults kept here, every value checked.

Every setting ``<name>`` is read from, in order: the per-task override (task
attribute ``exclusive_<name>``, or an RQ decorator argument), the app setting
``exclusive_<name>`` (Django: ``CELERY_EXCLUSIVE_<NAME>``), then ``DEFAULTS``.
Defaults live in this package rather than in ``app.add_defaults``, which would
hide a user's namespaced value.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

from .backends import SCHEMES
from .errors import ConfigurationError
from .keys import KeySpec

#: Celery's Redis broker schemes whose URL can serve as the lease store too.
REDIS_SCHEMES = ("redis", "rediss")

ON_DUPLICATE = ("skip", "requeue", "wait", "rerun")
ON_BACKEND_ERROR = ("requeue", "run")
ON_LEASE_LOST = ("log", "abort")
RERUN_ARGS = ("latest", "first")
SCOPES = ("run", "enqueue", "both")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The resolved settings of one task (or RQ job function)."""

    backend_url: str
    key: KeySpec = None
    key_prefix: str = "exclusive:"
    lease_ttl: float = 30.0
    limit: int = 1
    on_duplicate: str = "skip"
    wait_timeout: float = 10.0
    on_backend_error: str = "requeue"
    on_lease_lost: str = "log"
    #: First requeue delay in seconds; doubles with each requeue, with full jitter.
    requeue_delay: float = 1.0
    requeue_max_delay: float = 60.0
    #: None: requeue until the key frees up, never drop the duplicate.
    requeue_max_retries: Optional[int] = None
    #: rerun policy: the follow-up runs with the latest duplicate's arguments, or the first's.
    rerun_args: str = "latest"
    #: A priority caller that finds its key held takes the next turn and waits for it.
    priority: bool = False
    #: "enqueue"/"both": apply_async() of a key already queued or running returns that
    #: call's AsyncResult instead of sending again. The run-time lease is always taken.
    scope: str = "run"
    #: How long an enqueue mark outlives a message nobody ran (a lost message).
    enqueue_ttl: float = 3600.0


NAMES = tuple(f.name for f in dataclasses.fields(Settings))
DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(Settings) if f.default is not dataclasses.MISSING
}


def setting_name(name: str) -> str:
    return f"exclusive_{name}"


def default_backend_url(broker_url: Optional[str]) -> str:
    """The broker's URL when it is Redis, else a SQLite file shared by this host's workers."""
    if broker_url and urlsplit(broker_url).scheme in REDIS_SCHEMES:
        return broker_url
    return "sqlite:///" + os.path.join(tempfile.gettempdir(), "celery-exclusive.sqlite3")


def resolve(
    owner: str,
    override: Callable[[str], Any],
    app_setting: Callable[[str], Any],
    broker_url: Optional[str] = None,
) -> Settings:
    """Resolve and check every setting for ``owner`` (a task or job name, for errors).

    ``override(name)`` and ``app_setting(name)`` return None where nothing is set.
    """
    values: dict[str, Any] = {}
    for name in NAMES:
        value = override(name)
        if value is None:
            value = app_setting(name)
        if value is not None:
            values[name] = value
    values.setdefault("backend_url", default_backend_url(broker_url))
    return _check(owner, Settings(**values))


def _check(owner: str, settings: Settings) -> Settings:
    def bad(name: str, value: Any, allowed: str) -> ConfigurationError:
        return ConfigurationError(
            f"{owner}: {setting_name(name)}={value!r} is not allowed; {allowed}."
        )

    for name, choices in (
        ("on_duplicate", ON_DUPLICATE),
        ("on_backend_error", ON_BACKEND_ERROR),
        ("on_lease_lost", ON_LEASE_LOST),
        ("rerun_args", RERUN_ARGS),
        ("scope", SCOPES),
    ):
        value = getattr(settings, name)
        if value not in choices:
            raise bad(name, value, "use one of " + ", ".join(repr(c) for c in choices))

    numbers = {}
    for name in ("lease_ttl", "wait_timeout", "requeue_delay", "requeue_max_delay", "enqueue_ttl"):
        value = getattr(settings, name)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = -1.0
        if number < 0 or (name == "lease_ttl" and number <= 0) or isinstance(value, bool):
            raise bad(name, value, "use a positive number of seconds")
        numbers[name] = number

    limit = settings.limit
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise bad("limit", limit, "use a whole number of at least 1")
    retries = settings.requeue_max_retries
    if retries is not None and (isinstance(retries, bool) or not isinstance(retries, int)):
        raise bad("requeue_max_retries", retries, "use a whole number, or None for no limit")
    if not isinstance(settings.priority, bool):
        raise bad("priority", settings.priority, "use True or False")
    if not isinstance(settings.key_prefix, str):
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
