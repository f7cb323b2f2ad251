"""Pending reruns, reservations and enqueue marks, built on the store's marks.

Every store offers one primitive beside its leases: a small value with a ttl, changed
only by compare-and-swap (``Backend.swap_mark``). Each operation here is a short
read-then-swap loop on it, so a store needs nothing more to support them.

- A **pending rerun** (``<key>:~rerun``) names the one duplicate that will run after
  the current holder, and the arguments it will run with. Later duplicates join it
  instead of running or being dropped.
- A **reservation** (``<key>:~reserved``) gives a priority caller the next grant of
  the key; the store's ``try_acquire`` refuses everyone else while it stands.
- An **enqueue mark** (``<key>:~queued``) names the task already queued or running
  for a key, so ``apply_async`` can hand back its result instead of sending again.
"""

from __future__ import annotations

import json
from typing import Optional

from .backends import Backend
from .backends.base import reservation_mark
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


def reserve(backend: Backend, key: str, task_id: str, ttl: float) -> bool:
    """Reserve the next grant of ``key`` for ``task_id`` (or extend its reservation).

    False if someone else holds a reservation: that caller goes first.
    """
    return claim_mark(backend, reservation_mark(key), task_id, ttl) == task_id


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


def _swap(backend: Backend, name: str, update, ttl: float, only_if: Optional[str] = None) -> str:
    """Replace mark ``name`` by ``update(current)``; return the value it ends up with.

    With ``only_if``, a mark holding another value is left alone (and returned).
    """
    for _ in range(ATTEMPTS):
        current = backend.read_mark(name)
        if only_if is not None and current not in (None, only_if):
            return current
        new = update(current)
        if backend.swap_mark(name, current, new, ttl):
            return new
    raise _contended(backend, name)


def _contended(backend: Backend, name: str) -> BackendUnavailable:
    return BackendUnavailable(
        f"the mark {name!r} in {backend.safe_url} kept changing under {ATTEMPTS} attempts "
        "to update it; the store is overloaded or something rewrites it in a loop.",
        backend.safe_url,
    )
