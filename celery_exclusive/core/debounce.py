"""Debounce: of a burst of calls of one key, one run, with the latest call's
arguments, ``debounce`` seconds after the last call came and no later than
``debounce_max_wait`` after the first; every other call ends coalesced into that run.
"Latest" is by when the change was sent, as under ``rerun`` (``marks.changed_at``):
a call whose first try failed, joining late, never replaces a newer change.

The burst lives in the key's ``debounce`` mark (changed by compare-and-swap, as every
mark): the latest call's id and arguments, when the burst began and when it is due,
and which call took it to run (None while it gathers calls). A call that arrives
makes its arguments the burst's and goes back to the queue until the burst is due
(:func:`join`). A call coming back (its message says it joined) finds what its turn
is (:func:`turn`): the burst is not due yet (a later call moved it on): back to the
queue until it is; another call took it: this one is covered by that run; it is due
and nobody took it: this call takes the key's lease as any call, then the burst
(:func:`take`), and runs with the burst's arguments. Taken by a holder, a burst is
never taken by a call that dies before it runs: its run dies as any run does.

The arguments being the burst's, not a message's, whichever of its calls comes back
first runs it: a latest call whose message is lost (its worker died) loses nothing.
A burst taken is over; the next call opens a new one.

A call coming back to a mark that is gone (the store lost it, or it lapsed after
:data:`TTL`) runs with its own arguments: nothing newer is known to cover it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from ..backends import Backend
from ..errors import BackendUnavailable
from . import marks

#: The kind of the mark a key's burst is kept in.
DEBOUNCE = "debounce"

#: How long a burst's mark lasts unrefreshed: longer than any call of it may take to
#: come back, so that a call covered long ago still finds the run that covered it.
TTL = 24 * 3600.0


@dataclass(frozen=True)
class Turn:
    """What a call coming back from its burst does: ``wait`` seconds more (the burst is
    not due yet), or (``covered_by`` a task id) end coalesced into that call's run, or
    run with ``arguments`` (None: its own): at once if it took the burst already
    (``taken``), else once it holds the key, by taking the burst then (:func:`take`)."""

    wait: float = 0.0
    arguments: Optional[str] = None
    covered_by: Optional[str] = None
    taken: bool = False


def join(
    backend: Backend, key: str, task_id: str, arguments: str, period: float, max_wait: float
) -> Turn:
    """Make ``task_id`` (with its ``arguments``, JSON) the latest call of ``key``'s
    burst, opening one if none gathers calls; its turn is then to ``wait`` until the
    burst is due: ``period`` from now, or sooner where the burst's first call came
    ``max_wait`` ago (0: no bound). Or, joining no burst: ``covered_by`` the call that
    took one with a newer change (this one is older, come late), or ``taken`` by this
    very call (this is a copy of its message, delivered again)."""
    now = backend.store_time()
    for _ in range(marks.ATTEMPTS):
        current = backend.read_mark(key, DEBOUNCE)
        burst = _burst(current)
        taken_by = burst.get("taken_by") if burst is not None else None
        if taken_by == task_id:
            return Turn(arguments=burst["arguments"], taken=True)  # type: ignore[index]
        newer = burst is not None and (
            marks.changed_at(burst["arguments"]) > marks.changed_at(arguments)
        )
        if taken_by and newer:
            return Turn(covered_by=str(taken_by))
        opens = burst is None or bool(taken_by)
        first = now if opens else float(burst["first"])  # type: ignore[index]
        due = now + period if not max_wait else min(now + period, first + max_wait)
        if newer:
            # An older change come late (its first try failed, the queue reordered it):
            # the call moves the burst on, the burst keeps the newer change.
            joined = {**burst, "due": due}  # type: ignore[dict-item]
        else:
            joined = {"latest": task_id, "arguments": arguments, "first": first, "due": due}
        if backend.swap_mark(key, DEBOUNCE, current, json.dumps(joined), TTL):
            return Turn(wait=max(0.0, due - now))
    raise _contended(backend, key)


def turn(backend: Backend, key: str, task_id: str) -> Turn:
    """The turn of the call ``task_id`` come back from its burst (see :class:`Turn`), as
    the store holds it now; a due burst nobody took is taken by :func:`take`."""
    burst = _burst(backend.read_mark(key, DEBOUNCE))
    if burst is None:
        return Turn(taken=True)
    settled = _taken(burst, task_id)
    if settled is not None:
        return settled
    wait = float(burst["due"]) - backend.store_time()
    return Turn(wait=wait) if wait > 0 else Turn(arguments=burst["arguments"])


def take(backend: Backend, key: str, task_id: str) -> Turn:
    """Take ``key``'s due burst for the call ``task_id``, which holds the key now: the
    burst runs in it, with the arguments this returns, unless another call took it
    first (``covered_by``). One compare-and-swap: one call alone takes a burst; taken
    under the key's lease, it is taken by a run as alive as any holder's."""
    for _ in range(marks.ATTEMPTS):
        current = backend.read_mark(key, DEBOUNCE)
        burst = _burst(current)
        if burst is None:
            return Turn(taken=True)
        settled = _taken(burst, task_id)
        if settled is not None:
            return settled
        taken = json.dumps({**burst, "taken_by": task_id})
        try:
            swapped = backend.swap_mark(key, DEBOUNCE, current, taken, TTL)
        except BackendUnavailable as exc:
            # It may have been taken: the burst's change goes on with this call (run
            # unlocked with it, or sent again with it), never lost with the answer.
            raise marks.LostTake(exc, burst["arguments"]) from None
        if swapped:
            return Turn(arguments=burst["arguments"], taken=True)
    raise _contended(backend, key)


def _contended(backend: Backend, key: str) -> BackendUnavailable:
    return BackendUnavailable(
        f"the {DEBOUNCE} mark of {key!r} in {backend.safe_url} kept changing under "
        f"{marks.ATTEMPTS} attempts to update it; the store is overloaded.",
        backend.safe_url,
    )


def _taken(burst: dict, task_id: str) -> Optional[Turn]:
    """The turn of ``task_id`` where its burst was taken: by it (sent again since, it
    met a holder: it runs the burst), or by another call (it is covered). None: the
    burst still waits to be taken."""
    taken_by = burst.get("taken_by")
    if taken_by == task_id:
        return Turn(arguments=burst["arguments"], taken=True)
    if taken_by:
        return Turn(covered_by=str(taken_by))
    return None


def _burst(current: Optional[str]) -> Optional[dict]:
    if current is None:
        return None
    try:
        burst = json.loads(current)
    except ValueError:
        return None
    fields = ("latest", "arguments", "first", "due")
    return burst if isinstance(burst, dict) and all(f in burst for f in fields) else None
