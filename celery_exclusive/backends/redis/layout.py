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
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple, Optional

from ..line import LINE

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
