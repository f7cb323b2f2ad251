"""The Redis lease store (standalone, Sentinel, Cluster). See :mod:`.backend`."""

from .backend import RedisBackend
from .client import connect, store_options
from .recipe import SetNxBackend

__all__ = ["RedisBackend", "SetNxBackend", "connect", "store_options"]
