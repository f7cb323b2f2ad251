"""A lock for any code: the lease a task with the same key takes, for a ``with`` block.

A Django view, a management command, a cron script or an asyncio service takes the
very lease a task (or RQ job) with that key would take: the same key, prefix and
store, renewed by the process's heartbeat, with a fencing token from the same counter
and the same ``lease_acquired``, ``lease_released`` and ``lease_lost`` signals. So
the block and the task exclude each other::

    with settle.exclusive_lock(invoice_id=7) as lease:   # the key settle.delay(7) takes
        invoice.settle(fence=lease.fencing_token)

    async with exclusive_lock("invoice:7", app=app).waiting(5) as lease:
        ...

    @exclusive_lock("nightly-report", app=app)
    def rebuild_report(): ...

What happens when the key is held is said by the caller, never a setting: by default
entering raises :class:`~celery_exclusive.errors.LockHeld` at once, naming the
holder; ``wait=`` (or ``.waiting(seconds)``) stands in the key's line, first come
first served with the tasks waiting for it, and raises ``LockHeld`` if the key is
still held after that many seconds. The store not answering raises
:class:`~celery_exclusive.errors.BackendUnavailable`: a block never runs unlocked.

A lease lost inside the block (the store lost it, an operator freed it, the process
was paused past its ttl) interrupts nothing: a web server's or an event loop's
threads and signals are not the library's to take. The loss is logged, ``lease_lost``
is sent, ``lease.lost`` turns True and ``lease.ensure_held()`` raises
:class:`~celery_exclusive.errors.LeaseLost`; call it before each write. A block that
ends normally after its lease was lost raises ``LeaseLost`` as it exits, since its
work may have run beside the next holder.

A lock object is reusable and may be entered by many threads and asyncio tasks at
once: each entry takes a lease of its own. It is not re-entrant: entering a key the
same thread (or asyncio task) already holds through a lock raises at once, instead
of waiting for itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import inspect
from contextvars import ContextVar
from typing import Any, Callable, Optional, TypeVar

from .. import runtime, telemetry
from ..backends import Backend, backend_for_url, versions
from ..errors import (
    BackendUnavailable,
    ConfigurationError,
    ExclusiveError,
    LeaseLost,
    LockHeld,
)
from . import holders, policies
from .config import TRACE_KEYS, Settings, TraceKeys
from .lease import HeldLease, acquire

F = TypeVar("F", bound=Callable[..., Any])

#: What a lock writes beside its grant, so that a duplicate can say who holds the key.
LOCK_RECORD = {"lock": True}

#: The leases locks hold in this context, innermost last: (lock, lease, entered by).
_entered: ContextVar[tuple[tuple[ExclusiveLock, HeldLease, int], ...]] = ContextVar(
    "exclusive_locks_entered", default=()
)


@dataclasses.dataclass(frozen=True)
class ExclusiveLock:
    """The lease on ``key`` (the full store key, prefix included) in the store at
    ``backend_url``, for a ``with`` or ``async with`` block or a decorated function.

    ``ttl`` and ``limit`` must be those of the tasks sharing the key (a task's
    ``exclusive_lock()`` takes them from the task). ``wait`` is how long entering
    waits for a held key, in seconds; 0 raises at once. ``name`` is what signals are
    sent with as ``sender`` and what a duplicate names: the task's name for a task's
    lock. ``trace_keys`` is what OpenTelemetry spans show of the key, as the setting
    ``exclusive_trace_keys`` says; ``key_prefix`` is the part of the key its
    ``"prefix"`` choice shows.
    """

    key: str
    backend_url: str
    ttl: float = 30.0
    limit: int = 1
    wait: float = 0.0
    name: str = ""
    trace_keys: TraceKeys = "hash"
    key_prefix: str = ""

    def __post_init__(self) -> None:
        def bad(field: str, allowed: str) -> ConfigurationError:
            value = getattr(self, field)
            return ConfigurationError(
                f"exclusive lock of {self.key!r}: {field}={value!r} is not allowed; {allowed}."
            )

        if not _number(self.ttl) or self.ttl <= 0:
            raise bad("ttl", "use the lease_ttl of the tasks sharing the key, in seconds")
        if not _number(self.wait) or self.wait < 0:
            raise bad("wait", "use 0 (do not wait) or more seconds")
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise bad("limit", "use the exclusive_limit of the tasks sharing the key (1 or more)")
        if self.trace_keys not in TRACE_KEYS:
            raise bad("trace_keys", "use one of " + ", ".join(repr(c) for c in TRACE_KEYS))
        if not self.name:
            object.__setattr__(self, "name", self.key)

    def waiting(self, seconds: float) -> ExclusiveLock:
        """This lock, waiting up to ``seconds`` for a held key before it raises."""
        return dataclasses.replace(self, wait=seconds)

    @property
    def lease(self) -> Optional[HeldLease]:
        """The lease this lock holds in the running thread or asyncio task (the
        innermost entry), for a decorated function's body; None outside."""
        for lock, lease, _ in reversed(_entered.get()):
            if lock == self:
                return lease
        return None

    # --- taking and giving back ---------------------------------------------------------

    def acquire(self) -> HeldLease:
        """Take the lease, or wait for it up to ``wait`` seconds; raise
        :class:`LockHeld` naming the holder if it stays held.

        The lease is renewed by the process's heartbeat until :meth:`HeldLease.release`.
        Entering the lock calls this and releases on exit: prefer ``with``.
        """
        self._refuse_reentry()
        return self._take(own_span=False)  # its end is the caller's: no span to end then

    def _take(self, own_span: bool = True) -> HeldLease:
        trace = telemetry.call(
            None if self.key.endswith(self.name) else self.name,  # a name that is the key
            self.key,
            self.backend_url,
            "wait" if self.wait > 0 else "raise",
            self.limit,
            self.key_prefix,
            self.trace_keys,
            own_name="exclusive.lock",
        )
        # Not made current: the block may end in another thread (``async with``).
        trace.begin(attach=False, own=own_span)
        try:
            with trace.acquiring():
                backend = backend_for_url(self.backend_url)
                try:
                    lease = self._acquire(backend)
                except BackendUnavailable as exc:
                    raise self._unanswered(exc) from None
                trace.claimed("granted" if lease is not None else "held")
                if lease is None:
                    raise self._held(backend)
        except BaseException as exc:
            trace.end(exc)
            raise
        return lease

    def _unanswered(self, exc: BackendUnavailable) -> BackendUnavailable:
        """The store's error, said of this lock: its block does not run, as no
        ``on_backend_error`` applies to a lock (a task's setting, not a lock's)."""
        return BackendUnavailable(
            f"the exclusive lock of {self.name} could not be taken: its key {self.key!r} "
            f"went unanswered: {exc} Its block never runs without the lease: try again "
            "once the store answers.",
            exc.url,
        )

    def _acquire(self, backend: Backend) -> Optional[HeldLease]:
        versions.ensure(backend, self.key_prefix)
        lease = acquire(backend, self.key, self.ttl, self.limit, self.name, holder=LOCK_RECORD)
        if lease is None and self.wait > 0:
            settings = Settings(
                backend_url=self.backend_url,
                lease_ttl=self.ttl,
                limit=self.limit,
                wait_timeout=self.wait,
            )
            lease = policies.wait_for(
                settings, backend, self.key, self.name, None, holder=LOCK_RECORD
            )
        return lease

    def _held(self, backend: Backend) -> LockHeld:
        infos = backend.holders_of(self.key)
        task_id = next((info.task_id for info in infos if info.task_id), None)
        holder = holders.first_described(infos) or holders.NOBODY
        waited = f" for {self.wait:g}s" if self.wait else ""
        return LockHeld(
            f"the exclusive lock of {self.name} could not be taken: its key {self.key!r} "
            f"stayed held{waited} by {holder}. Wait for it with .waiting(seconds), or try "
            "again later.",
            self.key,
            task_id,
            holder,
        )

    def _refuse_reentry(self) -> None:
        me, taken = _caller(), (self.key, self.backend_url)
        for lock, lease, entered_by in _entered.get():
            if entered_by == me and (lock.key, lock.backend_url) == taken and lease.held:
                raise ExclusiveError(
                    f"the exclusive lock of {self.name} is entered again by the thread "
                    f"(or asyncio task) that holds it, on {self.key!r}: exclusive locks "
                    "are not re-entrant, and waiting for itself would only time out."
                )

    def _push(self, lease: HeldLease) -> None:
        _entered.set((*_entered.get(), (self, lease, _caller())))

    def _pop(self) -> HeldLease:
        entries = list(_entered.get())
        for i in range(len(entries) - 1, -1, -1):
            if entries[i][0] == self:
                lease = entries.pop(i)[1]
                _entered.set(tuple(entries))
                return lease
        raise RuntimeError(f"the exclusive lock of {self.key!r} was exited without being entered")

    def _ended(self, lease: HeldLease, failed: bool) -> None:
        """After the release: a block that ended normally under a lease lost meanwhile
        raises LeaseLost, as its work may have run beside the next holder."""
        if lease.lost and not failed:
            raise LeaseLost(
                f"the exclusive lock of {self.name} on {self.key!r} was lost while its block "
                f"ran ({lease.lost_reason}); another holder may have run beside it. Call "
                "lease.ensure_held() before each write to stop sooner.",
                self.key,
                self.name,
            )

    # --- with ---------------------------------------------------------------------------

    def __enter__(self) -> HeldLease:
        self._refuse_reentry()
        lease = self._take()
        self._push(lease)
        return lease

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        lease = self._pop()
        try:
            lease.release()
            self._ended(lease, exc_type is not None)
        except BaseException as error:
            lease.trace.end(error)
            raise
        lease.trace.end(exc)

    # --- async with ---------------------------------------------------------------------

    async def __aenter__(self) -> HeldLease:
        # The stores' clients block: taking (and waiting for) the lease runs in a thread,
        # never in the event loop.
        self._refuse_reentry()
        # In this context (its current span, for the traces), in a thread.
        take = contextvars.copy_context().run
        taking = asyncio.get_running_loop().run_in_executor(None, take, self._take)
        try:
            lease = await asyncio.shield(taking)
        except asyncio.CancelledError:
            # Cancelled while the thread takes the lease: whatever it gets goes back.
            taking.add_done_callback(_release_if_granted)
            raise
        self._push(lease)
        return lease

    async def __aexit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        lease = self._pop()
        releasing = asyncio.get_running_loop().run_in_executor(None, lease.release)
        try:
            try:
                await asyncio.shield(releasing)  # cancelled or not, the release goes out
            finally:
                self._ended(lease, exc_type is not None)
        except BaseException as error:
            lease.trace.end(error)
            raise
        lease.trace.end(exc)

    # --- as a decorator -----------------------------------------------------------------

    def __call__(self, function: F) -> F:
        """Run every call of ``function`` under a lease of its own (``async with`` for a
        coroutine function); the body finds it as ``lock.lease``."""
        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def locked_async(*args: Any, **kwargs: Any) -> Any:
                async with self:
                    return await function(*args, **kwargs)

            return locked_async  # type: ignore[return-value]

        @functools.wraps(function)
        def locked(*args: Any, **kwargs: Any) -> Any:
            with self:
                return function(*args, **kwargs)

        return locked  # type: ignore[return-value]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _caller() -> int:
    """Who enters a lock: the running asyncio task, else the thread."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop in this thread
        task = None
    return id(task) if task is not None else runtime.get_ident()


def _release_if_granted(taking: asyncio.Future) -> None:
    if not taking.cancelled() and taking.exception() is None:
        lease = taking.result()
        lease.release()
        lease.trace.end()
