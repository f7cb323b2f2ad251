"""The Redis store's start-up check: what the server is, and every command tried once.

``INFO`` (which works where ``CONFIG`` is disabled, as on most managed Redis) tells
whether the server evicts keys, forgets writes on restart, or is a Cluster node; then
every script and command the store uses runs once on probe keys, so a missing ACL
permission shows at start with its name rather than at the first contended task. A
plain-text URL whose server does not answer may point at a port that speaks TLS: the
check asks the port, and names the fix.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

from redis.cluster import RedisCluster

from ...errors import BackendUnavailable, ConfigurationError
from ..base import Backend
from ..line import LINE
from . import layout
from .client import CONNECT_TIMEOUT, SENTINEL_SCHEMES, TLS_SCHEMES, hosts

if TYPE_CHECKING:
    from .connection import RedisConnection


def server_warnings(connection: RedisConnection) -> list[str]:
    """Refuse a server that can evict leases or sits behind the wrong URL form; warn of
    one that forgets them on restart. Returns the warnings. A server that does not
    answer is asked whether it speaks TLS to a plain-text URL, before the outage is
    raised."""
    url, cluster = connection.safe_url, connection.cluster
    sections = ("memory", "persistence", "cluster", "replication")
    try:
        if cluster:
            primaries = RedisCluster.PRIMARIES
            per_node = connection.call(
                "reading INFO", None, connection.client.info, *sections, target_nodes=primaries
            )
            infos = list(per_node.values()) if isinstance(per_node, dict) else [per_node]
            if infos and "maxmemory_policy" not in infos[0]:  # one node answered flat
                infos = [per_node]
        else:
            infos = [connection.call("reading INFO", None, connection.client.info, *sections)]
    except BackendUnavailable:
        refuse_plain_text_to_tls(connection)
        raise
    warnings: list[str] = []
    for info in infos:
        if not cluster and int(info.get("cluster_enabled", 0)):
            raise ConfigurationError(
                f"exclusive_backend_url {url} points at a Redis Cluster node; write it as "
                "redis+cluster://host:port[,host:port] so that each key reaches its node."
            )
        policy = str(info.get("maxmemory_policy", "noeviction"))
        if policy.startswith(("allkeys-", "volatile-")):
            message = (
                f"the lease store at {url} has maxmemory-policy {policy}: under memory "
                "pressure Redis evicts leases (and fencing counters), and two workers then "
                "run the same key at once. Set maxmemory-policy noeviction (redis.conf, or "
                "CONFIG SET maxmemory-policy noeviction), or give leases a Redis of their "
                "own"
            )
            if not connection.options.allow_eviction:
                raise ConfigurationError(
                    message + "; where the policy cannot be changed (managed Redis) and the "
                    "risk is accepted, add allow_eviction=true to exclusive_backend_url."
                )
            warnings.append(message + " (allowed by allow_eviction=true).")
        if not int(info.get("aof_enabled", 0)):
            warnings.append(
                f"the lease store at {url} has append-only persistence off (appendonly "
                "no): a restart forgets the leases granted since its last snapshot (all of "
                "them without snapshots), so a key can be granted again while its holder "
                "still runs. The holder finds its lease lost at its next renewal, and "
                "fencing tokens keep rising (they are floored by the server's clock), so "
                "storage that checks them refuses the older holder's writes. Set "
                "appendonly yes to keep leases across restarts."
            )
        wanted = connection.options.min_replicas
        replicas = int(info.get("connected_slaves", 0))
        if wanted and replicas < wanted:
            warnings.append(
                f"the lease store at {url} has {replicas} connected replica(s) and "
                f"min_replicas={wanted}: every acquire is refused (as unavailable) until "
                f"{wanted} replica(s) acknowledge grants."
            )
    return warnings


def exercise(backend: Backend, probe_key: str, delete: Callable[..., Any]) -> None:
    """Run every script and command of the store once, on keys of its own, and clean up.

    ``Backend.check`` already took, renewed and released a mutex and swapped a mark;
    this adds a semaphore, a line with a waiter woken on release, a record, ``wait``,
    ``holders`` (SCAN) and ``force_release``. Probe keys are unique to this check, so
    workers starting together do not meet on them. ``delete(key, *names)`` deletes
    the probe keys' entries afterwards.
    """
    key = f"{probe_key}:{uuid.uuid4().hex}"
    semaphore = key + ":semaphore"
    owner = uuid.uuid4().hex
    try:
        leases = [backend.try_acquire(semaphore, uuid.uuid4().hex, 10.0, limit=2)]
        backend.try_acquire(semaphore, uuid.uuid4().hex, 0.001, limit=2)
        time.sleep(0.005)  # that one has expired: the next grant prunes it
        leases.append(backend.try_acquire(semaphore, uuid.uuid4().hex, 10.0, limit=2))
        backend.renew(filter(None, leases))
        backend.holders_of(semaphore)
        backend.wait(semaphore, 0.01)  # full: blocks, marked as waiting
        if leases[0] is not None:
            backend.release(leases[0])  # wakes it
        backend.force_release(semaphore)
        lease = backend.try_acquire(key, owner, 10.0)
        if lease is not None:
            backend.write_record(lease, "check", "1")
            backend.read_record(key, "check")
            backend.wait(key, 0.01)
            until = backend.store_time() + 10
            line = json.dumps([{"id": "check", "until": until}])
            backend.swap_mark(key, LINE, None, line, 10.0)
            backend.release(lease)  # wakes the first in line: RPUSH, LTRIM
            waiter = backend.try_acquire(key, owner, 10.0, claimant="check")
            if waiter is not None:
                backend.force_release(key)
        backend.holders(probe_key + ":")
    finally:
        for name in (key, semaphore):  # one DEL per key: its entries share one slot
            names = [layout.lease(name), layout.holders(name), layout.fence(name)]
            names += [layout.signal(name), layout.signal(name, "check"), layout.waiting(name)]
            names += [layout.mark(name, LINE), layout.record(name, "check")]
            delete(name, *names)


def refuse_plain_text_to_tls(connection: RedisConnection) -> None:
    """Raise ConfigurationError if the URL speaks plain text to a port that speaks TLS:
    such a server resets every connection, which would read as an outage and requeue
    tasks forever."""
    parts = urlsplit(connection.url)
    if parts.scheme in TLS_SCHEMES or "ssl=" in parts.query or not parts.hostname:
        return
    default_port = 26379 if parts.scheme in SENTINEL_SCHEMES else 6379
    for host, port in hosts(connection.url, parts, default_port):
        if speaks_tls(host, port):
            scheme = "rediss" + parts.scheme[len("redis") :]
            raise ConfigurationError(
                f"exclusive_backend_url {connection.safe_url} speaks plain text to {host}:{port}, "
                f"which speaks TLS and resets every plain-text connection. Write the URL as "
                f"{scheme}://... (with ssl_ca_certs=<the CA that signed the server's "
                "certificate> where a private CA did)."
            )


def speaks_tls(host: str, port: int) -> bool:
    """Whether the server at ``host:port`` answers a TLS handshake. Its certificate is
    not checked: the question is only which protocol the port speaks."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    except OSError:
        return False
    with sock:
        try:
            context.wrap_socket(sock, server_hostname=host).close()
        except ssl.SSLError as exc:
            # A TLS server that refuses this client (it asks for a client certificate)
            # still answered in TLS, with an alert; a plain-text server sent no record.
            return "ALERT" in str(exc).upper()
        except OSError:
            return False
    return True
