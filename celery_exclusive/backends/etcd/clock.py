"""The etcd server's clock, learned from its answers' ``Date`` headers."""

from __future__ import annotations

import email.utils
import threading
import time
from typing import Optional


class ServerClock:
    """etcd has no call that tells the time, but every gateway answer carries an HTTP
    ``Date`` (whole seconds) stamped by the server between our send and our receipt.
    Each answer bounds ``server time - our monotonic time``; intersecting the bounds
    of many answers narrows it to about a round trip once answers have straddled a
    second boundary (the heartbeat's renewals, at random phases, do that). If the
    bounds ever disagree (the server's clock was stepped), the newest one wins.

    ``now()`` uses the lower bound, which only rises as answers come: the clock never
    runs backwards, and it is behind the server by at most a second at first, about a
    round trip later. (The middle of the bounds would jump both ways as they narrow.)
    """

    def __init__(self) -> None:
        self.low = float("-inf")
        self.high = float("inf")
        self._lock = threading.Lock()

    def observe(self, date: Optional[str], sent: float, received: float) -> None:
        if not date:
            return
        try:
            stamp = email.utils.parsedate_to_datetime(date).timestamp()
        except (TypeError, ValueError):
            return
        # server time in [stamp, stamp + 1) at some instant in [sent, received]
        low, high = stamp - received, stamp + 1 - sent
        with self._lock:
            if low > self.high or high < self.low:
                self.low, self.high = low, high
            else:
                self.low, self.high = max(self.low, low), min(self.high, high)

    @property
    def known(self) -> bool:
        return self.high != float("inf")

    def now(self) -> float:
        with self._lock:
            return time.monotonic() + self.low
