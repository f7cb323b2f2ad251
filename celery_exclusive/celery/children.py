"""The pool children of a worker, watched from its main process: a child that exits
while it runs a call is seen to exit as it does, whether or not Celery has noticed.

Celery's prefork pool learns of a child's death when the child's end of a pipe closes:
it then looks once for children that have exited, and otherwise every 5 seconds. The
pipe closes while the process exits, a moment before its parent can wait for it; a look
that falls in between finds nothing, and the death is reported at the next round,
seconds later (past a short ``lease_ttl``, whose expiry then frees the key first). A
process descriptor (Linux ``pidfd_open``) becomes readable only once its process has
exited: one thread per process waits on the descriptors of the children it was told of
and calls back as each exits.

Where ``os.pidfd_open`` is missing (not Linux, Linux before 5.3) or refused (a sandbox
that forbids it), nothing is watched: a dead child's leases are freed when Celery
reports its death, or expire.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
from typing import Any, Callable, Optional

from ..core.per_process import PerProcess

__all__ = ["watch", "unwatch"]

logger = logging.getLogger("celery_exclusive")

#: Called in the watcher's thread with the pid of a child that exited.
OnExit = Callable[[int], None]

#: No process id is larger (Linux's ``PID_MAX_LIMIT`` on 64-bit systems).
PID_MAX_LIMIT = 4 * 1024 * 1024


class _Child:
    """A watched process: its descriptor, and the call it runs now (if any)."""

    __slots__ = ("pid", "fd", "call", "on_exit")

    def __init__(self, pid: int, fd: int) -> None:
        self.pid, self.fd = pid, fd
        self.call: Any = None
        self.on_exit: Optional[OnExit] = None


class Children:
    """The children this process watches (one per process: :func:`watch`).

    The caller's thread only opens a descriptor and registers it; the watcher's thread
    alone unregisters and closes them, so a descriptor's number is never reused while an
    event for it may still be on its way.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._children: dict[int, _Child] = {}
        self._selector: Optional[selectors.BaseSelector] = None
        self._usable = hasattr(os, "pidfd_open")

    def watch(self, pid: int, call: Any, on_exit: OnExit) -> bool:
        """Call ``on_exit(pid)`` in the watcher's thread if process ``pid`` exits while
        ``call`` is the call it runs. A pool child runs one call at a time: watching its
        next call replaces the one before. False if not watched: no ``pidfd_open`` here,
        or ``pid`` is no child of this process (a greenlet's id under gevent and eventlet,
        this process itself under the solo and threads pools), or it is gone and waited
        for already."""
        if not self._usable or not isinstance(pid, int) or not 0 < pid <= PID_MAX_LIMIT:
            return False
        if pid == os.getpid():
            return False
        with self._lock:
            child = self._children.get(pid) or self._open(pid)
            if child is None:
                return False
            child.call, child.on_exit = call, on_exit
        return True

    def unwatch(self, pid: Optional[int], call: Any) -> None:
        """``call`` ended: the exit of its process no longer concerns it."""
        with self._lock:
            child = self._children.get(pid) if pid is not None else None
            if child is not None and child.call is call:
                child.call = child.on_exit = None

    def _open(self, pid: int) -> Optional[_Child]:
        """Start watching ``pid`` (under the lock)."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None  # gone and waited for: Celery has seen it
        except OSError as exc:
            self._usable = False
            logger.info(
                "pool children are not watched (pidfd_open: %s): a dead child's "
                "leases are freed when Celery reports its death",
                exc,
            )
            return None
        try:
            if _parent_of(pid) != os.getpid():
                os.close(fd)
                return None
            if self._selector is None:
                selector = selectors.EpollSelector()
                try:
                    threading.Thread(
                        target=self._run,
                        args=(selector,),
                        name="celery-exclusive-children",
                        daemon=True,
                    ).start()
                except BaseException:  # no thread to wait on it: nobody ever would
                    selector.close()
                    raise
                self._selector = selector
            child = _Child(pid, fd)
            self._selector.register(fd, selectors.EVENT_READ, child)
        except (OSError, RuntimeError) as exc:  # RuntimeError: no more threads
            os.close(fd)
            logger.warning("pool child %s is not watched: %s", pid, exc)
            return None
        self._children[pid] = child
        return child

    def _run(self, selector: selectors.BaseSelector) -> None:
        # An epoll wait sees descriptors registered from other threads while it waits.
        while True:
            for key, _ in selector.select():
                self._exited(selector, key.data)

    def _exited(self, selector: selectors.BaseSelector, child: _Child) -> None:
        with self._lock:
            # Unregistered before it is closed: children forked since hold copies of it,
            # which would keep it registered, and readable, for good.
            selector.unregister(child.fd)
            os.close(child.fd)
            if self._children.get(child.pid) is child:
                del self._children[child.pid]
            on_exit, child.call, child.on_exit = child.on_exit, None, None
        if on_exit is not None:
            try:
                on_exit(child.pid)
            except Exception:  # the watcher must live on for the other children
                logger.exception("handling the exit of pool child %s failed", child.pid)


def _parent_of(pid: int) -> Optional[int]:
    """The parent of process ``pid``, None if it is gone (waited for)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


_children = PerProcess(Children)


def watch(pid: int, call: Any, on_exit: OnExit) -> bool:
    """Watch pool child ``pid`` while it runs ``call``: see :meth:`Children.watch`."""
    return _children().watch(pid, call, on_exit)


def unwatch(pid: Optional[int], call: Any) -> None:
    """``call``, run by pool child ``pid``, ended: see :meth:`Children.unwatch`."""
    children = _children.made_here()
    if children is not None:
        children.unwatch(pid, call)
