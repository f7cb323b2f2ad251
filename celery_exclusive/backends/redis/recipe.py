"""``?recipe=set-nx``: leases taken with Redis's own lock recipe, on the key's own name.

Redis documents one lock for a single instance: ``SET name value NX PX ttl`` to take
it, and a script that deletes it only if it still holds the taker's value to give it
back. Every common client is that recipe: redis-py's ``Lock`` (redis/lock.py:
``do_acquire`` is ``set(name, token, nx=True, px=timeout)``, ``LUA_RELEASE_SCRIPT``
compares ``get`` with the token before ``del``, ``LUA_EXTEND_SCRIPT`` before
``pexpire``), python-redis-lock (redis_lock/__init__.py: ``acquire`` is ``set(name,
id, nx=True, ex=expire)`` on ``lock:<name>``; ``UNLOCK_SCRIPT`` compares, deletes,
and pushes one wake-up onto ``lock-signal:<name>``, on which its waiters ``BLPOP``),
Go's redsync and node-redlock (the same ``SET NX PX`` and compare-and-delete on
each instance).

With ``redis://...?recipe=set-nx``, a lease key is that name, used as it is: a task
with ``exclusive_key_prefix=""`` and ``exclusive_key="invoice:{invoice_id}"`` holds
the Redis key ``invoice:7``, which redis-py's ``r.lock("invoice:7")`` takes too. So:

- **Our holder** makes a foreign client wait or fail as another client of its kind
  would: its ``SET NX`` finds the key taken, its compare-and-delete and
  compare-and-extend find another value. Our release is a compare-and-delete, our
  renewals a compare-and-``PEXPIRE``. A key named ``lock:<name>`` is released the
  python-redis-lock way too (one wake-up pushed onto ``lock-signal:<name>``, as its
  ``UNLOCK_SCRIPT`` does), so its blocked waiters take it at once rather than at
  their timeout (never, without one).
- **A foreign holder** makes our duplicates skip, wait or requeue, and is named: a
  value not written by this library. Our waiters poll a foreign holder every
  :data:`FOREIGN_POLL` seconds (redis-py's ``Lock.sleep`` default): its release
  wakes nobody of ours, and we never pop a wake-up meant for its waiters.
- **Never touched**: a foreign holder is never deleted, extended or overwritten,
  ``force_release`` included (it frees our holders only, and says so).

The value we write is the store's usual one (owner, fencing token, holder record):
``GET invoice:7`` says who holds it. Our fencing token stays ours: it comes from the
key's fence beside it, and rises with every grant of ours. A foreign holder gets no
token, and nothing fences its writes but what it does itself.

Everything else of the key (fence, line, marks, records, wake-up lists) lives beside
it in the store's own names (:class:`RecipeLayout`), in the key's hash slot on a
Cluster, and the store's own scripts run on those names (:mod:`.connection`). The
recipe has one holder per key (no ``limits``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from redis.crc import key_slot

from ...errors import ConfigurationError
from ..base import NO_END, Backend, Capabilities, End, LayoutVersion, Lease, LeaseInfo, MarkRead
from . import checks, layout
from .connection import RedisConnection

#: Seconds between two looks at a key a foreign client holds (redis-py's ``Lock.sleep``).
FOREIGN_POLL = 0.1
#: python-redis-lock's names: the lock ``lock:<name>``, its waiters' ``lock-signal:<name>``.
PRL_LOCK, PRL_SIGNAL = "lock:", "lock-signal:"
#: Who holds a key with a value this library did not write.
FOREIGN = "a client of Redis's SET NX lock recipe (redis-py Lock, python-redis-lock, redsync...)"


def hash_tag(name: str) -> Optional[str]:
    """The hash tag of a Redis key, as Redis Cluster finds it (cluster.c,
    ``keyHashSlot``): what lies between the first ``{`` and the first ``}`` after it,
    if not empty; else None (the whole name is hashed)."""
    start = name.find("{")
    if start == -1:
        return None
    end = name.find("}", start + 1)
    if end == -1 or end == start + 1:
        return None
    return name[start + 1 : end]


@functools.cache
def slot_tag(slot: int) -> str:
    """A short hash tag of Cluster slot ``slot``: the first of "0", "1", ... that
    hashes there (the same in every process)."""
    for number in itertools.count():
        if key_slot(str(number).encode()) == slot:
            return str(number)
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=4096)
def beside(key: str) -> str:
    """The stem of the store's own entries of the lease key ``key``: in its hash slot,
    apart from every other key's, and never a name a lease key can take.

    A plain key (no ``{``, ``}`` or ``%``) gets ``{<key>}``: the very stem the store's
    own layout gives it, so its fence (and so its tokens) carries on if its URL moves
    to or from the recipe. Any other key gets ``{<tag>}~<escaped key>``, ``<tag>``
    being its own hash tag, or a tag of its slot.
    """
    if not any(c in key for c in "{}%"):
        return "{" + key + "}"
    tag = hash_tag(key)
    if tag is None:
        tag = slot_tag(key_slot(key.encode()))
    return "{" + tag + "}~" + layout.escape(key)


def internal(name: str) -> bool:
    """Whether ``name`` is one of the store's own entries (:data:`.layout.ENTRY`: beside
    a key, or of the store's own layout), which no lease key may take. Any other name,
    hash tag or not, is a key of its own: ``{user42}:lock``, as Redis Cluster users name
    a lock, keeps its entries beside it in its tag's slot."""
    return layout.ENTRY.match(name) is not None


class RecipeLayout:
    """The recipe's names (:class:`.layout.Names`): the lease at the key's own name, the
    rest beside it (see :func:`beside`). ``cluster``: whether the store is a Redis
    Cluster, where python-redis-lock's wake-up list is pushed to only if it shares the
    key's hash slot."""

    def __init__(self, cluster: bool = False) -> None:
        self.cluster = cluster

    def lease(self, key: str) -> str:
        return key

    def entries(self, key: str) -> layout.Entries:
        return _entries(key)

    def holders(self, key: str) -> str:
        return beside(key) + ":holders"

    def signal(self, key: str, claimant: Optional[str] = None) -> str:
        base = beside(key) + ":signal"
        return base if claimant is None else base + ":" + claimant

    def mark(self, key: str, kind: str) -> str:
        return beside(key) + ":mark:" + kind

    def record(self, key: str, name: str) -> str:
        return beside(key) + ":record:" + name

    def foreign_signal(self, key: str) -> Optional[str]:
        """python-redis-lock's wake-up list of ``key``, if ``key`` is named as its locks
        are (and, on a cluster, the list shares its hash slot)."""
        if not key.startswith(PRL_LOCK):
            return None
        signal = PRL_SIGNAL + key[len(PRL_LOCK) :]
        if self.cluster and key_slot(signal.encode()) != key_slot(key.encode()):
            return None
        return signal

    def lease_pattern(self, prefix: str) -> str:
        return layout.glob_escape(prefix) + "*"

    def key_of(self, name: str) -> Optional[str]:
        return None if internal(name) else name


@functools.lru_cache(maxsize=4096)
def _entries(key: str) -> layout.Entries:
    stem = beside(key)
    return layout.Entries(
        key,
        stem + ":fence",
        stem + ":holders",
        stem + ":mark:line",
        stem + ":signal",
        stem + ":waiting",
    )


class SetNxBackend(Backend):
    """The Redis store speaking the ``SET NX PX`` recipe (see the module docstring)."""

    recipe = "set-nx"
    capabilities = Capabilities(
        records=True, marks=True, final_writes=True, event_log=True, windows=True
    )
    layout_version = LayoutVersion("redis+set-nx", 1)
    connection_class = RedisConnection
    connection: RedisConnection

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.names = RecipeLayout(self.connection.cluster)

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
        if internal(key):
            raise ConfigurationError(
                f"the lease key {key!r} names one of the store's own entries (a hash tag, "
                "then the name of an entry: ':fence', ':mark:<kind>', ...) in "
                f"{self.safe_url}: with ?recipe={self.recipe} a key is a Redis key of its "
                "own; change exclusive_key or exclusive_key_prefix (a hash tag followed by "
                "anything else, such as '{user42}:lock', is a key like any other)."
            )
        return self.connection.acquire(self.names, key, owner, ttl, limit, holder, claimant, read)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        return self.connection.renew(self.names, leases)

    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        if end != NO_END and self.connection.cluster:
            return super().release(lease, end)  # its mark may live in another hash slot
        return self.connection.release(self.names, lease, end)

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        # A foreign holder's release wakes none of ours: look again soon.
        holder = self.holders_of(key)
        if holder and holder[0].fencing_token is None:
            self.connection.block(key, [self.names.signal(key)], min(timeout, FOREIGN_POLL))
            return
        self.connection.wait(self.names, key, timeout, claimant)

    def force_release(self, key: str) -> int:
        """Free every lease of ours on ``key``; a foreign holder stays (it is not ours to
        free): release it with its own client."""
        freed = 0
        for info in self.holders_of(key):
            if info.fencing_token is not None:
                freed += bool(self.release(Lease(key, info.owner, info.fencing_token, 1.0)))
        return freed

    # --- what the operators see ---------------------------------------------------------

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        # Only ours: under a prefix, any string is a key's value, and nothing tells a
        # foreign lock from other data. holders_of(key) names a foreign holder.
        keys = self.connection.held_keys(self.names, prefix)
        found = [info for key in keys for info in self.holders_of(key)]
        return [info for info in found if info.fencing_token is not None]

    def holders_of(self, key: str) -> list[LeaseInfo]:
        return layout.leases_of(key, *self.connection.describe(self.names, key), other=_foreign)

    # --- records and marks -----------------------------------------------------------

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        action = f"reading the record {name!r} of {lease_key!r}"
        return self.connection.get(self.names.record(lease_key, name), action, lease_key)

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        return self.connection.write_record(self.names, lease, name, value)

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        action = f"reading the {kind} mark of {key!r}"
        return self.connection.get(self.names.mark(key, kind), action, key)

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        return self.connection.swap_mark(self.names, key, kind, expected, new, ttl)

    # --- the store's clock, the start-up check ----------------------------------------

    def store_time(self) -> float:
        return self.connection.store_time()

    def check(self, probe_key: str) -> list[str]:
        warnings = checks.server_warnings(self.connection)
        warnings += super().check(probe_key)
        names = [*self.names.entries(probe_key), self.names.mark(probe_key, "check")]
        self.connection.delete(probe_key, *names)
        return warnings


def _foreign(value: str) -> tuple[str, Optional[int], dict]:
    """A value this library did not write: a foreign holder, named by its value."""
    shown = value if len(value) <= 80 else value[:77] + "..."
    return value, None, {"foreign": f"{FOREIGN} with the value {shown!r}"}
