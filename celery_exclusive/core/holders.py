"""Who holds a key, in words: what a skipped duplicate and a refused lock say.

A store describes each live holder of a key as a :class:`~..backends.LeaseInfo`
whose ``holder`` is the record written beside the grant. Three kinds of holder
share a key:

- a task or job: its record has a ``task_id``;
- an exclusive lock (:mod:`.lock`): its record has ``"lock": true`` and the name of
  the task or key it was taken for;
- a client of the store's own lock recipe (a redis-py ``Lock``, ``etcdctl lock``, a
  session advisory lock...), which wrote no record of ours: the store describes it
  under ``"foreign"``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from ..backends import LeaseInfo

#: What a duplicate says when the store no longer has any holder to name.
NOBODY = "another task (which has just released it)"


def describe(info: LeaseInfo) -> str:
    """One holder, for people: ``task 5f1c...``, ``an exclusive lock of settle in process
    412 on web-1``, ``a redis-py Lock or another client of SET NX ...``."""
    record = info.holder
    foreign = record.get("foreign")
    if foreign:
        return f"{foreign}, not taken by celery-exclusive"
    if info.task_id:
        return f"task {info.task_id}"
    taken_for = record.get("task") or info.key
    where = f"process {record.get('pid', '?')} on {record.get('hostname', '?')}"
    if record.get("lock"):
        return f"an exclusive lock of {taken_for} in {where}"
    return f"{taken_for} in {where}"


def named(task_id: Optional[str], holder: Optional[str] = None, noun: str = "task") -> str:
    """Whom a duplicate yielded to, in words: the holding task (or job) by its id, else
    the holder as described (a lock, a foreign client), else :data:`NOBODY`."""
    return f"{noun} {task_id}" if task_id else holder or NOBODY


def first_described(infos: Iterable[LeaseInfo]) -> Optional[str]:
    """The first holder, described; None when there is none."""
    for info in infos:
        return describe(info)
    return None
