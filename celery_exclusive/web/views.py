"""What the page shows, read from the store: plain data, ready to send as JSON.

Each function makes a fixed number of store reads, whatever the number of leases: a
page of held keys is one ``Backend.holders_page`` (with the keys' lines, pending reruns
and enqueue marks), the beat panel one more, the feed one ``core.feed.read_events``. Values are
sent exactly as the store holds them; the page escapes them where it shows them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Optional

from ..backends import Backend, LeaseInfo
from ..backends.base import HeldKey
from ..backends.line import LINE, entries_of, until_of
from ..beat.records import SentRun
from ..core import holders, marks
from ..core.feed import read_events
from ..errors import ExclusiveError

#: The holder name of the leader-elected beat's lease (``beat.scheduler``).
BEAT_HOLDER = "celery beat"
#: Marks shown with each held key.
KINDS = (LINE, marks.RERUN, marks.QUEUED)


def page(backend: Backend, prefix: str, cursor: Optional[str], count: int) -> dict[str, Any]:
    """One page of held keys under ``prefix``, and the cursor of the next."""
    found = backend.holders_page(prefix, cursor, count, KINDS)
    now = backend.store_time()
    return {
        "keys": [held_key(backend, held, now) for held in found.keys],
        "cursor": found.cursor,
    }


def held_key(backend: Backend, held: HeldKey, now: float) -> dict[str, Any]:
    leases = [lease(backend, info) for info in held.leases]
    limits = {row["limit"] for row in leases if isinstance(row["limit"], int)}
    rerun = _json(held.marks.get(marks.RERUN))
    return {
        "key": held.key,
        "leases": leases,
        "limit": max(limits) if limits else None,
        "line": [
            {
                "id": entry["id"],
                "priority": entry.get("priority") is True,
                "until_in": round(until_of(entry) - now, 3),
            }
            for entry in entries_of(held.marks.get(LINE), now)
        ],
        "rerun": rerun.get("task_id") if isinstance(rerun, dict) else None,
        "queued": held.marks.get(marks.QUEUED),
    }


def lease(backend: Backend, info: LeaseInfo) -> dict[str, Any]:
    """One lease as the page shows it: never its owner token, which would let anyone
    who sees the page release or renew it."""
    holder = info.holder
    renewed = info.renewed_ago
    limit = holder.get("limit")
    return {
        # Who holds it, in words (a task, a lock, a foreign client): what the page names.
        "holder": holders.describe(info),
        "foreign": holders.foreign(info),
        "task": _text(holder.get("task")),
        "task_id": _text(info.task_id),
        "hostname": _text(holder.get("hostname")),
        "pid": holder.get("pid") if isinstance(holder.get("pid"), int) else None,
        "fencing_token": info.fencing_token,
        "age": None if info.age is None else round(info.age, 3),
        "expires_in": None if info.expires_in is None else round(info.expires_in, 3),
        "renewed_ago": None if renewed is None else round(renewed, 3),
        "limit": limit if isinstance(limit, int) and not isinstance(limit, bool) else None,
    }


def beat(backend: Backend, prefix: str, entries: Sequence[str]) -> list[dict[str, Any]]:
    """The leaders of leader-elected beats under ``prefix`` (``<prefix>beat:<name>``),
    and the last send of each of ``entries`` as the leader recorded it."""
    found = backend.holders_page(prefix + "beat:", None, 20)
    leaders = []
    for held in found.keys:
        for info in held.leases:
            if info.holder.get("task") != BEAT_HOLDER:
                continue
            leaders.append(
                {
                    "key": held.key,
                    **lease(backend, info),
                    "scheduler": _text(info.holder.get("scheduler")),
                    "entries": [_sent(backend, held.key, name) for name in entries],
                }
            )
    return leaders


def _sent(backend: Backend, key: str, name: str) -> dict[str, Any]:
    row: dict[str, Any] = {"name": name, "last_run_at": None, "total_run_count": None}
    if not backend.capabilities.records:
        return row
    try:
        value = backend.read_record(key, name)
        run = None if value is None else SentRun.decode(value)
    except (ValueError, KeyError, TypeError):
        return {**row, "error": "unreadable record"}
    except ExclusiveError as exc:
        return {**row, "error": str(exc)}
    if run is not None:
        row.update(
            last_run_at=run.last_run_at.timestamp(),
            total_run_count=run.total_run_count,
            fencing_token=run.fencing_token,
        )
    return row


def events(backend: Backend, feed: str) -> list[dict[str, Any]]:
    """The feed's events, oldest first; events that are not JSON objects are left out."""
    found = []
    for raw in read_events(backend, feed):
        event = _json(raw)
        if isinstance(event, dict) and isinstance(event.get("id"), str):
            found.append(event)
    return found


def _json(value: Optional[str]) -> Any:
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError:
        return None


def _text(value: Any) -> Optional[str]:
    return None if value is None else str(value)
