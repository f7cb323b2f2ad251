"""MongoDB lease store (``mongodb://``, ``mongodb+srv://``, pymongo).

See :mod:`.backend` for how a grant works and :mod:`.expressions` for the document.
"""

from .backend import MongoDBBackend
from .recipe import TtlLeaseBackend

__all__ = ["MongoDBBackend", "TtlLeaseBackend"]
