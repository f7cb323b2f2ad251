"""The line: who gets a key's next grants, as every store's ``try_acquire`` reads it.

Callers waiting for a held key stand in its line, the key's mark of kind ``"line"``
holding a JSON array of entries in the order they are to be served::

    [{"id": "nightly-7", "until": 1763800000.5, "priority": true},
     {"id": "task-42", "until": 1763800012.0, "priority": false}]

A store reads the ``id`` and ``until`` of each entry, and skips entries whose
``until`` (the store's time) has passed. ``try_acquire`` admits a claimant only
if it stands among the first *free* entries of the line (free: the slots not held;
one for a mutex), and someone not in the line only if the line is shorter than that;
a grant takes its claimant out of the line in the same atomic step. So when a holder
releases, nobody can take the key ahead of the first in line, however fast they ask.

The callers keep the rest of the entry (:mod:`celery_exclusive.core.marks`): each renews
its own ``until`` (the store's clock, ``Backend.store_time``) while it waits, and
drops entries whose ``until`` has passed, so the line of a waiter that died moves on.
"""

from __future__ import annotations

import json
from typing import Optional

#: The kind of the mark holding a key's line (see ``Backend.try_acquire``).
LINE = "line"


def entries_of(line: Optional[str], now: Optional[float] = None) -> list[dict]:
    """The entries of a line's value; an absent or unreadable value is an empty line.

    With ``now`` (the store's time), entries whose ``until`` has passed are left out.
    """
    if not line:
        return []
    try:
        entries = json.loads(line)
    except ValueError:
        return []
    if not isinstance(entries, list):
        return []
    return [
        e
        for e in entries
        if isinstance(e, dict)
        and isinstance(e.get("id"), str)
        and (now is None or until_of(e) > now)
    ]


def until_of(entry: dict) -> float:
    """When an entry lapses (store time); an entry without a readable ``until``, at once."""
    until = entry.get("until")
    return float(until) if isinstance(until, (int, float)) else 0.0


def admit(
    line: Optional[str], claimant: Optional[str], free: int, now: float
) -> tuple[bool, Optional[str]]:
    """Whether a grant to ``claimant`` may take one of ``free`` free slots, and the
    line's value once it has (None: empty, delete the mark).

    A claimant among the live entries (``until`` after ``now``) is admitted if its
    place is below ``free``; anybody else queues behind the whole live line. The value
    is returned unchanged when the claimant was not in it, so a store can tell that it
    need not write the mark.
    """
    entries = entries_of(line)
    live = [entry["id"] for entry in entries if until_of(entry) > now]
    position = live.index(claimant) if claimant in live else len(live)
    if position >= free:
        return False, line
    if position == len(live):
        return True, line
    rest = [entry for entry in entries if entry["id"] != claimant]
    return True, json.dumps(rest) if rest else None


def ids_of(line: Optional[str], now: Optional[float] = None) -> list[str]:
    """The ids in a line's value, first first (with ``now``: the live ones)."""
    return [entry["id"] for entry in entries_of(line, now)]


def first_in_line(line: Optional[str], claimant: Optional[str], now: float) -> bool:
    """Whether nobody but ``claimant`` stands first among the live entries of the line
    (an empty line: nobody)."""
    ids = ids_of(line, now)
    return not ids or ids[0] == claimant
