"""celery-once's and celery-singleton's options, and what each one is here.

An option of either library left on a task after a migration is read by nobody: a
``once={"keys": ["invoice_id"]}`` or ``unique_on=["invoice_id"]`` that stays behind
makes the key fall back to every argument, and calls that differ in any other
argument no longer exclude each other. The integrations refuse such an option, with
the translation :func:`translate` gives. The meanings are those of the libraries'
own code:

- celery-once (``celery_once/tasks.py``, ``backends/redis.py``, ``backends/file.py``):
  ``once`` is a dict whose ``keys`` are the arguments of the lock key (``[]``: the
  task name alone), ``graceful`` makes ``apply_async`` return a ``REJECTED`` result
  instead of raising ``AlreadyQueued``, ``timeout`` is the lock's lifetime in seconds
  (``ONCE["settings"]["default_timeout"]``, else one hour), and
  ``unlock_before_run`` frees the lock as the body starts. The app setting ``ONCE``
  names the backend and its ``settings`` (``url``, ``default_timeout``,
  ``blocking``, ``blocking_timeout``; the file backend's ``location``).
- celery-singleton (``celery_singleton/singleton.py``, ``config.py``): ``unique_on``
  lists the arguments of the lock key (a string is one name; an empty list the task
  name alone), ``lock_expiry`` is the lock's lifetime in seconds (default: never
  expires), ``raise_on_duplicate`` raises ``DuplicateTaskError`` at ``apply_async``
  instead of returning the first call's result; the app settings
  ``singleton_backend_url``, ``singleton_key_prefix``, ``singleton_lock_expiry``,
  ``singleton_raise_on_duplicate``, ``singleton_backend_class``,
  ``singleton_backend_kwargs`` and ``singleton_json_encoder_class`` configure it.

Both lock when a task is *sent*; here the lease is taken where it *runs*, and
``scope="enqueue"`` (or ``"both"``) adds their send-time check.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

#: How an integration writes one of its settings with a value: ``exclusive_key=[...]``
#: for a Celery task, ``@exclusive(key=[...])`` for an RQ job function.
Spell = Callable[[str, Any], str]

#: Task options of each library (``singleton_*`` also counts: the app settings' prefix).
ONCE_OPTIONS = ("once",)
SINGLETON_OPTIONS = ("unique_on", "lock_expiry", "raise_on_duplicate")
SINGLETON_PREFIX = "singleton_"
#: celery-once's app setting.
ONCE_SETTING = "ONCE"

#: The modules whose task classes read these options: a task that derives from one of
#: them still uses the library, and its options are not leftovers.
LIBRARIES = {"celery_once": "celery-once", "celery_singleton": "celery-singleton"}

MIGRATING = 'see "Migrate from celery-once, celery-singleton or RQ\'s unique" in the docs'


def library_of(name: str) -> Optional[str]:
    """The library whose option (or app setting, any case, namespace removed) ``name``
    is, or None."""
    lowered = name.lower()
    if lowered in ONCE_OPTIONS or name.upper() in (ONCE_SETTING, "ONCE_DEFAULT_TIMEOUT"):
        return "celery-once"
    if lowered in SINGLETON_OPTIONS or lowered.startswith(SINGLETON_PREFIX):
        return "celery-singleton"
    return None


def uses_library(cls: type) -> bool:
    """Whether task class ``cls`` derives from celery-once's or celery-singleton's."""
    return any(klass.__module__.split(".")[0] in LIBRARIES for klass in cls.__mro__)


def translate(name: str, value: Any, spell: Spell, setting: bool = False) -> str:
    """What to write instead of the task option (or, with ``setting``, the app setting)
    ``name`` (see :func:`library_of`) set to ``value``, in the words of ``spell``."""
    lowered = name.lower()
    if setting and lowered in ("once", "once_default_timeout"):
        return _once_setting(name, value, spell)
    if lowered == "once":
        return _once(value, spell)
    option = lowered[len(SINGLETON_PREFIX) :] if lowered.startswith(SINGLETON_PREFIX) else lowered
    if option == "unique_on":
        names = [value] if isinstance(value, str) and value else list(value or [])
        return f"write {spell('key', names)} (the task name and those arguments)"
    if option == "lock_expiry":
        return (
            f"its lock lived {_seconds(value)}; here a lease is renewed while the body runs "
            f"and lives {spell('lease_ttl', 30)} seconds after a crash: drop it, or, with "
            f"{spell('scope', 'both')}, write {spell('enqueue_ttl', value)} for how long the "
            "send-time mark outlives a message that never ran"
        )
    if option == "raise_on_duplicate":
        return (
            "nothing raises at delay() here: with "
            f"{spell('scope', 'enqueue')} (or 'both') delay() returns the queued call's "
            "AsyncResult (compare its id with the task_id you gave), and with the default "
            f"{spell('scope', 'run')} the duplicate's .get() raises DuplicateSkipped"
        )
    if option == "backend_url":
        return f"write {spell('backend_url', value)}"
    if option == "key_prefix":
        return f"write {spell('key_prefix', value)}"
    if option in ("backend_class", "backend_kwargs"):
        return (
            f"the store is chosen by {spell('backend_url', '<url>')}: redis://, "
            "redis+sentinel://, sqlite:///, postgresql://, consul://, ... with its options "
            "in the query string"
        )
    if option == "json_encoder_class":
        return (
            "keys are built from the arguments' canonical text here: name the arguments "
            f"that identify the work with {spell('key', ['...'])} instead of encoding others"
        )
    return "drop it"


def _once(value: Any, spell: Spell) -> str:
    """celery-once's task option ``once={...}``, key by key."""
    options: Mapping[str, Any] = value if isinstance(value, Mapping) else {}
    parts = []
    if "keys" in options:
        parts.append(f"{spell('key', list(options['keys'] or []))} for its keys")
    parts.append(
        f"{spell('scope', 'both')} to refuse a second copy at delay() as celery-once did"
        + (
            " (delay() then returns the queued call's result instead of raising or rejecting)"
            if "graceful" in options
            else ""
        )
    )
    if "timeout" in options:
        parts.append(
            f"{spell('enqueue_ttl', options['timeout'])} for its timeout (the lease itself "
            "is renewed while the body runs)"
        )
    if options.get("unlock_before_run"):
        parts.append(
            "unlock_before_run has no match: the lease is held while the body runs, so "
            f"leave {spell('scope', 'run')} to let a new call queue behind it"
        )
    return "write " + "; ".join(parts)


def _once_setting(name: str, value: Any, spell: Spell) -> str:
    """celery-once's app setting ``ONCE = {"backend": ..., "settings": {...}}``."""
    if name.upper() == "ONCE_DEFAULT_TIMEOUT":
        return f"write {spell('enqueue_ttl', value)}"
    config: Mapping[str, Any] = value if isinstance(value, Mapping) else {}
    settings: Mapping[str, Any] = config.get("settings") or {}
    parts = []
    if "url" in settings:
        parts.append(spell("backend_url", settings["url"]))
    elif "location" in settings or "File" in str(config.get("backend", "")):
        parts.append(spell("backend_url", "sqlite:///path/to/leases.db") + " (one host)")
    if "default_timeout" in settings:
        parts.append(spell("enqueue_ttl", settings["default_timeout"]))
    if settings.get("blocking"):
        parts.append(spell("on_duplicate", "wait"))
        if "blocking_timeout" in settings:
            parts.append(spell("wait_timeout", settings["blocking_timeout"]))
    if not parts:
        return "drop it"
    return "write " + ", ".join(parts)


def _seconds(value: Any) -> str:
    return "forever" if value is None else f"{value} seconds"
