"""Leader-elected ``celery beat``: run beat on several hosts, only one of them sends.

::

    app.conf.beat_scheduler = "exclusive"  # or "celery_exclusive.beat:LeaderScheduler"
    app.conf.exclusive_beat_scheduler = "django_celery_beat.schedulers:DatabaseScheduler"

Every beat process wraps its own instance of the scheduler users already have (the
*inner* scheduler, ``celery.beat:PersistentScheduler`` unless
``exclusive_beat_scheduler`` names another), so the schedule keeps coming from where
it always came from. Only the beat holding the lease ``<key_prefix>beat:<app name>``
sends; the others wait for it (the store wakes them when it is released) and try at
least every ``lease_ttl / 3``. They leave the inner scheduler untouched until they
lead: a follower neither reads nor writes its store (no default-entry upsert at start,
no sync).

The record is the authority. Each entry has a record in the lease store, beside the
lease, holding its last send and run count; only the lease holder can write it. Before
every send the leader reads the record and refuses a tick it shows as sent, whatever
the inner scheduler believes (it may have reloaded its entries from a stale database
row, an old schedule file or an admin form); otherwise it writes the new run into the
record with a fenced write, then sends. The rules, and why a read plus a fenced write
is a compare-and-set under the lease, are in :mod:`celery_exclusive.beat.records`.

A beat that takes over reads every record, sets the inner scheduler's entries to what
they say and writes that through to the inner scheduler's own store
(:mod:`celery_exclusive.beat.entries`), so the admin shows what was sent and a reload
cannot roll it back; every send is synced to that store at once, too. A tick that
fell in the failover window is handled by the entry's own schedule (Celery runs a late
entry once; it never replays every missed tick).

The record is written before the message is published, so a beat killed between the
two loses that one tick rather than letting the next leader send it a second time.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from celery.beat import ScheduleEntry, Scheduler
from celery.utils.imports import load_extension_class_names, symbol_by_name

from .. import runtime, telemetry
from ..backends import Backend, backend_for_url
from ..celery import settings as app_settings
from ..celery import startup
from ..core import config
from ..core.lease import HeldLease, acquire, heartbeat
from ..errors import BackendUnavailable, ConfigurationError
from .entries import adopt, baseline_changes, catch_up, total_run_count_of, write_through
from .records import SentRun, already_sent, as_utc

logger = logging.getLogger("celery_exclusive")

#: The scheduler wrapped when ``exclusive_beat_scheduler`` is not set: Celery's own.
DEFAULT_INNER_SCHEDULER = "celery.beat:PersistentScheduler"
#: What ``holders()`` shows as the "task" of the leading beat.
HOLDER_NAME = "celery beat"
#: The shortest pause between two attempts of a follower to take the lease.
MIN_RETRY = 0.05


class LeaderScheduler(Scheduler):
    """A beat scheduler that sends only while it holds the beat's lease.

    Celery's own ``tick()`` runs unchanged on top of the inner scheduler's entries:
    this class hands it the inner scheduler's schedule, ``is_due``, ``reserve`` and
    ``sync``, and puts the lease and the record in ``apply_entry``, the one place
    every send goes through.
    """

    def __init__(self, app, *args: Any, lazy: bool = False, **kwargs: Any) -> None:
        try:
            # The inner scheduler is built lazily and set up only once this beat leads.
            self.inner: Scheduler = inner_scheduler_class(app)(app, *args, lazy=True, **kwargs)
            self.settings = beat_settings(app)
            self.lease_key = lease_key(app, self.settings)
            self.backend = _backend_with_records(self.settings.backend_url)
        except ConfigurationError as exc:
            raise stop_beat(exc) from None
        self.retry_interval = self.settings.lease_ttl / 3
        self.lease: Optional[HeldLease] = None
        #: What its takeovers' spans say (:mod:`celery_exclusive.telemetry`).
        self.trace = telemetry.call(
            HOLDER_NAME,
            self.lease_key,
            self.backend.url,
            "leader",
            1,
            self.settings.key_prefix,
            self.settings.trace_keys,
        )
        #: Whether the inner scheduler has read its store (it does when this beat first leads).
        self.inner_ready = False
        #: (entry, what the inner scheduler's reserve() made of it) for the send under way.
        self._reserved: Optional[tuple[ScheduleEntry, ScheduleEntry]] = None
        self._store_down = False
        #: Whether this beat has said it stands by (said once each time it starts to).
        self._standing_by = False
        self._closed = False
        super().__init__(app, *args, lazy=lazy, **kwargs)
        self.max_interval = self.inner.max_interval

    # --- the inner scheduler is the schedule source ------------------------------

    @property
    def schedule(self) -> dict:
        return self.inner.schedule if self.inner_ready else {}

    @schedule.setter
    def schedule(self, schedule: dict) -> None:
        self.inner.schedule = schedule

    def setup_schedule(self) -> None:
        """Beat is starting: check the lease store. The inner scheduler waits until this
        beat leads, so that followers leave its store alone."""
        self._check_store()

    def is_due(self, entry: ScheduleEntry):
        return self.inner.is_due(entry)

    def reserve(self, entry: ScheduleEntry) -> ScheduleEntry:
        reserved = self.inner.reserve(entry)
        self._reserved = (entry, reserved)
        return reserved

    def schedules_equal(self, old_schedules, new_schedules) -> bool:
        # Delegated so a scheduler that flags its own changes (a database one) is heard.
        return self.inner.schedules_equal(old_schedules, new_schedules)

    def sync(self) -> None:
        """Sync the inner scheduler's store, only while leading: a follower's copy is stale."""
        if self._leading_now():
            self.inner.sync()

    @property
    def info(self) -> str:
        return (
            f"{self.inner.info}\n"
            f"    . inner scheduler -> {_qualname(type(self.inner))}\n"
            f"    . leader lease -> {self.lease_key} on {self.backend.safe_url} "
            f"(ttl {self.settings.lease_ttl:g}s)"
        )

    # --- leadership ---------------------------------------------------------------

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One pass of Celery's scheduler if this beat leads; else wait for the lease."""
        if not self.leading():
            return self._wait_for_the_lease()
        return super().tick(*args, **kwargs)

    def leading(self) -> bool:
        """Whether this beat holds the lease now, renewing it or trying to take it."""
        if self.lease is not None and not self._renewed():
            self._step_down()
        if self.lease is None:
            self._try_to_lead()
        return self.lease is not None

    def _wait_for_the_lease(self) -> float:
        """A follower waits up to ``lease_ttl / 3`` for the lease to come free, then tries
        again: a store that wakes waiters on release (Redis, Consul, memory; SQLite
        polls) hands the lease over at once when the leader stops on SIGTERM. Returns
        how long beat should sleep before the next tick."""
        if self._store_down:
            return self.retry_interval
        started = runtime.monotonic()
        try:
            self.backend.wait(self.lease_key, self.retry_interval)
        except BackendUnavailable as exc:
            self._store_failed(exc)
            return self.retry_interval
        # A lease that looked free at once but went to another beat: do not spin.
        return max(0.0, MIN_RETRY - (runtime.monotonic() - started))

    def _leading_now(self) -> bool:
        return self.lease is not None and not self.lease.lost

    def _renewed(self) -> bool:
        """Renew the lease once per tick; False if the store says it is gone.

        An unreachable store is not proof of loss: the heartbeat flags the lease once
        it has gone unrenewed for a whole ttl, and meanwhile every send still needs a
        fenced write, which an unreachable store refuses.
        """
        lease = self.lease
        if lease.lost:
            return False
        try:
            lost = self.backend.renew([lease.grant])
        except BackendUnavailable as exc:
            logger.warning("beat: could not renew the leader lease %s: %s", lease.key, exc)
            return True
        if lost:
            lease.mark_lost("the store no longer has it (expired or taken)")
            return False
        return True

    def _try_to_lead(self) -> None:
        started = runtime.monotonic()
        try:
            lease = acquire(
                self.backend,
                self.lease_key,
                self.settings.lease_ttl,
                name=HOLDER_NAME,
                holder={"scheduler": _qualname(type(self.inner))},
            )
        except BackendUnavailable as exc:
            self._store_failed(exc)
            return
        self._store_answered()
        if lease is None:
            self._stand_by()
            return
        try:
            resumed = self._take_over(lease)
        except BackendUnavailable as exc:
            # Leading without knowing what was sent last could send a tick twice.
            logger.warning("beat: took the lease but cannot read the last ticks: %s", exc)
            lease.release()
            return
        except BaseException:
            lease.release()
            raise
        self.lease = lease
        self._standing_by = False
        self._heap = None  # ordered afresh from the entries as the records left them
        telemetry.beat_takeover(
            self.trace, lease.fencing_token, resumed, runtime.monotonic() - started
        )
        logger.info(
            "beat: leading as %s fencing_token=%s; caught up %d %s with the records",
            lease.key,
            lease.fencing_token,
            resumed,
            "entry" if resumed == 1 else "entries",
        )

    def _stand_by(self) -> None:
        """Say once, as this beat starts to stand by, which beat it waits for: an
        operator reading a quiet follower's log learns it is waiting, not stuck. Each
        later attempt to take the lease says nothing."""
        if self._standing_by:
            return
        self._standing_by = True
        logger.info(
            "beat: standing by: %s holds the leader lease %s; this beat leads when it is "
            "released or expires (it tries again at least every %.1fs)",
            self._leader(),
            self.lease_key,
            self.retry_interval,
        )

    def _leader(self) -> str:
        """The beat holding the lease, for people: ``celery beat on host (pid 123)``."""
        try:
            infos = self.backend.holders_of(self.lease_key)
        except BackendUnavailable:
            infos = []
        if not infos:
            return "another beat"
        holder = infos[0].holder
        return (
            f"{holder.get('task') or 'a beat'} on {holder.get('hostname') or 'an unknown host'} "
            f"(pid {holder.get('pid') or '?'})"
        )

    def _take_over(self, lease: HeldLease) -> int:
        """Set the inner scheduler up (first time only) and catch it up with the records.

        The inner scheduler's own idea of each entry's last run (a database row, a
        local schedule file) is only as fresh as its last sync by whichever beat led;
        the records are what every leader sent. What moves forward is written through
        to the inner scheduler's store.
        """
        if not self.inner_ready:
            baseline_changes(self.inner)
            self.inner.setup_schedule()
            self.inner_ready = True
        moved = []
        for entry in list(self.inner.schedule.values()):
            run = self._read_run(lease, entry.name)
            if run is not None and catch_up(entry, run):
                moved.append(entry)
        if moved:
            write_through(self.inner, moved)
        return len(moved)

    def _step_down(self) -> None:
        lease, self.lease = self.lease, None
        self._reserved = None
        heartbeat().discard(lease)
        logger.error(
            "beat: lost the leader lease %s (%s); this beat stops sending now and tries "
            "to take the lease again every %.1fs",
            lease.key,
            lease.lost_reason,
            self.retry_interval,
        )

    # --- the lease store ------------------------------------------------------------

    def _check_store(self) -> None:
        """Check the lease store once as beat starts (:func:`startup.check_stores`).

        A misconfiguration stops beat with one line saying what to fix; a store that
        does not answer yet gets one warning, and beat keeps trying to lead.
        """
        try:
            answered = startup.check_stores(
                self.app,
                [self.settings],
                "this beat sends nothing until it answers, and keeps trying to lead",
            )
        except ConfigurationError as exc:
            raise stop_beat(exc) from None
        self._store_down = not answered

    def _store_failed(self, exc: BackendUnavailable) -> None:
        """Say once per outage that the store does not answer (beat keeps trying)."""
        if self._store_down:
            logger.debug("beat: the lease store still does not answer: %s", exc)
            return
        self._store_down = True
        logger.warning(
            "beat: cannot reach the lease store, not sending; trying again every %.1fs: %s",
            self.retry_interval,
            exc,
        )

    def _store_answered(self) -> None:
        if self._store_down:
            self._store_down = False
            logger.info("beat: the lease store at %s answers again", self.backend.safe_url)

    def _read_run(self, lease: HeldLease, name: str) -> Optional[SentRun]:
        """The recorded last send of entry ``name``; None if there is none (or unreadable)."""
        value = self.backend.read_record(lease.key, name)
        if value is None:
            return None
        try:
            return SentRun.decode(value)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            logger.warning("beat: ignoring the unreadable record of %s=%r: %s", name, value, exc)
            return None

    # --- sending ------------------------------------------------------------------

    def apply_entry(self, entry: ScheduleEntry, producer=None) -> None:
        """Send ``entry`` only if its record admits the tick, recording it first."""
        reserved, self._reserved = self._reserved, None
        advanced = reserved[1] if reserved is not None and reserved[0] is entry else None
        token = self.lease.fencing_token if self.lease is not None else 0
        with telemetry.beat_send(entry.name, entry.task, token) as sending:
            claimed = self._claim(entry, advanced) and self._still_leading(entry)
            sending.set("exclusive.beat.sent", claimed)
            if claimed:
                self.inner.apply_entry(entry, producer=producer)
        # The inner scheduler's reserve() noted the run; store it now, not in minutes.
        if claimed and self._leading_now():
            write_through(self.inner, [advanced if advanced is not None else entry])

    def _claim(self, entry: ScheduleEntry, advanced: Optional[ScheduleEntry]) -> bool:
        """The compare-and-set before a send: True if this beat may send ``entry`` now.

        ``advanced`` is the entry as the inner scheduler's ``reserve()`` moved it on
        (its new last run and run count), when Celery's ``tick()`` reserved it first.
        """
        lease = self.lease
        if lease is None or lease.lost:
            if lease is not None:
                self._step_down()
            return False
        try:
            recorded = self._read_run(lease, entry.name)
            if recorded is not None and not self._admits(recorded, entry, advanced):
                return False
            run = SentRun(
                last_run_at=as_utc(advanced.last_run_at if advanced else entry.default_now()),
                total_run_count=max(
                    (recorded.total_run_count or 0) + 1 if recorded else 0,
                    total_run_count_of(advanced) if advanced else total_run_count_of(entry) + 1,
                ),
                fencing_token=lease.fencing_token,
            )
            written = self.backend.write_record(lease.grant, entry.name, run.encode())
        except BackendUnavailable as exc:
            logger.error(
                "beat: not sending %s: the lease store did not answer: %s", entry.name, exc
            )
            return False
        if not written:
            lease.mark_lost("a fenced write found that another beat holds it, or none does")
            self._step_down()
            return False
        if advanced is not None:
            adopt(advanced, total_run_count=run.total_run_count)
        return True

    def _still_leading(self, entry: ScheduleEntry) -> bool:
        """Whether the lease is still held as the send goes out, its record written. A
        beat held up past the lease's deadline since (stopped, or its store's answer
        late) may have been followed by another, which read the record and sent the
        ticks after it: this one is then lost, as a beat killed before its send loses
        it, rather than sent late, after later ones."""
        if self._leading_now():
            return True
        logger.error(
            "beat: not sending %s: this beat was held up past its lease's deadline after "
            "recording it; the tick is lost rather than sent late, after another beat's",
            entry.name,
        )
        self._step_down()
        return False

    def _admits(
        self, recorded: SentRun, entry: ScheduleEntry, advanced: Optional[ScheduleEntry]
    ) -> bool:
        """Whether the record lets this tick go; one it shows as sent is refused."""
        try:
            sent = already_sent(entry, recorded)
        except Exception as exc:  # the user's schedule class: whatever it raises
            # Not knowing is not sending; the ERROR recurs at every tick it does.
            logger.error(
                "beat: not sending %s: its schedule failed on the recorded run %s (%s: %s)",
                entry.name,
                recorded.last_run_at.isoformat(),
                type(exc).__name__,
                exc,
            )
            return False
        if sent:
            self._refuse(entry, advanced, recorded)
        return not sent

    def _refuse(
        self, entry: ScheduleEntry, advanced: Optional[ScheduleEntry], recorded: SentRun
    ) -> None:
        """Do not send; put the entry back where the record says it is, store included."""
        entries = [e for e in (entry, advanced) if e is not None]
        for stale in entries:
            adopt(stale, recorded.last_run_at, recorded.total_run_count)
        write_through(self.inner, entries)
        self._heap = None  # it was ordered by what the inner scheduler believed
        logger.info(
            "beat: not sending %s: its record shows it sent at %s (run %s, fencing_token=%s); "
            "the scheduler's copy was stale and now follows the record",
            entry.name,
            recorded.last_run_at.isoformat(),
            recorded.total_run_count,
            recorded.fencing_token,
        )

    # --- shutdown -------------------------------------------------------------------

    def close(self) -> None:
        """Store what this leader sent, hand the lease over at once, close the inner
        scheduler.

        Celery calls this on SIGTERM and again as beat exits; the second call does
        nothing. The store is synced before the lease goes: once another beat leads,
        this one's copy is no longer the latest.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.sync()
            self._hand_over()
        finally:
            try:
                super().close()
            finally:
                if self.inner_ready:
                    self.inner.close()

    def _hand_over(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None and not lease.lost:
            lease.release()
            logger.info("beat: released the leader lease %s", lease.key)


def stop_beat(exc: ConfigurationError) -> SystemExit:
    """What a misconfiguration found as beat starts becomes: beat exits with one line
    saying what to fix (a traceback through Celery's start-up adds nothing)."""
    return SystemExit(f"celery-exclusive: {type(exc).__name__}: {exc}")


def beat_settings(app) -> config.Settings:
    """The beat's settings: ``exclusive_beat_<name>`` wins over ``exclusive_<name>``.

    So ``exclusive_beat_lease_ttl`` or ``exclusive_beat_backend_url`` can differ from
    what the tasks use.
    """
    conf = app.conf
    written = app_settings.AppSettings(conf)

    def describe(name: str, value: Any) -> str:
        key = f"exclusive_beat_{name}"
        key = key if conf.get(key) is not None else config.setting_name(name)
        return f"{written.given_as(key)}={value!r}"  # as the configuration spells it

    return config.resolve(
        HOLDER_NAME,
        lambda name: conf.get(f"exclusive_beat_{name}"),
        lambda name: conf.get(config.setting_name(name)),
        broker_url=conf.broker_url,
        app_name=app.main,
        describe=describe,
    )


def lease_key(app, settings: config.Settings) -> str:
    """``<key_prefix>beat:<exclusive_beat_key or the app's main name>``."""
    name = app.conf.get("exclusive_beat_key") or app.main or "celery"
    if not isinstance(name, str):
        raise ConfigurationError(
            f"exclusive_beat_key={name!r} is not allowed; use a string such as 'billing'."
        )
    return f"{settings.key_prefix}beat:{name}"


def inner_scheduler_class(app) -> type:
    """The scheduler class named by ``exclusive_beat_scheduler`` (a dotted path or alias)."""
    name = app.conf.get("exclusive_beat_scheduler") or DEFAULT_INNER_SCHEDULER
    if isinstance(name, type):
        cls = name
    else:
        aliases = dict(load_extension_class_names("celery.beat_schedulers"))
        try:
            cls = symbol_by_name(name, aliases=aliases)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigurationError(
                f"exclusive_beat_scheduler={name!r} cannot be imported ({exc}); use the "
                "dotted path of a beat scheduler class, such as "
                "'django_celery_beat.schedulers:DatabaseScheduler'."
            ) from None
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)) or issubclass(
        cls, LeaderScheduler
    ):
        raise ConfigurationError(
            f"exclusive_beat_scheduler={name!r} is not allowed; name a celery.beat.Scheduler "
            "subclass other than LeaderScheduler, such as 'celery.beat:PersistentScheduler'."
        )
    return cls


def _backend_with_records(url: str) -> Backend:
    backend = backend_for_url(url)
    if not backend.capabilities.records:
        raise ConfigurationError(
            f"the lease store at {backend.safe_url} cannot keep the beat's records yet; "
            "set exclusive_beat_backend_url to a redis:// or sqlite:// store."
        )
    return backend


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"
