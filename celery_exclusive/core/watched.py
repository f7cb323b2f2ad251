"""What the deadline keeper, the heartbeat and the loss diagnosis need of a held lease.

:class:`~celery_exclusive.core.lease.HeldLease` is built on those three modules (it
joins the heartbeat and the keeper, and asks :mod:`.losses` why it was lost), so they
know it by this protocol alone: importing the lease module from any of them would
close a cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    from ..backends import Backend, Lease


class WatchedLease(Protocol):
    #: The store that granted it, and the grant (key, owner, token, ttl).
    backend: Backend
    grant: Lease
    #: The task running under it, for the logs.
    task_id: Optional[str]
    #: Send time (monotonic) of the last renewal the store confirmed.
    renewed_at: float
    #: How long before the ttl runs out the holder counts the lease as lost.
    margin: float
    #: The trace of the call holding it (:mod:`celery_exclusive.telemetry`).
    trace: Any

    @property
    def key(self) -> str: ...

    @property
    def ttl(self) -> float: ...

    @property
    def fencing_token(self) -> int: ...

    @property
    def deadline(self) -> float: ...

    @property
    def lost(self) -> bool: ...

    def expire(self) -> None:
        """Flag the lease lost at its deadline, without asking the store."""

    def mark_lost(self, reason: str, cause: Optional[str] = None) -> None:
        """Flag the lease lost: log, send ``lease_lost``, tell its listeners."""
