"""MongoDB lease store (``mongodb://``, ``mongodb+srv://``, pymongo): a connection
(:mod:`.connection`) and two layouts over it, the library's own (:mod:`.backend`) and
MongoDB's TTL-lease document (:mod:`.recipe`, ``?recipe=ttl-lease``), both keeping
fences, marks and records in the key's document of the store's own collection
(:mod:`.expressions`, :mod:`.marks`).
"""

from .backend import MongoDBBackend
from .connection import MongoDBConnection
from .recipe import TtlLeaseBackend

__all__ = ["MongoDBBackend", "MongoDBConnection", "TtlLeaseBackend"]
