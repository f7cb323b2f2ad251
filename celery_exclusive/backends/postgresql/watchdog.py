"""A bound on every statement's wait for its answer, kept on the client.

psycopg 3 waits for an answer as long as the connection stays up: against a server
that hangs while the kernel still acknowledges (a stopped process, a black-holed
link) that is forever, and ``statement_timeout`` cannot help, since the server is the
one that does not run. A renewal stuck so would keep the backend's one connection,
and with it every later call of the process (the release after the body) forever.

So each call is watched: one daemon thread per backend looks at the call in flight
every WATCH_INTERVAL and, once it has waited longer than its bound, shuts its socket
down. The call then fails at once, as on a broken connection, and the next one opens
a new connection (within ``connect_timeout``). Nothing is created per call: starting
and ending one are two assignments, so the hot path pays nothing for the watch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import Optional

import psycopg

logger = logging.getLogger("celery_exclusive")

#: Seconds a statement may wait for its answer unless its caller says otherwise: as
#: ``connect_timeout`` (settings.py), and a renewal gets no longer than its ttl.
CALL_TIMEOUT = 5.0
#: How often the watch looks at the call in flight; a call is cut at most this late.
WATCH_INTERVAL = 0.05
#: After this many seconds without a call the thread sleeps until the next one.
IDLE_AFTER = 10.0


class CallWatch:
    """Cuts off the one call in flight on a connection once it outlasts its bound."""

    def __init__(self, what: str) -> None:
        self.what = what
        #: (connection, when it is cut off (monotonic), the call's bound) while a call
        #: is in flight.
        self._call: Optional[tuple[psycopg.Connection, float, float]] = None
        self._last_call = 0.0
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()
        self._idle = True

    @contextlib.contextmanager
    def bounded(self, conn: psycopg.Connection, bound: float):
        """Run the ``with`` block's statements on ``conn`` for at most ``bound`` seconds."""
        now = time.monotonic()
        self._call = (conn, now + bound, bound)
        if self._idle or self._pid != os.getpid():
            self._start()
        try:
            yield
        finally:
            self._call = None
            self._last_call = time.monotonic()

    def _start(self) -> None:
        if self._pid != os.getpid() or self._thread is None:  # none yet, or forked
            self._pid = os.getpid()
            self._thread = threading.Thread(
                target=self._run, name="celery-exclusive-pg-watch", daemon=True
            )
            self._idle = False
            self._thread.start()
        else:
            self._idle = False
            self._wake.set()

    def _run(self) -> None:
        while True:
            time.sleep(WATCH_INTERVAL)
            call = self._call
            if call is None:
                if time.monotonic() - self._last_call > IDLE_AFTER:
                    self._idle = True
                    if self._call is None:  # a call that started meanwhile saw it busy
                        self._wake.wait()
                    self._wake.clear()
                    self._idle = False
                continue
            conn, cut_at, bound = call
            if time.monotonic() >= cut_at and self._call is call:
                logger.warning(
                    "%s: no answer within %.1fs; cutting the connection off", self.what, bound
                )
                _shut_down(conn)


def _shut_down(conn: psycopg.Connection) -> None:
    """Shut the connection's socket down, so that a read waiting on it returns at once
    (closing it from another thread would free what the waiting one still uses)."""
    with contextlib.suppress(Exception):
        sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
