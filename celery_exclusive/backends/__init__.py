"""Lease stores, chosen by URL scheme.

A new backend registers its scheme here and nothing else changes. Backends are
imported only when their scheme is used, so ``redis`` or ``consul`` need not be
installed by users of the other stores.
"""

from __future__ import annotations

import importlib
import os
import threading
from urllib.parse import urlsplit

from ..errors import ConfigurationError
from .base import Backend, Lease, LeaseInfo

__all__ = ["Backend", "Lease", "LeaseInfo", "backend_for_url", "register_scheme", "SCHEMES"]

#: URL scheme -> "module:Class" of the backend that serves it.
SCHEMES: dict[str, str] = {
    "redis": "celery_exclusive.backends.redis:RedisBackend",
    "rediss": "celery_exclusive.backends.redis:RedisBackend",
    "redis+sentinel": "celery_exclusive.backends.redis:RedisBackend",
    "consul": "celery_exclusive.backends.consul:ConsulBackend",
    "consuls": "celery_exclusive.backends.consul:ConsulBackend",
    "sqlite": "celery_exclusive.backends.sqlite:SQLiteBackend",
    "memory": "celery_exclusive.backends.memory:MemoryBackend",
}

#: Which extra installs the client a scheme needs.
_EXTRAS = {"redis": "redis", "rediss": "redis", "redis+sentinel": "redis", "consul": "consul"}

_instances: dict[tuple[int, str], Backend] = {}
_instances_lock = threading.Lock()


def register_scheme(scheme: str, target: str) -> None:
    """Serve ``scheme://`` URLs with the backend class at ``"module:Class"``."""
    SCHEMES[scheme] = target


def backend_for_url(url: str) -> Backend:
    """The backend for ``url``, one instance per URL and process.

    Keyed by pid as well: a forked worker child must open its own connections
    rather than share its parent's sockets.
    """
    cache_key = (os.getpid(), url)
    backend = _instances.get(cache_key)
    if backend is None:
        with _instances_lock:
            backend = _instances.get(cache_key)
            if backend is None:
                backend = _instances[cache_key] = _load(url)
    return backend


def _load(url: str) -> Backend:
    scheme = urlsplit(url).scheme
    target = SCHEMES.get(scheme)
    if target is None:
        raise ConfigurationError(
            f"exclusive_backend_url {url!r} has the unknown scheme {scheme!r}; "
            f"use one of: {', '.join(s + '://' for s in sorted(SCHEMES))}."
        )
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = _EXTRAS.get(scheme.rstrip("s") if scheme == "consuls" else scheme, scheme)
        raise ConfigurationError(
            f"exclusive_backend_url uses {scheme}:// but its client is not installed "
            f"({exc}); install it with: pip install 'celery-exclusive[{extra}]'."
        ) from None
    return getattr(module, class_name)(url)
