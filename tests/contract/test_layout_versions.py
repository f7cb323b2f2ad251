"""The layout version every store holds under each key prefix, on every layout of every
store: recorded by the first process, shared where it may be, refused where it may
not, moved forward only by ``migrate``."""

from __future__ import annotations

import uuid

import pytest

from celery_exclusive import LayoutMismatch
from celery_exclusive.backends import LayoutVersion, versions


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


def recorded(backend, prefix: str):
    return backend.read_record(prefix + versions.RECORD_KEY, type(backend).layout_version.name)


def record(backend, prefix: str, value: str) -> None:
    """Make the store hold ``value`` as its layout's version, as another process did."""
    lease = backend.try_acquire(prefix + versions.RECORD_KEY, uuid.uuid4().hex, 10.0)
    assert lease is not None
    assert backend.write_record(lease, type(backend).layout_version.name, value)
    backend.release(lease)


def own_version(backend) -> int:
    return type(backend).layout_version.version


def test_every_layout_declares_a_version(backend):
    layout = type(backend).layout_version
    assert isinstance(layout, LayoutVersion)
    assert layout.version >= 1


def test_the_first_process_records_its_layout_version(backend, prefix):
    assert versions.check(backend, prefix) == own_version(backend)
    assert recorded(backend, prefix) == str(own_version(backend))


def test_a_process_of_the_recorded_version_shares_the_store(backend, prefix):
    record(backend, prefix, str(own_version(backend)))
    assert versions.check(backend, prefix) == own_version(backend)


def test_a_command_that_only_reads_records_nothing(backend, prefix):
    assert versions.check(backend, prefix, record=False) is None
    assert recorded(backend, prefix) is None


def test_a_store_holding_a_newer_layout_is_refused_with_the_upgrade_to_make(backend, prefix):
    newer = own_version(backend) + 1
    record(backend, prefix, str(newer))
    with pytest.raises(LayoutMismatch, match=f"version {newer}.*upgrade this process") as caught:
        versions.check(backend, prefix)
    assert (caught.value.found, caught.value.version) == (newer, own_version(backend))
    assert recorded(backend, prefix) == str(newer)


def test_a_store_holding_an_older_layout_is_refused_until_migrate_moves_it(backend, prefix):
    older = own_version(backend) - 1
    record(backend, prefix, str(older))
    with pytest.raises(LayoutMismatch, match=f"version {older}.*migrate"):
        versions.check(backend, prefix)
    assert "recorded (the store held version" in versions.migrate(backend, prefix)
    assert versions.check(backend, prefix) == own_version(backend)


def test_migrate_never_moves_a_newer_layout_back(backend, prefix):
    newer = own_version(backend) + 1
    record(backend, prefix, str(newer))
    with pytest.raises(LayoutMismatch):
        versions.migrate(backend, prefix)
    assert recorded(backend, prefix) == str(newer)


def test_an_older_version_the_layout_runs_beside_is_shared_and_kept(backend, prefix, monkeypatch):
    layout = type(backend).layout_version
    older = layout.version - 1
    beside = LayoutVersion(layout.name, layout.version, runs_beside=frozenset({older}))
    monkeypatch.setattr(type(backend), "layout_version", beside)
    record(backend, prefix, str(older))
    assert versions.check(backend, prefix) == older
    assert recorded(backend, prefix) == str(older)


def test_each_key_prefix_holds_its_own_version(backend, prefix):
    record(backend, prefix, str(own_version(backend) + 1))
    other = "other-" + prefix
    assert versions.check(backend, other) == own_version(backend)


def test_a_record_that_is_no_version_is_refused_naming_migrate(backend, prefix):
    record(backend, prefix, "banana")
    with pytest.raises(LayoutMismatch, match="'banana'.*migrate"):
        versions.check(backend, prefix)
