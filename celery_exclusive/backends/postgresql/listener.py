"""``wait()``'s wake-ups: one LISTENing connection per process, shared by its waiters.

A release (or a change to a key's line) sends ``NOTIFY`` on the store's channel with
the key's id as payload, delivered when its transaction commits. A thread of this
process reads notifications from its own connection and sets the events of the
waiters on that key. While it is not listening (not connected yet, the server
restarting) waiters poll instead, and every waiter is woken when the connection is
lost or regained, so a notification missed meanwhile costs one poll, never a hang.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Optional

import psycopg
from psycopg import sql

logger = logging.getLogger("celery_exclusive")

#: Seconds between reconnection attempts while the server is away.
RECONNECT_DELAY = 0.5


class Listener:
    def __init__(self, conninfo: str, channel: str) -> None:
        self.conninfo = conninfo
        self.channel = channel
        self.pid = os.getpid()
        self._waiters: dict[bytes, set[threading.Event]] = {}
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stopped = threading.Event()
        #: Set while a LISTEN is in force: waiters may sleep until woken.
        self.listening = threading.Event()
        self._connection: Optional[psycopg.Connection] = None

    @contextlib.contextmanager
    def subscribe(self, key_id: bytes) -> Iterator[threading.Event]:
        """An event set by every NOTIFY about ``key_id`` while the block runs."""
        event = threading.Event()
        with self._lock:
            self._waiters.setdefault(key_id, set()).add(event)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="celery-exclusive-listener", daemon=True
                )
                self._thread.start()
        try:
            yield event
        finally:
            with self._lock:
                events = self._waiters.get(key_id)
                if events is not None:
                    events.discard(event)
                    if not events:
                        del self._waiters[key_id]

    def _wake(self, key_id: Optional[bytes] = None) -> None:
        with self._lock:
            if key_id is None:
                events = [e for group in self._waiters.values() for e in group]
            else:
                events = list(self._waiters.get(key_id, ()))
        for event in events:
            event.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True) as conn:
                    self._connection = conn
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                    self.listening.set()
                    self._wake()  # anything missed while away: look again
                    while not self._stopped.is_set():
                        for notify in conn.notifies(timeout=1.0):
                            self._wake(bytes.fromhex(notify.payload))
            except Exception as exc:  # noqa: BLE001 - the thread must outlive any error
                if self._stopped.is_set():
                    return
                if self.listening.is_set():
                    logger.warning("celery-exclusive: LISTEN connection lost (%s); polling", exc)
                self.listening.clear()
                self._wake()
                time.sleep(RECONNECT_DELAY)
            finally:
                self._connection = None

    def stop(self) -> None:
        self._stopped.set()
        conn = self._connection
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.cancel_safe(timeout=1.0) if hasattr(conn, "cancel_safe") else conn.cancel()
