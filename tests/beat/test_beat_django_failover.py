"""django-celery-beat under the leader-elected beat, on real processes, across failovers.

A Django project (``tests/django_beat``) keeps its schedule in SQLite. Three
``celery beat`` processes wrap django-celery-beat's ``DatabaseScheduler`` with a lease
of 3 s in Redis; a worker runs every send into a ledger (``tests/support/django_beat/ledger.py``).
The schedule: tasks every 1 s, 2 s and 15 s, a disabled one, one that the admin
disables and one whose interval the admin changes mid-run, and a one-off
``ClockedSchedule``. The leader is SIGKILLed, SIGTERMed and SIGKILLed again, each time
right after it sent the 15 s task (and, the first time, the one-off): the moment a
successor trusting a stale row would send them again. A replacement beat starts after
each takeover, so three run again before the next stop.

The run happens once per module; each test asserts one fact about it.
"""

from __future__ import annotations

import importlib.util
import math
import signal
import time

import pytest

if importlib.util.find_spec("django_celery_beat") is None:  # Django needs Python >= 3.10
    pytest.skip("django-celery-beat is not installed", allow_module_level=True)

from celery_exclusive import backend_for_url  # noqa: E402
from tests.conftest import fresh_redis_db  # noqa: E402
from tests.support.django_beat import db  # noqa: E402
from tests.support.django_beat.cluster import BeatCluster, by_entry, sent_twice, worst_gaps  # noqa: E402

TTL = 3.0
#: Slack for process start-up and scheduling on a busy two-core machine.
SLACK = 1.0
#: The leader reads the schedule's change marker on every tick (at most 1 s apart).
PICKUP = 1.5
#: When the 15 s task (and, a second earlier, the one-off) is first due, after creation.
FIRST_DUE = 10.0
LEASE_KEY = "exclusive:beat:django_beat"
#: The shortest interval of each entry (every-2s is changed to 4 s mid-run).
INTERVALS = {"every-1s": 1, "every-2s": 2, "every-15s": 15, "to-disable": 1, "disabled": 1}
INTERVALS_AFTER_EDIT = {**INTERVALS, "every-2s": 4}


def create_schedule() -> None:
    db.periodic("every-1s", 1)
    db.periodic("every-2s", 2)
    db.periodic("every-15s", 15, due_in=FIRST_DUE)
    db.periodic("to-disable", 1)
    db.periodic("disabled", 1, enabled=False)
    db.one_off("one-off", due_in=FIRST_DUE - 1)


def edit_in_the_admin() -> None:
    """Change an interval and disable a task, as the admin's change form saves them."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    changed = PeriodicTask.objects.get(name="every-2s")
    changed.interval = IntervalSchedule.objects.create(every=4, period=IntervalSchedule.SECONDS)
    changed.save(update_fields=["interval"])
    disabled = PeriodicTask.objects.get(name="to-disable")
    disabled.enabled = False
    disabled.save(update_fields=["enabled"])


@pytest.fixture(scope="module")
def run(redis_server, tmp_path_factory):
    """Run the scenario once; return the ledger, the failovers and the rows at the end."""
    path = db.configure()
    from django_celery_beat.models import PeriodicTask

    db.empty_schedule()
    create_schedule()
    ledger_url = fresh_redis_db(redis_server)
    store = fresh_redis_db(redis_server)
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.support.django_beat.settings",
        "EXCLUSIVE_TEST_DJANGO_DB": path,
        "EXCLUSIVE_TEST_BROKER": fresh_redis_db(redis_server),
        "EXCLUSIVE_TEST_STORE": store,
        "EXCLUSIVE_TEST_LEDGER": ledger_url,
        "EXCLUSIVE_TEST_TTL": str(TTL),
    }
    cluster = BeatCluster(
        "tests.support.django_beat.celery_app",
        env,
        redis_server.client(int(ledger_url.rsplit("/", 1)[1])),
        tmp_path_factory.mktemp("beats"),
    )
    edited = {}

    def after_failover(i: int) -> None:
        if i == 0:
            edit_in_the_admin()
            edited["at"] = time.time()

    try:
        cluster.start()
        events = cluster.failovers(
            [signal.SIGKILL, signal.SIGTERM, signal.SIGKILL], "every-15s", after_failover
        )
        time.sleep(3)  # the last leader at work
        holders = backend_for_url(store).holders_of(LEASE_KEY)
        sends = cluster.finish(last=holders[0].holder["pid"] if holders else None)
        logs = cluster.logs(tail=100_000)
    finally:
        cluster.stop()
    rows = {
        t.name: {
            "total_run_count": t.total_run_count,
            "last_run_at": t.last_run_at.timestamp() if t.last_run_at else None,
            "enabled": t.enabled,
        }
        for t in PeriodicTask.objects.all()
    }
    print(
        "\nfailovers: "
        + ", ".join(f"{e['signal']} -> first send after {e['takeover_s']:.2f}s" for e in events)
        + f"; {len(sends)} sends; worst gaps "
        + ", ".join(f"{k} {v:.2f}s" for k, v in sorted(worst_gaps(sends).items()))
    )
    return {"sends": sends, "events": events, "edited_at": edited["at"], "rows": rows, "logs": logs}


def sends_of(run, entry: str) -> list[dict]:
    return by_entry(run["sends"]).get(entry, [])


def test_no_tick_is_sent_twice_across_kills_and_sigterms(run):
    assert sent_twice(run["sends"], INTERVALS) == [], run["logs"]


def test_the_one_off_task_is_sent_exactly_once(run):
    assert len(sends_of(run, "one-off")) == 1, run["logs"]


def test_the_one_off_task_is_left_disabled(run):
    assert run["rows"]["one-off"]["enabled"] is False


def test_a_disabled_task_is_never_sent(run):
    assert sends_of(run, "disabled") == []


def test_an_interval_changed_in_the_admin_is_followed_by_the_leader(run):
    after = [
        s["sent_at"] for s in sends_of(run, "every-2s") if s["sent_at"] > run["edited_at"] + PICKUP
    ]
    assert len(after) >= 3
    assert min(b - a for a, b in zip(after, after[1:])) >= 4 - 0.5


def test_a_task_disabled_in_the_admin_is_no_longer_sent(run):
    late = [s for s in sends_of(run, "to-disable") if s["sent_at"] > run["edited_at"] + PICKUP]
    assert sends_of(run, "to-disable") and late == []


def test_no_entry_waits_longer_than_a_failover_plus_its_interval(run):
    gaps = worst_gaps(run["sends"], until={"to-disable": run["edited_at"]})
    for entry in ("every-1s", "every-2s", "every-15s", "to-disable"):
        assert gaps[entry] <= TTL + TTL / 3 + INTERVALS_AFTER_EDIT[entry] + SLACK, entry


def test_a_successor_sends_within_a_failover_of_the_leader_stopping(run):
    for event in run["events"]:
        bound = (TTL if event["signal"] == "SIGKILL" else 0) + TTL / 3 + 1 + SLACK
        assert event["takeover_s"] <= bound, event
        assert event["successor"] != event["leader"]


def test_the_database_counts_what_was_sent(run):
    # A leader stopped between recording a tick and publishing it loses that tick (by
    # design): it is counted, never sent. SIGKILL can land there, and so can SIGTERM,
    # whose handler closes the scheduler and raises SystemExit wherever beat is. At
    # most one per stop (the failovers and the last leader's), and rare.
    surplus = {}
    for entry in ("every-1s", "every-2s", "every-15s", "to-disable"):
        surplus[entry] = run["rows"][entry]["total_run_count"] - len(sends_of(run, entry))
    stops = len(run["events"]) + 1
    assert min(surplus.values()) >= 0 and sum(surplus.values()) <= stops, (surplus, run["logs"])
    for entry in ("every-1s", "every-2s", "every-15s"):
        last_sent = sends_of(run, entry)[-1]["sent_at"]
        assert math.isclose(run["rows"][entry]["last_run_at"], last_sent, abs_tol=0.5), entry


def test_no_beat_logs_a_traceback(run):
    assert "Traceback" not in run["logs"], run["logs"]
