"""A SQLite store on a full disk says the disk is full, and works again once there is
room: an outage with its cause named, not a store that "did not answer".

The disk is a real one: a small tmpfs mounted for the test (root only).
"""

from __future__ import annotations

import errno
import os
import subprocess
import uuid

import pytest

from celery_exclusive.backends.sqlite import SQLiteBackend
from celery_exclusive.errors import BackendUnavailable


def owner() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB filesystem of the test's own."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


def fill(directory) -> str:
    """Write a file into ``directory`` until the disk is full; its path."""
    path = os.path.join(directory, "filler")
    with open(path, "wb", buffering=0) as file:
        try:
            while True:
                file.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return path


def test_a_write_on_a_full_disk_says_the_disk_is_full_and_works_once_there_is_room(small_disk):
    store = SQLiteBackend(f"sqlite:///{small_disk}/leases.db")
    held = store.try_acquire("k", owner(), 30)
    filler = fill(small_disk)
    with pytest.raises(BackendUnavailable) as full:
        for n in range(10_000):  # until the write-ahead log needs a page more
            store.try_acquire(f"key-{n}", owner(), 30, holder={"pad": "x" * 500})
    message = str(full.value)
    assert f"the disk holding {small_disk}/leases.db is full" in message
    assert "Free space on it" in message and "did not answer" not in message
    os.unlink(filler)
    assert store.renew([held]) == set()
    assert store.try_acquire("after", owner(), 30) is not None


def test_a_database_created_on_a_full_disk_says_the_disk_is_full(small_disk):
    fill(small_disk)
    with pytest.raises(BackendUnavailable, match="the disk holding .* is full") as full:
        SQLiteBackend(f"sqlite:///{small_disk}/leases.db").try_acquire("k", owner(), 30)
    assert "did not answer" not in str(full.value)
