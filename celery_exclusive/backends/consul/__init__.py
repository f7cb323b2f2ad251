"""The Consul lease store, in three parts a reader can take one at a time:

- ``http.py``: the URL's options, TLS, one connection pool per process, retries, and
  what each HTTP answer means;
- ``kv.py``: where a key's entries live (keys encoded into paths no router rewrites)
  and how transactions are written;
- ``session.py`` and ``backend.py``: the process's session and the backend protocol;
- ``recipes.py``: with ``?recipe=``, Consul's own lock recipes (HashiCorp's api.Lock and
  api.Semaphore, ``consul lock``, a plain KV acquire) instead of the store's layout.

``errors.py`` is the one failure translator: every client exception leaves the backend
as ``BackendUnavailable`` or a named ``ConfigurationError``.
"""

from __future__ import annotations

from .backend import ConsulBackend, parse_duration
from .errors import ConsulDatacenterError, ConsulPermissionDenied, ConsulValueTooLarge
from .http import ConsulSettings, format_duration, settings_from_url
from .kv import decode, encode
from .session import MAX_SESSION_TTL, MIN_SESSION_TTL

__all__ = [
    "MAX_SESSION_TTL",
    "MIN_SESSION_TTL",
    "ConsulBackend",
    "ConsulDatacenterError",
    "ConsulPermissionDenied",
    "ConsulSettings",
    "ConsulValueTooLarge",
    "decode",
    "encode",
    "format_duration",
    "parse_duration",
    "settings_from_url",
]
