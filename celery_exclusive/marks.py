"""Lines of waiters, pending reruns and enqueue marks, built on the store's marks.

Every store offers one primitive beside its leases: a small value with a ttl, changed
only by compare-and-swap (``Backend.swap_mark``). Each operation here is a short
read-then-swap loop on it, so a store needs nothing more to support them.

- A **pending rerun** (``<key>:~rerun``) names the one duplicate that will run after
  the current holder, and the arguments it will run with. Later duplicates join it
  instead of running or being dropped.
- A **line** (``<key>:~line``, see ``backends/line.py``) orders the callers waiting
  for a key: first come, first served, with priority callers ahead of the others.
  The store's ``try_acquire`` admits only the first in line, so a caller arriving
  at the instant of a release cannot jump it. Each waiter renews its own entry; an
  entry not renewed by its ``until`` (its waiter died) is dropped by the next
  waiter that changes the line.
- An **enqueue mark** (``<key>:~queued``) names the task already queued or running
  for a key, so ``apply_async`` can hand back its result instead of sending again.
"""

from __future__ import annotations

import json
import time
from typing import Optional

from .backends import Backend
from .backends.line import entries_of, ids_of, line_mark
from .errors import BackendUnavailable

RERUN, QUEUED = ":~rerun", ":~queued"

#: Compare-and-swap attempts before concluding the store is too contended to answer.
ATTEMPTS = 20


def join_rerun(
    backend: Backend, key: str, task_id: str, arguments: str, ttl: float, latest: bool = True
) -> str:
    """Make ``task_id`` the pending rerun of ``key``, or join the one already pending.

    Returns the task id of the pending rerun. Joining refreshes its ttl and, with
    ``latest``, hands it this caller's ``arguments`` (so the follow-up sees the newest
    change); the pending task keeps its own place either way.
    """
    name = key + RERUN

    def update(current: Optional[str]) -> str:
        if current is None:
            return json.dumps({"task_id": task_id, "arguments": arguments})
        pending = json.loads(current)
        if pending["task_id"] != task_id and latest:
            pending["arguments"] = arguments
        return json.dumps(pending)

    return json.loads(_swap(backend, name, update, ttl))["task_id"]


def take_rerun(backend: Backend, key: str, task_id: str) -> Optional[str]:
    """If ``task_id`` is the pending rerun of ``key``, end it and return its arguments.

    Called right after the pending task got the lease: a duplicate arriving from now
    on becomes the next pending rerun rather than joining this one.
    """
    name = key + RERUN
    for _ in range(ATTEMPTS):
        current = backend.read_mark(name)
        if current is None or json.loads(current)["task_id"] != task_id:
            return None
        if backend.swap_mark(name, current, None, 0):
            return json.loads(current)["arguments"]
    raise _contended(backend, name)


def pending_rerun(backend: Backend, key: str) -> Optional[str]:
    """The task id of the pending rerun of ``key``, if any (for the CLI)."""
    current = backend.read_mark(key + RERUN)
    return None if current is None else json.loads(current)["task_id"]


def take_place(
    backend: Backend, key: str, claimant: str, grace: float, priority: bool = False
) -> int:
    """Stand in the line of ``key`` for ``grace`` seconds, or renew one's place in it.

    A newcomer goes to the back, or with ``priority`` behind the priority callers
    already in line but ahead of everyone else. Returns the claimant's place
    (0: first). Entries whose ``until`` has passed are dropped on the way.
    """
    name = line_mark(key)

    def update(current: Optional[str]) -> str:
        now = time.time()
        entries = [e for e in entries_of(current) if _until(e) > now]
        mine = {"id": claimant, "until": now + grace, "priority": priority}
        ids = [e["id"] for e in entries]  # of the live entries, not of ``current``
        if claimant in ids:
            entries[ids.index(claimant)] = mine
        elif priority:  # priority entries stay together at the front
            entries.insert(sum(e.get("priority") is True for e in entries), mine)
        else:
            entries.append(mine)
        return json.dumps(entries)

    return ids_of(_swap(backend, name, update, _line_ttl)).index(claimant)


def leave_line(backend: Backend, key: str, claimant: str) -> None:
    """Step out of the line of ``key`` (a waiter that gave up); nothing if not in it."""
    name = line_mark(key)
    for _ in range(ATTEMPTS):
        current = backend.read_mark(name)
        entries = entries_of(current)
        rest = [e for e in entries if e["id"] != claimant]
        if len(rest) == len(entries):
            return
        now = time.time()
        rest = [e for e in rest if _until(e) > now]
        new = json.dumps(rest) if rest else None
        if backend.swap_mark(name, current, new, _line_ttl(new)):
            return
    raise _contended(backend, name)


def line_of(backend: Backend, key: str) -> list[str]:
    """The ids in the line of ``key``, first first (for the CLI and messages)."""
    return ids_of(backend.read_mark(line_mark(key)))


def _line_ttl(line: Optional[str]) -> float:
    """A line lives as long as its longest-lived entry."""
    return max((_until(e) for e in entries_of(line)), default=0.0) - time.time()


def _until(entry: dict) -> float:
    until = entry.get("until")
    return float(until) if isinstance(until, (int, float)) else 0.0


def claim_mark(backend: Backend, name: str, value: str, ttl: float) -> str:
    """Set mark ``name`` to ``value`` unless it holds another value; return what it holds.

    Setting it again with the same value refreshes its ttl.
    """
    return _swap(backend, name, lambda current: current or value, ttl, only_if=value)


def clear_mark(backend: Backend, name: str, value: str) -> bool:
    """Delete mark ``name`` if it still holds ``value``."""
    for _ in range(ATTEMPTS):
        current = backend.read_mark(name)
        if current != value:
            return False
        if backend.swap_mark(name, current, None, 0):
            return True
    raise _contended(backend, name)


def _swap(backend: Backend, name: str, update, ttl, only_if: Optional[str] = None) -> str:
    """Replace mark ``name`` by ``update(current)``; return the value it ends up with.

    ``ttl`` is seconds, or a function of the new value giving them. With ``only_if``,
    a mark holding another value is left alone (and returned).
    """
    for _ in range(ATTEMPTS):
        current = backend.read_mark(name)
        if only_if is not None and current not in (None, only_if):
            return current
        new = update(current)
        if backend.swap_mark(name, current, new, ttl(new) if callable(ttl) else ttl):
            return new
    raise _contended(backend, name)


def _contended(backend: Backend, name: str) -> BackendUnavailable:
    return BackendUnavailable(
        f"the mark {name!r} in {backend.safe_url} kept changing under {ATTEMPTS} attempts "
        "to update it; the store is overloaded or something rewrites it in a loop.",
        backend.safe_url,
    )
