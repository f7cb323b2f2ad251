"""The layout version a store holds, so that a rolling upgrade never splits exclusion.

What a layout keeps in a store (the names of its keys, the fields of a lease, where a
fencing counter lives) is its *layout*, declared by each :class:`~.base.Backend` class
as a :class:`~.base.LayoutVersion`: a name and a version, bumped by every change to what it writes.
Workers of two versions that write different layouts on one store would not see each
other's leases and would run one key twice, silently; so each store holds the version
in force under each key prefix, one record (:data:`RECORD_KEY`), and every process
meets it before it takes a lease:

- no record yet: read as version 1 (:data:`UNRECORDED`, what every release wrote
  before versions were recorded); the first process that shares it writes it;
- the same version, or an older one the layout lists in :attr:`~.base.LayoutVersion.runs_beside`
  (a compatibility mode: this version writes what that one reads, so old and new
  workers exclude each other for the length of a deploy): go on;
- anything else: :class:`~celery_exclusive.errors.LayoutMismatch`, naming both
  versions and what to do. An older record moves forward only by ``celery exclusive
  migrate``, run once no process of the older version is left.

The record is kept as a record (:meth:`~.base.Backend.write_record`) of the key
``<prefix>celery-exclusive:layout``, named after the layout: a record is written only
under a held lease, so two first processes cannot both write one. How a store keeps
records is the one part of a layout no version may change (a later version must
still read this record where this one wrote it).

A process checks a store once per key prefix: a worker and a beat as they start, and
any other (an RQ work horse, a lock for any code) before its first lease there, a
producer before its first enqueue mark. The
CLI checks before each command and records nothing but by ``migrate``.
"""

from __future__ import annotations

import uuid
from typing import Callable, Optional

from .. import runtime
from ..errors import BackendUnavailable, LayoutMismatch
from . import base
from .base import LayoutVersion

#: The lease key, under the key prefix, whose records hold the layout versions.
RECORD_KEY = "celery-exclusive:layout"

#: What a store without a record holds: releases from before layouts were recorded
#: wrote layout 1 of every store, so a store without a record is read as version 1
#: (a process of a later version finds it so, and may not share it unless it runs
#: beside version 1; a new store then starts with ``migrate``).
UNRECORDED = 1

#: Seconds a process holds the record key while it writes the first version.
_WRITE_TTL = 10.0
#: Seconds, then how many times, a first process waits for another one writing it.
_WAIT, _WRITE_TRIES = 0.5, 20
#: Seconds a process goes on with its check of a store before it reads the record
#: again: a process forgotten by an upgrade finds the ``migrate`` that ended it.
RECHECK_AFTER = 300.0


#: Of each (store URL, key prefix) this process checked, or the process it was forked
#: from (a worker's pool children share their parent's check at start): the version in
#: force there, and when to read it again.
_checked: dict[tuple[str, str], tuple[Optional[int], float]] = {}


def ensure(backend: base.Backend, key_prefix: str) -> Optional[int]:
    """:func:`check` the store under ``key_prefix``, once per :data:`RECHECK_AFTER` in a
    process: a process's first lease there waits for one read of the record, the later
    ones for nothing. Returns the version in force there: a layout that runs beside
    older versions writes what the one in force reads."""
    checked = (backend.url, key_prefix)
    known = _checked.get(checked)
    now = runtime.monotonic()
    if known is None or now >= known[1]:
        known = _checked[checked] = (check(backend, key_prefix), now + RECHECK_AFTER)
    return known[0]


def check(backend: base.Backend, key_prefix: str, record: bool = True) -> Optional[int]:
    """The version in force under ``key_prefix`` (None for a layout that declares
    none, or for a store that holds no record yet and a caller that does not
    ``record`` one: a command that only reads).

    Raises :class:`~celery_exclusive.errors.LayoutMismatch` where this process may not
    share the store, and :class:`~celery_exclusive.errors.BackendUnavailable` where
    the store does not answer.
    """
    layout = type(backend).layout_version
    if layout is None:
        return None
    key = key_prefix + RECORD_KEY
    found = _read(backend, key, layout)
    if found is None:
        if not _shares(layout, UNRECORDED):
            raise _mismatch(backend, key_prefix, layout, UNRECORDED, recorded=False)
        if not record:
            return None
        found = _write(backend, key, layout, UNRECORDED, lambda found: found is None)
    if not _shares(layout, found):
        raise _mismatch(backend, key_prefix, layout, found)
    return found


def migrate(backend: base.Backend, key_prefix: str) -> str:
    """Record this layout's version under ``key_prefix`` (what ``celery exclusive
    migrate`` does): over no record, an older one or one that is no version, never
    over a newer one. Says what it did."""
    layout = type(backend).layout_version
    if layout is None:
        return "this store's layout keeps no version"
    key = key_prefix + RECORD_KEY
    before = _read(backend, key, layout, unreadable=0)
    if before is not None and before > layout.version:
        raise _mismatch(backend, key_prefix, layout, before)

    def replaces(found: Optional[int]) -> bool:
        return found is None or found < layout.version

    _write(backend, key, layout, layout.version, replaces, unreadable=0)
    if before == layout.version:
        return f"layout {layout.name} version {layout.version} was already recorded"
    was = "no version" if before is None else f"version {before}"
    return f"layout {layout.name} version {layout.version} recorded (the store held {was})"


def _shares(layout: LayoutVersion, found: int) -> bool:
    return found == layout.version or found in layout.runs_beside


def _read(
    backend: base.Backend, key: str, layout: LayoutVersion, unreadable: Optional[int] = None
) -> Optional[int]:
    """The version recorded, None for none; a record that is no version is refused, or
    read as ``unreadable`` where given (by ``migrate``, which replaces it)."""
    value = backend.read_record(key, layout.name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        if unreadable is not None:
            return unreadable
        raise LayoutMismatch(
            f"the store at {backend.safe_url} holds {value!r} as the version of its "
            f"{layout.name} layout (record {layout.name!r} of {key!r}), which is no "
            "version: run `celery exclusive migrate` to record this one.",
            layout.name,
            None,
            layout.version,
        ) from None


def _write(
    backend: base.Backend,
    key: str,
    layout: LayoutVersion,
    version: int,
    replaces: Callable[[Optional[int]], bool],
    unreadable: Optional[int] = None,
) -> int:
    """Write ``version`` where ``replaces(version found)``, holding the record key;
    return the version then in force."""
    for _ in range(_WRITE_TRIES):
        lease = backend.try_acquire(
            key, uuid.uuid4().hex, _WRITE_TTL, holder={"task": "celery-exclusive layout"}
        )
        if lease is None:  # another process writes it now: read what it wrote
            backend.wait(key, _WAIT)
            found = _read(backend, key, layout, unreadable)
            if found is not None and not replaces(found):
                return found
            continue
        try:
            found = _read(backend, key, layout, unreadable)
            if found is not None and not replaces(found):
                return found
            if backend.write_record(lease, layout.name, str(version)):
                return version
        finally:
            backend.release(lease)
    raise BackendUnavailable(
        f"could not record the {layout.name} layout's version at {backend.safe_url}: its "
        f"key {key!r} stayed held for {_WRITE_TRIES * _WAIT:g}s (if no process is starting, "
        f"free it with `celery exclusive release {key}`)",
        backend.safe_url,
    )


def _mismatch(
    backend: base.Backend,
    key_prefix: str,
    layout: LayoutVersion,
    found: int,
    recorded: bool = True,
) -> LayoutMismatch:
    where = f"the store at {backend.safe_url} (key prefix {key_prefix!r})"
    if not recorded:
        where += " records no layout, so it"
    if found > layout.version:
        advice = (
            "its other processes run a newer celery-exclusive than this one: upgrade this "
            "process's celery-exclusive to theirs."
        )
    else:
        advice = (
            "stop every worker, beat and command of the older celery-exclusive, run "
            f"`celery exclusive --backend URL --prefix {key_prefix!r} migrate` with this "
            "one, then start the new processes (see the operating guide: Upgrade)."
        )
    return LayoutMismatch(
        f"{where} holds the {layout.name} layout version {found}, which this "
        f"celery-exclusive (layout version {layout.version}) cannot share: the processes "
        f"of both would not see each other's leases and would run one key twice. To go "
        f"on, {advice}",
        layout.name,
        found,
        layout.version,
    )
