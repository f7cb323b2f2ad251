"""etcd v3 lease store (``etcd://``, ``etcds://``), over etcd's JSON gateway.

See :mod:`.backend` for the layout and the transactions, :mod:`.client` for the URL,
auth, TLS and why the gateway rather than a gRPC client.
"""

from .backend import EtcdBackend
from .recipe import MutexBackend

__all__ = ["EtcdBackend", "MutexBackend"]
