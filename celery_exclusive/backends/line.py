"""The line: who gets a key's next grants, as every store's ``try_acquire`` reads it.

Callers waiting for a held key stand in its line, a mark (``<key>:~line``) holding a
JSON array of entries in the order they are to be served::

    [{"id": "nightly-7", "until": 1763800000.5, "priority": true},
     {"id": "task-42", "until": 1763800012.0, "priority": false}]

A store only reads the ``id`` of each entry. ``try_acquire`` admits a claimant only
if it stands among the first *free* entries of the line (free: the slots not held;
one for a mutex), and someone not in the line only if the line is shorter than that;
a grant takes its claimant out of the line in the same atomic step. So when a holder
releases, nobody can take the key ahead of the first in line, however fast they ask.

The callers keep the rest of the entry (:mod:`celery_exclusive.marks`): each renews
its own ``until`` while it waits, and drops entries whose ``until`` has passed, so
the line of a waiter that died moves on.
"""

from __future__ import annotations

import json
from typing import Optional

#: Suffix of the mark holding a key's line.
LINE = ":~line"


def line_mark(key: str) -> str:
    """The mark holding the line of ``key`` (see ``Backend.try_acquire``)."""
    return key + LINE


def entries_of(line: Optional[str]) -> list[dict]:
    """The entries of a line's value; an absent or unreadable value is an empty line."""
    if not line:
        return []
    try:
        entries = json.loads(line)
    except ValueError:
        return []
    if not isinstance(entries, list):
        return []
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)]


def admit(line: Optional[str], claimant: Optional[str], free: int) -> tuple[bool, Optional[str]]:
    """Whether a grant to ``claimant`` may take one of ``free`` free slots, and the
    line's value once it has (None: empty, delete the mark).

    A claimant in the line is admitted if its place is below ``free``; anybody else
    queues behind the whole line. The value is returned unchanged when the claimant
    was not in it, so a store can tell that it need not write the mark.
    """
    entries = entries_of(line)
    ids = [entry["id"] for entry in entries]
    position = ids.index(claimant) if claimant in ids else len(ids)
    if position >= free:
        return False, line
    if position == len(ids):
        return True, line
    rest = entries[:position] + entries[position + 1 :]
    return True, json.dumps(rest) if rest else None


def ids_of(line: Optional[str]) -> list[str]:
    """The ids in a line's value, first first."""
    return [entry["id"] for entry in entries_of(line)]


def first_in_line(line: Optional[str], claimant: Optional[str]) -> bool:
    """Whether nobody but ``claimant`` stands first in the line (an empty line: nobody)."""
    ids = ids_of(line)
    return not ids or ids[0] == claimant
