"""One object per process, made on first use: the heartbeat, the deadline keeper, the
feed. Each owns a thread, and threads do not survive a fork, so a forked child (a pool
child, a work horse) gets a fresh one rather than its parent's, whose thread is gone."""

from __future__ import annotations

from typing import Any, Callable, Generic, Optional, TypeVar

from .. import runtime

T = TypeVar("T")


class PerProcess(Generic[T]):
    """Call it for this process's ``make()``: one dictionary lookup once made.

    Kept by process id: a forked child finds no object of its own under its pid, and
    makes one (the parent's entry it inherited is never used); the simulation runs many
    processes in one and each finds its own."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._made: dict[int, T] = {}
        #: One lock per process too: a child forked while a thread of its parent made
        #: the parent's object would find the parent's lock copied held, for good.
        self._locks: dict[int, Any] = {}

    def __call__(self) -> T:
        pid = runtime.getpid()
        made = self._made.get(pid)
        if made is None:
            with self._locks.setdefault(pid, runtime.Lock()):
                made = self._made.get(pid)
                if made is None:
                    made = self._made[pid] = self._make()
        return made

    def made_here(self) -> Optional[T]:
        """This process's object if it was made already, else None (nothing is made)."""
        return self._made.get(runtime.getpid())

    def forget(self) -> None:
        """Drop every process's object (the simulation, between two schedules)."""
        self._made.clear()
        self._locks.clear()
