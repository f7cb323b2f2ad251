"""Why a held lease was lost: the cause its holder's :class:`LeaseLost` names, and so
the advice it gives (:data:`celery_exclusive.errors.LOSS_ADVICE`).

The store only says a lease is gone; what happened is read back once, when its holder
finds out (at a renewal or at its release), in this order:

- ``replaced``: a newer call replaced it (``on_duplicate="replace"`` leaves a replaced
  mark naming its fencing token);
- ``released``: an operator freed it (``celery exclusive release`` leaves a released
  mark listing the fencing tokens it freed);
- ``expired``: by the holder's own monotonic clock, the lease's deadline passed (see
  :mod:`.deadline`);
- ``taken``: another holder has the key, although this lease had time left;
- ``reset``: nobody holds it and it had time left: the store forgot it.

A store that cannot answer these reads gives ``unknown``. Losses found without asking
the store (a renewal that failed for a whole ``lease_ttl``, a process paused that
long) are ``expired`` by construction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import runtime
from ..errors import ExclusiveError
from . import marks

if TYPE_CHECKING:
    from .watched import WatchedLease


def cause_of(lease: WatchedLease) -> str:
    """Read back why the store no longer has ``lease``."""
    try:
        if marks.replaced_by(lease.backend, lease.key, lease.fencing_token):
            return "replaced"
        if marks.released_by_operator(lease.backend, lease.key, lease.fencing_token):
            return "released"
        if runtime.monotonic() >= lease.deadline:
            return "expired"
        holders = lease.backend.holders_of(lease.key)
    except ExclusiveError:
        return "unknown"
    if any(info.owner != lease.grant.owner for info in holders):
        return "taken"
    return "reset"
