"""From a store URL to a redis-py client: one Redis, a Sentinel-watched master, or a Cluster.

    redis://[[user]:password@]host[:port][/db][?options]         rediss:// for TLS
    redis+sentinel://[[user]:password@]host:26379[,host:26379]/service[/db][?options]
    redis+cluster://[[user]:password@]host:port[,host:port][?options]

``rediss+sentinel://`` and ``rediss+cluster://`` speak TLS to every node. The user
and password in a Sentinel URL are the data nodes'; the sentinels' own go in
``sentinel_username`` / ``sentinel_password``.

Options (query string): ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
``ssl_cert_reqs`` (``required``/``optional``/``none``, or Celery's spelling
``CERT_REQUIRED``/``CERT_OPTIONAL``/``CERT_NONE``), ``ssl_check_hostname``,
``socket_timeout``, ``socket_connect_timeout``; for Sentinel also ``sentinel_username``,
``sentinel_password``, ``sentinel_ssl`` (default: as the data nodes); and the store's
own (:class:`StoreOptions`): ``allow_eviction``, ``min_replicas``,
``min_replicas_timeout``; ``recipe`` picks the layout (``set-nx``: see recipe.py).
Options of the store belong in its URL: a broker URL reused as the store URL keeps its
meaning for both.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Optional, Union
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from ...errors import ConfigurationError
from ..base import redact_url

#: Seconds to connect, and to wait for any non-blocking reply.
CONNECT_TIMEOUT, SOCKET_TIMEOUT = 2.0, 5.0

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
TLS_SCHEMES = ("rediss", "rediss+cluster", "rediss+sentinel")

#: ``ssl_cert_reqs`` as redis-py spells it, from every spelling Celery accepts.
CERT_REQS = {
    "required": "required",
    "optional": "optional",
    "none": "none",
    "cert_required": "required",
    "cert_optional": "optional",
    "cert_none": "none",
    str(int(ssl.CERT_REQUIRED)): "required",
    str(int(ssl.CERT_OPTIONAL)): "optional",
    str(int(ssl.CERT_NONE)): "none",
}

_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

Client = Union[redis.Redis, RedisCluster]


@dataclass(frozen=True)
class StoreOptions:
    """What the URL asks of the store itself, beyond how to reach it."""

    #: "standalone", "sentinel" or "cluster".
    topology: str = "standalone"
    #: Accept a ``maxmemory-policy`` that evicts keys (managed Redis that cannot change
    #: it): the start-up check then warns instead of refusing.
    allow_eviction: bool = False
    #: Count a grant only once this many replicas have it (``WAIT``); 0: at once.
    min_replicas: int = 0
    #: Seconds ``WAIT`` gives the replicas before the grant is withdrawn.
    min_replicas_timeout: float = 0.5
    #: The database the URL names (as redis-py reads it: ``?db=``, else the path), for
    #: the permissions its user needs; Redis Cluster has one, 0.
    database: int = 0


def store_options(url: str) -> StoreOptions:
    """What ``url`` asks of the store; every option checked, nothing connected yet."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    options = _store_options(url, parts, query)
    if options.min_replicas and options.topology == "cluster":
        raise _bad_url(url, "min_replicas is for redis:// and redis+sentinel:// URLs")
    if "ssl_cert_reqs" in query:
        _cert_reqs(url, query["ssl_cert_reqs"])
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        if name in query and not os.path.isfile(query[name]):
            raise _bad_url(url, f"{name}={query[name]!r} is not a readable file")
    return options


def connect(url: str) -> Client:
    """A client for ``url`` (which :func:`store_options` has checked), retrying a failed
    command briefly (:func:`brief_retry`)."""
    client = _connect(url)
    client.set_retry(brief_retry())
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    for sentinel in manager.sentinels if manager is not None else ():
        sentinel.set_retry(brief_retry())
    return client


def brief_retry() -> Retry:
    """Two quick retries (10-100 ms apart) of a connection error: enough for a pooled
    connection the server closed or a node that moved, short enough that an outage is
    reported within a renewal interval. redis-py's default (10 retries, backoff up to
    1 s) would block a heartbeat for seconds; the callers requeue and retry on their own
    schedule.

    A call that timed out is not tried again: the server or the link hangs (a black
    hole answers nothing, and acknowledges everything), and each retry would wait a
    whole ``socket_timeout`` more: 15 s instead of 5 for one release."""
    return Retry(
        ExponentialWithJitterBackoff(base=0.01, cap=0.1),
        2,
        supported_errors=(RedisConnectionError,),
    )


def _connect(url: str) -> Client:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    options = _store_options(url, parts, query)
    if "ssl_cert_reqs" in query:
        query["ssl_cert_reqs"] = _cert_reqs(url, query["ssl_cert_reqs"])
    query.setdefault("socket_connect_timeout", str(CONNECT_TIMEOUT))
    query.setdefault("socket_timeout", str(SOCKET_TIMEOUT))
    if options.topology == "standalone":
        plain = urlunsplit(parts._replace(query=urlencode(query)))
        try:
            return redis.Redis.from_url(plain)
        except ValueError as exc:
            raise _bad_url(url, str(exc)) from None
    tls = parts.scheme in TLS_SCHEMES or _flag(url, query.pop("ssl", None), False)
    node_kwargs = _node_kwargs(url, parts, query, tls)
    if options.topology == "cluster":
        return _cluster(url, parts, query, node_kwargs)
    return _sentinel(url, parts, query, node_kwargs, tls)


def _store_options(url: str, parts, query: dict) -> StoreOptions:
    scheme = parts.scheme
    topology = (
        "cluster"
        if scheme in CLUSTER_SCHEMES
        else "sentinel"
        if scheme in SENTINEL_SCHEMES
        else "standalone"
    )
    try:
        min_replicas = int(query.pop("min_replicas", "0"))
        timeout = float(query.pop("min_replicas_timeout", "0.5"))
    except ValueError:
        raise _bad_url(
            url, "min_replicas must be a whole number and min_replicas_timeout seconds"
        ) from None
    if min_replicas < 0 or timeout <= 0:
        raise _bad_url(url, "min_replicas must be >= 0 and min_replicas_timeout > 0")
    query.pop("recipe", None)  # the layout's (backends._layout), not the client's
    path = [part for part in parts.path.split("/") if part]
    if topology == "standalone":
        database = query.get("db") or (path[0] if path else "0")
    else:  # a Sentinel URL names its service first; a Cluster has database 0
        database = path[1] if topology == "sentinel" and len(path) > 1 else "0"
    return StoreOptions(
        topology=topology,
        allow_eviction=_flag(url, query.pop("allow_eviction", None), False),
        min_replicas=min_replicas,
        min_replicas_timeout=timeout,
        database=int(database) if database.isdigit() else 0,
    )


def _node_kwargs(url: str, parts, query: dict, tls: bool) -> dict:
    """Connection keywords for every data node of a Sentinel or Cluster URL."""
    kwargs: dict = {
        "username": unquote(parts.username) if parts.username else query.pop("username", None),
        "password": unquote(parts.password) if parts.password else query.pop("password", None),
        "socket_timeout": float(query.pop("socket_timeout")),
        "socket_connect_timeout": float(query.pop("socket_connect_timeout")),
    }
    if tls:
        kwargs["ssl"] = True
        for name in _TLS_OPTIONS:
            if name in query:
                kwargs[name] = query.pop(name)
        if "ssl_check_hostname" in query:
            kwargs["ssl_check_hostname"] = _flag(url, query.pop("ssl_check_hostname"), True)
    elif any(name in query for name in _TLS_OPTIONS):
        raise _bad_url(url, "TLS options need rediss+cluster:// or rediss+sentinel://")
    return kwargs


def _cluster(url: str, parts, query: dict, node_kwargs: dict) -> RedisCluster:
    """redis-py asks the nodes for their slots at once: the connection calls
    :func:`connect` on first use, and translates what it raises."""
    if parts.path.strip("/") not in ("", "0"):
        raise _bad_url(url, "Redis Cluster has one database (0): leave the path out")
    _refuse_unknown(url, query)
    nodes = [ClusterNode(host, port) for host, port in hosts(url, parts, 6379)]
    return RedisCluster(startup_nodes=nodes, **node_kwargs)


def _sentinel(url: str, parts, query: dict, node_kwargs: dict, tls: bool) -> redis.Redis:
    from redis.sentinel import Sentinel

    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise _bad_url(url, "name the Sentinel service: redis+sentinel://host:26379/<service>")
    sentinel_kwargs = {
        "username": query.pop("sentinel_username", None),
        "password": query.pop("sentinel_password", None),
        "socket_timeout": node_kwargs["socket_timeout"],
        "socket_connect_timeout": node_kwargs["socket_connect_timeout"],
    }
    if _flag(url, query.pop("sentinel_ssl", None), tls):
        sentinel_kwargs["ssl"] = True
        for name in (*_TLS_OPTIONS, "ssl_check_hostname"):
            if name in node_kwargs:
                sentinel_kwargs[name] = node_kwargs[name]
    _refuse_unknown(url, query)
    sentinel = Sentinel(
        hosts(url, parts, 26379),
        sentinel_kwargs={k: v for k, v in sentinel_kwargs.items() if v is not None},
        **{k: v for k, v in node_kwargs.items() if v is not None},
    )
    db = int(path[1]) if len(path) > 1 else 0
    return sentinel.master_for(path[0], db=db)


def hosts(url: str, parts, default_port: int) -> list[tuple[str, int]]:
    """The ``(host, port)`` pairs of a URL's address list (``host:port[,host:port]``)."""
    hosts = []
    for hostport in parts.netloc.rsplit("@", 1)[-1].split(","):
        host, colon, port = hostport.rpartition(":")
        if not colon or "]" in port:  # no port, or an IPv6 address without one
            host, port = hostport, ""
        try:
            hosts.append((host.strip("[]"), int(port or default_port)))
        except ValueError:
            raise _bad_url(url, f"{hostport!r} is not host:port") from None
    return hosts


def _refuse_unknown(url: str, query: dict) -> None:
    if query:
        raise _bad_url(
            url,
            f"unknown option(s) {', '.join(sorted(query))}; see the options Redis URLs take "
            "(docs: reference/store-urls.md#redis-options)",
        )


def _cert_reqs(url: str, value: str) -> str:
    try:
        return CERT_REQS[value.strip().lower()]
    except KeyError:
        raise _bad_url(
            url,
            f"ssl_cert_reqs={value!r} is not one of required, optional, none "
            "(or CERT_REQUIRED, CERT_OPTIONAL, CERT_NONE)",
        ) from None


def _flag(url: str, value: Optional[str], default: bool) -> bool:
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise _bad_url(url, f"{value!r} is not a yes/no value (true/false, 1/0)")


def _bad_url(url: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"exclusive_backend_url {redact_url(url)!r}: {why}.")
