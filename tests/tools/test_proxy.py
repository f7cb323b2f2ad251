"""The fault proxy (tests/support/proxy.py) makes the faults it names, in front of a real
Redis: the deadline tests rest on it, and the lost-reply specs on its one-shot faults."""

from __future__ import annotations

import socket
import time
import uuid

import pytest
import redis

from tests.support.proxy import Proxy


@pytest.fixture
def proxy(redis_server):
    proxy = Proxy(redis_server.port)
    yield proxy
    proxy.close()


def client(proxy: Proxy, timeout: float = 2.0) -> redis.Redis:
    return redis.Redis(port=proxy.port, socket_timeout=timeout, retry=None)


def test_it_passes_bytes_both_ways():
    server_port = None
    with socket.create_server(("127.0.0.1", 0)) as listener:
        server_port = listener.getsockname()[1]
        proxy = Proxy(server_port)
        try:
            with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
                peer, _ = listener.accept()
                sock.sendall(b"ping")
                assert peer.recv(4) == b"ping"
                peer.sendall(b"pong")
                assert sock.recv(4) == b"pong"
                peer.close()
        finally:
            proxy.close()


def test_a_delayed_link_holds_each_way_for_the_delay(proxy):
    conn = client(proxy)
    conn.ping()
    proxy.delay(0.2)
    started = time.monotonic()
    conn.ping()
    assert 0.4 <= time.monotonic() - started < 1.5


def test_a_black_hole_keeps_connections_up_and_answers_nothing(proxy):
    conn = client(proxy, timeout=0.5)
    conn.ping()
    proxy.black_hole()
    with pytest.raises(redis.TimeoutError):
        conn.ping()
    # New connections are accepted too, and never answered.
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=1) as sock:
        sock.sendall(b"PING\r\n")
        sock.settimeout(0.5)
        with pytest.raises(socket.timeout):
            sock.recv(16)


def test_a_reset_breaks_open_connections_and_refuses_new_ones(proxy):
    with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(b"PING\r\n")
        assert sock.recv(16) == b"+PONG\r\n"
        proxy.reset()
        with pytest.raises(ConnectionResetError):
            sock.sendall(b"PING\r\n")
            sock.recv(16)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=1)


def test_pass_through_after_a_reset_listens_again(proxy):
    proxy.reset()
    proxy.pass_through()
    assert client(proxy).ping()


# --- one-shot faults -------------------------------------------------------------------


def connect(proxy: Proxy) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=2)


def test_a_dropped_reply_never_arrives_and_its_connection_is_closed(proxy):
    with connect(proxy) as sock:
        proxy.drop_reply_containing(b"PONG")
        sock.sendall(b"PING\r\n")
        assert sock.recv(16) == b""
    assert (proxy.dropped, proxy.lost) == (1, [b"+PONG\r\n"])


def test_the_request_whose_reply_was_dropped_was_carried_out(proxy, redis_server):
    key = f"dropped-{uuid.uuid4().hex}"
    with connect(proxy) as sock:
        proxy.drop_reply_containing(b"+OK")
        sock.sendall(f"SET {key} landed\r\n".encode())
        assert sock.recv(16) == b""
    assert redis.Redis(port=redis_server.port).get(key) == b"landed"


def test_replies_without_the_pattern_pass_and_the_first_with_it_is_dropped(proxy):
    with connect(proxy) as sock:
        proxy.drop_reply_containing(b"PONG")
        sock.sendall(b"ECHO hello\r\n")
        assert sock.recv(16) == b"$5\r\nhello\r\n"
        sock.sendall(b"PING\r\n")
        assert sock.recv(16) == b""
    assert proxy.lost == [b"+PONG\r\n"]


def test_only_one_reply_is_dropped(proxy):
    proxy.drop_reply_containing(b"PONG")
    with connect(proxy) as sock:
        sock.sendall(b"PING\r\n")
        assert sock.recv(16) == b""
    conn = client(proxy)
    assert conn.ping() and conn.ping()
    assert proxy.dropped == 1


def test_a_request_delivered_late_reaches_the_server_after_the_hold(proxy):
    with connect(proxy) as sock:
        proxy.deliver_late(b"PING", 0.5)
        started = time.monotonic()
        sock.sendall(b"PING\r\n")
        assert sock.recv(16) == b"+PONG\r\n"
        assert 0.5 <= time.monotonic() - started < 1.5
    assert proxy.delivered_late == 1


def test_a_request_delivered_late_lands_after_its_client_left(proxy, redis_server):
    key = f"late-{uuid.uuid4().hex}"
    direct = redis.Redis(port=redis_server.port)
    proxy.deliver_late(key.encode(), 1.0)
    with connect(proxy) as sock:
        sock.sendall(f"SET {key} landed\r\n".encode())
    time.sleep(0.2)
    assert direct.get(key) is None
    deadline = time.monotonic() + 3
    while direct.get(key) is None:
        assert time.monotonic() < deadline, "the held request never landed"
        time.sleep(0.02)
    assert direct.get(key) == b"landed"


def test_only_one_request_is_delivered_late(proxy):
    proxy.deliver_late(b"PING", 3.0)
    conn = client(proxy, timeout=10)
    conn.ping()
    started = time.monotonic()
    conn.ping()
    assert time.monotonic() - started < 2.0
    assert proxy.delivered_late == 1
