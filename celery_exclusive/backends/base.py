"""The backend protocol: what every lease store offers, one atomic round trip per call.

A backend knows nothing of Celery or RQ. It grants, renews and releases leases on
string keys (already namespaced by the caller), and answers who holds what for the
CLI. Every store error leaves a backend as :class:`BackendUnavailable`; a backend
never lets a client library's exception escape.
"""

from __future__ import annotations

import abc
import contextlib
import json
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, TypeVar, Union, cast
from urllib.parse import urlsplit, urlunsplit

from ..errors import BackendUnavailable, ConfigurationError, ExclusiveError

B = TypeVar("B", bound="Backend")


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


#: A mark set with a release: ``((key, kind), expected, new, ttl)``, as
#: :meth:`Backend.swap_mark_and_release` takes its arguments.
MarkSwap = tuple[tuple[str, str], Optional[str], str, float]


@dataclass(frozen=True)
class FinalWrite:
    """A write to a key of the application's own, made in one step with a release and
    only if the lease was still held then: a task's result stored as its lease is given
    back (Celery's Redis result backend on the lease store's server), so that a holder
    whose lease was lost never stores its success, and the key is free the moment the
    result can be read.

    ``key`` and ``value`` are written as they are (no namespace); ``database`` is the
    store's database to write in (None: the lease store's own); ``ttl`` in seconds (None:
    none); ``publish`` also publishes ``value`` on a channel named as ``key`` (Celery's
    result consumer listens there); a stored value that decodes as JSON and whose
    ``status`` field is ``keep_status`` is left as it is (Celery never stores over a
    success); ``clear_mark`` (``(key, kind, value)``): a mark of the store's deleted
    with the write if it still holds ``value`` (the call's enqueue mark, whose call
    ends here).
    """

    key: str
    value: Union[str, bytes]
    database: Optional[int] = None
    ttl: Optional[float] = None
    publish: bool = False
    keep_status: Optional[str] = None
    clear_mark: Optional[tuple[str, str, str]] = None


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


@dataclass(frozen=True)
class Capabilities:
    """What a store offers beyond leases with one holder per key, declared by its class.

    A store declares what it has (``capabilities = Capabilities(limits=True, ...)``), and
    callers ask it rather than try and catch: the beat scheduler refuses a store without
    ``records`` at start, the CLI and the web page leave out what a store does not keep.
    The loader checks each declaration against the class (:func:`check_capabilities`).
    """

    #: A key can have several holders (``exclusive_limit`` > 1, a semaphore). A store
    #: without refuses such an acquire with ConfigurationError naming the key.
    limits: bool = False
    #: :meth:`Backend.read_record` and :meth:`Backend.write_record`: fenced records kept
    #: beside a lease key (the leader-elected beat scheduler keeps its last ticks there).
    records: bool = False
    #: :meth:`Backend.read_mark` and :meth:`Backend.swap_mark`: small strings with a ttl
    #: beside a key (lines of waiters, pending reruns, enqueue-time deduplication,
    #: the operators' feed of events).
    marks: bool = False
    #: :meth:`Backend.database_for` and :meth:`Backend.release_and_write`: a
    #: :class:`FinalWrite` to a key on the same server, in one step with a release (a
    #: task's result stored with the release of its lease).
    final_writes: bool = False


#: Who needs the methods of each capability, for the error a store without it gives.
NEEDED_BY = {
    "records": "the leader-elected beat scheduler (its last ticks)",
    "marks": "the wait and rerun policies, exclusive_priority and exclusive_scope='enqueue'",
}

#: The methods each capability brings, beyond those every store has.
CAPABILITY_METHODS = {
    "records": ("read_record", "write_record"),
    "marks": ("read_mark", "swap_mark"),
    "final_writes": ("database_for", "release_and_write"),
}


class Backend(abc.ABC):
    """A lease store. A subclass serves the URL scheme that an entry point of the group
    ``celery_exclusive.backends`` names it for (see :mod:`celery_exclusive.backends`), or
    that :func:`~celery_exclusive.backends.register_scheme` gives it at run time.

    Every store has these operations, each one atomic step in the store (one round trip
    where the store allows):

    - :meth:`try_acquire`: grant a key to an owner for a ttl if fewer than ``limit``
      hold it and the key's line lets the claimant in; the fencing token rises with
      every grant of the key, floored by the store's clock.
    - :meth:`renew`: extend many leases, each only if its owner still holds it.
    - :meth:`release`: free a lease only if its owner holds it; idempotent.
    - :meth:`wait`: block until the key may be free (a hint, never a grant).
    - :meth:`holders` / :meth:`holders_of`, :meth:`force_release`: the operators' view.
    - :meth:`store_time`: the store's clock, which decides every expiry.

    What else it has it declares in :attr:`capabilities` (:class:`Capabilities`):
    several holders per key (``limits``), records (``records``: :meth:`read_record`,
    :meth:`write_record`) and marks (``marks``: :meth:`read_mark`, :meth:`swap_mark`,
    and the defaults built on them). A store that answers a write's loss by reading
    back does so with :mod:`.readback`; each store turns its client's exceptions into
    :class:`BackendUnavailable` or :class:`ConfigurationError` in one function.
    """

    #: What this store offers beyond leases with one holder per key (see
    #: :class:`Capabilities`); an instance whose URL gives up one narrows its own.
    capabilities: Capabilities = Capabilities()

    #: The subclass that serves this store's ``?recipe=`` URLs (another ecosystem's lock
    #: recipe, on the key's own name), if the store has one. The subclass sets it by
    #: being defined with ``recipe=True`` (``class SetNxBackend(RedisBackend,
    #: recipe=True)``), and the store's package imports both modules: the store's own
    #: module never imports its recipe's, which imports it.
    recipe_class: ClassVar[Optional[type[Backend]]] = None

    def __init_subclass__(cls, recipe: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if recipe:
            cls.__bases__[0].recipe_class = cls  # type: ignore[attr-defined]

    @classmethod
    def speaking_recipe(cls: type[B]) -> type[B]:
        """The class that serves this store's ``?recipe=`` URLs."""
        if cls.recipe_class is None:
            raise ConfigurationError(
                f"{cls.__name__} serves no ?recipe= URL; remove ?recipe= from the store URL."
            )
        return cast("type[B]", cls.recipe_class)

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
        """:meth:`try_acquire`, then :meth:`read_mark` of ``mark`` (a ``(key, kind)``
        pair), granted or not: ``(grant or None, value or None)``.

        A call that may be a second copy of its message reads, as it tries the key,
        whether its attempt already ran to the end. The read comes after the grant,
        so it sees what the previous holder wrote before it released. Refused, the copy
        still needs it: one whose attempt ended must not act as a duplicate (join a
        pending rerun with its old arguments, leave a skip over its result). A store
        that can send both in one round trip, in that order, overrides this.
        """
        grant = self.try_acquire(key, owner, ttl, limit, holder, claimant=claimant)
        if grant is None:
            return None, self.read_mark(*mark)
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

    def database_for(self, address: Mapping[str, Any]) -> Optional[int]:
        """The database a :class:`FinalWrite` to the server at ``address`` (``host``,
        ``port`` or ``path``, ``username``, ``password``, ``ssl``, ``db``: as another
        client of this store's kind connects to it) is made in, in one step with a
        release; None if no such write can reach it (another server, other credentials,
        a topology where one step cannot span two keys). Only a store with
        ``final_writes`` answers anything but None."""
        return None

    def release_and_write(
        self,
        lease: Lease,
        write: FinalWrite,
        mark: Optional[MarkSwap] = None,
    ) -> Optional[tuple[bool, bool]]:
        """Free ``lease`` if its owner still holds it and, only then, make ``write``; with
        ``mark`` (``((key, kind), expected, new, ttl)``, as :meth:`swap_mark_and_release`
        takes it), swap that mark first, in the same step.

        Returns ``(freed, written)``: ``freed`` as :meth:`release` returns it; ``written``
        True only if this call made the write (a call sent again after its answer was
        lost may free without knowing whether the first one wrote, and answers False,
        so the caller makes the write its own way). None if the mark held something
        else: nothing changed, ``lease`` is still held. Raises as :meth:`release` does;
        then the write may or may not have been made, and the lease not freed.
        """
        raise ConfigurationError(
            f"the store {self.safe_url} cannot make a write in one step with a release; "
            "ask database_for() first (capabilities.final_writes)."
        )

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

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        """The value last written to record ``name`` of ``lease_key``, or None.

        Records are small strings kept beside a lease key and never expire. Only a
        holder of that key can write one (:meth:`write_record`), so a record tells
        whoever holds the key next exactly what the previous holders did: the beat
        leader keeps each schedule entry's last run in one, named after the entry.
        A record belongs to its lease key: a store keeps the two together (one hash
        slot, one transaction) and apart from every other key's records and leases.
        """
        raise self._lacks("records", "read_record")

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        """Set record ``name`` of ``lease.key`` to ``value`` if ``lease`` is still held;
        False if it is not.

        The check and the write are one atomic step in the store (a fenced write): a
        holder whose lease expired or was taken can never overwrite what the new holder
        wrote, and a False answer is proof that the lease is gone.
        """
        raise self._lacks("records", "write_record")

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        """The live value of the ``kind`` mark of ``key``, or None if absent or expired.

        Marks are small strings with a ttl, kept beside a lease key: its line of
        waiters (``kind`` "line"), its pending rerun, a "queued" flag. ``kind`` is a
        short lowercase word. The store names a mark from both parts so that no key,
        whatever its characters, can reach another key's marks or a lease. Unlike
        records, anybody may change a mark, but only by :meth:`swap_mark`.
        """
        raise self._lacks("marks", "read_mark")

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        """If the ``kind`` mark of ``key`` holds ``expected`` (None: absent or expired),
        set it to ``new`` for ``ttl`` seconds of the store's clock (None: delete it) and
        return True; else change nothing and return False. One atomic compare-and-swap,
        from which the policies build the rest.
        """
        raise self._lacks("marks", "swap_mark")

    def _lacks(self, capability: str, method: str) -> ConfigurationError:
        """The error a call of a capability's method meets on a store without it (a
        caller that did not ask :attr:`capabilities` first)."""
        return ConfigurationError(
            f"the store {type(self).__name__} ({self.safe_url}) keeps no {capability} (its "
            f"capabilities do not declare them), so {method}() cannot run (needed by "
            f"{NEEDED_BY[capability]}). Use a store that keeps them: every built-in "
            "store does."
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
        if self.capabilities.marks:
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

    # --- operators' views: pages of held keys, renewals, the feed of events ---------

    def holders_page(
        self,
        prefix: str = "",
        cursor: Optional[str] = None,
        count: int = 100,
        kinds: Sequence[str] = (),
    ) -> HoldersPage:
        """Up to ``count`` held keys starting with ``prefix``, each with its live leases
        and its marks of ``kinds``; start where the page before left off (``cursor``,
        None: the first page).

        An operator's page of 10,000 held keys reads its hundred, not the 10,000. A key
        and all its holders are on one page. Pages follow key order where the store
        keeps keys in order (the cursor is then the last key shown); a store that
        cannot may list in its own order (Redis's SCAN) and give pages shorter than
        ``count``, but the last page is always the one whose ``cursor`` is None.

        This default reads every holder under ``prefix`` and then each mark: stores
        that can read a page and its marks in one round trip override it.
        """
        by_key: dict[str, list[LeaseInfo]] = {}
        for info in self.holders(prefix):
            if cursor is None or info.key > cursor:
                by_key.setdefault(info.key, []).append(info)
        keys = sorted(by_key)
        shown = keys[:count]
        return HoldersPage(
            [HeldKey(key, tuple(by_key[key]), self._marks_of(key, kinds)) for key in shown],
            shown[-1] if len(keys) > count else None,
        )

    def _marks_of(self, key: str, kinds: Sequence[str]) -> dict[str, str]:
        found = (
            {kind: self.read_mark(key, kind) for kind in kinds} if self.capabilities.marks else {}
        )
        return {kind: value for kind, value in found.items() if value is not None}

    def renewed_ago(self, info: LeaseInfo) -> Optional[float]:
        """Seconds since the store last extended the lease of ``info`` (its grant or its
        latest renewal), or None where the store cannot tell.

        Costs nothing to keep: every holder records its lease's ``ttl`` with the grant,
        and where each extension sets the expiry to the store's now + ttl, the time
        since is that ttl less ``expires_in``. A store whose leases expire with something
        else (a session, a process-wide lease) overrides this.
        """
        ttl = info.holder.get("ttl")
        if not isinstance(ttl, (int, float)) or info.expires_in is None:
            return None
        return max(0.0, float(ttl) - info.expires_in)

    def append_events(self, feed: str, events: Sequence[str], capacity: int, ttl: float) -> None:
        """Add ``events`` (short strings, oldest first) to the feed ``feed`` in one step,
        keeping only its newest ``capacity`` events, all of them gone ``ttl`` seconds
        after the last append.

        Workers report what operators want to see (a duplicate skipped, a lease lost)
        here, in batches, off the path of a task; :meth:`read_events` gives them back.
        ``feed`` is a key of the library's own (the key prefix), so the store keeps the
        feed where the key prefix's permissions reach. This default keeps the feed as
        one mark, a JSON array, changed by compare-and-swap; a store with a capped log
        of its own (a Redis stream) overrides it.
        """
        for _ in range(EVENT_ATTEMPTS):
            current = self.read_mark(feed, FEED)
            kept = _events_of(current) + list(events)
            new = json.dumps(kept[-capacity:]) if capacity > 0 else None
            if self.swap_mark(feed, FEED, current, new, ttl):
                return
        raise BackendUnavailable(
            f"the feed of {feed!r} in {self.safe_url} kept changing under {EVENT_ATTEMPTS} "
            "attempts to add to it.",
            self.safe_url,
        )

    def read_events(self, feed: str) -> list[str]:
        """The events of the feed ``feed`` (see :meth:`append_events`), oldest first."""
        return _events_of(self.read_mark(feed, FEED))


def check_capabilities(cls: type) -> None:
    """Refuse a store class whose declared capabilities do not match its methods: one
    that declares a capability without implementing its methods (callers would reach
    the base's refusal), or implements them without declaring it (callers would never
    use them). Raises ConfigurationError naming the class, the capability and the fix."""
    name = f"{cls.__module__}:{cls.__qualname__}"
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ConfigurationError(
            f"the store {name} is not a celery_exclusive.backends.Backend subclass; "
            "derive it from Backend (see 'A store of your own' in the docs)."
        )
    declared = cls.capabilities
    for capability, methods in CAPABILITY_METHODS.items():
        implemented = [m for m in methods if getattr(cls, m) is not getattr(Backend, m)]
        if getattr(declared, capability) and len(implemented) < len(methods):
            missing = ", ".join(f"{m}()" for m in methods if m not in implemented)
            raise ConfigurationError(
                f"the store {name} declares {capability} in its capabilities but does not "
                f"implement {missing}; implement them, or declare {capability}=False."
            )
        if implemented and not getattr(declared, capability):
            found = ", ".join(f"{m}()" for m in implemented)
            raise ConfigurationError(
                f"the store {name} implements {found} but does not declare {capability} "
                f"in its capabilities, so nothing would call them; add {capability}=True "
                "to its Capabilities, or remove the methods."
            )


def redact_url(url: str) -> str:
    """Replace the password in ``url`` with ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


@dataclass(frozen=True)
class HeldKey:
    """A held key on a page of :meth:`Backend.holders_page`: its live leases (several
    for a semaphore) and the marks asked for, by kind (absent marks left out)."""

    key: str
    leases: tuple[LeaseInfo, ...]
    marks: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HoldersPage:
    """One page of held keys, and where the next one starts (None: this is the last)."""

    keys: list[HeldKey]
    cursor: Optional[str]


def page_of(
    rows: Sequence[tuple[str, LeaseInfo, Sequence[Optional[str]]]],
    kinds: Sequence[str],
    count: int,
) -> HoldersPage:
    """A page from rows of (key, lease, its key's marks in the order of ``kinds``), in
    key order, read for up to ``count`` + 1 keys: the extra key, if any, is left for the
    next page, whose cursor is the last key kept."""
    keys: list[HeldKey] = []
    for key, info, values in rows:
        if keys and keys[-1].key == key:
            keys[-1] = HeldKey(key, (*keys[-1].leases, info), keys[-1].marks)
            continue
        if len(keys) == count:
            return HoldersPage(keys, keys[-1].key)
        marks = {kind: value for kind, value in zip(kinds, values) if value is not None}
        keys.append(HeldKey(key, (info,), marks))
    return HoldersPage(keys, None)


#: The kind of the mark that keeps a feed of events where a store has nothing better.
FEED = "feed"
#: Compare-and-swap attempts to add to such a feed before the store counts as too busy.
EVENT_ATTEMPTS = 20


def _events_of(value: Optional[str]) -> list[str]:
    """The events a feed mark holds; an absent or unreadable one holds none."""
    try:
        events = json.loads(value) if value else []
    except ValueError:
        return []
    return [event for event in events if isinstance(event, str)] if isinstance(events, list) else []
