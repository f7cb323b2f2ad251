"""Lease stores, chosen by URL scheme.

Every store, built-in or third-party, is declared the same way: an entry point in the
group ``celery_exclusive.backends`` whose name is the URL scheme and whose value is
the backend class, with the extra that installs its client in brackets::

    [project.entry-points."celery_exclusive.backends"]
    postgresql = "celery_exclusive.backends.postgresql:PostgreSQLBackend [postgresql]"

:func:`register_scheme` adds or replaces a scheme at run time. Backends are imported
only when their scheme is used, so a user of one store need not install the clients
of the others.
"""

from __future__ import annotations

import importlib
import os
import threading
from importlib.metadata import entry_points
from typing import Optional
from urllib.parse import urlsplit

from ..errors import ConfigurationError
from .base import (
    NO_END,
    Backend,
    Capabilities,
    Connection,
    End,
    FinalWrite,
    LayoutVersion,
    Lease,
    LeaseInfo,
    MarkRead,
    MarkSwap,
    check_capabilities,
    recipe_of,
)

__all__ = [
    "NO_END",
    "Backend",
    "Capabilities",
    "Connection",
    "End",
    "FinalWrite",
    "LayoutVersion",
    "Lease",
    "LeaseInfo",
    "MarkRead",
    "MarkSwap",
    "ENTRY_POINT_GROUP",
    "SCHEMES",
    "backend_for_url",
    "register_scheme",
]

#: The entry point group stores are declared in.
ENTRY_POINT_GROUP = "celery_exclusive.backends"


def _declared() -> tuple[dict[str, str], dict[str, str]]:
    """Schemes -> ``"module:Class"``, and schemes -> the extra that installs their client,
    from every installed distribution's entry points."""
    schemes, extras = {}, {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        schemes[entry.name] = entry.value.split("[")[0].strip()
        if entry.extras:
            extras[entry.name] = entry.extras[0]
    return schemes, extras


#: URL scheme -> "module:Class" of the backend that serves it.
SCHEMES, _EXTRAS = _declared()

_instances: dict[tuple[int, str], Backend] = {}
#: A lock per process: a child forked while a thread of its parent loaded a backend
#: would find the parent's lock copied held, for good.
_loading: dict[int, threading.Lock] = {}


def register_scheme(scheme: str, target: str, extra: Optional[str] = None) -> None:
    """Serve ``scheme://`` URLs with the backend class at ``"module:Class"``.

    ``extra`` names the ``pip install`` extra that installs its client, for the error
    a user sees when it is missing. Prefer an entry point in ``celery_exclusive.backends``
    for a store shipped as a package: it is found without an import.
    """
    SCHEMES[scheme] = target
    if extra is not None:
        _EXTRAS[scheme] = extra


def backend_for_url(url: str) -> Backend:
    """The backend for ``url``, one instance per URL and process.

    Keyed by pid as well: a forked worker child must open its own connections
    rather than share its parent's sockets.
    """
    pid = os.getpid()
    cache_key = (pid, url)
    backend = _instances.get(cache_key)
    if backend is None:
        with _loading.setdefault(pid, threading.Lock()):
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
        extra = _EXTRAS.get(scheme)
        if extra is None:
            raise
        raise ConfigurationError(
            f"exclusive_backend_url uses {scheme}:// but its client is not installed "
            f"({exc}); install it with: pip install 'celery-exclusive[{extra}]'."
        ) from None
    store_class = _layout(getattr(module, class_name), url)
    check_capabilities(store_class)
    return store_class(url)


def _layout(store_class: type, url: str) -> type:
    """The layout that serves ``url``: the store's own, or the one its ``?recipe=``
    names (:attr:`Backend.recipes`)."""
    recipe = recipe_of(url)
    if recipe is None:
        return store_class
    recipes = getattr(store_class, "recipes", {})
    target = recipes.get(recipe)
    if target is None:
        known = ", ".join(sorted(recipes)) or "none"
        raise ConfigurationError(
            f"exclusive_backend_url names recipe={recipe!r}, which {store_class.__name__} "
            f"does not speak (its recipes: {known}); correct it, or remove ?recipe= to use "
            "the library's own layout."
        )
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)
