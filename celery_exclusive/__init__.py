"""celery-exclusive: mutual exclusion for Celery tasks and RQ jobs.

A task runs only while its worker holds a lease on the task's key. Leases live in
Redis, PostgreSQL, etcd, Consul, MongoDB or SQLite, are renewed by a heartbeat while
the body runs, released on every exit path, and expire on their own when a worker dies.
"""

from .backends import Backend, Lease, LeaseInfo, backend_for_url, register_scheme
from .config import Settings
from .errors import (
    BackendUnavailable,
    ConfigurationError,
    DuplicateCoalesced,
    DuplicateSkipped,
    ExclusiveError,
    ExclusiveKeyError,
    LeaseLost,
)
from .lease import HeldLease, UnlockedLease
from .signals import duplicate_detected, lease_acquired, lease_lost, lease_released
from .task import ExclusiveTask

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendUnavailable",
    "ConfigurationError",
    "DuplicateCoalesced",
    "DuplicateSkipped",
    "ExclusiveError",
    "ExclusiveKeyError",
    "ExclusiveTask",
    "HeldLease",
    "Lease",
    "LeaseInfo",
    "LeaseLost",
    "Settings",
    "UnlockedLease",
    "backend_for_url",
    "duplicate_detected",
    "lease_acquired",
    "lease_lost",
    "lease_released",
    "register_scheme",
]
