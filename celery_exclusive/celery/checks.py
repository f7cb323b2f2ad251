"""Options and settings that would do nothing are refused, each with its fix.

Celery keeps any keyword of ``@app.task(...)`` as a class attribute and accepts any
setting, so three kinds of mistake would leave a task unprotected, or protected
otherwise than its author thinks, without a word:

- **A forgotten base class**: ``@app.task(exclusive_key=...)`` without
  ``base=ExclusiveTask`` is an ordinary task, and two calls for one key run at once.
- **An option nobody reads** on an ExclusiveTask: celery-once's ``once={...}`` or
  celery-singleton's ``unique_on``, ``lock_expiry``, ``raise_on_duplicate``,
  ``singleton_*`` left from a migration (the key silently falls back to every
  argument), a setting's name without its prefix (``on_duplicate="wait"``, the RQ
  decorator's spelling), a misspelt ``exclusive_*`` name.
- **A setting nobody reads**: a misspelt ``exclusive_*`` app setting, a Django
  ``CELERY_EXCLUSIVE_*`` setting of an app that reads Django's settings without
  ``namespace="CELERY"``, celery-once's ``ONCE`` or celery-singleton's ``singleton_*``
  once no task of the app uses them.

When they are found:

- An ExclusiveTask class is checked as it is made (:func:`check_task_class`, from
  ``ExclusiveTask.__init_subclass__``, which ``@app.task`` runs), so the mistake
  stops the import of a producer or a test; under the ``celery`` program, the
  start-up check below reports it.
- Everything, for every task and setting of the app, when a worker or ``celery beat``
  starts (:func:`check_app`, from the ``worker_init`` and ``beat_init`` receivers
  below): one line naming each mistake and its fix, and the process exits. They are
  connected whenever this package is imported, and the ``celery`` program imports it
  every time it starts, through the ``celery exclusive`` command's entry point
  (``celery.commands``), so a worker of an app that never imports celery-exclusive is
  checked too.
- An ExclusiveTask's first call checks its options and the app's settings again
  (:func:`check_task`, with its settings), for a producer that never starts a worker.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Optional

from celery import current_app
from celery.signals import beat_init, before_task_publish, import_modules, worker_init

from ..core import config, peers
from ..errors import ConfigurationError
from . import settings as app_settings

logger = logging.getLogger("celery_exclusive")

#: What a problem is prefixed with in the one line a worker or beat exits with.
EXIT_PREFIX = "celery-exclusive: ConfigurationError: "


# --- task classes ------------------------------------------------------------------------


def check_task_class(cls: type) -> None:
    """Refuse an ExclusiveTask subclass carrying an option nobody reads.

    Under the ``celery`` program a task class is made while the app is finalized, in
    the middle of Celery's start-up, where an exception is a traceback: there the
    worker's or beat's start-up check reports it instead, in one line with the other
    problems, and any other command at the task's first call (:func:`check_task`).
    """
    problems = list(_class_problems(cls))
    if problems and "celery.bin.celery" not in sys.modules:
        raise ConfigurationError(_joined(problems))


def check_task(task: Any) -> None:
    """Refuse an ExclusiveTask whose options, or whose app's settings, nothing reads:
    at its first call, with its settings."""
    problems = [*_class_problems(type(task)), *setting_problems(task.app)]
    broker = broker_problem(task.app)
    if broker is not None:
        problems.append(broker + ".")
    if problems:
        raise ConfigurationError(_joined(problems))


def is_exclusive_task(task: Any) -> bool:
    """Whether ``task`` is an ExclusiveTask (this module sits below the task class)."""
    return exclusive_base(type(task)) is not None


def exclusive_base(cls: type) -> Optional[type]:
    """ExclusiveTask, if it is along ``cls``'s MRO: the class that declares the
    settings property. (The checks sit below the task class, which runs them, and so do
    not import it.)"""
    for klass in cls.__mro__:
        if "exclusive_settings" in vars(klass):
            return klass
    return None


def _class_problems(cls: type) -> Iterator[str]:
    base = exclusive_base(cls)
    if base is None:
        return
    name = _task_name(cls)
    misspelt = []
    for attribute, value, owner in _own_attributes(cls, base):
        if attribute.startswith("exclusive_"):
            if attribute[len("exclusive_") :] not in config.NAMES and not hasattr(base, attribute):
                misspelt.append(attribute[len("exclusive_") :])
            continue
        if _read_by_a_base(cls, attribute, base):
            continue
        if peers.library_of(attribute) is not None and not peers.uses_library(cls):
            yield (
                f"{name}: {attribute}={value!r} is {peers.library_of(attribute)}'s option, "
                f"which ExclusiveTask does not read; {peers.translate(attribute, value, _spell)} "
                f"({peers.MIGRATING})."
            )
        elif attribute in config.NAMES and (owner.__dict__.get("_decorated") or _plain(value)):
            yield (
                f"{name}: {attribute}={value!r} is not read: a task's settings are spelt "
                f"exclusive_<name>; write {_spell(attribute, value)}."
            )
    for typo in misspelt:
        try:
            config.check_names(name, [typo])
        except ConfigurationError as exc:
            yield str(exc)


def _own_attributes(cls: type, exclusive_base: type) -> Iterator[tuple[str, Any, type]]:
    """``(name, value, class)`` of the attributes the ExclusiveTask subclasses along
    ``cls``'s MRO set themselves (for a class made by ``@app.task``: its options)."""
    seen = set()
    for klass in cls.__mro__:
        if klass is exclusive_base or not issubclass(klass, exclusive_base):
            continue
        for attribute, value in vars(klass).items():
            if attribute not in seen and not attribute.startswith("__"):
                seen.add(attribute)
                yield attribute, value, klass


def _read_by_a_base(cls: type, attribute: str, exclusive_base: type) -> bool:
    """Whether a class other than ExclusiveTask's subclasses declares ``attribute``:
    Celery's Task (``priority``, ...), or a base class of the user's that reads it."""
    return any(
        attribute in vars(klass)
        for klass in cls.__mro__
        if not issubclass(klass, exclusive_base) or klass is exclusive_base
    )


def _plain(value: Any) -> bool:
    """A value (not a method, property or other descriptor) set in a class body."""
    return not (callable(value) or hasattr(value, "__get__"))


def check_call_options(task_name: str, options: Mapping[str, Any]) -> None:
    """Refuse a setting (or celery-once's ``once``) given to one ``apply_async()`` call:
    settings are per task and per app, and Celery would send it along unread."""
    for option, value in options.items():
        if option.startswith("exclusive_") and option[len("exclusive_") :] in config.NAMES:
            raise ConfigurationError(
                f"{task_name}.apply_async({option}={value!r}): settings are per task and per "
                f"app, and a call cannot change them; set it on the task "
                f"(@app.task(base=ExclusiveTask, {option}=...)) or the app."
            )
        if option in peers.ONCE_OPTIONS:
            raise ConfigurationError(
                f"{task_name}.apply_async({option}={value!r}) is celery-once's per-call option, "
                f"which nothing reads here; on the task, {peers.translate(option, value, _spell)} "
                f"({peers.MIGRATING})."
            )


# --- a whole app -------------------------------------------------------------------------


def check_app(app: Any) -> None:
    """Refuse every task option and app setting of ``app`` that nothing reads."""
    problems = [*task_problems(app), *setting_problems(app)]
    if problems:
        raise ConfigurationError(_joined(problems))


def task_problems(app: Any) -> Iterator[str]:
    """Each registered task's options that nothing reads."""
    for task in list(app.tasks.values()):
        if is_exclusive_task(task):
            yield from _class_problems(type(task))
        else:
            yield from plain_task_problems(task)


def plain_task_problems(task: Any) -> Iterator[str]:
    """The options of a task that is no ExclusiveTask which only a base would read."""
    cls = type(task)
    options = sorted(attribute for attribute in dir(cls) if attribute.startswith("exclusive_"))
    if options:
        given = ", ".join(f"{option}={getattr(task, option)!r}" for option in options)
        yield (
            f"{task.name}: {given} is set, but the task is not an ExclusiveTask, so nothing "
            "reads it and its calls run without a lease (two calls for one key run at once). "
            "Give it the base class: @app.task(base=ExclusiveTask, ...) (from "
            "celery_exclusive import ExclusiveTask), or set "
            "task_cls='celery_exclusive:ExclusiveTask' on the app to make every task exclusive."
        )
    for attribute in _peer_options(cls):
        value = getattr(task, attribute)
        yield (
            f"{task.name}: {attribute}={value!r} is {peers.library_of(attribute)}'s option, "
            "but the task derives from neither that library's class nor ExclusiveTask, so "
            f"nothing reads it. Give it base=ExclusiveTask and "
            f"{peers.translate(attribute, value, _spell)} ({peers.MIGRATING})."
        )


def _peer_options(cls: type) -> list[str]:
    """celery-once or celery-singleton options on a plain task that no base reads."""
    if peers.uses_library(cls):
        return []
    found = []
    for attribute in vars(cls):
        if peers.library_of(attribute) is None or attribute.startswith("__"):
            continue
        if not any(attribute in vars(klass) for klass in cls.__mro__[1:]):
            found.append(attribute)
    return found


def setting_problems(app: Any) -> Iterator[str]:
    """App settings named like celery-exclusive's that nothing reads, in the words the
    configuration spells them."""
    conf = app.conf
    layout = app_settings.AppSettings(conf)
    uses = None  # read from the task registry only for a peer library's setting
    for key in layout.written():
        name = layout.unprefixed(key)
        if name.startswith("exclusive_"):
            yield from _setting_problem(layout, key, name)
        elif peers.library_of(name) is not None:
            library = peers.library_of(name)
            uses = uses or _uses(app)
            exclusive_tasks, peer_libraries = uses
            if exclusive_tasks and library not in peer_libraries:
                fix = peers.translate(name, conf.get(key), _app_spell(layout), setting=True)
                yield (
                    f"{key} is {library}'s setting, and no task of this app uses {library} now, "
                    f"so nothing reads it; {fix} ({peers.MIGRATING})."
                )


def _setting_problem(layout: app_settings.AppSettings, key: str, name: str) -> Iterator[str]:
    if name in config.APP_SETTINGS:
        if layout.reads(key, name):
            return
        yield f"{key} is never read: {layout.why_unread(key, name)}."
        return
    close = difflib.get_close_matches(name, config.APP_SETTINGS, n=1)
    if close:
        suggestion = layout.spelling(close[0])
        yield f"{key} is not a celery-exclusive setting; did you mean {suggestion}?"
        return
    yield (
        f"{key} is not a celery-exclusive setting, so nothing reads it (settings: "
        f"{', '.join(config.setting_name(n) for n in config.NAMES)}; for beat also "
        "exclusive_beat_<name>, exclusive_beat_key, exclusive_beat_scheduler)."
    )


def _uses(app: Any) -> tuple[bool, set[str]]:
    """Whether any task of ``app`` is an ExclusiveTask, and which peer libraries its
    tasks still use."""
    exclusive, libraries = False, set()
    for task in list(app.tasks.values()):
        exclusive |= is_exclusive_task(task)
        for klass in type(task).__mro__:
            library = peers.LIBRARIES.get(klass.__module__.split(".")[0])
            if library is not None:
                libraries.add(library)
    return exclusive, libraries


def environment_problems(environ: Mapping[str, str] = os.environ) -> list[str]:
    """``EXCLUSIVE_*`` environment variables, which configure RQ jobs and the
    ``celery-exclusive`` command, never a Celery task: each one, and its app setting."""
    return [
        f"{variable} is in the environment, which a Celery worker does not read "
        f"(EXCLUSIVE_* variables configure RQ jobs); set the app setting "
        f"{config.setting_name(variable[len('EXCLUSIVE_') :].lower())} for Celery"
        for variable in sorted(environ)
        if variable.startswith("EXCLUSIVE_")
        and variable[len("EXCLUSIVE_") :].lower() in config.NAMES
        and variable != "EXCLUSIVE_BACKEND_URL"
    ]


# --- the broker's transport --------------------------------------------------------------

#: kombu transports that the ``redis`` extra installs what they import for.
REDIS_TRANSPORTS = ("redis", "rediss", "sentinel")


def broker_problem(app: Any) -> Optional[str]:
    """Why the app's broker cannot be used here (its kombu transport does not import), or
    None. Without it, the first connection fails with kombu's traceback."""
    from kombu.transport import resolve_transport
    from kombu.utils.url import maybe_sanitize_url

    url = str(app.conf.broker_url or "").split(";")[0].strip()
    if "://" not in url:
        return None
    scheme = url.split("://", 1)[0].split("+", 1)[0]
    try:
        resolve_transport(scheme)
    except ImportError as exc:
        shown = maybe_sanitize_url(url)
        if scheme in REDIS_TRANSPORTS:
            return (
                f"the broker {shown} needs kombu's Redis transport, which cannot be imported "
                f"here ({exc}); install it with: pip install 'celery-exclusive[redis]' "
                "(redis-py, and celery[redis] for what the transport imports)"
            )
        return (
            f"the broker {shown} needs kombu's {scheme} transport, which cannot be imported "
            f"here ({exc}); install its client, e.g. pip install 'celery[{scheme}]'"
        )
    except (KeyError, ValueError):
        return None  # not a transport name: kombu says so itself
    return None


@import_modules.connect(weak=False, dispatch_uid="celery_exclusive.checks.broker")
def _check_broker(sender: Any = None, **kwargs: Any) -> None:
    """A worker and beat import their task modules before they first connect."""
    problem = None if sender is None else broker_problem(sender)
    if problem is not None:
        raise SystemExit(f"{EXIT_PREFIX}{problem}.")


# --- spelling ----------------------------------------------------------------------------


def _spell(name: str, value: Any) -> str:
    return f"{config.setting_name(name)}={value!r}"


def _app_spell(layout: app_settings.AppSettings) -> peers.Spell:
    return lambda name, value: f"{layout.spelling(config.setting_name(name))}={value!r}"


def _task_name(cls: type) -> str:
    return str(cls.__dict__.get("name") or f"{cls.__module__}.{cls.__qualname__}")


def _joined(problems: Iterable[str]) -> str:
    problems = list(dict.fromkeys(problems))
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems)


# --- at worker and beat start ------------------------------------------------------------


def _refuse(app: Any) -> None:
    """Exit with one line per problem: a traceback through Celery's start-up adds nothing."""
    try:
        check_app(app)
    except ConfigurationError as exc:
        raise SystemExit(f"{EXIT_PREFIX}{exc}") from None


@worker_init.connect(weak=False, dispatch_uid="celery_exclusive.checks.worker")
def _check_worker(sender: Any = None, **kwargs: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    _refuse(app)
    for problem in environment_problems():
        logger.warning("celery-exclusive: %s.", problem)


@beat_init.connect(weak=False, dispatch_uid="celery_exclusive.checks.beat")
def _check_beat(sender: Any = None, **kwargs: Any) -> None:
    app: Optional[Any] = getattr(sender, "app", None)
    if app is not None:
        _refuse(app)


# --- at a producer's first send of a task ------------------------------------------------

#: The task names whose first send in this process was looked at.
_sent: set[str] = set()


@before_task_publish.connect(weak=False, dispatch_uid="celery_exclusive.checks.publish")
def _check_first_send(sender: Optional[str] = None, **kwargs: Any) -> None:
    """A plain task with ``exclusive_*`` options, said as an ERROR at its first send.

    A producer cannot be stopped here: Celery's signals log what a receiver raises and
    send the message anyway (and ``delay()`` of a plain task reaches no code of ours
    otherwise). So the mistake is logged once a task and process, before the worker,
    which refuses to start with it, is ever reached.
    """
    if sender is None or sender in _sent:
        return
    _sent.add(sender)
    app = current_app._get_current_object()
    task = app._tasks.get(sender)
    if task is None or is_exclusive_task(task):
        return  # sent by name only, or checked at its own first call
    for problem in plain_task_problems(task):
        logger.error("celery-exclusive: %s", problem)
