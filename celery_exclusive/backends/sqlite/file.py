"""The database file a process tree works in, and noticing when its path names another.

Processes open the database by its path. When the file at that path is deleted, moved
or replaced while workers run, the processes that have it open go on in the old file
(an unlinked file lives on while open), and every process that opens the path later
works in another one: two sets of leases, each key granted in both, fencing counters
started again. SQLite cannot tell (its own documentation lists unlinking or renaming
an open database among the ways to corrupt one).

So the first process to open a path binds the path to the file it found (device and
inode). The binding is inherited by forked children (a worker's pool, started after
the worker checked its store) and every call compares the path with it, one
``stat()``. Once the path names another file or none, each call refuses with a
:class:`ConfigurationError` that says so, and is logged once per process: the leases
in the old file are invisible to every process that opens the path now, and a
process that went on would grant keys others hold. Restarting the workers binds them
to the file the path names then.

A process that opens the path for the first time cannot know which file was there
before, except in one case: the database is gone but its ``-wal`` or ``-shm`` is
still there, which SQLite deletes when the last connection closes. Then processes
still work in the deleted file, and a new database beside them would share its
write-ahead log: the first open refuses too.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from typing import Callable, Optional
from urllib.parse import quote

from ...errors import ConfigurationError

logger = logging.getLogger("celery_exclusive")

#: (st_dev, st_ino) of a file.
FileId = tuple[int, int]

#: The file each path was bound to by this process or the parent it forked from.
_bound: dict[str, FileId] = {}
#: Paths whose loss this process has logged.
_reported: set[str] = set()

#: Files SQLite keeps beside a database in WAL mode while connections are open.
SIDECARS = ("-wal", "-shm")


def file_id(path: str) -> Optional[FileId]:
    """The identity of the file at ``path``, or None if there is none."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


class DatabaseFile:
    """One database path, bound to the file it named when first opened."""

    def __init__(self, path: str, url: str) -> None:
        self.path = os.path.abspath(path)
        self.url = url

    def connect(self, connect: Callable[..., sqlite3.Connection]) -> sqlite3.Connection:
        """A new connection (``connect(target, uri=...)``) to the bound file; the first
        in this process tree binds the path to the file it opens (creating it)."""
        if self.path not in _bound:
            self._refuse_orphaned_sidecars()
            conn = connect(self.path, uri=False)
            found = file_id(self.path)
            if found is not None:
                _bound.setdefault(self.path, found)
            return conn
        self.ensure_same()
        # mode=rw: never create a new file where the bound one went missing.
        conn = connect(f"file:{quote(self.path)}?mode=rw", uri=True)
        try:
            self.ensure_same()  # the file just opened is the bound one
        except ConfigurationError:
            conn.close()
            raise
        return conn

    def ensure_same(self) -> None:
        """Raise ConfigurationError if the path no longer names the bound file; the
        error's ``database_gone`` is True (see :func:`gone`)."""
        problem = self.problem()
        if problem is not None:
            if self.path not in _reported:
                _reported.add(self.path)
                logger.error("celery-exclusive: %s", problem)
            error = ConfigurationError(problem)
            error.database_gone = True  # type: ignore[attr-defined]
            raise error

    def problem(self) -> Optional[str]:
        """What became of the bound file, or None while the path still names it."""
        bound = _bound.get(self.path)
        if bound is None:
            return None
        found = file_id(self.path)
        if found == bound:
            return None
        what = "was deleted or moved away" if found is None else "was replaced by another file"
        return (
            f"the lease store {self.url}: the database file {self.path} {what} while this "
            f"process used it (pid {os.getpid()}). Its leases are invisible to every process "
            "that opens the path now: this process grants no lease, and reports every lease "
            "it holds as lost. Restart every worker that uses this store; move or delete "
            "the file (with its -wal and -shm) only while they are all stopped, and keep it "
            "where no clean-up removes it."
        )

    def _refuse_orphaned_sidecars(self) -> None:
        if os.path.exists(self.path):
            return
        orphans = [self.path + s for s in SIDECARS if os.path.exists(self.path + s)]
        if orphans:
            raise ConfigurationError(
                f"the lease store {self.url}: the database file {self.path} is missing, but "
                f"{' and '.join(orphans)} are still there: the database was deleted or moved "
                "while processes had it open, and they still work in it. Stop every worker "
                "that uses this store, then put the database back, or delete "
                f"{' and '.join(orphans)} to start afresh."
            )


def gone(error: BaseException) -> bool:
    """Whether ``error`` says the bound database file was deleted, moved or replaced."""
    return getattr(error, "database_gone", False)
