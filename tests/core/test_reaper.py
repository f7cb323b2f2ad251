"""What the worker does with the lease of a holder process that died
(celery_exclusive.core.reaper): released, or kept as the end of a failed run keeps it
(a rate's slot, a window after every end), however many times the worker looks.

The store is the in-process one; the dead process is one this test started and waited
for, so its pid names no live process of this host.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
import uuid

import pytest

from celery_exclusive.backends import backend_for_url
from celery_exclusive.core import reaper
from celery_exclusive.core.config import Settings
from celery_exclusive.core.lease import HOSTNAME

KEY = "exclusive:reaped"
#: Longer than the rate's period below: a lease kept for the rest of the period then
#: reads back with less time left than its own ttl.
LEASE_TTL = 30.0


def resolved(**options) -> Settings:
    """Resolved settings (a rate sets the limit, as the app's resolution does)."""
    rate = options.get("rate")
    limit = int(rate.split("/")[0]) if rate else 1
    return Settings(backend_url="memory://", lease_ttl=LEASE_TTL, limit=limit, **options)


@pytest.fixture
def backend():
    return backend_for_url(f"memory://{uuid.uuid4().hex}")


@pytest.fixture
def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def grant_to_dead(backend, dead_pid: int, limit: int = 1) -> str:
    """A grant of KEY to task "t1" in a process that has exited; returns its owner."""
    owner = uuid.uuid4().hex
    holder = {"task_id": "t1", "hostname": HOSTNAME, "pid": dead_pid, "ttl": LEASE_TTL}
    assert backend.try_acquire(KEY, owner, LEASE_TTL, limit, holder) is not None
    return owner


def free_for_another(backend, limit: int = 1) -> bool:
    grant = backend.try_acquire(KEY, uuid.uuid4().hex, LEASE_TTL, limit)
    if grant is not None:
        backend.release(grant)
    return grant is not None


def test_a_dead_holder_without_a_rate_or_window_is_released(backend, dead_pid):
    grant_to_dead(backend, dead_pid)
    reaper.release_left_by(backend, KEY, "t1", resolved(), dead_pid, comes_back=False)
    assert free_for_another(backend)


def test_a_dead_holders_rate_slot_is_kept_to_a_period_after_its_grant(backend, dead_pid):
    settings = resolved(rate="1/1s")
    granted = time.monotonic()
    grant_to_dead(backend, dead_pid)
    reaper.release_left_by(backend, KEY, "t1", settings, dead_pid, comes_back=False)
    assert not free_for_another(backend)
    while time.monotonic() < granted + 0.9:
        assert not free_for_another(backend)
        time.sleep(0.05)
    time.sleep(0.5)
    assert free_for_another(backend)


def test_looking_again_at_a_kept_slot_keeps_it_to_the_same_end(backend, dead_pid):
    # As Celery does: the lease is kept as the child exits, and looked at again when
    # the death is reported, by then with less time left than its ttl says.
    settings = resolved(rate="1/1s")
    grant_to_dead(backend, dead_pid)
    reaper.release_left_by(backend, KEY, "t1", settings, dead_pid, comes_back=False)
    time.sleep(0.2)
    [left] = reaper.leases_on_this_host(backend, KEY, "t1", 1)
    keep = reaper.kept_after_death(settings, left, comes_back=False)
    assert 0.6 < keep < 0.85
    assert reaper.let_go(backend, left, "t1", keep)
    assert not free_for_another(backend)


def test_a_slot_its_run_kept_before_its_process_died_is_never_cut(backend, dead_pid):
    # The run ended and kept its slot for the rest of the period, then its process was
    # killed before its worker learned of the end.
    settings = resolved(rate="1/1s")
    grant_to_dead(backend, dead_pid)
    [left] = reaper.leases_on_this_host(backend, KEY, "t1", 1)
    assert not backend.renew([dataclasses.replace(left.lease, ttl=0.9)])  # as keep_for does
    reaper.release_left_by(backend, KEY, "t1", settings, dead_pid, comes_back=False)
    [kept] = reaper.leases_on_this_host(backend, KEY, "t1", 1)
    assert kept.expires_in is not None and kept.expires_in > 0.8


def test_a_window_after_every_end_is_kept_unless_the_call_comes_back(backend, dead_pid):
    settings = resolved(unique_for=60.0, unique_after="end")
    grant_to_dead(backend, dead_pid)
    reaper.release_left_by(backend, KEY, "t1", settings, dead_pid, comes_back=False)
    assert not free_for_another(backend)
    # Its call is sent again after all: the window it was kept for ends.
    [left] = reaper.leases_on_this_host(backend, KEY, "t1", 1)
    assert reaper.kept_after_death(settings, left, comes_back=True) == 0.0
    assert not reaper.let_go(backend, left, "t1", 0.0)
    assert free_for_another(backend)


def test_a_window_after_a_success_only_is_not_kept_for_a_run_that_died(backend, dead_pid):
    settings = resolved(unique_for=60.0)  # unique_after="success"
    grant_to_dead(backend, dead_pid)
    reaper.release_left_by(backend, KEY, "t1", settings, dead_pid, comes_back=False)
    assert free_for_another(backend)


def test_a_semaphores_dead_holder_keeps_its_own_slot_only(backend, dead_pid):
    settings = resolved(rate="2/1s")
    grant_to_dead(backend, dead_pid, limit=2)
    reaper.release_left_by(backend, KEY, "t1", settings, dead_pid, comes_back=False)
    other = backend.try_acquire(KEY, uuid.uuid4().hex, LEASE_TTL, 2)
    assert other is not None  # the second slot
    assert backend.try_acquire(KEY, uuid.uuid4().hex, LEASE_TTL, 2) is None
