"""What each redis-py exception becomes for the library, as the connection's
:meth:`~.connection.RedisConnection.translate` asks.

Retrying fixes an outage (a store that does not answer, is loading, is read-only in a
failover, or asks to try again): that becomes :class:`BackendUnavailable`, and a task
is requeued. Retrying never fixes a refused password, a missing ACL permission, a
certificate that does not verify, or a URL that names the wrong topology: that
becomes :class:`ConfigurationError`, naming the setting and the fix, and a task fails
rather than being requeued forever.
"""

from __future__ import annotations

import ssl
from typing import Optional

from redis import exceptions as rex

from ...errors import ConfigurationError, ExclusiveError
from ..base import unavailable

#: Every command the store runs, in scripts or directly: the minimal ACL grants these
#: (``ACL SETUSER <user> on >password ~{<prefix>* +<each>``). ``select`` only for a
#: database other than 0; ``wait`` only with ``min_replicas``; ``info`` for the
#: start-up check; ``scan`` for the CLI's ``ls``.
ACL_COMMANDS = [
    "evalsha", "script|load", "get", "mget", "set", "del", "exists", "type", "time", "pttl",
    "pexpire", "zadd", "zrem", "zscore", "zcard", "zcount", "zrangebyscore",
    "zremrangebyscore", "hget", "hset", "hdel", "rpush", "ltrim", "blpop", "scan", "info",
    "select", "wait",
]  # fmt: skip

#: What a Redis Cluster client needs beyond :data:`ACL_COMMANDS`.
ACL_CLUSTER_COMMANDS = ("cluster|slots", "command")

#: Replies that say "not now": loading, a failover under way, a full or busy server.
_TRANSIENT_ERRORS = (
    rex.BusyLoadingError,
    rex.ReadOnlyError,
    rex.TryAgainError,
    rex.ClusterDownError,
    rex.OutOfMemoryError,
)
_TRANSIENT_REPLIES = ("LOADING", "READONLY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "BUSY")
_TRANSIENT_REPLIES += ("NOREPLICAS", "OOM")
_AUTH_REPLIES = ("WRONGPASS", "NOAUTH", "INVALID USERNAME-PASSWORD", "AUTH FAILED")
_TLS_WORDS = ("CERTIFICATE", "WRONG_VERSION_NUMBER", "WRONG VERSION NUMBER", "ALERT", "[SSL")


def library_error(
    exc: BaseException, url: str, action: str, key: Optional[str] = None, cluster: bool = False
) -> ExclusiveError:
    """The error ``exc`` (raised by redis-py while ``action``) becomes for callers.

    ``url`` is the store URL without its password; ``cluster`` says whether it is a
    ``redis+cluster://`` URL (a MOVED reply is then redis-py's business, not a mistake).
    """
    text = f"{type(exc).__name__}: {exc}"
    upper = str(exc).upper()
    if isinstance(exc, ExclusiveError):
        return exc
    if isinstance(exc, _TRANSIENT_ERRORS):
        return unavailable(url, action, exc)
    if cluster and ("NON LOCAL KEY" in upper or "CLUSTER IS DOWN" in upper):
        # A script refused an entry of its own key's slot: the slot is moving between
        # masters (resharding), and the script runs once the move is done. Or a script
        # ran on a node that lost its cluster's majority, which comes back.
        return unavailable(url, action, exc)
    if (
        isinstance(exc, rex.NoPermissionError)
        or "NOPERM" in upper
        or "CAN'T RUN THIS COMMAND" in upper  # a command inside a script (Redis 7)
        or "NO PERMISSIONS TO ACCESS" in upper  # a key outside the user's pattern
    ):
        return ConfigurationError(
            f"the Redis user of exclusive_backend_url {url} lacks a permission the lease "
            f"store needs ({text}, while {action}). Grant it the store's key pattern and "
            f"commands: ACL SETUSER <user> ~{{<key_prefix>* +{' +'.join(ACL_COMMANDS)} "
            "(docs: how-to/stores/redis.md#a-least-privilege-acl-user)."
        )
    if isinstance(exc, (rex.AuthenticationError, rex.AuthenticationWrongNumberOfArgsError)) or any(
        word in upper for word in _AUTH_REPLIES
    ):
        return ConfigurationError(
            f"Redis refused the credentials of exclusive_backend_url {url} ({text}, while "
            f"{action}); correct the user name and password in the URL "
            "(redis://user:password@host:port/db)."
        )
    if _tls_failure(exc):
        return ConfigurationError(
            f"TLS with the lease store at {url} failed ({text}, while {action}). Check "
            "exclusive_backend_url: ssl_ca_certs (the CA that signed the server's "
            "certificate), ssl_certfile and ssl_keyfile (a client certificate, if the "
            "server asks for one), ssl_cert_reqs, and rediss:// (TLS) against redis://."
        )
    if "WRONGTYPE LIMIT MISMATCH" in upper:
        return ConfigurationError(
            f"the key {key!r} is held with a different exclusive_limit than the one "
            "requested; every task sharing a key must use the same limit."
        )
    if "WRONGTYPE" in upper:
        return ConfigurationError(
            f"an entry of the key {key!r} in {url} holds a value of another kind ({text}): "
            "something other than celery-exclusive writes under its exclusive_key_prefix; "
            "give the lease store a prefix (or a database) of its own."
        )
    if isinstance(exc, rex.RedisClusterException) and "NOT ENABLED" in upper:
        return ConfigurationError(
            f"exclusive_backend_url {url} names a Redis Cluster, but the server is not one, "
            f"or the URL's user may not run CLUSTER SLOTS ({text}); write the URL as "
            "redis://host:port/db, or grant the user +cluster|slots +command."
        )
    if not cluster and (
        isinstance(exc, (rex.AskError, rex.ClusterCrossSlotError))
        or upper.startswith(("MOVED", "ASK", "CROSSSLOT"))
        or "CLUSTER SUPPORT DISABLED" in upper
    ):
        return ConfigurationError(
            f"the Redis at exclusive_backend_url {url} is a Redis Cluster ({text}); write "
            "the URL as redis+cluster://host:port[,host:port]."
        )
    if "UNKNOWN COMMAND" in upper or "SELECT IS NOT ALLOWED" in upper:
        return ConfigurationError(
            f"the Redis at exclusive_backend_url {url} does not offer a command the lease "
            f"store needs ({text}, while {action}); the store needs Redis >= 6.2 with Lua "
            "scripting, and these commands neither renamed nor disabled: "
            f"{' '.join(ACL_COMMANDS)}."
        )
    if isinstance(exc, (rex.ResponseError, rex.DataError)) and not any(
        upper.startswith(reply) or f" {reply} " in upper for reply in _TRANSIENT_REPLIES
    ):
        return ConfigurationError(
            f"the lease store at {url} refused a command while {action} ({text}); "
            "retrying will not help. Check exclusive_backend_url and the server's version "
            "(Redis >= 6.2)."
        )
    return unavailable(url, action, exc)


def _tls_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a TLS handshake that failed for good (not a dropped link)."""
    seen: Optional[BaseException] = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        seen = seen.__cause__ or seen.__context__
    if not isinstance(exc, rex.ConnectionError):
        return False
    upper = str(exc).upper()
    return any(word in upper for word in _TLS_WORDS) and "EOF" not in upper
