"""Freeing the lease of a holder process that died: a Celery pool child or an RQ work
horse killed while it held one (SIGKILL, the OOM killer, a hard time limit, a stop
command).

The dead process cannot release; its lease would block the key until ``lease_ttl``
runs out. The worker's main process sees the death and calls these: the store says
which leases the task or job id holds, and each is released owner-checked (with the
owner token the store itself reports), only once the process named in its holder
record is gone, and only for processes of this host, the only ones whose end can be
seen from here.
"""

from __future__ import annotations

import logging
from typing import Optional

from .. import runtime
from ..backends import Backend, Lease
from ..errors import ExclusiveError
from .lease import HOSTNAME

logger = logging.getLogger("celery_exclusive")

#: How long the main process waits for a killed child to be gone before leaving its
#: lease to expire instead (a hard time limit sends SIGKILL 0.1 s after SIGTERM).
REAP_PATIENCE = 3.0


def leases_on_this_host(
    backend: Backend, key: str, task_id: str, limit: int
) -> list[tuple[Lease, Optional[int]]]:
    """The leases the store says ``task_id`` holds on ``key`` from a process of this
    host, each with that process's pid. Raises what the store raises (an
    :class:`~celery_exclusive.errors.ExclusiveError`)."""
    found = []
    for info in backend.holders_of(key):
        if info.task_id != task_id or info.holder.get("hostname", HOSTNAME) != HOSTNAME:
            continue
        lease = Lease(key, info.owner, info.fencing_token or 0, 0.0, limit)
        found.append((lease, info.holder.get("pid")))
    return found


def release_left_by(backend: Backend, key: str, task_id: str, limit: int, pid: int) -> None:
    """Release what ``task_id`` holds on ``key`` from process ``pid`` of this host, which
    has exited. A lease of another process is left alone, this task id's included (a
    copy of the call that runs elsewhere)."""
    try:
        held = leases_on_this_host(backend, key, task_id, limit)
    except ExclusiveError as exc:
        logger.warning("lease of lost task %s on %s left to expire: %s", task_id, key, exc)
        return
    for lease, holder in held:
        if holder == pid:
            release_when_gone(backend, lease, pid, task_id)


def release_when_gone(
    backend: Backend,
    lease: Lease,
    pid: Optional[int],
    task_id: str,
    patience: float = REAP_PATIENCE,
) -> None:
    """Release ``lease`` once process ``pid`` has ended; after ``patience`` seconds of
    it still running, leave the lease to expire instead."""
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
    try:
        if backend.release(lease):
            logger.warning("released lease key=%s of lost task_id=%s", lease.key, task_id)
    except ExclusiveError as exc:
        logger.warning("lease of lost task %s on %s left to expire: %s", task_id, lease.key, exc)


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
