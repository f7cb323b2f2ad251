"""No fork while a thread of this process is inside SQLite.

The SQLite library keeps process-wide mutexes (its memory allocator's, its file
system layer's) that a call holds while it runs. A fork copies them as they are: if
another thread of the parent was inside SQLite at that moment, the child's copy stays
locked for good, and the child's first SQLite call (opening its own connection) hangs
forever. A Celery worker's main process does exactly this: it frees the lease of a
killed pool child in a thread of its own while the pool forks that child's
replacement, which then hangs on the first call it is given.

So every use of a connection passes :data:`GATE` (its close too, when a thread that
had one ends: :class:`GatedConnection`), and a fork of this process waits at
it (:func:`os.register_at_fork`) until no other thread is inside; threads arriving
meanwhile wait for the fork to be done. A thread that forks from inside a passage of
its own is not waited for (it would wait for itself).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator


class ForkGate:
    """Passages of threads through SQLite, and forks that wait for none to be open."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        #: Passages open now, across this process's threads.
        self._inside = 0
        #: Whether a fork waits (or runs): no passage opens until it is done.
        self._forking = False
        #: Passages open in the calling thread (nested ones count each).
        self._own = threading.local()

    @contextlib.contextmanager
    def passage(self) -> Iterator[None]:
        own = getattr(self._own, "depth", 0)
        with self._changed:
            while self._forking and not own:
                self._changed.wait()
            self._inside += 1
        self._own.depth = own + 1
        try:
            yield
        finally:
            self._own.depth = own
            with self._changed:
                self._inside -= 1
                self._changed.notify_all()

    def before_fork(self) -> None:
        with self._changed:
            self._forking = True
            while self._inside > getattr(self._own, "depth", 0):
                self._changed.wait()

    def after_fork_in_parent(self) -> None:
        with self._changed:
            self._forking = False
            self._changed.notify_all()

    def after_fork_in_child(self) -> None:
        # The child has only the forking thread: no passage of another is open here,
        # and the lock may have been copied held by the parent's waiting threads.
        depth = getattr(self._own, "depth", 0)
        self._reset()
        self._inside = self._own.depth = depth


GATE = ForkGate()


class GatedConnection(sqlite3.Connection):
    """A connection closed inside the gate when it is dropped (its thread ended), not
    by the library's own finalizer, outside it."""

    def __del__(self) -> None:
        with GATE.passage():
            self.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=GATE.before_fork,
        after_in_parent=GATE.after_fork_in_parent,
        after_in_child=GATE.after_fork_in_child,
    )
