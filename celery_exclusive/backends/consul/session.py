"""The Consul session of one process: what it is created with, and what it holds.

A process opens one session, on its first acquire, and renews it once per heartbeat
for all its leases; a forked child opens its own.

- **TTL**: from the first lease the process takes, clamped to Consul's 10 s-86400 s
  (a WARNING says so). Each granted lease reports ``min(requested ttl, session TTL)``,
  so the heartbeat (every ttl/3) renews often enough. Consul may let an unrenewed
  session live up to twice its TTL.
- **Not bound to node health** (``"Checks": []``, ``"NodeChecks": []``): by default a
  session dies with its agent's ``serfHealth`` check, so a network blip between agent
  and servers would take the locks of a worker that is still running. Sessions still
  die when their agent's node is deregistered (Consul's ``deleteNodeTxn``); the lock
  delay below covers that.
- **Lock delay**: after a session is invalidated (TTL expiry, node deregistration, an
  operator's destroy), nobody can lock its keys for this long. The default is the time
  its holder needs to notice the loss: one renewal interval (TTL/3) plus one request
  timeout, capped at Consul's 60 s. Its cost: a key whose holder's session died stays
  unavailable that much longer (releases and the worker's own cleanup of a killed
  child delete the key and never wait). ``?lock_delay=`` sets it (0 to 60 s).
- **Behavior** ``delete`` (default): an invalidated session's keys are deleted rather
  than left unlocked, so crashed workers leave nothing behind in KV.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ..base import LeaseInfo
from .http import MAX_LOCK_DELAY, REQUEST_TIMEOUT, format_duration

#: Consul's session TTL bounds (structs.SessionTTLMax; session_ttl_min defaults to 10 s).
MIN_SESSION_TTL, MAX_SESSION_TTL = 10.0, 86400.0


def ttl_seconds(duration: str) -> float:
    """Seconds in a Go duration as Consul prints a session's TTL ("10s", "1m30s")."""
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)(ns|us|µs|ms|s|m|h)", duration))


def lock_delay_for(session_ttl: float, configured: Optional[float]) -> float:
    """The lock delay a session gets: ``configured``, else renewal interval + detection."""
    if configured is not None:
        return configured
    return min(MAX_LOCK_DELAY, session_ttl / 3 + REQUEST_TIMEOUT)


def create_body(name: str, ttl: float, behavior: str, lock_delay: float) -> dict:
    """The ``/v1/session/create`` body. Durations are whole milliseconds, which Go parses."""
    return {
        "Name": name,
        "TTL": format_duration(ttl),
        "Behavior": behavior,
        "LockDelay": format_duration(lock_delay),
        "Checks": [],
        "NodeChecks": [],
    }


@dataclass(frozen=True)
class SessionLeaseInfo(LeaseInfo):
    """A lease that lives as long as its holder's session: when it was last extended is
    unknown, since Consul does not say when a session was last renewed, and its
    ``expires_in`` (a session's TTL, for another process's) tells nothing of it."""

    @property
    def renewed_ago(self) -> Optional[float]:
        return None


@dataclass
class Orphan:
    """A lock this process may hold without a lease: a release or an acquire whose
    answer was lost. Freed by the next heartbeat once seen; forgotten once ``until``
    (monotonic) has passed without it appearing."""

    path: str
    owner: str
    until: float


@dataclass
class ProcessState:
    """The session of one process. A forked child starts with a fresh one."""

    pid: int = field(default_factory=lambda: os.getpid())
    lock: threading.Lock = field(default_factory=threading.Lock)
    session_id: Optional[str] = None
    session_ttl: float = 0.0
    renewed_at: float = 0.0
    #: limit-1 keys this session locks -> (owner, fencing token; 0 while acquiring).
    #: Consul lets a session lock a key it already holds again (overwriting the
    #: value), so leases of one process must be kept apart here, before the request.
    held: dict[str, tuple[str, int]] = field(default_factory=dict)
    orphans: dict[str, Orphan] = field(default_factory=dict)
    #: ``?recipe=`` semaphore slots: owner -> the session of its own holding the slot
    #: (Consul's semaphore keys holders by session, one slot each).
    slot_sessions: dict[str, str] = field(default_factory=dict)
    #: ``?recipe=`` keys a wait saw free: their entries and line, the next grant's pins.
    seen: dict[str, tuple[dict[str, Any], Optional[Any]]] = field(default_factory=dict)
    #: ``?recipe=`` keys whose lock was refused in a lock delay -> when to try again.
    delayed: dict[str, float] = field(default_factory=dict)

    def forget_session(self, session_id: str) -> None:
        """The session is gone, and with it every lock it had."""
        with self.lock:
            if self.session_id == session_id:
                self.session_id = None
                self.held.clear()
                self.orphans.clear()

    def add_orphan(self, path: str, owner: str, watch: float = float("inf")) -> None:
        with self.lock:
            self.orphans[path] = Orphan(path, owner, time.monotonic() + watch)
