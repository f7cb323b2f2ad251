"""A TCP proxy of our own in front of a real server, to make the faults a network and a
hung server make, on demand and for every connection at once:

- ``pass_through()``: bytes go both ways as they come (the start);
- ``delay(low, high)``: every chunk, each way, arrives ``low``..``high`` seconds late
  (drawn per chunk, order kept): a slow link or a slow store;
- ``black_hole()``: connections stay up and new ones are accepted, the kernel
  acknowledges every byte, and nothing is forwarded either way: a hung server, a
  partition that drops packets. Clients wait for their own timeouts;
- ``reset()``: every open connection is reset (RST) and new ones are refused: a
  crashed server, a partition that answers. ``pass_through()`` listens again.

Connections made while black-holed are never joined to the server; after
``pass_through()`` clients must make new ones (as after a real partition, their old
ones carry half a conversation).

And one-shot faults on a single exchange, on top of the mode, for the specs of a write
whose answer never came back (each is armed once, and spent by the first chunk it
matches; a black-holed chunk matches none):

- ``drop_reply_containing(pattern)``: the request reaches the server and is carried
  out, the reply that carries ``pattern`` never arrives: the proxy closes that
  connection instead of forwarding it;
- ``deliver_late(pattern, seconds)``: the request that carries ``pattern`` reaches the
  server ``seconds`` late, whether or not its client still waits: a write that lands
  after its client gave up on the answer.

A pattern is looked for in each chunk as one read returns it, not across chunks: over
loopback a store's small requests and replies each arrive whole.
"""

from __future__ import annotations

import contextlib
import queue
import random
import socket
import struct
import threading
import time

from tests.support.servers import free_port

PASS, DELAY, BLACK_HOLE, RESET = "pass", "delay", "black-hole", "reset"


class Proxy:
    """Listens on ``127.0.0.1:port`` and forwards to ``host:target_port``."""

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self.port = free_port()
        self.mode = PASS
        self._delay = (0.0, 0.0)
        #: The armed one-shot faults: the pattern of the reply to drop, and the pattern
        #: and hold of the request to deliver late.
        self._drop_reply: bytes | None = None
        self._late_request: tuple[bytes, float] | None = None
        #: How many replies were dropped so far, and requests delivered late.
        self.dropped = self.delivered_late = 0
        #: The replies dropped, as the server sent them: what the client never heard.
        self.lost: list[bytes] = []
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._closed = False
        self._listen()

    # --- modes ---------------------------------------------------------------------

    def pass_through(self) -> None:
        with self._lock:
            self.mode = PASS
        if self._listener is None:
            self._listen()

    def delay(self, low: float, high: float | None = None) -> None:
        with self._lock:
            self.mode, self._delay = DELAY, (low, low if high is None else high)

    def black_hole(self) -> None:
        with self._lock:
            self.mode = BLACK_HOLE

    def reset(self) -> None:
        with self._lock:
            self.mode = RESET
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, set()
        if listener is not None:
            # shutdown first: close() alone leaves a thread blocked in accept() on it,
            # and the port listening.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for sock in sockets:
            _abort(sock)

    def close(self) -> None:
        self._closed = True
        self.reset()

    # --- one-shot faults -----------------------------------------------------------

    def drop_reply_containing(self, pattern: bytes) -> None:
        """Lose the next reply (a chunk from the server) that contains ``pattern``, and
        close its connection."""
        with self._lock:
            self._drop_reply = pattern

    def deliver_late(self, pattern: bytes, seconds: float) -> None:
        """Hold the next request (a chunk from a client) that contains ``pattern`` for
        ``seconds`` before the server gets it (and what follows it on its connection)."""
        with self._lock:
            self._late_request = (pattern, seconds)

    def url_for(self, url: str) -> str:
        """``url`` with the server's port replaced by this proxy's."""
        port = self.target[1]
        assert f":{port}" in url, url
        return url.replace(f":{port}", f":{self.port}", 1)

    # --- plumbing ------------------------------------------------------------------

    def _listen(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                mode = self.mode
                self._sockets.add(client)
            if mode == BLACK_HOLE:  # up, acknowledged, never answered
                threading.Thread(target=self._swallow, args=(client,), daemon=True).start()
                continue
            try:
                server = socket.create_connection(self.target, timeout=5)
                server.settimeout(None)
            except OSError:
                _abort(client)
                continue
            with self._lock:
                self._sockets.add(server)
            for source, sink, replies in ((client, server, False), (server, client, True)):
                chunks: queue.Queue = queue.Queue()
                threading.Thread(
                    target=self._read, args=(source, chunks, replies), daemon=True
                ).start()
                threading.Thread(
                    target=self._write, args=(sink, chunks, source), daemon=True
                ).start()

    def _swallow(self, sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass

    def _read(self, source: socket.socket, chunks: queue.Queue, replies: bool) -> None:
        """Read as fast as the kernel delivers (so it acknowledges everything); queue
        each chunk with the time it may leave, or drop it while black-holed. ``replies``:
        the source is the server. A reply dropped ends the connection here, once the
        chunks before it have left."""
        last_due = 0.0
        try:
            while True:
                chunk = source.recv(65536)
                if not chunk:
                    break
                with self._lock:
                    mode, (low, high) = self.mode, self._delay
                    if mode == BLACK_HOLE:
                        continue
                    if replies and self._spend_drop(chunk):
                        break
                    held = 0.0 if replies else self._spend_late(chunk)
                due = time.monotonic() + held
                due += random.uniform(low, high) if mode == DELAY else 0.0
                last_due = max(last_due, due)  # never overtakes an earlier chunk
                chunks.put((last_due, chunk))
        except OSError:
            pass
        chunks.put(None)

    def _spend_drop(self, reply: bytes) -> bool:
        """Whether ``reply`` is the one to drop (then noted, and the fault spent)."""
        if self._drop_reply is None or self._drop_reply not in reply:
            return False
        self._drop_reply = None
        self.dropped += 1
        self.lost.append(reply)
        return True

    def _spend_late(self, request: bytes) -> float:
        """How long to hold ``request``: the armed hold if it matches (then spent)."""
        if self._late_request is None or self._late_request[0] not in request:
            return 0.0
        (_, seconds), self._late_request = self._late_request, None
        self.delivered_late += 1
        return seconds

    def _write(self, sink: socket.socket, chunks: queue.Queue, source: socket.socket) -> None:
        try:
            while True:
                item = chunks.get()
                if item is None:
                    break
                due, chunk = item
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                with self._lock:
                    if self.mode == BLACK_HOLE:
                        continue  # black-holed while it waited to leave
                sink.sendall(chunk)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with self._lock:
                self._sockets.discard(sock)


def _abort(sock: socket.socket) -> None:
    """Close with an RST, not a FIN: the peer's next read fails with ECONNRESET."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
