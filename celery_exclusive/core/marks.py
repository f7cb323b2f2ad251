"""Lines of waiters, pending reruns and enqueue marks, built on the store's marks.

Every store offers one primitive beside its leases: a small value with a ttl, changed
only by compare-and-swap (``Backend.swap_mark``). Each operation here is a short
read-then-swap loop on it, so a store needs nothing more to support them.

- A **pending rerun** (the key's ``rerun`` mark) names the one duplicate that will run after
  the current holder, and the arguments it will run with. Later duplicates join it
  instead of running or being dropped, while it is alive: standing in the key's line,
  or away on a requeue for no longer than it takes to come back. A duplicate finding a
  pending rerun that is not alive (its task died) takes its place.
- A **line** (the key's ``line`` mark, see ``backends/line.py``) orders the callers waiting
  for a key: first come, first served, with priority callers ahead of the others.
  The store's ``try_acquire`` admits only the first in line, so a caller arriving
  at the instant of a release cannot jump it. Each waiter renews its own entry; an
  entry not renewed by its ``until`` (its waiter died) is dropped by the next
  waiter that changes the line. ``until`` is the store's time
  (``Backend.store_time``), so workers whose clocks disagree agree on the line.
- An **enqueue mark** (the key's ``queued`` mark) names the task already queued or running
  for a key, so ``apply_async`` can hand back its result instead of sending again.
- A **released mark** (kind ``released``) lists the fencing tokens an operator freed
  by hand, so that their holders say so when they find their leases gone.
- A **finished mark** (kind ``done``, one per task id and key) records the last attempt
  of a task id that ended (its ``retries`` count), so that a copy of its message
  delivered again later (a broker's redelivery under ``acks_late``) does not run the
  body a second time.
- A **replaced mark** (kind ``replaced``) names the grant of a key that a newer call
  replaced (``on_duplicate="replace"``), that call, and whether the replaced run said it
  stopped: its holder learns the cause of its loss from it, its successor waits for it.
- A **resume mark** (kind ``resume``, one per task id and key, beside its finished mark)
  keeps the arguments a call whose message may come again (Celery's ``acks_late``, or
  ``retry_on_worker_lost``) runs with as the pending rerun of its key, until its
  attempt ends. The message comes back with the arguments it was sent with; the run it
  resumes had the newest duplicate's, which the pending rerun's mark gave up when the
  run took them.
"""

from __future__ import annotations

import json
from typing import Callable, Optional

from ..backends import Backend
from ..backends.line import LINE, entries_of, ids_of, until_of
from ..errors import BackendUnavailable

#: Kinds of the marks kept here (the line's is ``backends.line.LINE``).
RERUN, QUEUED, DONE, RELEASED, RESUME = "rerun", "queued", "done", "released", "resume"
#: The kind of a **replaced mark**: which grant of a key a newer call replaced, by whom,
#: and whether that run said it stopped.
REPLACED = "replaced"

#: How long an operator's release is remembered (a **released mark**: the fencing
#: tokens ``celery exclusive release`` freed), so that a holder finding its lease gone
#: learns why: at its next renewal, or when its body ends under ``on_lease_lost="log"``.
RELEASED_TTL = 24 * 3600.0

#: How long the arguments of a run that a delivery of its message may resume are kept
#: at least (a **resume mark**): dropped when its attempt ends, they expire only where
#: nobody saw it end (its whole host lost), and must outlast the longest run.
RESUME_TTL = 24 * 3600.0

#: How long a pending rerun's mark lasts unrefreshed: the arguments in it are a run
#: owed to the duplicates that joined it, however long its task takes to come back.
RERUN_TTL = 24 * 3600.0

#: Compare-and-swap attempts before concluding the store is too contended to answer.
ATTEMPTS = 20


def join_rerun(
    backend: Backend,
    key: str,
    task_id: str,
    arguments: str,
    ttl: float,
    latest: bool = True,
    alive_for: Optional[float] = None,
    gone: Optional[str] = None,
) -> str:
    """Make ``task_id`` the pending rerun of ``key``, or join the one already pending.

    Returns the task id of the pending rerun. Joining refreshes the mark's ttl and,
    with ``latest``, hands the pending task this caller's ``arguments`` if they are the
    newer change (:func:`changed_at`: a duplicate that comes back from a requeue, or a
    run owed to a dead pending rerun, carries an older change than one that joined
    meanwhile, and never replaces it), so the follow-up sees the newest change; the
    pending task keeps its own place either way.

    A pending rerun that is no longer alive (see :func:`_alive`) is not joined: its
    task died while it waited, or never came back from a requeue, and nothing would
    ever run for the duplicates joining it. The caller takes its place instead.
    ``alive_for`` (default: ``ttl``) is how long the pending task counts as alive
    from now without standing in the key's line: it gets there within moments.
    ``gone``: a task the caller knows is no longer pending, whatever the mark says (it
    handed the caller the run it owed, and the answer to its take of the mark was
    lost, so the mark may still name it): its place is taken as a dead one's.
    """
    grace = ttl if alive_for is None else alive_for

    def update(current: Optional[str]) -> str:
        now = backend.store_time()
        pending = _pending(current)
        if pending is None or (
            pending["task_id"] != task_id
            and (pending["task_id"] == gone or not _alive(backend, key, pending, now))
        ):
            # A dead pending rerun's run is owed to its duplicates: its place goes to
            # this caller, with the newer of the two changes (a run with it covers both).
            newest = arguments
            if pending is not None and changed_at(pending["arguments"]) > changed_at(arguments):
                newest = pending["arguments"]
            return json.dumps({"task_id": task_id, "arguments": newest, "until": now + grace})
        if pending["task_id"] == task_id:
            pending["until"] = now + grace  # its own task is back: alive again
        elif latest and changed_at(arguments) >= changed_at(pending["arguments"]):
            pending["arguments"] = arguments
        return json.dumps(pending)

    return json.loads(_swap(backend, key, RERUN, update, ttl))["task_id"]


def rerun_away(backend: Backend, key: str, task_id: str, away: float, ttl: float) -> Optional[str]:
    """The pending rerun ``task_id`` of ``key`` leaves for ``away`` seconds (requeued):
    it stays pending that long without standing in line, and no longer.

    Returns the task id of the pending rerun: ``task_id``, or whoever took its place
    meanwhile (None: nobody is pending).
    """
    for _ in range(ATTEMPTS):
        current = backend.read_mark(key, RERUN)
        pending = _pending(current)
        if pending is None or pending["task_id"] != task_id:
            return None if pending is None else pending["task_id"]
        pending["until"] = backend.store_time() + away
        if backend.swap_mark(key, RERUN, current, json.dumps(pending), ttl):
            return task_id
    raise _contended(backend, key, RERUN)


def take_rerun(
    backend: Backend, key: str, task_id: str, keep: Optional[Callable[[str], None]] = None
) -> Optional[str]:
    """If ``task_id`` is the pending rerun of ``key``, end it and return its arguments.

    Called right after the pending task got the lease: a duplicate arriving from now
    on becomes the next pending rerun rather than joining this one. ``keep`` is called
    with the arguments before they are taken (each time they are read anew): kept
    first, they are never only in a process that dies before it keeps them.
    """
    for _ in range(ATTEMPTS):
        current = backend.read_mark(key, RERUN)
        pending = _pending(current)
        if pending is None or pending["task_id"] != task_id:
            return None
        if keep is not None:
            keep(pending["arguments"])
        try:
            if backend.swap_mark(key, RERUN, current, None, 0):
                return pending["arguments"]
        except BackendUnavailable as exc:
            raise LostTake(exc, pending["arguments"]) from None
    raise _contended(backend, key, RERUN)


class LostTake(BackendUnavailable):
    """The swap that took a pending rerun's arguments went unanswered: it may have
    taken them, and then they are nowhere but here. The call carries them on (sent again
    with them, or run with them) rather than lose the change they hold."""

    def __init__(self, error: BackendUnavailable, arguments: str) -> None:
        super().__init__(str(error), error.url)
        self.arguments = arguments


def changed_at(arguments: str) -> float:
    """When the change a call's arguments carry first reached the library (the store's
    time, as the engine stamps them: ``engine.arguments.encode_call``); 0 for arguments
    stamped by no one (an earlier version), which any stamped change is newer than."""
    try:
        stamp = json.loads(arguments).get("as_of")
    except (ValueError, AttributeError):
        return 0.0
    return float(stamp) if isinstance(stamp, (int, float)) else 0.0


def hand_on_rerun(
    backend: Backend, key: str, task_id: str, carrier: Callable[[], str], alive_for: float
) -> Optional[str]:
    """``task_id`` died (or gave up) while it was the pending rerun of ``key``: the
    duplicates that joined it are owed its run, which a new call carries. Make that call
    the pending rerun in its place (``carrier()``: the id the host sends it under, made
    only when there is a run to hand on), counted alive for ``alive_for`` seconds while
    it travels to a worker; take ``task_id`` out of the key's line; return the arguments
    the carrier runs with (None: ``task_id`` was not pending).

    Named in the mark from the start, the carrier is pending as its giver was: duplicates
    that come meanwhile join it, and should it die before it stands in line, its own
    death hands the run on again. (Taken out of the mark instead, the run would be owed
    by nobody while the carrier travels and waits: lost with it.)"""
    carrier_id: Optional[str] = None
    for _ in range(ATTEMPTS):
        current = backend.read_mark(key, RERUN)
        pending = _pending(current)
        if pending is None or pending["task_id"] != task_id:
            return None
        carrier_id = carrier_id or carrier()
        until = backend.store_time() + alive_for
        handed = json.dumps({**pending, "task_id": carrier_id, "until": until})
        try:
            swapped = backend.swap_mark(key, RERUN, current, handed, RERUN_TTL)
        except BackendUnavailable as exc:
            raise LostTake(exc, pending["arguments"]) from None
        if swapped:
            leave_line(backend, key, task_id)
            return pending["arguments"]
    raise _contended(backend, key, RERUN)


def pending_rerun(backend: Backend, key: str) -> Optional[str]:
    """The task id of the pending rerun of ``key``, if any (for the CLI)."""
    pending = _pending(backend.read_mark(key, RERUN))
    return None if pending is None else pending["task_id"]


def _pending(current: Optional[str]) -> Optional[dict]:
    """A rerun mark's value; None when absent."""
    return None if current is None else json.loads(current)


def _alive(backend: Backend, key: str, pending: dict, now: float) -> bool:
    """Whether the task of a pending rerun can still come to run (``now``: store time).

    It is alive while it stands in the key's line (its waiter renews that place every
    ``lease_ttl / 3``; the place of a waiter that died lapses within ``lease_ttl``),
    and until the ``until`` it was given when it joined or left on a requeue. A mark
    written without ``until`` lives as long as the mark.
    """
    until = pending.get("until")
    if not isinstance(until, (int, float)) or until > now:
        return True
    return pending["task_id"] in ids_of(backend.read_mark(key, LINE), now)


def take_place(
    backend: Backend,
    key: str,
    claimant: str,
    grace: float,
    priority: bool = False,
    away: bool = False,
) -> int:
    """Stand in the line of ``key`` for ``grace`` seconds, or renew one's place in it.

    A newcomer goes to the back, or with ``priority`` behind the priority callers
    already in line but ahead of everyone else. Returns the claimant's place
    (0: first). Entries whose ``until`` has passed are dropped on the way.

    ``away``: the claimant keeps its place while its message is away on a requeue
    (a priority call that waited in vain). It keeps it ahead of every call without
    priority, but a priority call that stands waiting goes ahead of it: the one that
    is away can only take its turn once a worker is free to run it again, and the
    waiters ahead would otherwise hold every worker while they wait on it.
    """

    def update(current: Optional[str]) -> str:
        now = backend.store_time()
        entries = entries_of(current, now)
        mine = {"id": claimant, "until": now + grace, "priority": priority}
        if away:
            mine["away"] = True
        ids = [e["id"] for e in entries]  # of the live entries, not of ``current``
        if claimant in ids:
            place = ids.index(claimant)
            entries[place] = mine
        elif priority:  # priority entries stay together at the front
            place = sum(e.get("priority") is True for e in entries)
            entries.insert(place, mine)
        else:
            place = len(entries)
            entries.append(mine)
        while priority and not away and place > 0 and entries[place - 1].get("away") is True:
            entries[place - 1], entries[place] = entries[place], entries[place - 1]
            place -= 1
        return json.dumps(entries)

    return ids_of(_swap(backend, key, LINE, update, lambda line: _line_ttl(backend, line))).index(
        claimant
    )


def leave_line(backend: Backend, key: str, claimant: str) -> None:
    """Step out of the line of ``key`` (a waiter that gave up); nothing if not in it."""
    for _ in range(ATTEMPTS):
        current = backend.read_mark(key, LINE)
        entries = entries_of(current)
        rest = [e for e in entries if e["id"] != claimant]
        if len(rest) == len(entries):
            return
        now = backend.store_time()
        rest = [e for e in rest if until_of(e) > now]
        new = json.dumps(rest) if rest else None
        if backend.swap_mark(key, LINE, current, new, _line_ttl(backend, new, now)):
            return
    raise _contended(backend, key, LINE)


def waiting(backend: Backend, key: str, claimant: str) -> bool:
    """Whether ``claimant`` stands in the line of ``key`` now, waiting (not away on a
    requeue): a delivery of its call is waiting for the key this very moment."""
    now = backend.store_time()
    return any(
        entry["id"] == claimant and entry.get("away") is not True
        for entry in entries_of(backend.read_mark(key, LINE), now)
    )


def line_of(backend: Backend, key: str) -> list[str]:
    """The ids in the line of ``key``, first first (for the CLI and messages)."""
    return ids_of(backend.read_mark(key, LINE))


def _line_ttl(backend: Backend, line: Optional[str], now: Optional[float] = None) -> float:
    """A line lives as long as its longest-lived entry (in the store's time)."""
    if now is None:
        now = backend.store_time()
    return max((until_of(e) for e in entries_of(line)), default=0.0) - now


def claim_mark(backend: Backend, key: str, kind: str, value: str, ttl: float) -> str:
    """Set the ``kind`` mark of ``key`` to ``value`` unless it holds another value;
    return what it holds. Setting it again with the same value refreshes its ttl.
    """
    return _swap(backend, key, kind, lambda current: current or value, ttl, only_if=value)


def clear_mark(backend: Backend, key: str, kind: str, value: str) -> bool:
    """Delete the ``kind`` mark of ``key`` if it still holds ``value``: one
    compare-and-swap, one round trip (a worker clears its call's queued mark after
    every run)."""
    return backend.swap_mark(key, kind, value, None, 0)


def _swap(backend: Backend, key: str, kind: str, update, ttl, only_if: Optional[str] = None) -> str:
    """Replace the ``kind`` mark of ``key`` by ``update(current)``; return the value it
    ends up with.

    ``ttl`` is seconds, or a function of the new value giving them. With ``only_if``,
    a mark holding another value is left alone (and returned).
    """
    for _ in range(ATTEMPTS):
        current = backend.read_mark(key, kind)
        if only_if is not None and current not in (None, only_if):
            return current
        new = update(current)
        if backend.swap_mark(key, kind, current, new, ttl(new) if callable(ttl) else ttl):
            return new
    raise _contended(backend, key, kind)


def _contended(backend: Backend, key: str, kind: str) -> BackendUnavailable:
    return BackendUnavailable(
        f"the {kind} mark of {key!r} in {backend.safe_url} kept changing under {ATTEMPTS} "
        "attempts to update it; the store is overloaded or something rewrites it in a loop.",
        backend.safe_url,
    )


def finished_key(key: str, task_id: str) -> str:
    """Where the marks of ``task_id`` on ``key`` live (its finished mark, its resume
    mark): beside ``key`` (same prefix, so the same store permissions cover it), one
    per task id.

    The task id is appended as JSON after a NUL: JSON never contains a raw NUL, so the
    last NUL tells key and id apart, and no two (key, task id) pairs share a mark.
    """
    return f"{key}\x00{json.dumps(task_id)}"


def finished_attempt(backend: Backend, key: str, task_id: str) -> Optional[int]:
    """The ``retries`` count of the last attempt of ``task_id`` on ``key`` that ended,
    or None if none did (within the mark's ttl)."""
    return attempt_of(finished_mark(backend, key, task_id))


def finished_mark(backend: Backend, key: str, task_id: str) -> Optional[str]:
    """The finished mark of ``task_id`` on ``key`` as stored (see :func:`attempt_of`)."""
    return backend.read_mark(finished_key(key, task_id), DONE)


# A finished mark is a whole number: ``retries`` for an attempt whose body ran to the end,
# ``-(retries + 1)`` for one that ended as a duplicate, without its body (skipped,
# coalesced, given up). A worker of an earlier version reads the negative value as "no
# attempt ended", and its copies act as they did before, rather than fail to parse it.


def attempt_of(mark: Optional[str]) -> Optional[int]:
    """The ``retries`` count a finished mark holds, or None for no mark."""
    return None if mark is None else _finished_order(int(mark))[0]


def run_recorded(mark: Optional[str], retries: int) -> bool:
    """Whether the finished mark ``mark`` records the end of the run of attempt
    ``retries``, or of a later attempt: what the end of that run need not write."""
    return mark is not None and _finished_order(int(mark)) >= (retries, True)


def ended(mark: Optional[str], retries: int, resumed: bool = False) -> bool:
    """Whether the finished mark ``mark`` says attempt ``retries`` (or a later retry) of
    its task ended: a delivery of that attempt's message is a copy to drop.

    A call ``resumed`` (sent again by the library to resume a run stopped by the loss
    of its lease) is dropped only once a run ended: a copy of its message taken for a
    duplicate meanwhile (the broker's, while the run was being stopped) does not end
    the run it resumes."""
    if run_recorded(mark, retries):
        return True
    finished = attempt_of(mark)
    return not resumed and finished is not None and finished >= retries


def mark_finished(
    backend: Backend,
    key: str,
    task_id: str,
    retries: int,
    ttl: float,
    as_duplicate: bool = False,
) -> None:
    """Record that attempt ``retries`` of ``task_id`` on ``key`` ended (``as_duplicate``:
    without its body); keep the latest attempt, and a run's end over a duplicate's."""
    name = finished_key(key, task_id)
    new = -(retries + 1) if as_duplicate else retries
    for _ in range(ATTEMPTS):
        current = backend.read_mark(name, DONE)
        if current is not None and _finished_order(int(current)) > _finished_order(new):
            return
        if backend.swap_mark(name, DONE, current, str(new), ttl):
            return
    raise _contended(backend, name, DONE)


def _finished_order(value: int) -> tuple[int, bool]:
    """Sort key of finished marks' values: the attempt, then a run's end after a
    duplicate's."""
    return (value, True) if value >= 0 else (-value - 1, False)


def resume_arguments(backend: Backend, key: str, task_id: str) -> Optional[str]:
    """The arguments (JSON) an earlier delivery of ``task_id`` ran with as the pending
    rerun of ``key``, while its attempt has not ended; None if there are none."""
    return backend.read_mark(finished_key(key, task_id), RESUME)


def keep_resume(
    backend: Backend,
    key: str,
    task_id: str,
    arguments: str,
    ttl: float,
    current: Optional[str] = None,
) -> None:
    """Keep ``arguments`` as those the call ``task_id`` runs with on ``key``, for ``ttl``
    seconds: as long as its message may be delivered again. ``current``: what the mark
    was read to hold (one swap when it still does)."""
    _set_resume(backend, finished_key(key, task_id), current, arguments, ttl)


def drop_resume(backend: Backend, key: str, task_id: str, current: Optional[str]) -> None:
    """The attempt of ``task_id`` on ``key`` ended: its resume mark, last known to hold
    ``current``, goes."""
    _set_resume(backend, finished_key(key, task_id), current, None, 0)


def _set_resume(
    backend: Backend, name: str, current: Optional[str], new: Optional[str], ttl: float
) -> None:
    for _ in range(ATTEMPTS):
        if current == new or backend.swap_mark(name, RESUME, current, new, ttl):
            return
        current = backend.read_mark(name, RESUME)
    raise _contended(backend, name, RESUME)


def mark_released(backend: Backend, key: str, tokens: list[int]) -> None:
    """Remember that an operator freed the grants of ``key`` with these fencing tokens."""
    if not backend.capabilities.marks or not tokens:
        return

    def update(current: Optional[str]) -> str:
        return json.dumps(sorted({*json.loads(current or "[]"), *tokens}))

    _swap(backend, key, RELEASED, update, RELEASED_TTL)


def released_by_operator(backend: Backend, key: str, token: int) -> bool:
    """Whether an operator freed the grant of ``key`` with fencing token ``token``."""
    if not backend.capabilities.marks:
        return False
    return token in json.loads(backend.read_mark(key, RELEASED) or "[]")


#: How long a replaced call is remembered after its run's bound: a copy of its message,
#: or a retry of it, that comes meanwhile ends replaced instead of replacing its successor.
REPLACED_MEMORY = 3600.0


def mark_replaced(
    backend: Backend,
    key: str,
    token: int,
    task_id: str,
    by: str,
    stops_within: float,
    freed: bool = False,
) -> bool:
    """Say that the call ``by`` replaces the grant of ``key`` with fencing token
    ``token``, of the call ``task_id`` (before it frees that grant), whose run stops
    within ``stops_within`` seconds at the latest (its lease's ttl and grace). Runs
    replaced before stay listed: each is waited for, and each learns why it stopped.

    Returns False if another call replaced that grant already (the run ends naming the
    first call that replaced it): that call frees the grant, and a release of it that
    finds it gone says nothing of whether it stopped.

    The bound on when the run stops counts from when its grant was freed, which only
    the call that freed it knows (after its release answered): it says so with
    ``freed`` once it did, and the bound then counts from now. Until then the entry is
    not ``freed``, and a call granted the key counts the bound from its own grant,
    which came after the release however late that was (its request held up, or sent
    again): the run may have renewed its grant until the release."""
    now = backend.store_time()
    first = True
    entry = {
        "token": token,
        "task_id": task_id,
        "by": by,
        "stopped": False,
        "until": now + stops_within,
        "within": stops_within,
        "freed": freed,
    }

    def listed(current: Optional[str]) -> str:
        nonlocal first
        kept = [e for e in _replaced(current) if e["until"] + REPLACED_MEMORY > now]
        earlier = next((e for e in kept if e["token"] == token), None)
        if earlier is None:
            first = True
            return json.dumps([*kept, entry])
        first = earlier["by"] == by  # this call's own earlier try
        earlier["until"] = max(earlier["until"], entry["until"])
        earlier["within"] = max(earlier["within"], stops_within)
        earlier["freed"] = earlier.get("freed", True) or freed
        return json.dumps(kept)

    _swap(backend, key, REPLACED, listed, stops_within + REPLACED_MEMORY)
    return first


def replaced_by(backend: Backend, key: str, token: int) -> Optional[str]:
    """The call that replaced the grant of ``key`` with fencing token ``token``, if one did."""
    for entry in _replaced(backend.read_mark(key, REPLACED)):
        if entry["token"] == token:
            return str(entry["by"])
    return None


def call_replaced_by(backend: Backend, key: str, task_id: str) -> Optional[str]:
    """The call that replaced a run of the call ``task_id`` on ``key``, if one did."""
    for entry in _replaced(backend.read_mark(key, REPLACED)):
        if entry.get("task_id") == task_id:
            return str(entry["by"])
    return None


def note_stopped(backend: Backend, key: str, token: int) -> None:
    """Say that the replaced run of ``key``'s grant ``token`` stopped (or was over
    already): its successor runs."""

    def stopped(current: Optional[str]) -> Optional[str]:
        entries = _replaced(current)
        if not any(e["token"] == token for e in entries):
            return current
        return json.dumps([{**e, "stopped": e["stopped"] or e["token"] == token} for e in entries])

    current = backend.read_mark(key, REPLACED)
    ttl = max((e["until"] for e in _replaced(current)), default=0.0) - backend.store_time()
    _swap(backend, key, REPLACED, stopped, max(ttl, 0.0) + REPLACED_MEMORY)


def replaced_runs_left(backend: Backend, key: str, own_token: int) -> dict[int, float]:
    """The runs of ``key`` that a newer call replaced and that may still run (not the
    grant ``own_token``, the caller's, which holds the key), by token: the seconds each
    may still run. A run is over once it said it stopped, or once its lease's ttl and
    grace have passed (its own deadline has stopped it by then); never more than that
    bound, whatever the store's clock did. One read where none was replaced (a free
    key's grant); the store's clock besides otherwise.

    A run whose replacing call never said its grant was freed (it died, or the store
    did not answer, between its release and its word) was freed by the caller's grant
    at the latest: the caller says so, so that its bound counts from now for every call
    after it too, rather than from each one's own grant."""
    entries = replaced_runs(backend, key, own_token)
    if not entries:
        return {}
    unconfirmed = [e for e in entries if not e.get("freed", True)]  # (older: all freed)
    for e in unconfirmed:
        mark_replaced(backend, key, e["token"], e["task_id"], e["by"], e["within"], True)
    now = backend.store_time()
    left = {e["token"]: min(e["until"] - now, e["within"]) for e in entries}
    left.update((e["token"], e["within"]) for e in unconfirmed)  # from now, as marked
    return {token: seconds for token, seconds in left.items() if seconds > 0}


def replaced_runs(backend: Backend, key: str, own_token: int) -> list[dict]:
    """The entries of the runs of ``key`` a newer call replaced that have not said they
    stopped (not the grant ``own_token``, the caller's)."""
    return [
        e
        for e in _replaced(backend.read_mark(key, REPLACED))
        if not e["stopped"] and e["token"] != own_token
    ]


def _replaced(current: Optional[str]) -> list[dict]:
    try:
        entries = json.loads(current) if current else []
    except ValueError:
        return []
    fields = {"token", "by", "stopped", "until", "within"}
    if not isinstance(entries, list):
        return []
    return [e for e in entries if isinstance(e, dict) and fields <= e.keys()]
