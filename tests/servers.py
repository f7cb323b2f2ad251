"""Real servers the tests start for themselves, on free loopback ports."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A ``redis-server`` child process the test owns: it can kill and restart it."""

    def __init__(self, appendonly: bool = False) -> None:
        #: Persist every write (fsync always), as a lease store must if a restart is
        #: to keep its fencing counters: counters that restart at 1 pass no fence.
        self.appendonly = appendonly
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed: apt-get install redis-server")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="exclusive-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def url_for_db(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--appendfsync",
                "always",
                "--dir",
                self.dir,
                "--databases",
                "32",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
            finally:
                client.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(10)
        self.process = None

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(port=self.port, db=db)

    def cleanup(self) -> None:
        self.stop(signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


def kill_tree(process: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Signal a child started with ``start_new_session=True`` and its whole group."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
