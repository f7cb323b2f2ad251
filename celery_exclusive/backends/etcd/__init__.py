"""etcd v3 lease store (``etcd://``, ``etcds://``), over etcd's JSON gateway.

A connection (:mod:`.connection`: the gateway, the process's etcd leases, the one
translator of failures) plus two layouts: the library's own (:mod:`.backend`) and
etcd's concurrency mutex on the key's own name (:mod:`.recipe`, ``?recipe=mutex``).
"""

from .backend import EtcdBackend
from .recipe import MutexBackend

__all__ = ["EtcdBackend", "MutexBackend"]
