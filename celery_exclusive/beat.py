"""Leader-elected ``celery beat``: run beat on several hosts, only one of them sends.

::

    app.conf.beat_scheduler = "exclusive"  # or "celery_exclusive.beat:LeaderScheduler"
    app.conf.exclusive_beat_scheduler = "django_celery_beat.schedulers:DatabaseScheduler"

Every beat process wraps its own instance of the scheduler users already have (the
*inner* scheduler, ``celery.beat:PersistentScheduler`` unless
``exclusive_beat_scheduler`` names another), so the schedule keeps coming from where
it always came from. Only the beat holding the lease ``<key_prefix>beat:<app name>``
sends; the others try to take it every ``lease_ttl / 3``.

Exactly-once ticks across a failover rest on one fenced write per send: before it
sends an entry, the leader stores the entry's run time in a record that only the
lease holder can write, in the same atomic step that checks the lease. A refused
write proves the lease is gone, so that beat sends nothing more. A beat that takes
over first reads these records back into its inner scheduler's entries and carries
on from the last tick actually sent: nothing is sent twice, and a tick that fell in
the failover window is handled by the entry's own schedule (Celery runs a late entry
once; it never replays every missed tick).

The record is written before the message is published, so a beat killed between the
two loses that one tick rather than letting the next leader send it a second time.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from typing import Any, Optional

from celery.beat import ScheduleEntry, Scheduler
from celery.utils.imports import load_extension_class_names, symbol_by_name

from . import config
from .backends import Backend, backend_for_url
from .errors import BackendUnavailable, ConfigurationError
from .lease import HeldLease, acquire, heartbeat

logger = logging.getLogger("celery_exclusive")

#: The scheduler wrapped when ``exclusive_beat_scheduler`` is not set: Celery's own.
DEFAULT_INNER_SCHEDULER = "celery.beat:PersistentScheduler"
#: What ``holders()`` shows as the "task" of the leading beat.
HOLDER_NAME = "celery beat"


class LeaderScheduler(Scheduler):
    """A beat scheduler that sends only while it holds the beat's lease.

    Celery's own ``tick()`` runs unchanged on top of the inner scheduler's entries:
    this class hands it the inner scheduler's schedule, ``is_due``, ``reserve`` and
    ``sync``, and puts the lease check and the fenced record in ``apply_entry``,
    the one place every send goes through.
    """

    def __init__(self, app, *args: Any, lazy: bool = False, **kwargs: Any) -> None:
        # The inner scheduler is built lazily and set up by our setup_schedule(),
        # which Scheduler.__init__ calls unless this instance is lazy too.
        self.inner: Scheduler = inner_scheduler_class(app)(app, *args, lazy=True, **kwargs)
        self.settings = beat_settings(app)
        self.lease_key = lease_key(app, self.settings)
        self.retry_interval = self.settings.lease_ttl / 3
        self.lease: Optional[HeldLease] = None
        self.backend = _backend_with_records(self.settings.backend_url)
        super().__init__(app, *args, lazy=lazy, **kwargs)
        self.max_interval = self.inner.max_interval

    # --- the inner scheduler is the schedule source ------------------------------

    @property
    def schedule(self) -> dict:
        return self.inner.schedule

    @schedule.setter
    def schedule(self, schedule: dict) -> None:
        self.inner.schedule = schedule

    def setup_schedule(self) -> None:
        self.inner.setup_schedule()

    def is_due(self, entry: ScheduleEntry):
        return self.inner.is_due(entry)

    def reserve(self, entry: ScheduleEntry) -> ScheduleEntry:
        return self.inner.reserve(entry)

    def schedules_equal(self, old_schedules, new_schedules) -> bool:
        # Delegated so a scheduler that flags its own changes (a database one) is heard.
        return self.inner.schedules_equal(old_schedules, new_schedules)

    def sync(self) -> None:
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
        """One pass of Celery's scheduler if this beat leads; else the time to retry."""
        if not self.leading():
            return self.retry_interval
        return super().tick(*args, **kwargs)

    def leading(self) -> bool:
        """Whether this beat holds the lease now, renewing it or trying to take it."""
        if self.lease is not None and not self._renewed():
            self._step_down()
        if self.lease is None:
            self._try_to_lead()
        return self.lease is not None

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
        try:
            lease = acquire(
                self.backend,
                self.lease_key,
                self.settings.lease_ttl,
                name=HOLDER_NAME,
                holder={"scheduler": _qualname(type(self.inner))},
            )
        except BackendUnavailable as exc:
            logger.warning(
                "beat: cannot reach the lease store, not sending; retrying in %.1fs: %s",
                self.retry_interval,
                exc,
            )
            return
        if lease is None:
            return
        try:
            resumed = self._resume_from_records(lease)
        except BackendUnavailable as exc:
            # Leading without knowing what was sent last could send a tick twice.
            logger.warning("beat: took the lease but cannot read the last ticks: %s", exc)
            lease.release()
            return
        self.lease = lease
        logger.info(
            "beat: leading as %s fencing_token=%s, resumed %d entries from the last ticks sent",
            lease.key,
            lease.fencing_token,
            resumed,
        )
        self.populate_heap()

    def _resume_from_records(self, lease: HeldLease) -> int:
        """Make each entry's last run the one the previous leaders recorded.

        The inner scheduler's own idea of the last run (a local schedule file) is
        only what this process sent; the records are what every leader sent.
        """
        resumed = 0
        for entry in self.schedule.values():
            key = self.record_key(entry.name)
            value = self.backend.read_record(key)
            if value is None:
                continue
            try:
                entry.last_run_at = _parse_run_time(value, entry)
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("beat: ignoring the unreadable record %s=%r: %s", key, value, exc)
                continue
            resumed += 1
        return resumed

    def _step_down(self) -> None:
        lease, self.lease = self.lease, None
        heartbeat().discard(lease)
        logger.error(
            "beat: lost the leader lease %s (%s); this beat stops sending now and tries "
            "to take the lease again every %.1fs",
            lease.key,
            lease.lost_reason,
            self.retry_interval,
        )

    # --- sending ------------------------------------------------------------------

    def apply_entry(self, entry: ScheduleEntry, producer=None) -> None:
        """Send ``entry`` only after recording its run under the lease."""
        if self._record_run(entry):
            self.inner.apply_entry(entry, producer=producer)

    def record_key(self, entry_name: str) -> str:
        return f"{self.lease_key}:last-run:{entry_name}"

    def _record_run(self, entry: ScheduleEntry) -> bool:
        """The fenced write before a send: True only if this beat still leads."""
        lease = self.lease
        if lease is None or lease.lost:
            if lease is not None:
                self._step_down()
            return False
        value = json.dumps(
            {"last_run_at": entry.default_now().isoformat(), "fencing_token": lease.fencing_token}
        )
        try:
            written = self.backend.write_record(lease.grant, self.record_key(entry.name), value)
        except BackendUnavailable as exc:
            logger.error(
                "beat: not sending %s, the lease store did not answer: %s", entry.name, exc
            )
            return False
        if not written:
            lease.mark_lost("a fenced write found that another beat holds it, or none does")
            self._step_down()
        return written

    # --- shutdown -------------------------------------------------------------------

    def close(self) -> None:
        """Hand the lease over at once, then close the inner scheduler.

        Celery calls this on SIGTERM and again as beat exits; both must be safe.
        """
        try:
            self._hand_over()
        finally:
            try:
                super().close()
            finally:
                self.inner.close()

    def _hand_over(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None and not lease.lost:
            lease.release()
            logger.info("beat: released the leader lease %s", lease.key)


def beat_settings(app) -> config.Settings:
    """The beat's settings: ``exclusive_beat_<name>`` wins over ``exclusive_<name>``.

    So ``exclusive_beat_lease_ttl`` or ``exclusive_beat_backend_url`` can differ from
    what the tasks use.
    """
    conf = app.conf
    return config.resolve(
        HOLDER_NAME,
        lambda name: conf.get(f"exclusive_beat_{name}"),
        lambda name: conf.get(config.setting_name(name)),
        broker_url=conf.broker_url,
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
    if not backend.stores_records:
        raise ConfigurationError(
            f"the lease store at {backend.safe_url} cannot keep the beat's records yet; "
            "set exclusive_beat_backend_url to a redis:// or sqlite:// store."
        )
    return backend


def _parse_run_time(value: str, entry: ScheduleEntry) -> datetime:
    """A recorded run time, in the time zone the entry's schedule works in."""
    run_at = datetime.fromisoformat(json.loads(value)["last_run_at"])
    tz = entry.default_now().tzinfo
    return run_at.astimezone(tz) if tz is not None else run_at.astimezone().replace(tzinfo=None)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"
