"""Who holds a key, in words: what every surface says of a holder.

A skipped duplicate, a refused lock, the worker's log, the operators' commands and
page, and a lost lease's error all name holders here, so that each says what is known
of one, the same way, and none shows ``None``, ``-`` or ``?`` for it.

A store describes each live holder of a key as a :class:`~..backends.LeaseInfo`
whose ``holder`` is the record written beside the grant. Three kinds of holder
share a key:

- a task or job: its record has a ``task_id``;
- an exclusive lock (:mod:`.lock`): its record has ``"lock": true`` and the name of
  the task or key it was taken for;
- a client of the store's own lock recipe (a redis-py ``Lock``, ``etcdctl lock``, a
  session advisory lock...), which wrote no record of ours: the store describes it
  under ``"foreign"`` (its value, session or pid: whatever the store can read), and
  this library never frees it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from .. import runtime
from ..backends import LeaseInfo

#: What a duplicate says when the store no longer has any holder to name.
NOBODY = "another task (which has just released it)"
#: A foreign holder its store could read nothing more of.
SOME_FOREIGN_CLIENT = "a foreign client"


def in_words(record: Mapping[str, Any], key: str = "", noun: str = "task") -> str:
    """A holder, for people, from the record written beside its grant: ``task 5f1c...
    on web-1``, ``an exclusive lock of settle in process 412 on web-1``, ``a client of
    Redis's SET NX lock recipe (...) with the value '...', not taken by celery-exclusive``.

    ``key`` names a holder whose record names nothing else; ``noun`` is what a task is
    called where it runs (RQ's are jobs)."""
    if "foreign" in record:
        foreign = record["foreign"]
        named = foreign if isinstance(foreign, str) and foreign else SOME_FOREIGN_CLIENT
        return f"{named}, not taken by celery-exclusive"
    hostname = record.get("hostname")
    task_id = record.get("task_id")
    if task_id:
        return f"{noun} {task_id}" + (f" on {hostname}" if hostname else "")
    taken_for = record.get("task") or key
    where = f"process {record.get('pid', '?')} on {hostname or '?'}"
    if record.get("lock"):
        return f"an exclusive lock of {taken_for} in {where}"
    return f"{taken_for} in {where}"


def describe(info: LeaseInfo, noun: str = "task") -> str:
    """One holder as its store reads it, in words (:func:`in_words`)."""
    return in_words(info.holder, info.key, noun)


def foreign(info: LeaseInfo) -> bool:
    """Whether a foreign client holds this lease: one this library did not take, and
    never frees (``celery exclusive release`` included)."""
    return "foreign" in info.holder


def first_described(infos: Iterable[LeaseInfo]) -> Optional[str]:
    """The first holder, described; None when there is none."""
    for info in infos:
        return describe(info)
    return None


def all_described(infos: Iterable[LeaseInfo]) -> str:
    """Every holder of a key, described, one after the other; :data:`NOBODY` if none."""
    return ", ".join(describe(info) for info in infos) or NOBODY


def named(task_id: Optional[str], holder: Optional[str] = None, noun: str = "task") -> str:
    """Whom a duplicate yielded to, in words: the holding task (or job) by its id, else
    the holder as described (a lock, a foreign client), else :data:`NOBODY`."""
    if task_id:
        return in_words({"task_id": task_id}, noun=noun)
    return holder or NOBODY


def holding(name: str, task_id: Optional[str]) -> str:
    """The holder of a lease this process holds, taken for ``name``: ``settle[5f1c...]``
    for a task, as its worker names it; else (a lock, a direct call, the beat leader)
    by its name and this process, which is all it is known by."""
    if task_id:
        return f"{name}[{task_id}]"
    return in_words({"task": name, "pid": runtime.getpid(), "hostname": socket.gethostname()})
