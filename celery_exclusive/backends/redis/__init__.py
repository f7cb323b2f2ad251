"""The Redis lease store (standalone, Sentinel, Cluster). See :mod:`.backend`."""

from .backend import RedisBackend
from .client import connect, store_options

__all__ = ["RedisBackend", "connect", "store_options"]
