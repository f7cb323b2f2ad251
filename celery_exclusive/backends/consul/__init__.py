"""The Consul lease store: one connection and four layouts over it.

- ``http.py``: the URL's options, TLS, one connection pool per process, retries, and
  what each HTTP answer means;
- ``connection.py``: :class:`ConsulConnection`, what every layout shares (the session,
  a transaction, a read, marks, the reading back of lost answers) and the one failure
  translator;
- ``kv.py`` and ``session.py``: where a key's entries live, and a session's settings;
- ``backend.py``: :class:`ConsulBackend`, the library's own layout;
- ``recipes.py``: with ``?recipe=``, Consul's own lock recipes on the key's path
  (HashiCorp's api.Lock and api.Semaphore, ``consul lock``, a plain KV acquire).
"""

from __future__ import annotations

from .backend import ConsulBackend
from .connection import (
    ConsulConnection,
    ConsulDatacenterError,
    ConsulPermissionDenied,
    ConsulValueTooLarge,
)
from .http import ConsulSettings, format_duration, settings_from_url
from .kv import decode, encode
from .session import MAX_SESSION_TTL, MIN_SESSION_TTL

__all__ = [
    "MAX_SESSION_TTL",
    "MIN_SESSION_TTL",
    "ConsulBackend",
    "ConsulConnection",
    "ConsulDatacenterError",
    "ConsulPermissionDenied",
    "ConsulSettings",
    "ConsulValueTooLarge",
    "decode",
    "encode",
    "format_duration",
    "settings_from_url",
]
