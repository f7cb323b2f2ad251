"""Freeing the lease of a holder process that died: a Celery pool child or an RQ work
horse killed while it held one (SIGKILL, the OOM killer, a hard time limit, a stop
command).

The dead process cannot release; its lease would block the key until ``lease_ttl``
runs out. The worker's main process sees the death and calls these: the store says
which leases the task or job id holds, and each is released owner-checked (with the
owner token the store itself reports), only once the process named in its holder
record is gone, and only for processes of this host, the only ones whose end can be
seen from here. A lease its run would have kept past its end (a rate's slot, a window
after every end) is kept as that end would, not released: a run that died is a run
that failed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple, Optional

from .. import runtime
from ..backends import Backend, Lease
from ..errors import ExclusiveError
from .config import Settings
from .lease import HOSTNAME

logger = logging.getLogger("celery_exclusive")

#: How long the main process waits for a killed child to be gone before leaving its
#: lease to expire instead (a hard time limit sends SIGKILL 0.1 s after SIGTERM).
REAP_PATIENCE = 3.0


class Left(NamedTuple):
    """A lease a process of this host holds, as the store reports it."""

    lease: Lease
    #: The process holding it, as its holder record says.
    pid: Optional[int]
    #: Seconds since the store last extended it (its grant or a renewal), if it says.
    extended_ago: Optional[float]
    #: Seconds until it lapses, if the store says.
    expires_in: Optional[float]


def leases_on_this_host(backend: Backend, key: str, task_id: str, limit: int) -> list[Left]:
    """The leases the store says ``task_id`` holds on ``key`` from a process of this
    host. Raises what the store raises (an
    :class:`~celery_exclusive.errors.ExclusiveError`)."""
    found = []
    for info in backend.holders_of(key):
        if info.task_id != task_id or info.holder.get("hostname", HOSTNAME) != HOSTNAME:
            continue
        lease = Lease(key, info.owner, info.fencing_token or 0, 0.0, limit)
        found.append(Left(lease, info.holder.get("pid"), info.renewed_ago, info.expires_in))
    return found


def kept_after_death(settings: Settings, left: Left, comes_back: bool) -> float:
    """Seconds the lease of a holder that died is kept rather than freed: a run that
    died is a run that failed (:meth:`~.config.Settings.kept_after`), so under a rate
    its slot stays to a period after its grant, and under ``unique_after="end"`` its
    window follows, unless its call ``comes_back`` (its run is still to come).

    The grant's time is not kept; its last extension came at or after it, so the time
    since then counts as the time since the grant. That holds only while the lease has
    the ttl its holder record says: one kept already (its run ended and kept it, then
    its process died; or a look before this one kept it) reads back with less, and the
    time since its extension reads longer than it is. So a lease that is kept is never
    kept for less than it has left, up to the longest these settings ever keep one (a
    lease not kept yet has its ttl left): a slot never ends before a period after its
    grant, nor later than a period after the worker saw the death. Only a lease with
    nothing to keep is freed at once."""
    if not settings.keeps_lease:
        return 0.0
    since_grant = max(0.0, left.extended_ago or 0.0)
    keep = settings.kept_after(True, since_grant, window=not comes_back)
    if keep > 0 or settings.rate is not None:
        longest = settings.kept_after(True, 0.0, window=not comes_back)
        keep = max(keep, min(left.expires_in or 0.0, longest))
    return keep


def release_left_by(
    backend: Backend, key: str, task_id: str, settings: Settings, pid: int, comes_back: bool
) -> None:
    """Release what ``task_id`` holds on ``key`` from process ``pid`` of this host, which
    has exited (or keep it: :func:`kept_after_death`). A lease of another process is
    left alone, this task id's included (a copy of the call that runs elsewhere)."""
    try:
        held = leases_on_this_host(backend, key, task_id, settings.limit)
    except ExclusiveError as exc:
        logger.warning("lease of lost task %s on %s left to expire: %s", task_id, key, exc)
        return
    for left in held:
        if left.pid == pid:
            keep = kept_after_death(settings, left, comes_back)
            release_when_gone(backend, left, task_id, keep=keep)


def release_when_gone(
    backend: Backend,
    left: Left,
    task_id: str,
    patience: float = REAP_PATIENCE,
    keep: float = 0.0,
) -> None:
    """Release ``left``'s lease once its process has ended; after ``patience`` seconds
    of it still running, leave the lease to expire instead. With ``keep`` (seconds), the
    lease is kept that long from then, and left to lapse, instead of released."""
    lease, pid = left.lease, left.pid
    deadline = runtime.monotonic() + patience
    while pid and alive(pid):
        if runtime.monotonic() >= deadline:
            logger.warning(
                "lease of lost task %s on %s left to expire: process %s still running",
                task_id,
                lease.key,
                pid,
            )
            return
        runtime.sleep(0.02)
    let_go(backend, left, task_id, keep)


def let_go(backend: Backend, left: Left, task_id: str, keep: float = 0.0) -> bool:
    """Release ``left``'s lease, whose process has ended, or with ``keep`` (seconds)
    keep it that long and let it lapse. Returns whether the lease is kept."""
    lease = left.lease
    try:
        if keep > 0:
            if backend.renew([dataclasses.replace(lease, ttl=keep)]):
                return False  # lost already: expired, or freed by a copy of the call
            logger.warning(
                "lease key=%s of lost task_id=%s kept %.1fs more (its window or rate slot)",
                lease.key,
                task_id,
                keep,
            )
            return True
        if backend.release(lease):
            logger.warning("released lease key=%s of lost task_id=%s", lease.key, task_id)
    except ExclusiveError as exc:
        logger.warning("lease of lost task %s on %s left to expire: %s", task_id, lease.key, exc)
    return False


def alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie does not)."""
    try:
        runtime.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed child stays a zombie until its parent reaps it; a zombie runs no code.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
