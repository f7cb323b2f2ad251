"""Start-up checks of the lease stores, for every long-running process that uses them.

A worker (``worker.CheckExclusiveSettings``) and a beat call :func:`check_stores` before
doing any work, so that what no retry can fix stops the process at once with one line
naming the setting, and a store that does not answer is said once, up front, rather
than discovered task by task.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any, Callable, Union
from urllib.parse import urlsplit

from ..backends import backend_for_url, versions
from ..backends.sqlite import path_from_url
from ..core import config
from ..errors import BackendUnavailable, ConfigurationError
from . import settings as app_settings

logger = logging.getLogger("celery_exclusive")

#: The probe key, under the checked prefix: one key per prefix, reused by every start.
PROBE_KEY = "celery-exclusive:start-up-check"


def check_stores(
    app: Any,
    settings: Iterable[config.Settings],
    meanwhile: Union[str, Callable[[list[config.Settings]], str]],
) -> bool:
    """Everything a process of ``app`` checks at start about the stores ``settings``
    use: say where leases live, refuse a default store in someone else's directory,
    and :func:`check_store` each store once per key prefix.

    ``meanwhile`` says what the process does while a store does not answer (or, given
    the settings that use one store, returns it). A worker calls this from its start-up
    bootstep; ``celery beat`` calls it with its own settings before leading. Returns
    whether every store answered.
    """
    stores: dict[tuple[str, str], list[config.Settings]] = {}
    for one in settings:
        stores.setdefault((one.backend_url, one.key_prefix), []).append(one)
    for url in sorted({url for url, _ in stores}):
        default = app_settings.is_default_store(app, url)
        announce_store(url, default)
        if default and urlsplit(url).scheme == "sqlite":
            check_default_store_directory(url)
    answered = True
    for (url, prefix), group in sorted(stores.items()):
        answered &= check_store(url, prefix, meanwhile(group) if callable(meanwhile) else meanwhile)
    return answered


def check_store(url: str, key_prefix: str, meanwhile: str) -> bool:
    """Check the store at ``url`` with a probe key under ``key_prefix``, and the layout
    version it holds there (:mod:`~celery_exclusive.backends.versions`).

    Raises :class:`ConfigurationError` for what retrying cannot fix (permissions,
    authentication, TLS, topology, a path that is no database, a layout this version
    cannot share). A store that does not
    answer is logged as one WARNING saying ``meanwhile`` (what the process does until
    it answers) and False is returned. The store's own warnings are logged.
    """
    backend = backend_for_url(url)
    try:
        warnings = backend.check(key_prefix + PROBE_KEY)
        versions.ensure(backend, key_prefix)
    except BackendUnavailable as exc:
        logger.warning(
            "celery-exclusive: the lease store %s does not answer at start (%s); %s",
            backend.safe_url,
            exc,
            meanwhile,
        )
        return False
    for warning in warnings:
        logger.warning("celery-exclusive: %s: %s", backend.safe_url, warning)
    return True


def check_default_store_directory(url: str) -> None:
    """Refuse a default store whose directory belongs to someone else.

    The default store is private to its user: a directory owned by another uid (a
    shared ``XDG_STATE_HOME``, a ``HOME`` left pointing at another user's) would let
    that user read and change the leases.
    """
    path = os.path.abspath(path_from_url(url))
    directory = os.path.dirname(path)
    try:
        owner = os.stat(directory).st_uid
    except FileNotFoundError:
        return  # created with mode 0700 by the store itself
    except OSError as exc:
        raise ConfigurationError(
            f"the default lease store {path} cannot be used: {exc}. Set "
            "exclusive_backend_url to a sqlite:/// file this user can write, or to a "
            "shared store's URL (redis://, postgresql://, etcd://, consul://, ...)."
        ) from None
    uid = os.getuid() if hasattr(os, "getuid") else owner
    if owner != uid:
        raise ConfigurationError(
            f"the default lease store {path} is in a directory owned by uid {owner}, not "
            f"by this user (uid {uid}): leases there would not be private. Point "
            "XDG_STATE_HOME (or HOME) at this user's own directory, or set "
            "exclusive_backend_url."
        )


def announce_store(url: str, default: bool) -> None:
    """Say where leases live when that limits what they coordinate."""
    scheme = urlsplit(url).scheme
    if scheme == "sqlite" and default:
        logger.warning(
            "celery-exclusive: leases live in %s, the default store: a file private to this "
            "app and user, which coordinates only this host's workers of this app. Set "
            "exclusive_backend_url to a shared store (redis://, postgresql://, etcd://, "
            "consul://, ...) to coordinate several hosts (or to a sqlite:/// file of your "
            "choice to silence this).",
            url,
        )
    elif scheme == "sqlite":
        logger.info(
            "celery-exclusive: leases live in %s, which coordinates only the workers of this host",
            url,
        )
    elif scheme == "memory":
        logger.warning(
            "celery-exclusive: leases live in %s, which coordinates only one process; "
            "use it for eager mode and tests",
            url,
        )
