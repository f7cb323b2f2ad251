"""``exclusive_lock(key, app=...)``: a lock on a key of a Celery app's own, for any code.

The key is written as a task's ``exclusive_key`` fills it, without the prefix: a task
declared with ``exclusive_key="invoice:{invoice_id}"`` takes ``invoice:7`` for
``settle(7)``, and so does ``exclusive_lock("invoice:7", app=app)``. The app's
settings give the prefix (``exclusive_key_prefix``), the store, the lease ttl and the
limit, as they do to its tasks. The lock of one task call, whatever its key format,
is ``task.exclusive_lock(*args, **kwargs)``.
"""

from __future__ import annotations

from typing import Any, Optional

from ..core.lock import ExclusiveLock
from . import settings as app_settings


def exclusive_lock(
    key: str,
    *,
    app: Any = None,
    wait: float = 0.0,
    backend_url: Optional[str] = None,
    ttl: Optional[float] = None,
    limit: Optional[int] = None,
) -> ExclusiveLock:
    """The lock of ``key`` under ``app``'s settings (the current app if None): the
    lease its tasks take on ``exclusive_key_prefix + key``.

    ``wait`` is how long entering waits for a held key before it raises
    :class:`~celery_exclusive.errors.LockHeld`; 0 raises at once. ``backend_url``,
    ``ttl`` and ``limit`` override the app's ``exclusive_backend_url``,
    ``exclusive_lease_ttl`` and ``exclusive_limit``: give them only as the tasks
    sharing the key have them.
    """
    if app is None:
        from celery import current_app

        app = current_app
    given = {"backend_url": backend_url, "lease_ttl": ttl, "limit": limit}
    settings = app_settings.for_app(app, f"exclusive_lock({key!r})", given.get)
    return ExclusiveLock(
        settings.key_prefix + key,
        settings.backend_url,
        ttl=settings.lease_ttl,
        limit=settings.limit,
        wait=wait,
        name=key,
        trace_keys=settings.trace_keys,
        key_prefix=settings.key_prefix,
    )
