"""A Celery app's ``app.conf`` as the settings of :mod:`celery_exclusive.core.config`
read it: which spelling of a setting Celery looks up, the changes made to it after the
first call (which move the settings' generation), and the settings of a task or lock in
an app.
"""

from __future__ import annotations

from typing import Any, Callable

from celery.app.utils import Settings as CelerySettings

from ..core.config import (
    Settings,
    default_backend_url,
    forced,
    invalidate,
    resolve,
    setting_name,
)


class AppSettings:
    """An ``app.conf`` as its user wrote it: which spelling of a setting Celery looks
    up, and why a key spelt otherwise is never read.

    ``conf.get("exclusive_lease_ttl")`` finds ``exclusive_lease_ttl`` and, in an app
    configured with ``config_from_object(..., namespace="CELERY")`` (Django's way),
    ``CELERY_EXCLUSIVE_LEASE_TTL`` (the namespace in its case, then the name in that
    case). Any other spelling is kept by Celery and read by nobody.
    """

    def __init__(self, conf: Any) -> None:
        self.conf = conf
        self.prefix: str = getattr(conf, "prefix", None) or ""

    def written(self) -> list[str]:
        """Every key of the configuration, as written."""
        return [str(key) for key in self.conf]

    def spelling(self, name: str) -> str:
        """How this app's configuration is best written to set ``name``
        (``exclusive_lease_ttl``): with its namespace if it has one."""
        return self._candidates(name)[0]

    def given_as(self, name: str) -> str:
        """The key under which ``conf.get(name)`` finds its value, as the user wrote it
        (``name`` itself when unset)."""
        for candidate in self._candidates(name):
            if any(candidate in layer for layer in self.conf.maps):
                return candidate
        return name

    def reads(self, key: str, name: str) -> bool:
        """Whether ``conf.get(name)`` looks ``key`` up."""
        return key in self._candidates(name)

    def unprefixed(self, key: str) -> str:
        """``key`` lowercased, without the namespace (or a Django ``CELERY_`` prefix the
        app does not read): what it would be called in ``app.conf``."""
        lowered = key.lower()
        for prefix in (self.prefix.lower(), "celery_"):
            if prefix and lowered.startswith(prefix):
                return lowered[len(prefix) :]
        return lowered

    def why_unread(self, key: str, name: str) -> str:
        """Why ``key``, a spelling of setting ``name``, is never read, and what to write."""
        looked_up = " or ".join(self._candidates(name))
        if key.lower().startswith("celery_") and not self.prefix:
            return (
                f"this app reads its configuration without a namespace, so Celery looks up "
                f"{looked_up} only; write that, or read Django's settings with "
                "app.config_from_object('django.conf:settings', namespace='CELERY')"
            )
        return (
            f"Celery looks it up as {looked_up} only (names are case-sensitive); write "
            f"{self.spelling(name)}"
        )

    def _candidates(self, name: str) -> list[str]:
        if not self.prefix:
            return [name]
        namespaced = self.prefix + name
        namespaced = namespaced.upper() if self.prefix.isupper() else namespaced.lower()
        return [namespaced, name]


class WatchedSettings(CelerySettings):
    """Celery's ``app.conf``, counting its changes (:func:`watch` puts it in place).

    Every way Celery and users change a configuration goes through these methods:
    ``app.conf.x = ...`` (``__setattr__`` calls ``__setitem__``), ``update()``,
    ``setdefault()``, ``pop()``, ``clear()``, ``add_defaults()``, and the swap that
    finalizes a pending configuration. Writing into ``app.conf.changes`` directly
    bypasses them.
    """

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        invalidate()

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        invalidate()

    def update(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().update(*args, **kwargs)
        finally:
            invalidate()

    def pop(self, key: Any, *default: Any) -> Any:
        try:
            return super().pop(key, *default)
        finally:
            invalidate()

    def clear(self) -> None:
        super().clear()
        invalidate()

    def add_defaults(self, d: Any) -> None:
        super().add_defaults(d)
        invalidate()

    def swap_with(self, other: Any) -> None:
        super().swap_with(other)
        invalidate()


def watch(conf: Any) -> bool:
    """Count the changes of ``conf`` (an ``app.conf``) from now on; False when it is
    not Celery's own settings object, whose changes then cannot be seen."""
    if isinstance(conf, WatchedSettings):
        return True
    if type(conf) is not CelerySettings:
        return False
    # The same object, so every reference to it (and every change) stays; its own
    # __setattr__ would store "__class__" as a setting.
    object.__setattr__(conf, "__class__", WatchedSettings)
    return True


def for_app(app: Any, owner: str, override: Callable[[str], Any] = lambda name: None) -> Settings:
    """The settings of ``owner`` in a Celery ``app``: ``override``, then the app's
    ``exclusive_<name>`` settings, then the defaults (the default store is the app's).

    From now on, changes to ``app.conf`` move :func:`generation`."""
    conf = app.conf
    watch(conf)
    written = AppSettings(conf)

    def describe(name: str, value: Any) -> str:
        given = override(name) is not None and forced(name) is None
        key = setting_name(name) if given else written.given_as(setting_name(name))
        return f"{key}={value!r}"

    return resolve(
        owner,
        override,
        lambda name: conf.get(setting_name(name)),
        broker_url=conf.broker_url,
        app_name=app.main,
        describe=describe,
    )


def is_default_store(app: Any, url: str) -> bool:
    """Whether ``url`` is the store ``app`` gets when ``exclusive_backend_url`` is unset."""
    return url == default_backend_url(app.conf.broker_url, app.main)
