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
Cluster. The recipe has one holder per key: ``exclusive_limit`` must be 1.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Optional

from redis.crc import key_slot

from ...errors import ConfigurationError
from ..base import Backend, Lease, LeaseInfo
from . import checks, layout, scripts
from .backend import RedisBackend

#: The value of ``?recipe=`` this module speaks.
RECIPE = "set-nx"
#: Seconds between two looks at a key a foreign client holds (redis-py's ``Lock.sleep``).
FOREIGN_POLL = 0.1
#: python-redis-lock's names: the lock ``lock:<name>``, its waiters' ``lock-signal:<name>``.
PRL_LOCK, PRL_SIGNAL = "lock:", "lock-signal:"
#: Milliseconds a python-redis-lock wake-up lasts (its ``signal_expire`` default).
PRL_SIGNAL_EXPIRE = 1000


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


class RecipeLayout:
    """:mod:`.layout` for the recipe: the lease at the key's own name, the rest
    beside it (see :func:`beside`). Same functions, so the store's scripts run as is."""

    def lease(self, key: str) -> str:
        return key

    def entries(self, key: str) -> layout.Entries:
        return _entries(key)

    def fence(self, key: str) -> str:
        return beside(key) + ":fence"

    def holders(self, key: str) -> str:
        return beside(key) + ":holders"

    def signal(self, key: str, claimant: Optional[str] = None) -> str:
        base = beside(key) + ":signal"
        return base if claimant is None else base + ":" + claimant

    def waiting(self, key: str) -> str:
        return beside(key) + ":waiting"

    def mark(self, key: str, kind: str) -> str:
        return beside(key) + ":mark:" + kind

    def record(self, key: str, name: str) -> str:
        return beside(key) + ":record:" + name

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


def internal(name: str) -> bool:
    """Whether ``name`` is in the store's own namespace (``{...}`` followed by more):
    the entries beside keys, which no lease key may take."""
    return name.startswith("{") and name.find("}") not in (-1, len(name) - 1)


RELEASE = (
    scripts._NOW
    + scripts._HOLDS
    + scripts._LINE
    + scripts._WAKE
    + scripts._RELEASE
    + """
-- Free the owner's lease and wake whoever may take it: our waiters, and the waiters of
-- python-redis-lock blocked on its lock-signal list (KEYS[6], when the key has one), as
-- its UNLOCK_SCRIPT wakes them: DEL, LPUSH 1, PEXPIRE.
-- Returns 1 if the owner held the key, else 0 (and changes nothing).
local lease_key, holders_key, line_key = KEYS[1], KEYS[2], KEYS[3]
local signal_key, waiting_key, foreign_signal = KEYS[4], KEYS[5], KEYS[6]
local owner, limit, signal_ttl, foreign_ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]

local freed = release(lease_key, holders_key, line_key, signal_key, waiting_key,
                      owner, limit, signal_ttl)
if freed == 1 and foreign_signal then
  redis.call('DEL', foreign_signal)
  redis.call('LPUSH', foreign_signal, 1)
  redis.call('PEXPIRE', foreign_signal, foreign_ttl)
end
return freed
"""
)

FOREIGN = "a client of Redis's SET NX lock recipe (redis-py Lock, python-redis-lock, redsync...)"


class SetNxBackend(RedisBackend, recipe=True):
    """The Redis store speaking the ``SET NX PX`` recipe (see the module docstring)."""

    #: One holder per key, as the recipe has; no final writes (the store's script
    #: releases the store's way, and python-redis-lock's waiters would not be woken).
    capabilities = replace(RedisBackend.capabilities, limits=False, final_writes=False)
    database_for = Backend.database_for
    release_and_write = Backend.release_and_write

    def __init__(self, url: str, client: Any = None) -> None:
        super().__init__(url, client)
        self.layout = RecipeLayout()

    def _script(self, name: str):
        if name == "release":
            script = self._scripts.get("recipe release")
            if script is None:
                script = self._scripts["recipe release"] = self.client.register_script(RELEASE)
            return script
        return super()._script(name)

    # --- leases -----------------------------------------------------------------------

    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
    ) -> Optional[Lease]:
        self._check(key, limit)
        return super().try_acquire(key, owner, ttl, limit, holder, claimant)

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
        self._check(key, limit)
        return super().try_acquire_and_read_mark(key, owner, ttl, limit, holder, claimant, mark)

    def _check(self, key: str, limit: int) -> None:
        if limit != 1:
            raise ConfigurationError(
                f"{self.safe_url} speaks Redis's SET NX lock recipe, which has one holder "
                f"per key, but {key!r} was asked for with exclusive_limit={limit}: use a "
                "store URL without ?recipe= for limits."
            )
        if internal(key):
            raise ConfigurationError(
                f"the lease key {key!r} names one of the store's own entries ({{...}} "
                f"followed by more) in {self.safe_url}: with ?recipe={RECIPE} a key is a "
                "Redis key of its own; change exclusive_key or exclusive_key_prefix."
            )

    def release(self, lease: Lease) -> bool:
        self._fresh_master(force=True)  # as the store's own release does
        names = self.layout.entries(lease.key)
        keys = [names.lease, names.holders, names.line, names.signal, names.waiting]
        args = [lease.owner, lease.limit, max(1, int(max(lease.ttl, 1.0) * 1000))]
        foreign_signal = self._foreign_signal(lease.key)
        if foreign_signal is not None:
            keys.append(foreign_signal)
            args.append(PRL_SIGNAL_EXPIRE)
        action = f"releasing {lease.key!r}"
        resent: list[bool] = []
        freed = bool(self._run("release", action, lease.key, keys, args, resent))
        return self.freed_unless_resent(freed, resent)

    def _foreign_signal(self, key: str) -> Optional[str]:
        """python-redis-lock's wake-up list of ``key``, if ``key`` is named as its locks
        are and the list shares its hash slot (off Cluster, always)."""
        if not key.startswith(PRL_LOCK):
            return None
        signal = PRL_SIGNAL + key[len(PRL_LOCK) :]
        if self.cluster and key_slot(signal.encode()) != key_slot(key.encode()):
            return None
        return signal

    def swap_mark_and_release(
        self,
        lease: Lease,
        mark: tuple[str, str],
        expected: Optional[str],
        new: str,
        ttl: float,
    ) -> Optional[bool]:
        # The store's one-script version releases the store's way: python-redis-lock's
        # waiters would not be woken. Two steps, the release through release().
        return Backend.swap_mark_and_release(self, lease, mark, expected, new, ttl)

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        # A foreign holder's release wakes none of ours: look again soon.
        holder = self.holders_of(key)
        if holder and holder[0].fencing_token is None:
            timeout = min(timeout, FOREIGN_POLL)
            signals = [self.layout.signal(key)]
            self._call(f"waiting on {key!r}", key, self.client.blpop, signals, timeout)
            return
        super().wait(key, timeout, claimant)

    def force_release(self, key: str) -> int:
        """Free every lease of ours on ``key``; a foreign holder stays (it is not ours to
        free): release it with its own client."""
        freed = 0
        for info in self.holders_of(key):
            if info.fencing_token is not None:
                freed += self.release(Lease(key, info.owner, info.fencing_token, 1.0))
        return freed

    # --- what the CLI sees ------------------------------------------------------------

    def holders_of(self, key: str) -> list[LeaseInfo]:
        found = self._run("describe", f"reading {key!r}", key, [key, self.layout.holders(key)], [])
        kind, pttl, value = _text(found[0]), found[2:3], found[3:4]
        if kind != "string" or not value or value[0] is None:
            return super().holders_of(key) if kind == "zset" else []
        text, expires_in = _text(value[0]), _seconds(pttl[0])
        ours = _parse(text)
        if ours is not None:
            owner, token, record = ours
            return [LeaseInfo(key, owner, token, expires_in, record)]
        shown = text if len(text) <= 80 else text[:77] + "..."
        described = {"foreign": f"{FOREIGN} with the value {shown!r}"}
        return [LeaseInfo(key, text, None, expires_in, described)]

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        # Only ours: under a prefix, any string is a key's value, and nothing tells a
        # foreign lock from other data. holders_of(key) names a foreign holder.
        return [info for info in super().holders(prefix) if info.fencing_token is not None]

    def check(self, probe_key: str) -> list[str]:
        warnings = checks.server_warnings(self)
        warnings += Backend.check(self, probe_key)
        names = self.layout.entries(probe_key)
        self._call(
            "cleaning up the check",
            probe_key,
            self.client.delete,
            *names,
            self.layout.mark(probe_key, "check"),
        )
        return warnings


def _parse(value: str) -> Optional[tuple[str, int, dict]]:
    """Owner, token and holder record of a value this library wrote
    (``<len(owner)>:<owner> <token> <holder JSON>``, see scripts.py); None for any other."""
    length, colon, rest = value.partition(":")
    if not colon or not length.isdigit() or rest[int(length) : int(length) + 1] != " ":
        return None
    owner, rest = rest[: int(length)], rest[int(length) + 1 :]
    token, space, record = rest.partition(" ")
    if not space or not token.isdigit():
        return None
    try:
        holder = json.loads(record)
    except ValueError:
        return None
    return (owner, int(token), holder) if isinstance(holder, dict) else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _seconds(pttl: Any) -> Optional[float]:
    return None if pttl is None or pttl < 0 else pttl / 1000
