"""SQLite lease store: the embedded default, coordinating every worker on one host.

The backend is :mod:`.backend`; the host clock its leases expire by is :mod:`.clock`;
the binding of its path to one file is :mod:`.file`; its tables are :mod:`.schema`.
"""

from .backend import SQLiteBackend, path_from_url

__all__ = ["SQLiteBackend", "path_from_url"]
