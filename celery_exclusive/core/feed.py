"""The feed: what workers report for operators to watch, kept in the lease store.

An operator asking "why didn't my task run?" wants to see the duplicates that were
skipped, requeued or coalesced, and the leases that were lost, as they happen, on
whichever host they happen. Each worker process notes such events here and a thread
of its own sends them to the store in batches (:func:`append_events`), into a
feed per key prefix that the web view reads (:func:`read_events`): a log of the store's
own where it has one (``Capabilities.event_log``, a Redis stream), else one mark.

Nothing of it is on the path of a call that gets its key: that call pays one
dictionary lookup. A duplicate or a loss pays a JSON encoding and a list append; the
store round trip is the thread's. Everything is bounded: the store keeps the newest
:data:`CAPACITY` events of a feed for :data:`TTL` seconds after the last was added, a
process buffers at most :data:`BUFFER` per feed while its store does not answer, and
what it had to drop is reported as one ``missed`` event once the store answers again.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import runtime
from ..errors import BackendUnavailable, ExclusiveError
from .outcomes import Coalesced, Requeue, Skipped
from .per_process import PerProcess

if TYPE_CHECKING:
    from ..backends import Backend
    from .lease import HeldLease

logger = logging.getLogger("celery_exclusive")

#: Events a store keeps per feed, the newest.
CAPACITY = 500
#: Seconds a feed lives after its last event was added.
TTL = 24 * 3600.0
#: Events a process keeps per feed while its store does not answer.
BUFFER = 1000
#: Seconds the thread waits after an event for others to join its batch.
FLUSH_DELAY = 0.2
#: Seconds between attempts while the store does not answer: doubling up to the last.
RETRY_FIRST, RETRY_MAX = 1.0, 30.0

#: The outcomes of ``policies.claim`` that are reported, and the field naming whom the
#: duplicate yielded to: a task id (a holder that is no task is named in words, in the
#: event's ``holder``).
OUTCOMES: dict[type, tuple[str, str]] = {
    Skipped: ("skipped", "holder_task_id"),
    Requeue: ("requeued", "holder_task_id"),
    Coalesced: ("coalesced", "rerun_task_id"),
}

HOSTNAME = socket.gethostname()


class Feed:
    """This process's buffer of events, and the thread that sends them."""

    def __init__(self) -> None:
        self.pid = runtime.getpid()
        self._lock = runtime.Lock()
        #: (store, feed) -> events not sent yet, oldest first.
        self._pending: dict[tuple[Backend, str], deque[str]] = {}
        #: (store, feed) -> events dropped from a full buffer since the last send.
        self._missed: dict[tuple[Backend, str], int] = {}
        self._wake = runtime.Event()
        self._thread: Optional[threading.Thread] = None

    def note(self, backend: Backend, feed: str, kind: str, key: str, **fields: Any) -> None:
        """Queue one event of ``kind`` about ``key`` for the feed ``feed`` of ``backend``."""
        event = json.dumps(
            {
                "id": os.urandom(8).hex(),
                "at": runtime.wall(),
                "kind": kind,
                "key": key,
                "host": HOSTNAME,
                "pid": self.pid,
                **fields,
            }
        )
        with self._lock:
            queue = self._pending.setdefault((backend, feed), deque())
            if len(queue) >= BUFFER:
                queue.popleft()
                self._missed[(backend, feed)] = self._missed.get((backend, feed), 0) + 1
            queue.append(event)
            if self._thread is None:
                self._thread = runtime.Thread(
                    target=self._run, name="celery-exclusive-feed", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def flush(self) -> bool:
        """Send every queued event now; False if a store did not take them (they stay
        queued, as far as the buffer allows)."""
        with self._lock:
            batches, self._pending = self._pending, {}
            missed, self._missed = self._missed, {}
        sent = True
        for (backend, feed), queue in batches.items():
            events = list(queue)
            dropped = missed.get((backend, feed), 0)
            if dropped:
                events.insert(0, _missed_event(dropped, self.pid))
            try:
                append_events(backend, feed, events, CAPACITY, TTL)
            except ExclusiveError as exc:
                sent = False
                logger.debug("feed: %d event(s) not sent yet: %s", len(events), exc)
                self._requeue(backend, feed, queue, dropped)
            except Exception:  # a store's bug must not end the thread, nor be silent
                sent = False
                logger.exception("feed: %d event(s) could not be sent", len(events))
        return sent

    def _requeue(self, backend: Backend, feed: str, events: deque[str], dropped: int) -> None:
        with self._lock:
            newer = self._pending.get((backend, feed), deque())
            queue = deque(events)
            queue.extend(newer)
            overflow = max(0, len(queue) - BUFFER)
            for _ in range(overflow):
                queue.popleft()
            self._pending[(backend, feed)] = queue
            lost = dropped + overflow + self._missed.get((backend, feed), 0)
            if lost:
                self._missed[(backend, feed)] = lost

    def _run(self) -> None:
        retry = RETRY_FIRST
        while True:
            self._wake.wait()
            runtime.sleep(FLUSH_DELAY)  # let a burst join one batch
            self._wake.clear()
            if self.flush():
                retry = RETRY_FIRST
                continue
            self._wake.wait(retry)  # a new event does not hurry a store that is down
            retry = min(retry * 2, RETRY_MAX)
            self._wake.set()


def _missed_event(count: int, pid: int) -> str:
    return json.dumps(
        {
            "id": os.urandom(8).hex(),
            "at": runtime.wall(),
            "kind": "missed",
            "count": count,
            "host": HOSTNAME,
            "pid": pid,
        }
    )


#: This process's feed; a forked child gets a fresh one (threads do not fork).
feed = PerProcess(Feed)


@atexit.register
def _flush_at_exit() -> None:
    """A process that ends normally sends what it still holds (once, no retry)."""
    current = feed.made_here()
    if current is not None:
        current.flush()


def reported(claim: Callable[..., Any]) -> Callable[..., Any]:
    """Report the duplicate outcomes of ``claim`` (``policies.claim``) to the feed of
    the call's key prefix, and a loss of the lease it grants, once it is found."""

    @functools.wraps(claim)
    def claim_reported(
        settings: Any,
        backend: Backend,
        key: str,
        name: str,
        task_id: Optional[str],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        outcome = claim(settings, backend, key, name, task_id, *args, **kwargs)
        reported_as = OUTCOMES.get(type(outcome))
        if reported_as is not None:
            kind, whom = reported_as
            fields = {"task": name, "task_id": task_id, "other": getattr(outcome, whom, None)}
            if getattr(outcome, "holder", None):
                fields["holder"] = outcome.holder  # a lock, a foreign client (holders.py)
            if kind == "requeued":
                fields["countdown"] = round(outcome.countdown, 3)
            feed().note(backend, settings.key_prefix, kind, key, **fields)
        else:
            lease = getattr(outcome, "lease", None)
            if lease is not None:
                lease.on_loss(functools.partial(_lost, settings.key_prefix))
        return outcome

    return claim_reported


def _lost(prefix: str, lease: HeldLease) -> None:
    """A loss listener: runs in the thread that found the loss, so it only queues."""
    feed().note(
        lease.backend,
        prefix,
        "lost",
        lease.key,
        task=lease.name,
        task_id=lease.task_id,
        fencing_token=lease.fencing_token,
        reason=lease.lost_reason,
    )


#: The kind of the mark that keeps a feed of events where a store has no log.
FEED = "feed"
#: Compare-and-swap attempts to add to such a feed before the store counts as too busy.
EVENT_ATTEMPTS = 20


def append_events(
    backend: Backend, feed: str, events: Sequence[str], capacity: int, ttl: float
) -> None:
    """Add ``events`` (short strings, oldest first) to the feed ``feed`` in one step,
    keeping only its newest ``capacity`` events, all of them gone ``ttl`` seconds after
    the last append. ``feed`` is a key of the library's own (the key prefix), so the
    store keeps it where the key prefix's permissions reach.

    In the store's own log where it has one; else as one mark, a JSON array, changed by
    compare-and-swap."""
    if backend.capabilities.event_log:
        backend.connection.append_events(feed, events, capacity, ttl)
        return
    for _ in range(EVENT_ATTEMPTS):
        current = backend.read_mark(feed, FEED)
        kept = _events_of(current) + list(events)
        new = json.dumps(kept[-capacity:]) if capacity > 0 else None
        if backend.swap_mark(feed, FEED, current, new, ttl):
            return
    raise BackendUnavailable(
        f"the feed of {feed!r} in {backend.safe_url} kept changing under {EVENT_ATTEMPTS} "
        "attempts to add to it.",
        backend.safe_url,
    )


def read_events(backend: Backend, feed: str) -> list[str]:
    """The events of the feed ``feed`` (see :func:`append_events`), oldest first."""
    if backend.capabilities.event_log:
        return backend.connection.read_events(feed)
    return _events_of(backend.read_mark(feed, FEED))


def _events_of(value: Optional[str]) -> list[str]:
    """The events a feed mark holds; an absent or unreadable one holds none."""
    try:
        events = json.loads(value) if value else []
    except ValueError:
        return []
    return [event for event in events if isinstance(event, str)] if isinstance(events, list) else []
