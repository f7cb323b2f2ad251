"""A Consul agent's HTTP API for tests: a stand-in, since no Consul server package can be
installed on the test machines.

It copies the rules of hashicorp/consul that the Consul lease store relies on, each
citing the source file and function it follows (``store.py``: the state store;
``server.py``: the HTTP agent, Go's ServeMux, ACLs, limits, leader elections), and has
a test per rule in ``tests/stores/consul/test_consul_emulator.py``. ``start_consul()``
gives the test suite a real agent instead when ``CONSUL_HTTP_ADDR`` is set or a
``consul`` binary is installed. Not part of the package: never import it from there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import Optional
from urllib.parse import urlsplit

from .durations import parse_go_duration
from .server import MAX_TXN_BYTES, MAX_TXN_OPS, MAX_VALUE_BYTES, ConsulEmulator, Policy, clean_path
from .store import MAX_LOCK_DELAY, SERF_CHECK

__all__ = [
    "MAX_LOCK_DELAY",
    "MAX_TXN_BYTES",
    "MAX_TXN_OPS",
    "MAX_VALUE_BYTES",
    "SERF_CHECK",
    "ConsulEmulator",
    "EmulatedConsul",
    "Policy",
    "RealConsul",
    "clean_path",
    "parse_go_duration",
    "start_consul",
]


# -- a store for the test suite: a real agent when there is one, else the emulator ----


class RealConsul:
    """A Consul agent the tests did not emulate: CONSUL_HTTP_ADDR, or ``consul agent -dev``."""

    min_session_ttl = 10.0
    short_ttl = 10.0

    def __init__(self, url: str, process: Optional[subprocess.Popen] = None) -> None:
        self.url = url
        self.process = process

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)


class EmulatedConsul:
    """The emulator with sub-second session TTLs, so expiry tests take about a second."""

    min_session_ttl = 0.25
    short_ttl = 0.5

    def __init__(self) -> None:
        self.emulator = ConsulEmulator(min_session_ttl=self.min_session_ttl).start()
        self.url = self.emulator.url

    def stop(self) -> None:
        self.emulator.stop()


def start_consul():
    """CONSUL_HTTP_ADDR if set, else a ``consul agent -dev`` if the binary exists, else
    the emulator. Each has ``url``, ``min_session_ttl``, ``short_ttl`` and ``stop()``."""
    addr = os.environ.get("CONSUL_HTTP_ADDR")
    if addr:
        parts = urlsplit(addr if "//" in addr else "//" + addr)
        scheme = "consuls" if parts.scheme == "https" else "consul"
        return RealConsul(f"{scheme}://{parts.hostname}:{parts.port or 8500}")
    binary = shutil.which("consul")
    if binary is None:
        return EmulatedConsul()
    from tests.support.servers import free_port

    http = free_port()
    ports = [f"-{name}={free_port()}" for name in ("serf-lan-port", "serf-wan-port", "server-port")]
    process = subprocess.Popen(
        [
            binary,
            "agent",
            "-dev",
            "-bind=127.0.0.1",
            "-client=127.0.0.1",
            f"-http-port={http}",
            "-dns-port=-1",
            "-grpc-port=-1",
            *ports,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait_for_leader(http)
    return RealConsul(f"consul://127.0.0.1:{http}", process)


def _wait_for_leader(port: int, timeout: float = 30.0) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/v1/status/leader", timeout=1).json():
                return
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"consul agent -dev on port {port} did not elect a leader")
