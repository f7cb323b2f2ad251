"""What the calling thread sends to Redis, for specs that count round trips."""

from __future__ import annotations

import threading
from typing import Callable, Optional

from redis.connection import AbstractConnection


def sent_by_this_thread(monkeypatch, keep: Optional[Callable[[bytes], bool]] = None) -> list[bytes]:
    """From now on, each send of this thread (a command or a whole pipeline, packed) that
    ``keep`` accepts. Other threads are left out: the process's heartbeat renews other
    tests' leases from threads of its own, at moments no spec controls."""
    sent: list[bytes] = []
    send = AbstractConnection.send_packed_command
    me = threading.get_ident()

    def counted(self, command, check_health=True):
        if threading.get_ident() == me:
            packed = command if isinstance(command, bytes) else b"".join(command)
            if keep is None or keep(packed):
                sent.append(packed)
        return send(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
    return sent
