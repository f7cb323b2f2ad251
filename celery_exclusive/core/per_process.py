"""One object per process, made on first use: the heartbeat, the deadline keeper, the
feed. Each owns a thread, and threads do not survive a fork, so a forked child (a pool
child, a work horse) gets a fresh one rather than its parent's, whose thread is gone."""

from __future__ import annotations

from typing import Callable, Generic, Optional, TypeVar

from .. import runtime

T = TypeVar("T")


class PerProcess(Generic[T]):
    """Call it for this process's ``make()``: one read and one comparison once made."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._made: Optional[tuple[int, T]] = None  # (pid, what was made there)
        self._lock = runtime.Lock()

    def __call__(self) -> T:
        made = self._made
        if made is None or made[0] != runtime.getpid():
            with self._lock:
                made = self._made
                if made is None or made[0] != runtime.getpid():
                    made = self._made = (runtime.getpid(), self._make())
        return made[1]

    def made_here(self) -> Optional[T]:
        """This process's object if it was made already, else None (nothing is made)."""
        made = self._made
        return made[1] if made is not None and made[0] == runtime.getpid() else None
