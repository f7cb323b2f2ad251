"""The store protocol: what every lease store offers, one atomic round trip per call.

A store is a :class:`Connection` (its client, and the one translator of its failures)
plus layouts that speak over it, each a :class:`Backend`: the library's own, and each
foreign lock recipe the store's ecosystem has. A layout knows nothing of Celery or RQ.
It grants, renews and releases leases on string keys (already namespaced by the
caller), and answers who holds what for the operators. Every store error leaves it as
:class:`BackendUnavailable` or :class:`ConfigurationError`; a client library's exception
never escapes.

:class:`Backend` has fifteen public methods: six every store implements, five with
defaults a store may do better, and two pairs that come with a declared capability
(:class:`Capabilities`). What they exchange: :class:`Lease` (a grant), :class:`End`
(how an attempt ends, carried out by the release), :class:`MarkRead` (a mark read with
a grant), :class:`LeaseInfo` and :class:`HoldersPage` (what the operators see).
"""

from __future__ import annotations

import abc
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union
from urllib.parse import parse_qs, urlsplit, urlunsplit

from .. import runtime
from ..errors import BackendUnavailable, ConfigurationError, ExclusiveError


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
class MarkSwap:
    """A mark set as an attempt ends, before its key is free: the ``kind`` mark of
    ``key`` from ``expected`` (None: absent) to ``new``, for ``ttl`` seconds (a call's
    finished mark, which a copy of its message delivered later finds)."""

    key: str
    kind: str
    expected: Optional[str]
    new: str
    ttl: float


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
class End:
    """How an attempt ends, as the release of its lease carries it out: the finished
    mark to swap before the key is free (``mark``), the result to write only if the
    lease was still held (``write``: a store with ``final_writes``), both, or neither.
    :meth:`Backend.release` takes it; :data:`NO_END` is neither."""

    mark: Optional[MarkSwap] = None
    write: Optional[FinalWrite] = None


#: A release that only frees the key.
NO_END = End()


@dataclass
class MarkRead:
    """A mark to read with a grant (:meth:`Backend.try_acquire`'s ``read``), right after
    the attempt and whether it was granted or not: a call whose message may come twice
    learns, as it tries its key, whether its attempt already ended.

    A store that can read it in the grant's own round trip sets ``value`` and ``done``;
    else the caller reads it next (:func:`celery_exclusive.core.lease.acquire`)."""

    key: str
    kind: str
    value: Optional[str] = None
    done: bool = False


@dataclass(frozen=True)
class LeaseInfo:
    """What the store says about a current holder, for ``holders()`` and the CLI."""

    key: str
    owner: str
    fencing_token: Optional[int]
    expires_in: Optional[float]
    holder: Mapping[str, Any] = field(default_factory=dict)
    #: Seconds since the store last extended the lease, where the store knows it
    #: otherwise than by its expiry (a session, a process-wide lease); see
    #: :attr:`renewed_ago`.
    since_renewal: Optional[float] = None

    @property
    def task_id(self) -> Optional[str]:
        return self.holder.get("task_id")

    @property
    def renewed_ago(self) -> Optional[float]:
        """Seconds since the store last extended this lease (its grant or its latest
        renewal), or None where that cannot be told.

        Costs nothing to keep: every holder records its lease's ``ttl`` with the grant,
        and where each extension sets the expiry to the store's now + ttl, the time
        since is that ttl less ``expires_in``. A store whose leases expire with something
        else gives :attr:`since_renewal` instead.
        """
        if self.since_renewal is not None:
            return self.since_renewal
        ttl = self.holder.get("ttl")
        if not isinstance(ttl, (int, float)) or self.expires_in is None:
            return None
        return max(0.0, float(ttl) - self.expires_in)

    @property
    def age(self) -> Optional[float]:
        acquired_at = self.holder.get("acquired_at")
        return None if acquired_at is None else max(0.0, runtime.wall() - acquired_at)


@dataclass(frozen=True)
class Capabilities:
    """What a store offers beyond leases with one holder per key, declared by its class.

    A store declares what it has (``capabilities = Capabilities(limits=True, ...)``), and
    callers ask it rather than try and catch: the beat scheduler refuses a store without
    ``records`` at start, the CLI and the web page leave out what a store does not keep.
    The loader checks each declaration against the class (:func:`check_capabilities`),
    and :func:`require` is the one refusal a caller gives when a store lacks one.
    """

    #: A key can have several holders (``exclusive_limit`` > 1, a semaphore).
    limits: bool = False
    #: :meth:`Backend.read_record` and :meth:`Backend.write_record`: fenced records kept
    #: beside a lease key (the leader-elected beat scheduler keeps its last ticks there).
    records: bool = False
    #: :meth:`Backend.read_mark` and :meth:`Backend.swap_mark`: small strings with a ttl
    #: beside a key (lines of waiters, pending reruns, enqueue-time deduplication,
    #: the operators' feed of events).
    marks: bool = False
    #: An :class:`End` with a :class:`FinalWrite` in :meth:`Backend.release`, and
    #: :meth:`Connection.database_for`: a write to a key on the same server, in one step
    #: with a release (a task's result stored with the release of its lease).
    final_writes: bool = False
    #: :meth:`Connection.append_events` and :meth:`Connection.read_events`: a capped log
    #: of the store's own for the operators' feed (else the feed is kept as a mark).
    event_log: bool = False
    #: :meth:`Backend.renew` gives each lease its own ttl, whatever it was granted with:
    #: a run's lease is kept for a while after it (a uniqueness window). Stores whose
    #: leases live as long as a session or lease granted once (etcd, Consul) cannot.
    windows: bool = False


#: Who needs each capability, for the error a store without it gives.
NEEDED_BY = {
    "limits": "exclusive_limit > 1 (a semaphore)",
    "records": "the leader-elected beat scheduler (its last ticks)",
    "marks": "the wait and rerun policies, exclusive_priority and exclusive_scope='enqueue'",
    "final_writes": "a result stored with the release of its lease",
    "event_log": "the operators' feed kept in a log of the store's own",
    "windows": "exclusive_unique_for and exclusive_rate (a run's lease kept after it)",
}

#: The methods each capability brings, beyond those every store has: on the store's
#: class (its layout), or on its connection class.
CAPABILITY_METHODS = {
    "records": ("read_record", "write_record"),
    "marks": ("read_mark", "swap_mark"),
}
CONNECTION_METHODS = {
    "final_writes": ("database_for",),
    "event_log": ("append_events", "read_events"),
}


@dataclass(frozen=True)
class LayoutVersion:
    """What a :class:`Backend` class writes to its store, and its version (the record
    a store holds of it: :mod:`.versions`)."""

    #: The layout's name: the store's own (``"redis"``) or a recipe's
    #: (``"redis+set-nx"``); one record per name.
    name: str
    #: Bumped by every change to what the layout writes (key names, fields, scripts'
    #: data, a table's columns).
    version: int
    #: Older versions this one can share a store with: it reads and writes so that
    #: their processes and this one exclude each other (the compatibility mode of a
    #: rolling upgrade). Empty: an upgrade stops the older processes first.
    runs_beside: frozenset[int] = frozenset()


def require(backend: Backend, capability: str, key: Optional[str] = None) -> None:
    """Refuse, with the one error every caller gives, what ``backend`` cannot do: a use
    of ``capability`` (a field of :class:`Capabilities`) it does not declare."""
    if getattr(backend.capabilities, capability):
        return
    where = f" (key {key!r})" if key is not None else ""
    raise ConfigurationError(
        f"the store {type(backend).__name__} ({backend.safe_url}) does not offer "
        f"{capability}{where}, which {NEEDED_BY[capability]} needs; use a store that does "
        "(see the stores' capabilities in the docs), or leave that setting at its default."
    )


def unavailable(safe_url: str, action: str, exc: BaseException) -> BackendUnavailable:
    """The one error every store failure that retrying may cure becomes. It says what
    the store did, not what a caller does meanwhile: that is each caller's to add (a
    task's ``on_backend_error``, a lock's block that never runs unlocked)."""
    return BackendUnavailable(
        f"the lease store at {safe_url} did not answer while {action} "
        f"({type(exc).__name__}: {exc}). Check that it is running and reachable.",
        safe_url,
    )


def recipe_of(url: str) -> Optional[str]:
    """The ``?recipe=`` a store URL names (another ecosystem's lock recipe), if any."""
    values = parse_qs(urlsplit(url).query).get("recipe")
    return values[-1] if values else None


class Connection:
    """What the layouts of one store share: the store's client, and the one function
    that turns its failures into the library's errors (:meth:`translate`).

    A store is a connection plus layouts: its own layout (where the library keeps
    leases, fences, marks and records) and, where its ecosystem has one, each foreign
    lock recipe (another client's keys, spoken as that client writes them). Each layout
    is a :class:`Backend` over the same kind of connection; what they share lives here,
    never in a layout another one subclasses.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.safe_url = redact_url(url)

    def translate(
        self, exc: BaseException, action: str, key: Optional[str] = None
    ) -> ExclusiveError:
        """The library's error for the client's exception ``exc``, raised while
        ``action`` (on ``key``): :class:`BackendUnavailable` where retrying may cure it,
        :class:`ConfigurationError` (naming the fix) where it cannot. A client's exception
        never leaves a store any other way."""
        return unavailable(self.safe_url, action, exc)

    def migrate(self) -> Optional[str]:
        """Create what the store needs before workers use it, as the URL's user; return
        what was done, or None where a store needs nothing (the default).

        For databases whose workers' role may not create tables: an owner runs
        ``celery exclusive --backend <owner's URL> migrate`` once.
        """
        return None

    def database_for(self, address: Mapping[str, Any]) -> Optional[int]:
        """The database a :class:`FinalWrite` to the server at ``address`` (``host``,
        ``port`` or ``path``, ``username``, ``password``, ``ssl``, ``db``: as another
        client of this store's kind connects to it) is made in, in one step with a
        release; None if no such write can reach it (another server, other credentials,
        a topology where one step cannot span two keys). Only a store with
        ``final_writes`` answers anything but None."""
        return None

    def append_events(self, feed: str, events: Sequence[str], capacity: int, ttl: float) -> None:
        """Add ``events`` to the log ``feed``, keeping its newest ``capacity``, all gone
        ``ttl`` seconds after the last append (``event_log`` stores only; the others keep
        the feed as a mark: :mod:`celery_exclusive.core.feed`)."""
        raise ConfigurationError(f"the store at {self.safe_url} keeps no event log")

    def read_events(self, feed: str) -> list[str]:
        """The events of the log ``feed``, oldest first (``event_log`` stores only)."""
        raise ConfigurationError(f"the store at {self.safe_url} keeps no event log")

    def close(self) -> None:  # noqa: B027 - optional hook, most stores have nothing to do
        """Free connections and any per-process resources."""


class Backend(abc.ABC):
    """A lease store: one layout of a store over its :class:`Connection`. A class serves
    the URL scheme that an entry point of the group ``celery_exclusive.backends`` names
    it for (see :mod:`celery_exclusive.backends`), or that
    :func:`~celery_exclusive.backends.register_scheme` gives it at run time; its
    :attr:`recipes` name the layouts that serve the same scheme's ``?recipe=`` URLs.

    Every store has these six operations (required), each one atomic step in the store
    (one round trip where the store allows):

    - :meth:`try_acquire`: grant a key to an owner for a ttl if fewer than ``limit``
      hold it and the key's line lets the claimant in; the fencing token rises with
      every grant of the key, floored by the store's clock.
    - :meth:`renew`: extend many leases, each only if its owner still holds it.
    - :meth:`release`: free a lease only if its owner holds it, ending its attempt as
      an :class:`End` says; idempotent.
    - :meth:`wait`: block until the key may be free (a hint, never a grant).
    - :meth:`holders` and :meth:`force_release`: the operators' view and their hand.

    Five have defaults a store overrides where it can do better: :meth:`holders_of`,
    :meth:`holders_page`, :meth:`store_time`, :meth:`check`, :meth:`close`. The rest
    come with a capability the class declares in :attr:`capabilities`
    (:class:`Capabilities`): marks (:meth:`read_mark`, :meth:`swap_mark`) and records
    (:meth:`read_record`, :meth:`write_record`). Every client exception passes through
    the connection's :meth:`Connection.translate`; a store that answers a write's loss
    by reading back does so with :mod:`.readback`.
    """

    #: What this store offers beyond leases with one holder per key (see
    #: :class:`Capabilities`); an instance whose URL gives up one narrows its own.
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: What this layout writes and its version, recorded in the store under each key
    #: prefix (:mod:`.versions`); None for a store that keeps no version (a process
    #: then shares it with any other, unchecked).
    layout_version: ClassVar[Optional[LayoutVersion]] = None
    #: The connection this layout speaks over, made from the URL by :meth:`__init__`.
    connection_class: ClassVar[type[Connection]] = Connection
    #: The ``?recipe=`` this layout speaks (another ecosystem's lock, on the key's own
    #: name); None for a store's own layout.
    recipe: ClassVar[Optional[str]] = None
    #: On a store's own layout: the layouts of its ``?recipe=`` URLs, by recipe name, as
    #: ``"module:Class"`` (imported only when a URL names one).
    recipes: ClassVar[Mapping[str, str]] = {}

    def __init__(self, url: str) -> None:
        named = recipe_of(url)
        if named != type(self).recipe:
            raise ConfigurationError(
                f"the store URL {redact_url(url)} names recipe={named!r}, which "
                f"{type(self).__name__} does not speak; open it with "
                "celery_exclusive.backends.backend_for_url(), which picks the layout."
            )
        self.url = url
        #: The URL with any password replaced, fit for logs and error messages.
        self.safe_url = redact_url(url)
        self.connection = self.connection_class(url)

    # --- every store --------------------------------------------------------------------

    @abc.abstractmethod
    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
        read: Optional[MarkRead] = None,
    ) -> Optional[Lease]:
        """Required. Grant ``key`` to ``owner`` for ``ttl`` seconds if fewer than
        ``limit`` hold it; None when the key is full.

        ``holder`` is stored beside the lease for ``holders()`` (task id, hostname,
        pid, acquired_at). The key's line (its mark of kind :data:`~.line.LINE`)
        decides who may take a free slot: ``claimant`` only if it stands among the
        first free entries (see :func:`~.line.admit`), and the grant takes it out of the
        line, in the same atomic step. All holders of a key share one limit
        (:func:`~.limits.check_limit`). A store that reads ``read``'s mark in the same
        round trip, after the grant, fills it in (:class:`MarkRead`); others leave it.
        """

    @abc.abstractmethod
    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        """Required. Extend every lease by its ttl in one round trip; return those found
        lost."""

    @abc.abstractmethod
    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        """Required. Free ``lease`` if its owner still holds it: True if it was freed,
        False if it was not held (nothing done). Idempotent.

        ``end`` (:class:`End`) is how the attempt under the lease ends, carried out
        before the key is free: its ``mark`` is swapped first (a mark that already holds
        ``new`` counts as swapped: a call sent again after its answer was lost finds its
        own write); if it held something else, nothing changes and the answer is None
        (the lease is still held). Its ``write`` is made only if the lease was still
        held, in the same step (``final_writes``): True then means freed and written, and
        a store that cannot tell whether a lost answer's write was made settles it
        before answering.

        A store implements the plain release and hands an ``end`` it cannot carry out
        in one step to this default (``return super().release(lease, end)``), which swaps
        the mark and then releases the plain way.
        """
        if end.write is not None:
            require(self, "final_writes", lease.key)
            raise ConfigurationError(
                f"{type(self).__name__} declares final_writes but left an End with a write "
                "to the default release; carry it out in the store's own release()."
            )
        mark = end.mark
        if mark is not None and not self._swap_for_end(mark):
            return None
        return self.release(lease)

    def _swap_for_end(self, mark: MarkSwap) -> bool:
        """Swap an end's mark; True if it now holds ``new`` (by this call or the last)."""
        require(self, "marks", mark.key)
        swapped = self.swap_mark(mark.key, mark.kind, mark.expected, mark.new, mark.ttl)
        return swapped or self.read_mark(mark.key, mark.kind) == mark.new

    @abc.abstractmethod
    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        """Required. Block until ``key`` may have a slot free for ``claimant``, or
        ``timeout`` passes.

        Free for ``claimant``: a slot is free and the key's line does not put anyone
        ahead of it. A store that wakes one waiter per release wakes the first in line.
        Returning is a hint, not a grant: the caller tries to acquire next.
        """

    @abc.abstractmethod
    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        """Required. Every live lease whose key starts with ``prefix``."""

    @abc.abstractmethod
    def force_release(self, key: str) -> int:
        """Required. Free every lease on ``key`` whoever holds it (operators only).
        Returns how many."""

    # --- defaults a store may do better ----------------------------------------------------

    def holders_of(self, key: str) -> list[LeaseInfo]:
        """The live leases on exactly ``key`` (read on every refused grant). This default
        filters :meth:`holders`; a store with a direct lookup overrides it."""
        return [info for info in self.holders(key) if info.key == key]

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

    def store_time(self) -> float:
        """Now, by the store's clock, in seconds since the epoch.

        Whatever callers make expire by a timestamp (a waiter's place in line) is
        stamped with this, never with the worker's clock: workers' clocks disagree,
        the store's is one. Stores that share the host's clock (SQLite, memory) keep
        this default.
        """
        return runtime.wall()

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

    def close(self) -> None:
        """Free connections and any per-process resources (the connection's)."""
        self.connection.close()

    # --- capabilities ---------------------------------------------------------------------

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        """Marks. The live value of the ``kind`` mark of ``key``, or None if absent or
        expired.

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
        """Marks. If the ``kind`` mark of ``key`` holds ``expected`` (None: absent or
        expired), set it to ``new`` for ``ttl`` seconds of the store's clock (None:
        delete it) and return True; else change nothing and return False. One atomic
        compare-and-swap, from which the policies build the rest.
        """
        raise self._lacks("marks", "swap_mark")

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        """Records. The value last written to record ``name`` of ``lease_key``, or None.

        Records are small strings kept beside a lease key and never expire. Only a
        holder of that key can write one (:meth:`write_record`), so a record tells
        whoever holds the key next exactly what the previous holders did: the beat
        leader keeps each schedule entry's last run in one, named after the entry.
        A record belongs to its lease key: a store keeps the two together (one hash
        slot, one transaction) and apart from every other key's records and leases.
        """
        raise self._lacks("records", "read_record")

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        """Records. Set record ``name`` of ``lease.key`` to ``value`` if ``lease`` is
        still held; False if it is not.

        The check and the write are one atomic step in the store (a fenced write): a
        holder whose lease expired or was taken can never overwrite what the new holder
        wrote, and a False answer is proof that the lease is gone.
        """
        raise self._lacks("records", "write_record")

    def _lacks(self, capability: str, method: str) -> ConfigurationError:
        """The error a call of a capability's method meets on a store without it (a
        caller that did not ask :attr:`capabilities` first)."""
        return ConfigurationError(
            f"the store {type(self).__name__} ({self.safe_url}) keeps no {capability} (its "
            f"capabilities do not declare them), so {method}() cannot run (needed by "
            f"{NEEDED_BY[capability]}). Use a store that keeps them: every built-in "
            "store does."
        )


def check_capabilities(cls: type) -> None:
    """Refuse a store class whose declared capabilities do not match its methods (or its
    connection's): one that declares a capability without implementing its methods
    (callers would reach the base's refusal), or implements them without declaring it
    (callers would never use them). Raises ConfigurationError naming the class, the
    capability and the fix."""
    name = f"{cls.__module__}:{cls.__qualname__}"
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ConfigurationError(
            f"the store {name} is not a celery_exclusive.backends.Backend subclass; "
            "derive it from Backend (see 'A store of your own' in the docs)."
        )
    declared = cls.capabilities
    sides = [
        (cls, Backend, CAPABILITY_METHODS),
        (cls.connection_class, Connection, CONNECTION_METHODS),
    ]
    for owner, base, by_capability in sides:
        for capability, methods in by_capability.items():
            implemented = [m for m in methods if getattr(owner, m) is not getattr(base, m)]
            where = "" if owner is cls else f" (on its connection, {owner.__qualname__})"
            if getattr(declared, capability) and len(implemented) < len(methods):
                missing = ", ".join(f"{m}()" for m in methods if m not in implemented)
                raise ConfigurationError(
                    f"the store {name} declares {capability} in its capabilities but does "
                    f"not implement {missing}{where}; implement them, or declare "
                    f"{capability}=False."
                )
            if implemented and not getattr(declared, capability):
                found = ", ".join(f"{m}()" for m in implemented)
                raise ConfigurationError(
                    f"the store {name} implements {found}{where} but does not declare "
                    f"{capability} in its capabilities, so nothing would call them; add "
                    f"{capability}=True to its Capabilities, or remove the methods."
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
