"""The layout version every store holds under each key prefix, on every layout of every
store: recorded by the first process, shared where it may be, refused where it may
not, moved forward only by ``migrate``."""

from __future__ import annotations

import threading
import uuid

import pytest

from celery_exclusive import LayoutMismatch, runtime
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


def later(backend, monkeypatch, runs_beside=frozenset()) -> LayoutVersion:
    """Make this process's layout one version later than the store's own."""
    layout = type(backend).layout_version
    newer = LayoutVersion(layout.name, layout.version + 1, runs_beside=frozenset(runs_beside))
    monkeypatch.setattr(type(backend), "layout_version", newer)
    return newer


def test_a_store_without_a_record_holds_version_one_to_a_later_layout(backend, prefix, monkeypatch):
    later(backend, monkeypatch)
    with pytest.raises(LayoutMismatch, match="records no layout.*version 1.*migrate"):
        versions.check(backend, prefix)
    assert recorded(backend, prefix) is None


def test_a_later_layout_that_runs_beside_version_one_records_it_on_a_store_without_one(
    backend, prefix, monkeypatch
):
    later(backend, monkeypatch, runs_beside={1})
    assert versions.check(backend, prefix) == 1
    assert recorded(backend, prefix) == "1"


def test_migrate_replaces_a_record_that_is_no_version(backend, prefix):
    record(backend, prefix, "banana")
    assert "recorded (the store held version 0)" in versions.migrate(backend, prefix)
    assert versions.check(backend, prefix) == own_version(backend)


def test_processes_starting_together_record_one_version(backend, prefix):
    found, barrier = [], threading.Barrier(4)

    def start() -> None:
        barrier.wait(10)
        found.append(versions.check(backend, prefix))

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert found == [own_version(backend)] * 4
    assert recorded(backend, prefix) == str(own_version(backend))


def test_a_first_write_whose_lease_was_lost_is_made_again(backend, prefix, monkeypatch):
    write = backend.write_record
    refused = []

    def lost_once(lease, name, value):
        if not refused:
            refused.append(name)
            return False  # the lease expired under the writer
        return write(lease, name, value)

    monkeypatch.setattr(backend, "write_record", lost_once)
    assert versions.check(backend, prefix) == own_version(backend)
    assert refused and recorded(backend, prefix) == str(own_version(backend))


def test_a_process_reads_the_record_again_after_a_while(backend, prefix, monkeypatch):
    assert versions.ensure(backend, prefix) == own_version(backend)
    record(backend, prefix, str(own_version(backend) + 1))  # a newer release's migrate
    assert versions.ensure(backend, prefix) == own_version(backend)  # not read again yet
    after = runtime.monotonic() + versions.RECHECK_AFTER
    monkeypatch.setattr(runtime, "monotonic", lambda: after)
    with pytest.raises(LayoutMismatch, match="upgrade this process"):
        versions.ensure(backend, prefix)
