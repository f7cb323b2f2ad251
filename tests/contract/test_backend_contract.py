"""The backend protocol, as every lease store must honour it.

Runs once per store in ``conftest.BACKEND_CASES`` against the real store.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from celery_exclusive.backends import End, MarkRead, MarkSwap
from celery_exclusive.backends.line import LINE
from celery_exclusive.errors import ConfigurationError


def owner() -> str:
    return uuid.uuid4().hex


def needs(store, capability: str) -> None:
    """Skip a test of what ``store`` does not declare in its capabilities."""
    if not getattr(store.capabilities, capability):
        pytest.skip(f"{type(store).__name__} does not declare {capability}")


def test_a_free_key_is_granted_with_a_fencing_token(backend):
    lease = backend.try_acquire("k", owner(), 10)
    assert lease is not None
    assert lease.key == "k"
    assert isinstance(lease.fencing_token, int)


def test_a_held_key_is_refused_to_another_owner(backend):
    assert backend.try_acquire("k", owner(), 10) is not None
    assert backend.try_acquire("k", owner(), 10) is None


def test_fencing_tokens_strictly_increase_across_grants(backend):
    tokens = []
    for _ in range(3):
        lease = backend.try_acquire("k", owner(), 10)
        tokens.append(lease.fencing_token)
        assert backend.release(lease)
    assert tokens == sorted(set(tokens))


def test_release_frees_the_key(backend):
    lease = backend.try_acquire("k", owner(), 10)
    assert backend.release(lease) is True
    assert backend.try_acquire("k", owner(), 10) is not None


def test_release_is_idempotent(backend):
    lease = backend.try_acquire("k", owner(), 10)
    assert backend.release(lease) is True
    assert backend.release(lease) is False


def test_nobody_can_release_a_lease_they_do_not_hold(backend):
    held = backend.try_acquire("k", owner(), 10)
    impostor = type(held)(held.key, owner(), held.fencing_token, held.ttl)
    assert backend.release(impostor) is False
    assert backend.try_acquire("k", owner(), 10) is None


def test_an_unrenewed_lease_expires_after_its_ttl(backend, backend_case):
    ttl = backend_case.short_ttl
    backend.try_acquire("k", owner(), ttl)
    time.sleep(ttl * 2.5)
    assert backend.try_acquire("k", owner(), 10) is not None


def test_renewal_keeps_a_lease_past_its_ttl(backend, backend_case):
    ttl = backend_case.short_ttl
    lease = backend.try_acquire("k", owner(), ttl)
    for _ in range(6):
        time.sleep(ttl / 3)
        assert backend.renew([lease]) == set()
    assert backend.try_acquire("k", owner(), 10) is None


def test_renew_reports_exactly_the_leases_that_are_gone(backend):
    kept = backend.try_acquire("kept", owner(), 10)
    gone = backend.try_acquire("gone", owner(), 10)
    backend.force_release("gone")
    assert backend.renew([kept, gone]) == {gone}


def test_renewing_a_released_lease_does_not_revive_it(backend):
    lease = backend.try_acquire("k", owner(), 10)
    backend.release(lease)
    assert backend.renew([lease]) == {lease}
    assert backend.try_acquire("k", owner(), 10) is not None


def test_a_limit_admits_that_many_holders_and_no_more(backend):
    needs(backend, "limits")
    leases = [backend.try_acquire("k", owner(), 10, limit=3) for _ in range(3)]
    assert all(leases)
    assert len({lease.fencing_token for lease in leases}) == 3
    assert backend.try_acquire("k", owner(), 10, limit=3) is None


def test_releasing_one_holder_of_a_limit_frees_one_slot(backend):
    needs(backend, "limits")
    leases = [backend.try_acquire("k", owner(), 10, limit=2) for _ in range(2)]
    backend.release(leases[0])
    assert backend.try_acquire("k", owner(), 10, limit=2) is not None
    assert backend.try_acquire("k", owner(), 10, limit=2) is None


def test_an_expired_holder_of_a_limit_frees_its_slot(backend, backend_case):
    needs(backend, "limits")
    ttl = backend_case.short_ttl
    backend.try_acquire("k", owner(), ttl, limit=2)
    backend.try_acquire("k", owner(), 30, limit=2)
    time.sleep(ttl * 2.5)
    assert backend.try_acquire("k", owner(), 10, limit=2) is not None


def test_renewal_keeps_a_limit_slot(backend, backend_case):
    needs(backend, "limits")
    ttl = backend_case.short_ttl
    lease = backend.try_acquire("k", owner(), ttl, limit=2)
    backend.try_acquire("k", owner(), 30, limit=2)
    for _ in range(6):
        time.sleep(ttl / 3)
        assert backend.renew([lease]) == set()
    assert backend.try_acquire("k", owner(), 10, limit=2) is None


@pytest.mark.parametrize("first, second", [(1, 2), (2, 1), (2, 3)])
def test_contenders_disagreeing_on_the_limit_get_a_configuration_error(backend, first, second):
    needs(backend, "limits")
    backend.try_acquire("k", owner(), 10, limit=first)
    with pytest.raises(ConfigurationError, match="exclusive_limit"):
        backend.try_acquire("k", owner(), 10, limit=second)


def test_wait_returns_soon_after_the_holder_releases(backend):
    lease = backend.try_acquire("k", owner(), 10)
    threading.Timer(0.3, backend.release, [lease]).start()
    started = time.monotonic()
    backend.wait("k", timeout=10)
    waited = time.monotonic() - started
    assert 0.2 < waited < 5.0
    assert backend.try_acquire("k", owner(), 10) is not None


def test_wait_gives_up_after_its_timeout(backend):
    backend.try_acquire("k", owner(), 10)
    started = time.monotonic()
    backend.wait("k", timeout=0.5)
    assert time.monotonic() - started >= 0.45


def test_holders_describe_each_live_lease(backend):
    lease = backend.try_acquire("app:k", owner(), 10, holder={"task_id": "t-1", "pid": 42})
    backend.try_acquire("other:k", owner(), 10)
    [info] = backend.holders("app:")
    assert info.key == "app:k"
    assert info.owner == lease.owner
    assert info.fencing_token == lease.fencing_token
    assert info.task_id == "t-1"
    assert info.holder["pid"] == 42
    assert 0 < info.expires_in <= 10


def test_holders_list_every_holder_of_a_limit(backend):
    needs(backend, "limits")
    tokens = {backend.try_acquire("k", owner(), 10, limit=2).fencing_token for _ in range(2)}
    assert {info.fencing_token for info in backend.holders("k")} == tokens


def test_force_release_frees_a_key_whoever_holds_it(backend):
    needs(backend, "limits")
    backend.try_acquire("k", owner(), 10, limit=2)
    backend.try_acquire("k", owner(), 10, limit=2)
    assert backend.force_release("k") == 2
    assert backend.holders("k") == []
    assert backend.try_acquire("k", owner(), 10) is not None


# --- records: small values only the lease holder can write ----------------------------


def test_a_record_never_written_reads_as_none(backend):
    assert backend.read_record("beat", "last") is None


def test_the_holder_writes_a_record_everyone_can_read(backend):
    lease = backend.try_acquire("beat", owner(), 10)
    assert backend.write_record(lease, "last", "2024-01-01T00:00:00+00:00") is True
    assert backend.read_record("beat", "last") == "2024-01-01T00:00:00+00:00"


def test_a_later_write_replaces_the_record(backend):
    lease = backend.try_acquire("beat", owner(), 10)
    backend.write_record(lease, "last", "one")
    backend.write_record(lease, "last", "two")
    assert backend.read_record("beat", "last") == "two"


def test_records_are_independent_of_each_other(backend):
    lease = backend.try_acquire("beat", owner(), 10)
    backend.write_record(lease, "a", "a")
    backend.write_record(lease, "b", "b")
    assert (backend.read_record("beat", "a"), backend.read_record("beat", "b")) == ("a", "b")


def test_a_released_lease_cannot_write_a_record(backend):
    lease = backend.try_acquire("beat", owner(), 10)
    backend.write_record(lease, "last", "mine")
    backend.release(lease)
    assert backend.write_record(lease, "last", "stale") is False
    assert backend.read_record("beat", "last") == "mine"


def test_an_expired_lease_cannot_write_a_record(backend, backend_case):
    ttl = backend_case.short_ttl
    lease = backend.try_acquire("beat", owner(), ttl)
    time.sleep(ttl * 2.5)
    assert backend.write_record(lease, "last", "stale") is False
    assert backend.read_record("beat", "last") is None


def test_a_former_holder_cannot_overwrite_the_new_holders_record(backend):
    old = backend.try_acquire("beat", owner(), 10)
    backend.force_release("beat")
    new = backend.try_acquire("beat", owner(), 10)
    assert backend.write_record(new, "last", "new") is True
    assert backend.write_record(old, "last", "old") is False
    assert backend.read_record("beat", "last") == "new"


def test_a_holder_of_a_limit_can_write_a_record(backend):
    needs(backend, "limits")
    lease = backend.try_acquire("k", owner(), 10, limit=2)
    assert backend.write_record(lease, "last", "v") is True
    assert backend.read_record("k", "last") == "v"


def test_records_do_not_show_up_as_holders(backend):
    lease = backend.try_acquire("app:beat", owner(), 10)
    backend.write_record(lease, "last", "v")
    assert [info.key for info in backend.holders("app:")] == ["app:beat"]


def test_concurrent_writers_with_and_without_the_lease_leave_only_the_holders_value(backend):
    held = backend.try_acquire("beat", owner(), 10)
    stale = type(held)(held.key, owner(), held.fencing_token, held.ttl)
    answers: dict[str, list[bool]] = {"held": [], "stale": []}

    def write(name, lease):
        for i in range(50):
            answers[name].append(backend.write_record(lease, "last", f"{name}-{i}"))

    threads = [threading.Thread(target=write, args=a) for a in (("held", held), ("stale", stale))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(answers["held"]) and not any(answers["stale"])
    assert backend.read_record("beat", "last") == "held-49"


# --- marks: small ttl'd values changed only by compare-and-swap ---------------------


@pytest.fixture
def marks(backend):
    needs(backend, "marks")
    return backend


def test_an_absent_mark_reads_as_none(marks):
    assert marks.read_mark("m", "x") is None


def test_a_mark_is_created_only_where_none_was_expected(marks):
    assert marks.swap_mark("m", "x", None, "a", 10) is True
    assert marks.swap_mark("m", "x", None, "b", 10) is False
    assert marks.read_mark("m", "x") == "a"


def test_a_mark_changes_only_from_the_expected_value(marks):
    marks.swap_mark("m", "x", None, "a", 10)
    assert marks.swap_mark("m", "x", "z", "b", 10) is False
    assert marks.swap_mark("m", "x", "a", "b", 10) is True
    assert marks.read_mark("m", "x") == "b"


def test_a_mark_swapped_to_none_is_deleted(marks):
    marks.swap_mark("m", "x", None, "a", 10)
    assert marks.swap_mark("m", "x", "a", None, 10) is True
    assert marks.read_mark("m", "x") is None


def test_an_expired_mark_reads_as_none_and_counts_as_absent(marks, backend_case):
    marks.swap_mark("m", "x", None, "a", backend_case.short_ttl)
    time.sleep(backend_case.short_ttl * 2.5)
    assert marks.read_mark("m", "x") is None
    assert marks.swap_mark("m", "x", None, "b", 10) is True


def test_marks_are_not_listed_as_holders(marks):
    marks.swap_mark("k", "x", None, "a", 10)
    assert marks.holders("k") == []


# --- the two steps of an attempt that may be delivered twice: take the key and read
# whether it already ended; record that it ended and give the key back ---------------


def test_a_grant_comes_with_the_mark_read_after_it(marks):
    marks.swap_mark("done-of-k", "x", None, "2", 10)
    grant, value = with_mark(marks, "k", owner(), 10, 1, None, None, ("done-of-k", "x"))
    assert grant is not None and grant.key == "k"
    assert value == "2"
    assert marks.try_acquire("k", owner(), 10) is None


def test_a_grant_reads_an_absent_mark_as_none(marks):
    grant, value = with_mark(marks, "k", owner(), 10, 1, None, None, ("m", "x"))
    assert grant is not None and value is None


def test_a_refused_grant_comes_with_the_mark_too(marks):
    marks.try_acquire("k", owner(), 10)
    marks.swap_mark("m", "x", None, "2", 10)
    assert with_mark(marks, "k", owner(), 10, 1, None, None, ("m", "x")) == (
        None,
        "2",
    )


def test_a_refused_grant_reads_an_absent_mark_as_none(marks):
    marks.try_acquire("k", owner(), 10)
    assert with_mark(marks, "k", owner(), 10, 1, None, None, ("m", "x")) == (
        None,
        None,
    )


def test_a_grant_with_its_mark_honours_the_line(marks):
    stand_in_line(marks, "k", "first")
    refused = with_mark(marks, "k", owner(), 10, 1, None, "second", ("m", "x"))
    assert refused[0] is None
    grant, _ = with_mark(marks, "k", owner(), 10, 1, None, "first", ("m", "x"))
    assert grant is not None and in_line(marks, "k") == []


def test_setting_the_mark_and_releasing_does_both(marks):
    lease = marks.try_acquire("k", owner(), 10)
    assert marks.release(lease, End(MarkSwap("m", "x", None, "3", 10))) is True
    assert marks.read_mark("m", "x") == "3"
    assert marks.try_acquire("k", owner(), 10) is not None


def test_setting_the_mark_and_releasing_swaps_from_the_expected_value(marks):
    marks.swap_mark("m", "x", None, "1", 10)
    lease = marks.try_acquire("k", owner(), 10)
    assert marks.release(lease, End(MarkSwap("m", "x", "1", "2", 10))) is True
    assert marks.read_mark("m", "x") == "2"


def test_setting_the_mark_and_releasing_frees_one_slot_of_a_limit(marks):
    needs(marks, "limits")
    first = marks.try_acquire("k", owner(), 10, 2)
    grant, value = with_mark(marks, "k", owner(), 10, 2, None, None, ("m", "x"))
    assert first is not None and grant is not None and value is None
    assert marks.release(grant, End(MarkSwap("m", "x", None, "0", 10))) is True
    assert [info.owner for info in marks.holders_of("k")] == [first.owner]
    assert marks.try_acquire("k", owner(), 10, 2) is not None


def test_a_mark_that_moved_leaves_mark_and_lease_as_they_were(marks):
    marks.swap_mark("m", "x", None, "5", 10)
    lease = marks.try_acquire("k", owner(), 10)
    assert marks.release(lease, End(MarkSwap("m", "x", None, "3", 10))) is None
    assert marks.read_mark("m", "x") == "5"
    assert marks.try_acquire("k", owner(), 10) is None
    assert marks.release(lease) is True


def test_setting_the_mark_and_releasing_again_finds_its_own_write(marks):
    lease = marks.try_acquire("k", owner(), 10)
    assert marks.release(lease, End(MarkSwap("m", "x", None, "3", 10))) is True
    assert marks.release(lease, End(MarkSwap("m", "x", None, "3", 10))) is False
    assert marks.read_mark("m", "x") == "3"


def test_setting_the_mark_on_a_lease_already_gone_reports_it_not_freed(marks):
    lease = marks.try_acquire("k", owner(), 10)
    marks.force_release("k")
    assert marks.release(lease, End(MarkSwap("m", "x", None, "3", 10))) is False
    assert marks.read_mark("m", "x") == "3"


def with_mark(store, key, owner, ttl, limit, holder, claimant, mark):
    """A grant and the mark read right after it, as the lease layer asks a store: in the
    grant's round trip where the store fills the read in, else right after."""
    read = MarkRead(*mark)
    grant = store.try_acquire(key, owner, ttl, limit, holder, claimant, read)
    return grant, read.value if read.done else store.read_mark(*mark)


def stand_in_line(store, key: str, *claimants: str, ttl: float = 10) -> None:
    """Make ``claimants`` the line of ``key``, in that order, the way waiters write it."""
    line = json.dumps([{"id": c, "until": store.store_time() + ttl} for c in claimants])
    assert store.swap_mark(key, LINE, store.read_mark(key, LINE), line, ttl)


def in_line(store, key: str) -> list[str]:
    return [entry["id"] for entry in json.loads(store.read_mark(key, LINE) or "[]")]


def test_a_line_admits_only_its_first_to_a_free_key(marks):
    stand_in_line(marks, "k", "first", "second")
    assert marks.try_acquire("k", owner(), 10) is None
    assert marks.try_acquire("k", owner(), 10, claimant="second") is None
    assert marks.try_acquire("k", owner(), 10, claimant="first") is not None


def test_a_grant_takes_its_claimant_out_of_the_line(marks):
    stand_in_line(marks, "k", "first", "second")
    lease = marks.try_acquire("k", owner(), 10, claimant="first")
    assert in_line(marks, "k") == ["second"]
    marks.release(lease)
    assert marks.try_acquire("k", owner(), 10) is None
    assert marks.try_acquire("k", owner(), 10, claimant="second") is not None
    assert marks.read_mark("k", LINE) is None


def test_a_refused_grant_leaves_the_line_as_it_was(marks):
    marks.try_acquire("k", owner(), 10)
    stand_in_line(marks, "k", "first", "second")
    assert marks.try_acquire("k", owner(), 10, claimant="first") is None  # still held
    assert in_line(marks, "k") == ["first", "second"]


def test_a_semaphore_admits_as_many_of_the_line_as_it_has_free_slots(marks):
    needs(marks, "limits")
    marks.try_acquire("k", owner(), 10, limit=3)
    stand_in_line(marks, "k", "a", "b", "c")
    assert marks.try_acquire("k", owner(), 10, limit=3, claimant="c") is None
    assert marks.try_acquire("k", owner(), 10, limit=3, claimant="b") is not None
    assert in_line(marks, "k") == ["a", "c"]
    assert marks.try_acquire("k", owner(), 10, limit=3, claimant="c") is None
    assert marks.try_acquire("k", owner(), 10, limit=3, claimant="a") is not None


def test_a_newcomer_gets_a_slot_only_when_there_are_more_slots_than_waiters(marks):
    needs(marks, "limits")
    stand_in_line(marks, "k", "a")
    assert marks.try_acquire("k", owner(), 10, limit=2) is not None
    assert marks.try_acquire("k", owner(), 10, limit=2) is None
    assert in_line(marks, "k") == ["a"]


def test_an_expired_line_no_longer_refuses(marks, backend_case):
    stand_in_line(marks, "k", "gone", ttl=backend_case.short_ttl)
    time.sleep(backend_case.short_ttl * 2.5)
    assert marks.try_acquire("k", owner(), 10) is not None


def test_a_lapsed_entry_by_the_stores_clock_no_longer_holds_its_place(marks):
    now = marks.store_time()
    line = json.dumps([{"id": "dead", "until": now - 1}, {"id": "live", "until": now + 30}])
    assert marks.swap_mark("k", LINE, None, line, 30)
    assert marks.try_acquire("k", owner(), 10) is None
    assert marks.try_acquire("k", owner(), 10, claimant="live") is not None


def test_wait_does_not_return_for_a_free_key_while_another_is_first_in_line(marks):
    stand_in_line(marks, "k", "first")
    started = time.monotonic()
    marks.wait("k", timeout=0.5, claimant="second")
    assert time.monotonic() - started >= 0.45


def test_wait_returns_at_once_for_the_first_in_line_of_a_free_key(marks):
    stand_in_line(marks, "k", "first")
    started = time.monotonic()
    marks.wait("k", timeout=10, claimant="first")
    assert time.monotonic() - started < 5.0


def test_a_release_wakes_the_first_in_line_and_nobody_behind_it(marks):
    lease = marks.try_acquire("k", owner(), 10)
    stand_in_line(marks, "k", "first", "second")
    waited = {}

    def wait(claimant: str, timeout: float) -> None:
        started = time.monotonic()
        marks.wait("k", timeout=timeout, claimant=claimant)
        waited[claimant] = time.monotonic() - started

    # The one behind starts waiting first: a store waking whoever waited longest fails.
    behind = threading.Thread(target=wait, args=("second", 2.0))
    behind.start()
    time.sleep(0.2)
    first = threading.Thread(target=wait, args=("first", 10.0))
    first.start()
    time.sleep(0.3)
    marks.release(lease)
    first.join()
    behind.join()
    assert waited["first"] < 5.0, "the release did not wake the first in line"
    assert waited["second"] >= 1.9, "the release woke a waiter behind the first"


# --- keys are data: no key, whatever its characters, reaches another key's entries ----

#: Keys an attacker or an unlucky argument can produce: the store's own separators,
#: Redis hash tags and glob characters, HTTP path segments, control and wide characters.
HOSTILE_KEYS = [
    "k:~line",
    "k:~fence",
    "k:~signal",
    "k:~holders",
    "k:~rerun",
    "k:~queued",
    "k:~record:last",
    "k/.lock",
    "k/x",
    "{k}",
    "k}{",
    "k*",
    "k[ab]?",
    "k\\",
    "k\nline two",
    "k\x00nul",
    "k//double",
    "k/./dot",
    "k/../up",
    "k/",
    "k%2Fenc",
    "k?q=1#frag",
    " k ",
    "ключ-" + "ü" * 300,
]


@pytest.mark.parametrize("key", HOSTILE_KEYS, ids=repr)
def test_any_key_is_granted_listed_and_freed_exactly(backend, key):
    plain = backend.try_acquire("k", owner(), 10)
    try:
        lease = backend.try_acquire(key, owner(), 10)
    except ConfigurationError as refused:
        # A recipe locks the key under its own name, as its ecosystem's clients name it
        # (Backend.recipe), and may refuse, by name, one they cannot (Consul's KV paths).
        assert backend.recipe is not None and repr(key) in str(refused)
        pytest.skip(f"?recipe={backend.recipe} refuses this key by name: {refused}")
    assert lease is not None and lease.key == key
    assert backend.try_acquire(key, owner(), 10) is None
    assert [info.key for info in backend.holders_of(key)] == [key]
    listed = {"k", key} if key.startswith("k") else {"k"}
    assert sorted(info.key for info in backend.holders("k")) == sorted(listed)
    assert backend.force_release(key) == 1
    assert backend.holders_of(key) == []
    assert [info.key for info in backend.holders_of("k")] == ["k"]
    assert backend.renew([plain]) == set()


@pytest.mark.parametrize("key", [k for k in HOSTILE_KEYS if k.startswith("k:~")], ids=repr)
def test_a_key_named_like_an_internal_entry_is_an_ordinary_key(marks, key):
    needs(marks, "limits")
    stand_in_line(marks, "k", "first")
    lease = marks.try_acquire(key, owner(), 10, limit=2)
    assert lease is not None
    assert in_line(marks, "k") == ["first"]
    assert marks.try_acquire("k", owner(), 10, claimant="first") is not None
    marks.swap_mark(key, "rerun", None, "pending", 10)
    assert marks.read_mark("k", "rerun") is None
    assert marks.release(lease) is True


def test_marks_of_one_key_are_apart_from_another_keys_and_kinds(marks):
    marks.swap_mark("k", "line", None, "a", 10)
    assert marks.read_mark("k", "rerun") is None
    assert marks.read_mark("k:~line", "line") is None
    assert marks.read_mark("k:", "line") is None
    assert marks.holders("k") == []


def test_records_belong_to_their_lease_key(backend):
    one = backend.try_acquire("beat:a", owner(), 10)
    other = backend.try_acquire("beat:a:~record:x", owner(), 10)
    assert backend.write_record(one, "x", "mine") is True
    assert backend.read_record("beat:a:~record:x", "x") is None
    assert backend.write_record(other, "x", "theirs") is True
    assert backend.read_record("beat:a", "x") == "mine"
    assert backend.holders_of("beat:a:~record:x")[0].key == "beat:a:~record:x"


# --- the store's clock, and the start-up check ------------------------------------------


def test_the_store_clock_tells_epoch_seconds_and_moves_forward(backend):
    first = backend.store_time()
    time.sleep(0.05)
    second = backend.store_time()
    assert abs(first - time.time()) < 60
    assert second > first


def test_a_healthy_store_passes_the_start_up_check_and_leaves_the_probe_key_free(backend):
    assert isinstance(backend.check("exclusive:~check"), list)
    assert backend.holders_of("exclusive:~check") == []
