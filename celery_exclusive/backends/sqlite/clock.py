"""The host's clock for SQLite leases: the kernel's, read alike by every process.

Leases in a SQLite file expire by a clock that every process using the file must read
alike. The wall clock (``time.time()``) is not that clock: it steps (NTP, an operator,
a resumed VM), which would expire every lease at once or keep dead ones, and one
process can be shown a clock of its own: libfaketime, preloaded into a worker, fakes
``time()``, ``gettimeofday()`` and ``clock_gettime()`` for every clock id,
CLOCK_MONOTONIC and CLOCK_BOOTTIME included (unless ``FAKETIME_DONT_FAKE_MONOTONIC=1``).

What the kernel writes into ``/proc`` is the same for every process of the host:

- ``/proc/uptime``: seconds since boot, suspend included (CLOCK_BOOTTIME), in
  hundredths, rounded down. Nobody can step it.
- ``/proc/sys/kernel/random/boot_id``: a random id, new at every boot.
- ``/proc/stat`` ``btime``: when the host booted, by the kernel's wall clock, in whole
  seconds.

The store reads the time as ``origin + uptime``. ``origin`` is the boot's ``btime`` as
the first process of that boot to open the database read it, kept in the database: every
process of the boot then reads the same time, which never steps and stays near epoch
seconds (so that fencing tokens floored by it keep rising when a database is replaced,
and across reboots). A new boot id tells the store that every holder it knew is gone.

Where ``/proc`` cannot be read (macOS, Windows, some sandboxes), the store falls back to
the wall clock, with the limits above.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

PROC_UPTIME = "/proc/uptime"
PROC_BOOT_ID = "/proc/sys/kernel/random/boot_id"
PROC_STAT = "/proc/stat"

#: ``/proc/uptime`` counts hundredths of a second, rounded down: a time read from it is
#: up to this much behind the kernel's.
RESOLUTION = 0.01


@dataclass(frozen=True)
class Boot:
    """This boot of the host, as its kernel tells it."""

    #: The kernel's random id of the boot.
    id: str
    #: When the host booted, in epoch seconds by the kernel's wall clock.
    started: float


def current_boot() -> Optional[Boot]:
    """This boot, or None where the kernel does not tell (no ``/proc``)."""
    try:
        with open(PROC_BOOT_ID) as file:
            boot_id = file.read().strip()
        with open(PROC_STAT) as file:
            started = next(float(line.split()[1]) for line in file if line.startswith("btime "))
        uptime()
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return Boot(boot_id, started) if boot_id else None


_uptime_fd: Optional[int] = None
_uptime_lock = threading.Lock()


def uptime() -> float:
    """Seconds since boot, from ``/proc/uptime``: one ``pread()`` of a descriptor opened
    once per process (pread has no file offset to share, so a forked child reads the
    inherited descriptor safely)."""
    global _uptime_fd
    if _uptime_fd is None:
        with _uptime_lock:
            if _uptime_fd is None:
                _uptime_fd = os.open(PROC_UPTIME, os.O_RDONLY)
    return float(os.pread(_uptime_fd, 64, 0).split()[0])


class HostClock:
    """Now, in epoch seconds, as every process of the host reads it from one database:
    ``origin + uptime()``, or the wall clock where there is no kernel clock (origin
    None)."""

    def __init__(self, origin: Optional[float]) -> None:
        self.origin = origin
        #: How far behind the kernel's time a reading may be.
        self.resolution = 0.0 if origin is None else RESOLUTION

    def now(self) -> float:
        if self.origin is None:
            return time.time()
        return self.origin + uptime()
