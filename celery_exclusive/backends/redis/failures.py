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
from .client import StoreOptions

#: The commands the store runs, in scripts or directly, whatever the URL: a
#: least-privilege ACL user is granted these and the store's key pattern (``info`` for
#: the start-up check, ``scan`` for the CLI's ``ls``); :func:`acl_commands` adds what a
#: URL needs beyond them.
ACL_COMMANDS = [
    "evalsha", "script|load", "get", "mget", "set", "del", "exists", "type", "time", "pttl",
    "pexpire", "zadd", "zrem", "zscore", "zcard", "zcount", "zrangebyscore",
    "zremrangebyscore", "hget", "hset", "hdel", "rpush", "ltrim", "blpop", "scan", "info",
]  # fmt: skip
#: What a Redis Cluster client asks every node before any command: the slots each
#: serves, and where each command's keys are.
ACL_CLUSTER_COMMANDS = ["cluster|slots", "command"]


def acl_commands(options: StoreOptions) -> list[str]:
    """Every command the user of a URL asking ``options`` needs: :data:`ACL_COMMANDS`,
    and ``select`` for a database other than 0, ``wait`` for ``min_replicas``, and
    :data:`ACL_CLUSTER_COMMANDS` on Redis Cluster. What the errors below advise, and
    what the docs' ACL rules grant (tests/docs checks that they agree)."""
    extra = ACL_CLUSTER_COMMANDS if options.topology == "cluster" else []
    extra += ["select"] if options.database else []
    extra += ["wait"] if options.min_replicas else []
    return ACL_COMMANDS + extra


def acl_rule(options: StoreOptions) -> str:
    """The ACL rule that grants the user of a URL asking ``options`` what it needs."""
    return f"ACL SETUSER <user> ~{{<key_prefix>* +{' +'.join(acl_commands(options))}"


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
    exc: BaseException, url: str, action: str, key: Optional[str], options: StoreOptions
) -> ExclusiveError:
    """The error ``exc`` (raised by redis-py while ``action``) becomes for callers.

    ``url`` is the store URL without its password, ``options`` what it asks (on a
    ``redis+cluster://`` URL a MOVED reply is redis-py's business, not a mistake; a
    permission names what the URL's user needs).
    """
    cluster = options.topology == "cluster"
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
            f"commands: {acl_rule(options)} "
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
            f"redis://host:port/db, or grant the user on every node: {acl_rule(options)} "
            "(docs: how-to/stores/redis.md#a-least-privilege-acl-user)."
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
            f"{' '.join(acl_commands(options))}."
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
