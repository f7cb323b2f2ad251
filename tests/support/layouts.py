"""Make a store hold a layout version, as a process of another version would have."""

from __future__ import annotations

import uuid

from celery_exclusive.backends import backend_for_url, versions


def record_layout(url: str, prefix: str, version: object) -> None:
    """Make the store at ``url`` hold ``version`` as its layout's under ``prefix``."""
    backend = backend_for_url(url)
    lease = backend.try_acquire(prefix + versions.RECORD_KEY, uuid.uuid4().hex, 10.0)
    assert lease is not None
    assert backend.write_record(lease, type(backend).layout_version.name, str(version))
    backend.release(lease)


def recorded_layout(url: str, prefix: str):
    """The layout version the store at ``url`` holds under ``prefix``, as it wrote it."""
    backend = backend_for_url(url)
    return backend.read_record(prefix + versions.RECORD_KEY, type(backend).layout_version.name)
