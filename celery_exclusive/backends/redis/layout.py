"""Where each lease key's entries live in Redis: one name per entry, one hash slot per key.

A lease key ``K`` (already namespaced by the caller, e.g. ``exclusive:invoice:7``) is
escaped and wrapped in a Redis Cluster hash tag, ``{E}``. The escaping replaces only
``%`` and ``}`` (by ``%25`` and ``%7D``), so ``E`` holds no ``}``: the tag always ends
at the brace the store put there, and every entry of ``K`` shares one hash slot::

    {E}                  the lease: a string (limit 1) or a sorted set owner -> expiry ms
    {E}:holders          limit > 1: hash "h:<owner>" -> "<token> <holder JSON>", "limit" -> N
    {E}:fence            the last fencing token granted
    {E}:signal           wake-up list for waiters not in the line
    {E}:signal:<id>      wake-up list of the waiter ``<id>`` of the line
    {E}:waiting          set while a waiter not in the line blocks on {E}:signal
    {E}:mark:<kind>      the mark ``kind`` (the line, a pending rerun, ...)
    {E}:record:<name>    the record ``name``
    {E}:events           the feed of events of the key prefix ``K`` (a capped stream)

The first ``}`` of a Redis key ends ``E``, and ``E`` decodes to exactly one ``K``, so no
key, whatever its characters, can name another key's entry: a key spelled like an
internal entry (``k:~line``, ``k}:fence``) is escaped into a tag of its own. Lease
entries are the only names whose first ``}`` is their last character.

Escaping keeps the caller's prefix readable: every name for keys under the prefix
``exclusive:`` starts with ``{exclusive:``, which is the pattern an ACL grants
(``~{exclusive:*``).

What a lease holds (:func:`leases_of`): a limit-1 lease is a string, ``<len(owner)>:<owner>
<token> <holder JSON>``; a semaphore a sorted set owner -> expiry (ms) beside its
holders hash (see :mod:`.scripts`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Callable, NamedTuple, Optional, Protocol

from ..base import LeaseInfo
from ..line import LINE

#: The name of every entry but the lease: its key's hash tag, then ``:`` and what the
#: functions below add to it, or (beside a key of ``?recipe=set-nx``) ``~`` and more.
ENTRY = re.compile(
    r"\{[^}]*\}(?:~|:(?:fence|holders|waiting|events|signal)\Z|:(?:signal|mark|record):)"
)

_ESCAPES = {ord("%"): "%25", ord("}"): "%7D"}
_UNESCAPE = re.compile("%(25|7D)")
_UNESCAPED = {"25": "%", "7D": "}"}


def escape(key: str) -> str:
    """``key`` with ``%`` and ``}`` percent-encoded: injective, and free of ``}``."""
    return key.translate(_ESCAPES)


@functools.lru_cache(maxsize=4096)
def lease(key: str) -> str:
    """The Redis key holding the lease of ``key`` (cached: a worker names the same few
    keys over and over, on every acquire, renewal and release)."""
    return "{" + escape(key) + "}"


class Entries(NamedTuple):
    """The names a lease operation passes to its script, built once per key."""

    lease: str
    fence: str
    holders: str
    line: str
    signal: str
    waiting: str


class Names(Protocol):
    """Where a layout keeps each entry of a lease key: this module for the store's own,
    :class:`~.recipe.RecipeLayout` for ``?recipe=set-nx``. The connection's scripts run
    on whichever a layout gives them."""

    def lease(self, key: str) -> str: ...
    def entries(self, key: str) -> Entries: ...
    def holders(self, key: str) -> str: ...
    def signal(self, key: str, claimant: Optional[str] = None) -> str: ...
    def mark(self, key: str, kind: str) -> str: ...
    def record(self, key: str, name: str) -> str: ...
    def foreign_signal(self, key: str) -> Optional[str]: ...
    def lease_pattern(self, prefix: str) -> str: ...
    def key_of(self, name: str) -> Optional[str]: ...


@functools.lru_cache(maxsize=4096)
def entries(key: str) -> Entries:
    """The entries of ``key`` the scripts touch (cached, as :func:`lease` is)."""
    return Entries(lease(key), fence(key), holders(key), mark(key, LINE), signal(key), waiting(key))


def fence(key: str) -> str:
    return lease(key) + ":fence"


def holders(key: str) -> str:
    return lease(key) + ":holders"


def signal(key: str, claimant: Optional[str] = None) -> str:
    """The wake-up list of ``key``, or of one waiter in its line."""
    base = lease(key) + ":signal"
    return base if claimant is None else base + ":" + claimant


def waiting(key: str) -> str:
    return lease(key) + ":waiting"


def mark(key: str, kind: str) -> str:
    return lease(key) + ":mark:" + kind


def record(key: str, name: str) -> str:
    return lease(key) + ":record:" + name


def events(feed: str) -> str:
    return lease(feed) + ":events"


def foreign_signal(key: str) -> None:
    """Another client's wake-up list to push to on release: none, the names here being
    the store's own."""
    return None


def lease_pattern(prefix: str) -> str:
    """A SCAN pattern matching the lease of every key that starts with ``prefix``
    (and a few other entries, which :func:`key_of` tells apart)."""
    return "{" + glob_escape(escape(prefix)) + "*}"


def key_of(name: str) -> Optional[str]:
    """The lease key whose lease ``name`` is, or None if ``name`` is another entry."""
    if not name.startswith("{") or name.find("}") != len(name) - 1:
        return None
    return _UNESCAPE.sub(lambda m: _UNESCAPED[m.group(1)], name[1:-1])


def glob_escape(text: str) -> str:
    """``text`` with Redis glob characters escaped, to match it literally."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def parse_value(value: str) -> Optional[tuple[str, int, dict]]:
    """Owner, token and holder record of a limit-1 lease value this store wrote
    (``<len(owner)>:<owner> <token> <holder JSON>``); None for any other."""
    length, colon, rest = value.partition(":")
    if not colon or not length.isdigit() or rest[int(length) : int(length) + 1] != " ":
        return None
    owner, rest = rest[: int(length)], rest[int(length) + 1 :]
    token, space, record = rest.partition(" ")
    if not space or not token.isdigit():
        return None
    holder = _json(record)
    return (owner, int(token), holder) if holder is not None else None


def leases_of(
    key: str,
    kind: str,
    now_ms: int,
    held: list,
    other: Callable[[str], tuple[str, Optional[int], dict]],
) -> list[LeaseInfo]:
    """The live leases of ``key`` as the DESCRIBE script finds them (its kind, the
    store's now in ms, and what it holds: see :mod:`.scripts`), a semaphore's by token;
    a limit-1 value the store did not write is shown as ``other(value)`` says:
    ``(owner, token, holder)``."""
    if kind == "string":
        pttl, value = held
        text = as_text(value)
        owner, token, holder = parse_value(text) or other(text)
        expires_in = None if pttl is None or pttl < 0 else pttl / 1000
        return [LeaseInfo(key, owner, token, expires_in, holder)]
    leases = []
    for i in range(0, len(held), 3):  # a semaphore's holders: owner, expiry, detail
        number, _, record = as_text(held[i + 2]).partition(" ")
        expires_in = (float(held[i + 1]) - now_ms) / 1000
        leases.append(
            LeaseInfo(key, as_text(held[i]), int(number), expires_in, _json(record) or {})
        )
    return sorted(leases, key=lambda info: info.fencing_token or 0)


def _json(text: str) -> Optional[dict]:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def as_text(value: Any) -> str:
    """A reply from Redis as text (the client answers bytes)."""
    return value.decode() if isinstance(value, bytes) else value
