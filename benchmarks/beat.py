"""Beat failover: celery-exclusive over django-celery-beat, and celery-redbeat, under
one kill schedule.

Each side runs three real ``celery beat`` processes and a worker
(``tests/support/django_beat/cluster.py``), with entries every 1 s, 2 s and 15 s; celery-exclusive
also has a one-off ``ClockedSchedule`` (RedBeat has no one-off schedule). The leader is
stopped right after it sent the 15 s entry, by SIGKILL, SIGTERM, SIGKILL, SIGTERM and
SIGKILL in turn, and a beat is started in its place each time. Lease ttl and RedBeat
lock timeout 3 s; loop interval 1 s.

Reported per side, over ``runs`` runs: ticks sent twice (two sends of one entry closer
than half its interval), sends of the one-off, takeover (the stop to another beat's
first send) and each entry's worst gap against ttl + ttl/3 + interval.
"""

from __future__ import annotations

import signal
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import redis_server
from tests.support.django_beat.cluster import BeatCluster, by_entry, sent_twice, worst_gaps

TTL = 3.0
INTERVALS = {"every-1s": 1, "every-2s": 2, "every-15s": 15}
#: The 15 s entry and the one-off are first due this long after the schedule is written.
FIRST_DUE = 10.0
SIGNALS = ["SIGKILL", "SIGTERM", "SIGKILL", "SIGTERM", "SIGKILL"]


def django_schedule() -> dict:
    """A fresh django-celery-beat schedule; the environment its beats need."""
    from tests.support.django_beat import db

    path = db.configure()
    db.empty_schedule()
    db.periodic("every-1s", 1)
    db.periodic("every-2s", 2)
    db.periodic("every-15s", 15, due_in=FIRST_DUE)
    db.one_off("one-off", due_in=FIRST_DUE - 1)
    return {
        "DJANGO_SETTINGS_MODULE": "tests.support.django_beat.settings",
        "EXCLUSIVE_TEST_DJANGO_DB": path,
    }


def static_schedule() -> dict:
    """RedBeat writes its schedule from the app's ``beat_schedule`` as each beat starts."""
    return {}


#: Side -> (the beats' app, what writes its schedule, whether it has the one-off).
SIDES = {
    "celery-exclusive + django-celery-beat": (
        "tests.support.django_beat.celery_app",
        django_schedule,
        True,
    ),
    "celery-redbeat": ("benchmarks.redbeat_app", static_schedule, False),
}


def one_run(server, app: str, schedule, signals: list[str]) -> dict:
    for db_number in (1, 2, 3):
        server.client(db_number).flushdb()
    env = {
        "EXCLUSIVE_TEST_BROKER": server.url_for_db(1),
        "EXCLUSIVE_TEST_STORE": server.url_for_db(2),
        "EXCLUSIVE_TEST_LEDGER": server.url_for_db(3),
        "EXCLUSIVE_TEST_TTL": str(TTL),
    }
    env.update(schedule())
    with tempfile.TemporaryDirectory(prefix="bench-beat-") as directory:
        cluster = BeatCluster(app, env, server.client(3), Path(directory))
        try:
            cluster.start()
            events = cluster.failovers([signal.Signals[s] for s in signals], "every-15s")
            sends = cluster.finish()
        finally:
            cluster.stop()
    return {
        "sends": len(sends),
        "sent_twice": len(sent_twice(sends, {**INTERVALS, "one-off": float("inf")})),
        "one_off": len(by_entry(sends).get("one-off", [])),
        "takeover": [(e["signal"], e["takeover_s"]) for e in events],
        "worst_gap": worst_gaps([s for s in sends if s["entry"] in INTERVALS]),
    }


def run(runs: int = 3, signals: list[str] = SIGNALS) -> dict:
    out = {"ttl": TTL, "runs": runs, "signals": signals, "intervals": INTERVALS, "sides": {}}
    with redis_server() as server:
        for side, (app, schedule, has_one_off) in SIDES.items():
            results = [one_run(server, app, schedule, signals) for _ in range(runs)]
            out["sides"][side] = summary(results, has_one_off)
    return out


def summary(results: list[dict], one_off: bool) -> dict:
    def takeovers(name: str) -> list[float]:
        return [t for r in results for sig, t in r["takeover"] if sig == name]

    kills, terms = takeovers("SIGKILL"), takeovers("SIGTERM")
    return {
        "sends": sum(r["sends"] for r in results),
        "sent_twice": sum(r["sent_twice"] for r in results),
        "one_off_sends": [r["one_off"] for r in results] if one_off else None,
        "sigkill_takeover_s": [statistics.median(kills), max(kills)] if kills else None,
        "sigterm_takeover_s": [statistics.median(terms), max(terms)] if terms else None,
        "worst_gap_s": {
            entry: max(r["worst_gap"].get(entry, 0.0) for r in results) for entry in INTERVALS
        },
    }


if __name__ == "__main__":
    from benchmarks.common import main_json

    main_json(run)
