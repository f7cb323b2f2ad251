"""The aggregation expressions the MongoDB store's updates and reads are made of,
each written once. Every time in them is ``$$NOW``: the server's clock, one value per
command, never a worker's.

A key's document, in the store's own collection::

    {_id: <key>,
     holders: [{o: owner, t: token, exp: Date, ttl: ms, h: {holder record}}, ...],
     limit: n,            # the limit the key is held with
     fence: NumberLong,   # the last fencing token granted
     rev: n,              # bumped by every grant and mark change (a grant's CAS reads it)
     marks: {<kind>: {v: value, exp: Date}},
     records: [{n: name, v: value}],
     gc_at: Date}         # the TTL index's field: only garbage collection

``?recipe=ttl-lease`` keeps its holders in lease documents of their own (:mod:`.recipe`)
and the rest here, with ``granted`` (the latest token granted, which fences records)
and ``at`` (the server's time of the latest grant) instead of ``holders`` and ``limit``.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from ..line import LINE

NOW = "$$NOW"

#: The holders whose expiry is still ahead of the server's clock.
LIVE = {
    "$filter": {
        "input": {"$ifNull": ["$holders", []]},
        "as": "h",
        "cond": {"$gt": ["$$h.exp", NOW]},
    }
}

#: The owners of the live holders.
LIVE_OWNERS = {"$map": {"input": LIVE, "as": "h", "in": "$$h.o"}}

#: The next fencing token: the last one + 1, but never below the server's clock in
#: microseconds (of a date, which BSON keeps to the millisecond), so a document deleted
#: (by the TTL index, by hand) or restored from an old backup still gives tokens above
#: every one granted in an earlier millisecond.
NEXT_TOKEN = {
    "$max": [
        {"$add": [{"$ifNull": ["$fence", 0]}, 1]},
        {"$multiply": [{"$toLong": NOW}, 1000]},
    ]
}

#: One day: how long a document outlives its last write before the TTL index may
#: delete it (longer still for longer leases).
GC_GRACE_MS = 86_400_000


def field(kind: str) -> str:
    """A mark kind as a field name: kinds are short lowercase words; anything else is
    hex-encoded, so no kind can name a path."""
    return kind if re.fullmatch(r"[a-z][a-z0-9_]*", kind) else "x" + kind.encode().hex()


def under(prefix: str, cursor: Optional[str] = None) -> dict:
    """A query on ``_id`` for the keys starting with ``prefix`` (after ``cursor``), as a
    range the ``_id`` index serves; the caller drops what sorts in it without starting
    so (a prefix ending in the last code point)."""
    ids: dict = {"$gte": prefix}
    if cursor is not None:
        ids["$gt"] = cursor
    if prefix and ord(prefix[-1]) < 0x10FFFF:  # every key starting with it sorts below
        ids["$lt"] = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    return {"_id": ids}


def with_record(name: str, value: str) -> dict:
    """The records with ``name`` set to ``value``."""
    others = {
        "$filter": {
            "input": {"$ifNull": ["$records", []]},
            "as": "r",
            "cond": {"$ne": ["$$r.n", {"$literal": name}]},
        }
    }
    return {"$concatArrays": [others, [{"n": {"$literal": name}, "v": {"$literal": value}}]]}


def holds(owner: str) -> dict:
    """True while ``owner`` is among the live holders."""
    return {"$in": [{"$literal": owner}, LIVE_OWNERS]}


def live_mark(kind: str, field: str = "v") -> dict:
    """The ``kind`` mark's ``field`` while it has not expired, else null."""
    path = f"$marks.{kind}"
    return {"$cond": [{"$gt": [f"{path}.exp", NOW]}, f"{path}.{field}", None]}


def mark_is_live(kind: str) -> dict:
    return {"$gt": [f"$marks.{kind}.exp", NOW]}


def line_set_to(line: Optional[str]) -> dict:
    """The update stage that leaves the key's line as ``line`` (None: none), keeping its
    expiry."""
    if line is None:
        return {"$unset": f"marks.{LINE}"}
    return {"$set": {f"marks.{LINE}.v": {"$literal": line}}}


def gc_at(ttl_ms: int) -> Any:
    """When the TTL index may delete the document: a while after this write, unless it
    keeps records (they never expire)."""
    return {
        "$cond": [
            {"$gt": [{"$size": {"$ifNull": ["$records", []]}}, 0]},
            "$$REMOVE",
            {"$add": [NOW, max(GC_GRACE_MS, 10 * ttl_ms)]},
        ]
    }


def bump_rev() -> dict:
    return {"$add": [{"$ifNull": ["$rev", 0]}, 1]}


def when(test: str, then: Any, field: str) -> dict:
    """``then`` if the temporary field ``test`` is true, else the field as it was."""
    return {"$cond": [f"${test}", then, f"${field}"]}


def grant(owner: str, ttl_ms: int, limit: int, holder: dict, test: Any = True) -> list[dict]:
    """The update pipeline of a grant: if ``test`` (an expression on the document, by
    ``$$NOW``) holds, drop expired holders and add this one with the next token;
    otherwise change nothing.

    The test lives in the pipeline, not in the query: MongoDB refuses ``$expr`` in the
    query of an upsert (src/mongo/db/ops/parsed_update.cpp, QueryFeatureNotAllowed),
    and only ``$expr`` can name ``$$NOW``. The caller sees whether it was granted by
    finding its owner among the holders of the document returned.
    """
    entry = {
        "o": {"$literal": owner},
        "t": "$fence",
        "exp": {"$add": [NOW, ttl_ms]},
        "ttl": ttl_ms,
        "h": {"$literal": holder},
    }
    return [
        {"$set": {"_grant": test}},
        {"$set": {"fence": when("_grant", NEXT_TOKEN, "fence")}},
        {
            "$set": {
                "holders": when("_grant", {"$concatArrays": [LIVE, [entry]]}, "holders"),
                "limit": when("_grant", limit, "limit"),
                "rev": when("_grant", bump_rev(), "rev"),
                "gc_at": when("_grant", gc_at(ttl_ms), "gc_at"),
            }
        },
        {"$unset": "_grant"},
    ]
