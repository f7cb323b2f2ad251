"""The settings of an ``@exclusive`` RQ job function, in RQ's own words.

Every setting ``<name>`` of :class:`celery_exclusive.core.config.Settings` is, for an RQ
job function, the decorator argument ``<name>``, else the environment variable
``EXCLUSIVE_<NAME>`` of the process, else the package default. The list of names is
the dataclass's, read here once: nothing re-lists it. Errors name a setting the way
its user gave it: ``@exclusive(on_duplicate='drop')`` or ``EXCLUSIVE_ON_DUPLICATE='drop'``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import typing
from collections.abc import Mapping
from typing import Any, Optional
from urllib.parse import quote

import redis
from rq.queue import Queue

from ..core import config
from ..errors import ConfigurationError

#: Environment variables ``EXCLUSIVE_<NAME>`` supply settings no decorator gives.
ENV_PREFIX = "EXCLUSIVE_"

#: Settings that act in Celery's ``apply_async``, which an RQ enqueue never goes
#: through (RQ's own ``job_id`` + ``unique=True`` refuses a second enqueue), and
#: ``skip_state``: a skipped RQ job always ends ``canceled``, with a record of the skip.
CELERY_ONLY = ("scope", "enqueue_ttl", "skip_state")

#: Each decorator option and its type, from the one list of settings.
OPTION_TYPES: dict[str, Any] = {
    name: kind
    for name, kind in typing.get_type_hints(config.Settings).items()
    if name not in CELERY_ONLY
}

#: What the environment may spell a boolean as.
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def check_options(owner: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options given to ``@exclusive``, without the ones left as None; an unknown
    or Celery-only name is a :class:`ConfigurationError`."""
    config.check_names(owner, options, lambda name: f"@exclusive({name}=...)")
    for name in options:
        if name == "skip_state":
            raise ConfigurationError(
                f"{owner}: @exclusive(skip_state=...) applies to Celery tasks only: a skipped "
                "RQ job always ends canceled (RQ's status for a job that did not run), with "
                "{'outcome': 'skipped', ...} as its result, and never counts as failed."
            )
        if name in CELERY_ONLY:
            raise ConfigurationError(
                f"{owner}: @exclusive({name}=...) applies to Celery's apply_async only; an RQ "
                "enqueue does not go through it. Give the job a job_id and enqueue it with "
                "unique=True to refuse a second enqueue."
            )
    return {name: value for name, value in options.items() if value is not None}


def signature() -> inspect.Signature:
    """``@exclusive``'s signature as ``help()`` and editors show it: the function, then
    every option, keyword-only, None by default (meaning: the environment, then the
    default). Built from the settings' types, so it cannot drift from them."""
    function = inspect.Parameter(
        "function", inspect.Parameter.POSITIONAL_ONLY, default=None, annotation=Optional[Any]
    )
    options = [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Optional[kind]
        )
        for name, kind in OPTION_TYPES.items()
    ]
    return inspect.Signature([function, *options])


def resolve(
    owner: str, options: Mapping[str, Any], connection_url: Optional[str]
) -> config.Settings:
    """Decorator options, then ``EXCLUSIVE_<NAME>``, then the defaults; checked.

    ``connection_url`` (the job's Redis) is the default lease store.
    """

    def describe(name: str, value: Any) -> str:
        if name in options:
            return f"@exclusive({name}={value!r})"
        return f"{ENV_PREFIX}{name.upper()}={value!r}"

    def from_environment(name: str) -> Any:
        return from_env(owner, name)

    return config.resolve(
        owner, options.get, from_environment, broker_url=connection_url, describe=describe
    )


def settings_for(
    owner: str, options: Mapping[str, Any], connection: Optional[redis.Redis]
) -> config.Settings:
    """The settings of one call, resolved when it runs. Unless ``backend_url`` names
    the lease store, it is ``connection``'s Redis: the job's own (None: no job)."""
    default_url = None
    if not (options.get("backend_url") or from_env(owner, "backend_url")):
        if connection is None:
            raise ConfigurationError(
                f"{owner} was called outside any RQ job, so no queue's Redis can hold its "
                "lease: give @exclusive(backend_url=...) or set EXCLUSIVE_BACKEND_URL."
            )
        default_url = connection_url(connection)
        if default_url is None:
            raise ConfigurationError(
                f"{owner}: cannot tell the URL of the job's Redis connection (Sentinel or "
                "Unix socket); give @exclusive(backend_url=...) or set EXCLUSIVE_BACKEND_URL."
            )
    return resolve(owner, options, default_url)


def from_env(owner: str, name: str) -> Any:
    """``EXCLUSIVE_<NAME>`` parsed to the setting's type; None when unset or empty.

    A value that does not parse is returned as it is, for the check to name it.
    """
    if name == "key" or name not in OPTION_TYPES:
        # A process-wide key would turn every per-record lock into one global lock.
        return None
    variable = ENV_PREFIX + name.upper()
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return None
    kind = OPTION_TYPES[name]
    if kind is bool:
        if raw.lower() in TRUE + FALSE:
            return raw.lower() in TRUE
        raise ConfigurationError(
            f"{owner}: {variable}={raw!r} is not allowed; use "
            + ", ".join(TRUE + FALSE)
            + " (any case)."
        )
    if int in (kind, *typing.get_args(kind)):
        try:
            return int(raw)
        except ValueError:
            return raw
    return raw


def connection_url(connection: redis.Redis) -> Optional[str]:
    """The ``redis://`` URL of a client's database, or None if it has no plain URL.

    A Sentinel pool or a Unix socket has none: such setups name ``backend_url``.
    """
    pool = connection.connection_pool
    kwargs = pool.connection_kwargs
    if "path" in kwargs or "host" not in kwargs or "Sentinel" in type(pool).__name__:
        return None
    scheme = "rediss" if issubclass(pool.connection_class, redis.SSLConnection) else "redis"
    auth = ""
    if kwargs.get("password") is not None:
        auth = f"{quote(kwargs.get('username') or '', safe='')}:"
        auth += f"{quote(kwargs['password'], safe='')}@"
    elif kwargs.get("username"):
        auth = f"{quote(kwargs['username'], safe='')}@"
    return f"{scheme}://{auth}{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"


def within_timeout(settings: config.Settings, timeout: Optional[float]) -> config.Settings:
    """Keep a ``wait`` well inside the job timeout: RQ kills a horse that overruns it."""
    limit = job_timeout(timeout)
    if settings.on_duplicate != "wait" or settings.wait_timeout <= limit / 2:
        return settings
    return dataclasses.replace(settings, wait_timeout=limit / 2)


def job_timeout(timeout: Optional[float]) -> float:
    """Seconds a job may run before RQ kills its horse (infinite for -1)."""
    if timeout is None:
        return float(Queue.DEFAULT_TIMEOUT)  # what the worker applies to a job without one
    return float("inf") if timeout <= 0 else float(timeout)
