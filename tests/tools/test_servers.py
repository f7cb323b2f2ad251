"""The test servers' own behaviour that the specs rely on."""

from __future__ import annotations

import socket

from tests.support.servers import EtcdServer


def test_an_etcd_whose_port_another_process_took_starts_on_fresh_ports():
    """Parallel test processes pick free ports independently: one may take a port between
    another's choice and its server's bind."""
    server = EtcdServer()
    taken = server.port
    with socket.create_server(("127.0.0.1", taken)):
        server.start()
        try:
            assert server.port != taken
            assert server.started
        finally:
            server.cleanup()
