"""What ``@exclusive`` and the RQ workers refuse because nothing would read it.

- **An option that belongs elsewhere**, given to ``@exclusive``: one of RQ's own job
  options (``job_timeout``, ``unique``, ``retry``... which ``queue.enqueue()`` and
  RQ's ``@job`` take), a Celery task's spelling (``exclusive_key``), or a
  celery-once or celery-singleton option left from a migration (``once``,
  ``unique_on``). Each is named with where it goes.
- **An environment variable nobody reads**: ``EXCLUSIVE_<NAME>`` is how an RQ worker
  takes a setting, so a misspelt one (``EXCLUSIVE_LEASE_TLL``), one that is never
  read from the environment (``EXCLUSIVE_KEY``: a process-wide key would turn every
  per-record lock into one lock) and a Celery-only one (``EXCLUSIVE_SCOPE``) are
  refused when ``celery_exclusive.rq`` is imported: by a worker started with
  ``--job-class celery_exclusive.rq.ExclusiveJob``, and by every process that
  enqueues a marked function. Variables of other names (``EXCLUSIVE_MY_FLAG``) are
  left alone: only a near miss of a setting's name is taken for a typo.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Any, Optional

from ..core import config, peers
from ..errors import ConfigurationError
from . import options as rq_options

#: RQ's own job options (``Queue.enqueue``, ``Queue.parse_args``, RQ's ``@job``):
#: what each one is there.
RQ_OPTIONS = {
    "job_timeout": "queue.enqueue(f, ..., job_timeout=...) or RQ's @job(timeout=...)",
    "timeout": "queue.enqueue(f, ..., job_timeout=...) or RQ's @job(timeout=...)",
    "job_id": "queue.enqueue(f, ..., job_id=...)",
    "description": "queue.enqueue(f, ..., description=...)",
    "result_ttl": "queue.enqueue(f, ..., result_ttl=...) or RQ's @job(result_ttl=...)",
    "ttl": "queue.enqueue(f, ..., ttl=...) or RQ's @job(ttl=...)",
    "failure_ttl": "queue.enqueue(f, ..., failure_ttl=...) or RQ's @job(failure_ttl=...)",
    "depends_on": "queue.enqueue(f, ..., depends_on=...)",
    "at_front": "queue.enqueue(f, ..., at_front=True)",
    "meta": "queue.enqueue(f, ..., meta=...)",
    "retry": "queue.enqueue(f, ..., retry=Retry(...)) or RQ's @job(retry=...)",
    "repeat": "queue.enqueue(f, ..., repeat=Repeat(...))",
    "on_success": "queue.enqueue(f, ..., on_success=...)",
    "on_failure": "queue.enqueue(f, ..., on_failure=...)",
    "on_stopped": "queue.enqueue(f, ..., on_stopped=...)",
    "rate_limit": "queue.enqueue(f, ..., rate_limit=RateLimit(...)) (RQ 3)",
    "webhooks": "queue.enqueue(f, ..., webhooks=...)",
    "queue": "RQ's @job(queue) or Queue(name).enqueue(f, ...)",
    "connection": "Queue(..., connection=...) (the lease store is backend_url)",
    "unique": (
        "queue.enqueue(f, ..., job_id=..., unique=True), which refuses a second enqueue "
        "of that job id; @exclusive keeps two runs of one key apart whatever their ids "
        "(on_duplicate says what a duplicate gets)"
    ),
}

#: Settings a worker never takes from the environment, and why.
NOT_FROM_ENVIRONMENT = {
    "key": (
        "a key is never read from the environment: one process-wide key would turn every "
        "per-record lock into one lock; give @exclusive(key=...)"
    ),
    **{
        name: (
            f"{config.setting_name(name)} is a Celery setting that RQ never reads"
            + (
                "; give the job a job_id and enqueue it with unique=True to refuse a second enqueue"
                if name != "skip_state"
                else ": a skipped RQ job always ends canceled with a record of the skip"
            )
        )
        for name in rq_options.CELERY_ONLY
    },
}

#: A typo changes a few characters; a name longer or shorter by more is another variable.
NEAR_MISS_LENGTH = 2


def check_options(owner: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``@exclusive``'s options, checked: one that belongs elsewhere is refused with
    where it goes, then every other unknown or Celery-only name
    (:func:`celery_exclusive.rq.options.check_options`)."""
    for name, value in options.items():
        problem = foreign_option(owner, name, value)
        if problem is not None:
            raise ConfigurationError(problem)
    return rq_options.check_options(owner, options)


def foreign_option(owner: str, name: str, value: Any) -> Optional[str]:
    """The error for an ``@exclusive`` option that is not one of its settings but
    belongs elsewhere, or None."""
    shown = f"@exclusive({name}={value!r})"
    if name in RQ_OPTIONS:
        where = RQ_OPTIONS[name]
        return f"{owner}: {shown} is RQ's own job option, not a lock setting: give it to {where}."
    if name.startswith("exclusive_") and name[len("exclusive_") :] in rq_options.OPTION_TYPES:
        bare = name[len("exclusive_") :]
        return (
            f"{owner}: {shown} is a Celery task's spelling; @exclusive takes it as "
            f"{_spell(bare, value)}."
        )
    if peers.library_of(name) is not None:
        return (
            f"{owner}: {shown} is {peers.library_of(name)}'s option, which nothing reads here; "
            f"{peers.translate(name, value, _spell)} ({peers.MIGRATING})."
        )
    return None


def check_environment(environ: Mapping[str, str] = os.environ) -> None:
    """Refuse ``EXCLUSIVE_*`` variables that look like settings but are never read."""
    problems = []
    for variable in sorted(environ):
        if not variable.startswith(rq_options.ENV_PREFIX):
            continue
        name = variable[len(rq_options.ENV_PREFIX) :].lower()
        if name in rq_options.OPTION_TYPES and name != "key":
            continue
        if name in NOT_FROM_ENVIRONMENT:
            problems.append(f"{variable} is never read: {NOT_FROM_ENVIRONMENT[name]}")
        elif name.startswith("beat_") and name[len("beat_") :] in (
            *config.NAMES,
            "key",
            "scheduler",
        ):
            problems.append(
                f"{variable} is never read: beat's settings are Celery app settings "
                f"({config.setting_name(name)})"
            )
        else:
            close = [
                match
                for match in difflib.get_close_matches(
                    name, rq_options.OPTION_TYPES, n=3, cutoff=0.75
                )
                if abs(len(match) - len(name)) <= NEAR_MISS_LENGTH and match != "key"
            ]
            if close:
                problems.append(
                    f"{variable} is not a celery-exclusive setting, so nothing reads it; did "
                    f"you mean {rq_options.ENV_PREFIX}{close[0].upper()}?"
                )
    problems = [p if p.endswith("?") else p + "." for p in problems]
    if problems:
        raise ConfigurationError(
            problems[0]
            if len(problems) == 1
            else f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems)
        )


def _spell(name: str, value: Any) -> str:
    """An option as ``@exclusive`` takes it; Celery's send-time settings as RQ's own."""
    if name == "scope":
        return "queue.enqueue(f, ..., job_id=..., unique=True)"
    if name == "enqueue_ttl":
        return f"queue.enqueue(f, ..., ttl={value!r})"
    return f"@exclusive({name}={value!r})"
