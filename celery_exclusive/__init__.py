"""celery-exclusive: mutual exclusion for Celery tasks and RQ jobs.

A task runs only while its worker holds a lease on the task's key. Leases live in
Redis, PostgreSQL, etcd, Consul, MongoDB or SQLite, are renewed by a heartbeat while
the body runs, released on every exit path, and expire on their own when a worker dies.
"""

from .backends import Backend, Capabilities, Lease, LeaseInfo, backend_for_url, register_scheme
from .celery import checks as _checks  # noqa: F401 - checks every worker and beat at start
from .celery.lock import exclusive_lock
from .celery.task import ExclusiveTask
from .core.config import Settings
from .core.lease import HeldLease, UnlockedLease
from .core.lock import ExclusiveLock
from .errors import (
    BackendUnavailable,
    ConfigurationError,
    DuplicateCoalesced,
    DuplicateReplaced,
    DuplicateSkipped,
    ExclusiveError,
    ExclusiveKeyError,
    LayoutMismatch,
    LeaseLost,
    LockHeld,
)
from .signals import (
    duplicate_detected,
    lease_acquired,
    lease_lost,
    lease_released,
    lease_waited,
)

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendUnavailable",
    "Capabilities",
    "ConfigurationError",
    "DuplicateCoalesced",
    "DuplicateReplaced",
    "DuplicateSkipped",
    "ExclusiveError",
    "ExclusiveKeyError",
    "LayoutMismatch",
    "ExclusiveLock",
    "ExclusiveTask",
    "HeldLease",
    "Lease",
    "LeaseInfo",
    "LeaseLost",
    "LockHeld",
    "Settings",
    "UnlockedLease",
    "backend_for_url",
    "duplicate_detected",
    "exclusive_lock",
    "lease_acquired",
    "lease_lost",
    "lease_released",
    "lease_waited",
    "register_scheme",
]
