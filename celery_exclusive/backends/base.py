"""The backend protocol: what every lease store offers, one atomic round trip per call.

A backend knows nothing of Celery or RQ. It grants, renews and releases leases on
string keys (already namespaced by the caller), and answers who holds what for the
CLI. Every store error leaves a backend as :class:`BackendUnavailable`; a backend
never lets a client library's exception escape.
"""

from __future__ import annotations

import abc
import contextlib
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import urlsplit, urlunsplit

from ..errors import BackendUnavailable, ExclusiveError


@dataclass(frozen=True)
class Lease:
    """One grant of one key to one owner.

    ``owner`` is a random token private to the holder: release and renew compare it,
    so nobody can free or extend a lease they do not hold. ``fencing_token`` strictly
    increases with every grant of the key; pass it to the storage the task writes so
    that storage can refuse a writer whose lease has since been granted again.
    """

    key: str
    owner: str
    fencing_token: int
    ttl: float
    limit: int = 1


@dataclass(frozen=True)
class LeaseInfo:
    """What the store says about a current holder, for ``holders()`` and the CLI."""

    key: str
    owner: str
    fencing_token: Optional[int]
    expires_in: Optional[float]
    holder: Mapping[str, Any] = field(default_factory=dict)

    @property
    def task_id(self) -> Optional[str]:
        return self.holder.get("task_id")

    @property
    def age(self) -> Optional[float]:
        acquired_at = self.holder.get("acquired_at")
        return None if acquired_at is None else max(0.0, time.time() - acquired_at)


class Backend(abc.ABC):
    """A lease store. Subclasses register a URL scheme in ``backends/__init__.py``."""

    #: Whether ``wait()`` is woken by the store (True) or polls it (False).
    pushes_wakeups: bool = False

    def __init__(self, url: str) -> None:
        self.url = url

    @property
    def safe_url(self) -> str:
        """The URL with any password replaced, fit for logs and error messages."""
        return redact_url(self.url)

    @abc.abstractmethod
    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
    ) -> Optional[Lease]:
        """Grant ``key`` to ``owner`` for ``ttl`` seconds if fewer than ``limit`` hold it.

        ``holder`` is stored beside the lease for ``holders()`` (task id, hostname,
        pid, acquired_at). Returns None when the key is full.

        The key's line (its mark of kind :data:`~.line.LINE`) decides who may
        take a free slot: ``claimant`` only if it stands among the first free entries
        (see :func:`~.line.admit`), and the grant takes it out of the line. The check
        and the grant are one atomic step, so nobody slips in ahead of the line.
        """

    def try_acquire_and_read_mark(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int,
        holder: Optional[Mapping[str, Any]],
        claimant: Optional[str],
        mark: tuple[str, str],
    ) -> tuple[Optional[Lease], Optional[str]]:
        """:meth:`try_acquire`, then, if it granted, :meth:`read_mark` of ``mark`` (a
        ``(key, kind)`` pair); ``(None, None)`` when it did not grant.

        A call that may be a second copy of its message reads, as it takes the key,
        whether its attempt already ran to the end. The read comes after the grant,
        so it sees what the previous holder wrote before it released. A store that can
        send both in one round trip, in that order, overrides this.
        """
        grant = self.try_acquire(key, owner, ttl, limit, holder, claimant=claimant)
        if grant is None:
            return None, None
        try:
            return grant, self.read_mark(*mark)
        except ExclusiveError:
            self.give_back(grant)
            raise

    def give_back(self, grant: Lease) -> None:
        """Release a grant nobody will run under, as well as the store lets: after a
        failure that keeps its caller from using it. A release that fails too leaves it
        to expire."""
        with contextlib.suppress(ExclusiveError):
            self.release(grant)

    @abc.abstractmethod
    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        """Extend every lease by its ttl in one round trip; return those found lost."""

    @abc.abstractmethod
    def release(self, lease: Lease) -> bool:
        """Free ``lease`` if its owner still holds it. Idempotent; True if it was freed."""

    def swap_mark_and_release(
        self,
        lease: Lease,
        mark: tuple[str, str],
        expected: Optional[str],
        new: str,
        ttl: float,
    ) -> Optional[bool]:
        """Set the mark ``mark`` (a ``(key, kind)`` pair) to ``new`` for ``ttl`` seconds
        if it holds ``expected`` (None: absent), then :meth:`release` ``lease``.

        Returns what the release returns; None if the mark held something else, and
        then nothing changed: ``lease`` is still held. A mark that already holds ``new``
        counts as set (a call sent again after its answer was lost finds its own
        write). An attempt that must be recorded as ended before its key is free ends
        this way. A store that can do both in one round trip, in that order, overrides
        this.
        """
        key, kind = mark
        if not self.swap_mark(key, kind, expected, new, ttl) and self.read_mark(key, kind) != new:
            return None
        return self.release(lease)

    @abc.abstractmethod
    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        """Block until ``key`` may have a slot free for ``claimant``, or ``timeout`` passes.

        Free for ``claimant``: a slot is free and the key's line does not put anyone
        ahead of it. A store that wakes one waiter per release wakes the first in line.
        Returning is a hint, not a grant: the caller tries to acquire next.
        """

    @abc.abstractmethod
    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        """Every live lease whose key starts with ``prefix``."""

    def holders_of(self, key: str) -> list[LeaseInfo]:
        """The live leases on exactly ``key``. Stores with a direct lookup override this."""
        return [info for info in self.holders(key) if info.key == key]

    @abc.abstractmethod
    def force_release(self, key: str) -> int:
        """Free every lease on ``key`` whoever holds it (operators only). Returns how many."""

    #: Whether ``read_record`` / ``write_record`` are implemented (the leader-elected
    #: beat scheduler refuses, at start, a store that cannot keep its records).
    stores_records: bool = False

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        """The value last written to record ``name`` of ``lease_key``, or None.

        Records are small strings kept beside a lease key and never expire. Only a
        holder of that key can write one (:meth:`write_record`), so a record tells
        whoever holds the key next exactly what the previous holders did: the beat
        leader keeps each schedule entry's last run in one, named after the entry.
        A record belongs to its lease key: a store keeps the two together (one hash
        slot, one transaction) and apart from every other key's records and leases.
        """
        raise NotImplementedError(self._no_records("read_record"))

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        """Set record ``name`` of ``lease.key`` to ``value`` if ``lease`` is still held;
        False if it is not.

        The check and the write are one atomic step in the store (a fenced write): a
        holder whose lease expired or was taken can never overwrite what the new holder
        wrote, and a False answer is proof that the lease is gone.
        """
        raise NotImplementedError(self._no_records("write_record"))

    def _no_records(self, method: str) -> str:
        return (
            f"{type(self).__name__} ({self.safe_url}) does not implement {method}() yet, "
            "which the leader-elected beat scheduler needs to remember the last tick it "
            "sent. Point exclusive_beat_backend_url at a redis://, sqlite:// or memory:// "
            "store meanwhile."
        )

    #: Whether ``read_mark`` / ``swap_mark`` are implemented (lines of waiters, coalesced
    #: reruns and enqueue-time dedup need them).
    stores_marks: bool = False

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        """The live value of the ``kind`` mark of ``key``, or None if absent or expired.

        Marks are small strings with a ttl, kept beside a lease key: its line of
        waiters (``kind`` "line"), its pending rerun, a "queued" flag. ``kind`` is a
        short lowercase word. The store names a mark from both parts so that no key,
        whatever its characters, can reach another key's marks or a lease. Unlike
        records, anybody may change a mark, but only by :meth:`swap_mark`.
        """
        raise NotImplementedError(self._no_marks("read_mark"))

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        """If the ``kind`` mark of ``key`` holds ``expected`` (None: absent or expired),
        set it to ``new`` for ``ttl`` seconds of the store's clock (None: delete it) and
        return True; else change nothing and return False. One atomic compare-and-swap,
        from which the policies build the rest.
        """
        raise NotImplementedError(self._no_marks("swap_mark"))

    def _no_marks(self, method: str) -> str:
        return (
            f"{type(self).__name__} ({self.safe_url}) does not implement {method}(), which "
            "the wait and rerun policies, exclusive_priority and exclusive_scope='enqueue' "
            "need. Use a redis://, sqlite:// or memory:// store for those tasks."
        )

    def store_time(self) -> float:
        """Now, by the store's clock, in seconds since the epoch.

        Whatever callers make expire by a timestamp (a waiter's place in line) is
        stamped with this, never with the worker's clock: workers' clocks disagree,
        the store's is one. Stores that share the host's clock (SQLite, memory) keep
        this default.
        """
        return time.time()

    def migrate(self) -> Optional[str]:
        """Create what the store needs before workers use it, as the URL's user; return
        what was done, or None where a store needs nothing (the default).

        For databases whose workers' role may not create tables: an owner runs
        ``celery exclusive --backend <owner's URL> migrate`` once.
        """
        return None

    def check(self, probe_key: str) -> list[str]:
        """Check, once at worker (or beat) start, that leases can be kept here.

        Raises :class:`~celery_exclusive.errors.ConfigurationError` for a problem that
        retrying cannot fix (authentication, permissions, TLS, topology, a path that
        cannot be written) and :class:`BackendUnavailable` when the store does not
        answer; returns warnings to log (a store that forgets its state on restart).

        This default takes, renews and releases ``probe_key`` and swaps one of its
        marks: every kind of write a worker makes. Stores add what only they can see.
        """
        lease = self.try_acquire(
            probe_key, uuid.uuid4().hex, 10.0, holder={"task": "celery-exclusive check"}
        )
        if lease is not None:
            self.renew([lease])
            self.release(lease)
        if self.stores_marks:
            token = uuid.uuid4().hex
            if self.swap_mark(probe_key, "check", None, token, 10.0):
                self.swap_mark(probe_key, "check", token, None, 10.0)
        return []

    def close(self) -> None:  # noqa: B027 - optional hook, most backends have nothing to do
        """Free connections and any per-process resources."""

    def unavailable(self, action: str, exc: BaseException) -> BackendUnavailable:
        """Build the one error every store failure becomes."""
        return BackendUnavailable(
            f"the lease store at {self.safe_url} did not answer while {action} "
            f"({type(exc).__name__}: {exc}). Check that it is running and reachable, "
            "or choose what tasks do meanwhile with exclusive_on_backend_error.",
            self.safe_url,
        )


def redact_url(url: str) -> str:
    """Replace the password in ``url`` with ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))
