"""Marks and records: what the library keeps beside a key, in the key's document of the
store's own collection (:mod:`.expressions`), whichever layout holds its leases. A mark
is changed only by compare-and-swap, by the server's clock; a record is read here and
written by each layout, fenced its own way."""

from __future__ import annotations

import math
import uuid
from typing import Optional, Protocol

from . import expressions as x
from .connection import MongoDBConnection, upsert


class Layout(Protocol):
    """A layout of the store: each takes these functions as its methods."""

    connection: MongoDBConnection


def read_mark(store: Layout, key: str, kind: str) -> Optional[str]:
    found = store.connection.aggregate(
        f"reading the {kind} mark of {key!r}", {"_id": key}, {"v": x.live_mark(x.field(kind))}
    )
    return found[0].get("v") if found else None


def swap_mark(
    store: Layout,
    key: str,
    kind: str,
    expected: Optional[str],
    new: Optional[str],
    ttl: float,
) -> bool:
    connection, field = store.connection, x.field(kind)
    ttl_ms = max(1, math.ceil(ttl * 1000))
    action = f"changing the {kind} mark of {key!r}"
    live = x.mark_is_live(field)
    if expected is not None:
        # The document exists (its mark is live): an update, no upsert, may say so in
        # its query.
        query = {
            "_id": key,
            "$expr": {"$and": [live, {"$eq": [f"$marks.{field}.v", {"$literal": expected}]}]},
        }
        if new is None:
            update = [{"$unset": f"marks.{field}"}, {"$set": {"rev": x.bump_rev()}}]
        else:
            mark = {"v": {"$literal": new}, "exp": {"$add": [x.NOW, ttl_ms]}}
            changes = {f"marks.{field}": mark, "rev": x.bump_rev(), "gc_at": x.gc_at(ttl_ms)}
            update = [{"$set": changes}]
        return connection.run(action, lambda c: c.update_one(query, update).matched_count > 0)
    if new is None:  # "delete it if absent": only a live mark makes it false
        query = {"_id": key, "$expr": live}
        return connection.run(action, lambda c: c.find_one(query, {"_id": 1})) is None
    # Create where there is none: an upsert, so the test is in the pipeline, and a
    # token of this call's own in the mark tells whether it was this call that set it.
    token = uuid.uuid4().hex
    mark = {"v": {"$literal": new}, "exp": {"$add": [x.NOW, ttl_ms]}, "s": token}
    update = [
        {"$set": {"_swap": {"$not": [live]}}},
        {
            "$set": {
                f"marks.{field}": x.when("_swap", mark, f"marks.{field}"),
                "rev": x.when("_swap", x.bump_rev(), "rev"),
                "gc_at": x.when("_swap", x.gc_at(ttl_ms), "gc_at"),
            }
        },
        {"$unset": "_swap"},
    ]
    found = connection.run(action, lambda c: upsert(c, key, update, {f"marks.{field}.s": 1}))
    return ((found or {}).get("marks") or {}).get(field, {}).get("s") == token


def read_record(store: Layout, lease_key: str, name: str) -> Optional[str]:
    doc = store.connection.run(
        f"reading the record {name!r} of {lease_key!r}",
        lambda c: c.find_one({"_id": lease_key}, {"records": 1}),
    )
    for record in (doc or {}).get("records") or []:
        if record.get("n") == name:
            return record.get("v")
    return None
