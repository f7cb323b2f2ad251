"""The Consul store's failure translator: every client exception leaves the backend as
:class:`~celery_exclusive.errors.BackendUnavailable` (retrying may help) or as one of
the named :class:`~celery_exclusive.errors.ConfigurationError` subclasses below (it
cannot: a token's permissions, a size limit, the datacenter, TLS, a path)."""

from __future__ import annotations

from ...errors import ConfigurationError
from .http import ConsulError, Denied, Refused, TooLarge, Unavailable


class ConsulPermissionDenied(ConfigurationError):
    """The ACL token lacks ``key_prefix`` write on the store's folder, or ``session``
    write on its agent's node."""


class ConsulValueTooLarge(ConfigurationError):
    """A value or transaction past Consul's limits (512 KiB per value and per
    transaction by default)."""


class ConsulDatacenterError(ConfigurationError):
    """Sessions cannot be created where the URL points (another datacenter)."""


def policy_for(root: str) -> str:
    """The ACL rules the store needs, for messages."""
    return (
        f'key_prefix "{root}" {{ policy = "write" }} and session_prefix "" '
        '{ policy = "write" } (or session "<this agent\'s node>")'
    )


def translate(exc: ConsulError, action: str, backend) -> Exception:
    """The ExclusiveError ``exc`` becomes, raised while ``action`` (e.g. "acquiring 'k'")."""
    url, root = backend.safe_url, backend.settings.root
    if isinstance(exc, Denied):
        if exc.path.startswith("/v1/session/"):
            what = "create or renew sessions (session:write on its agent's node)"
        else:
            what = f"write keys under {root or '/'!r} of Consul's KV store (key:write)"
        return ConsulPermissionDenied(
            f"the Consul ACL token of {url} may not {what}: permission denied while "
            f"{action} ({exc}). Grant its policy {policy_for(root)}, or set the token "
            "with ?token= or CONSUL_HTTP_TOKEN."
        )
    if isinstance(exc, TooLarge):
        return ConsulValueTooLarge(
            f"Consul at {url} refused a request as too large while {action} ({exc}). One "
            "value, and one transaction, must stay under kv_max_value_size and "
            "txn_max_req_len (512 KiB by default): pass smaller arguments (an id rather "
            "than the data), or raise those limits on the Consul servers."
        )
    if isinstance(exc, Refused):
        if any(reason in str(exc) for reason in ("node registration", "datacenter")):
            dc = backend.settings.dc
            return ConsulDatacenterError(
                f"Consul at {url} cannot keep sessions for this agent's node "
                f"{'in datacenter ' + repr(dc) + ' ' if dc else ''}({exc}) while {action}. "
                "A session lives on the node of the agent the URL names: point "
                "exclusive_backend_url at an agent of the datacenter whose KV holds the "
                "leases, and leave out ?dc= (or name that agent's own datacenter)."
            )
        return ConfigurationError(
            f"Consul at {url} refused a request while {action} ({exc}); retrying cannot "
            "fix it. Check the URL's options (ns and partition need Consul Enterprise) "
            "and, for consuls://, the CA (cacert / CONSUL_CACERT) and client certificate."
        )
    if isinstance(exc, Unavailable):
        return backend.unavailable(action, exc)
    return backend.unavailable(action, exc)
