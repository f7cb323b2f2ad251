"""The Redis lease store (standalone, Sentinel, Cluster): a connection
(:mod:`.connection`) and two layouts, the store's own (:mod:`.backend`) and Redis's
SET NX lock recipe on the key's own name (``?recipe=set-nx``, :mod:`.recipe`)."""

from .backend import RedisBackend
from .client import connect, store_options
from .connection import RedisConnection
from .recipe import SetNxBackend

__all__ = ["RedisBackend", "RedisConnection", "SetNxBackend", "connect", "store_options"]
