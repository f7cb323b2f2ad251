"""The clock, the threads and the process the lease layer runs in: the one seam of the
deterministic simulation.

Every module below the integrations that reads the time, sleeps, waits, locks, starts
a thread, asks for its process id or signals its process does it through the names
here, called as ``runtime.monotonic()`` at the moment it needs them. In production
they are the standard library's own, bound once at import, so a call costs what the
standard library's does, plus one attribute lookup.

The simulation (``tests/simulation``, see the architecture page) puts its own in their
place with :func:`install`: a virtual clock that moves only when every thread it runs
is waiting, threads that are greenlets it schedules one at a time from a seed, and
processes it pauses, resumes and kills. The engine, the policies, the marks, the lease
with its heartbeat and deadline keeper run unchanged on top, so what the simulation
explores is the code that ships, not a model of it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Seconds on a clock that never goes back (deadlines, ttls, timeouts).
monotonic = time.monotonic
#: Seconds since the epoch, on this host's clock (what a store that shares the host's
#: clock stamps, what a holder record says it was acquired at).
wall = time.time
#: CPU seconds this process has used (a pause shows as time that passed without it).
process_time = time.process_time
sleep = time.sleep

Event = threading.Event
Lock = threading.Lock
Condition = threading.Condition
Thread = threading.Thread
get_ident = threading.get_ident

getpid = os.getpid
getppid = os.getppid
#: Send a signal to a process (the interrupt that stops a body, the kill after it).
kill = os.kill


def in_main_thread() -> bool:
    """Whether the caller runs in its process's main thread (where signals land)."""
    return threading.current_thread() is threading.main_thread()


#: Every name :func:`install` may replace.
NAMES = (
    "monotonic",
    "wall",
    "process_time",
    "sleep",
    "Event",
    "Lock",
    "Condition",
    "Thread",
    "get_ident",
    "getpid",
    "getppid",
    "kill",
    "in_main_thread",
)


@contextmanager
def install(**replacements: Any) -> Iterator[None]:
    """Put ``replacements`` (names of :data:`NAMES`) in place of the standard library's
    for the ``with`` block, then put the originals back."""
    unknown = set(replacements) - set(NAMES)
    if unknown:
        raise ValueError(f"runtime has no {', '.join(sorted(unknown))}")
    module = globals()
    saved = {name: module[name] for name in replacements}
    module.update(replacements)
    try:
        yield
    finally:
        module.update(saved)
