"""The library's own etcd layout: every entry of a key in a folder of its own.

Under the URL's root prefix (default ``celery-exclusive/``), the folder of a key ``K``
(:class:`~.kv.Names`) holds one entry per holder, ``h/<owner>``: JSON ``{"owner",
"limit", "holder"}``, attached to the holder process's etcd lease (:mod:`.connection`),
and the key's marks and records.

A grant is one transaction: "no holder key exists and no line" (``create_revision ==
0`` over the holder range and on the line key) puts the holder key; when that fails,
the same round trip reads the holders and the line, and if the line admits the
claimant (:func:`~..line.admit`) a second transaction puts the holder key and writes
the line back, guarded by "no holder key changed and the line is as read" (the
revisions read). ``wait()`` watches the key's folder from the revision it read.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Optional

from ..base import (
    NO_END,
    Backend,
    Capabilities,
    End,
    HeldKey,
    HoldersPage,
    LayoutVersion,
    Lease,
    LeaseInfo,
    MarkRead,
)
from ..limits import check_limit
from ..line import LINE, admit, first_in_line
from . import kv
from .connection import CAS_ATTEMPTS, EtcdConnection

#: Entries a page of held keys reads per key asked for: a holder or a few, its marks.
PAGE_ENTRIES = 6


class EtcdBackend(Backend):
    """The etcd store, in the library's own layout (see the module docstring)."""

    capabilities = Capabilities(limits=True, records=True, marks=True)
    layout_version = LayoutVersion("etcd", 1)
    connection_class = EtcdConnection
    recipes: ClassVar[Mapping[str, str]] = {
        "mutex": "celery_exclusive.backends.etcd.recipe:MutexBackend",
    }
    connection: EtcdConnection

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.names = kv.Names(self.connection.root)

    def _holder(self, lease: Lease) -> bytes:
        return self.names.holders(lease.key) + lease.owner.encode()

    # --- leases -----------------------------------------------------------------------

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
        value = json.dumps({"owner": owner, "limit": limit, "holder": dict(holder or {})})
        name = self.names.holders(key) + owner.encode()

        def grant(lease_id: str) -> Optional[tuple[int, bytes]]:
            token = self._grant(key, kv.put(name, value, lease_id), limit, claimant, read)
            return None if token is None else (token, name)

        granted = self.connection.acquire(owner, ttl, value, [name], grant)
        return None if granted is None else Lease(key, owner, granted[0], ttl, limit)

    def _grant(self, key, put, limit, claimant, read: Optional[MarkRead]) -> Optional[int]:
        action = f"acquiring {key!r}"
        holders, line = self.names.holders(key), self.names.mark(key, LINE)
        mark = [] if read is None else [kv.read(self.names.mark(read.key, read.kind))]
        reads = [kv.read(holders, prefix=True), kv.read(line), *mark]
        # First bet: nobody holds the key and nobody stands in line (one round trip).
        guard = [kv.compare(holders, "CREATE", "0", prefix=True), kv.compare(line, "CREATE", "0")]
        success = [put, *mark]
        for _ in range(CAS_ATTEMPTS):
            answer = self.connection.txn(action, guard, success, reads)
            if answer.get("succeeded"):
                kv.fill(read, answer)
                return kv.revision(answer)
            held, found = kv.kvs(answer["responses"][0]), kv.kvs(answer["responses"][1])
            check_limit(key, limit, [kv.record_of(entry).get("limit") for entry in held])
            line_value = kv.text_of(found[0]) if found else None
            admitted, rest = admit(line_value, claimant, limit - len(held), self.store_time())
            if not admitted:
                kv.fill(read, answer)
                return None
            # Then the grant takes the claimant out of the line, if no holder entry
            # changed and the line is as read.
            newer = str(kv.revision(answer) + 1)
            guard = [kv.compare(holders, "MOD", newer, "LESS", prefix=True)]
            guard.append(kv.unchanged(line, found))
            success = [put, *([] if rest == line_value else [kv.rewrite(line, rest)]), *mark]
        raise self.connection.contended(key)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        return self.connection.renew([(lease, self._holder(lease)) for lease in leases])

    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        if end != NO_END:
            return super().release(lease, end)
        return self.connection.release(lease, self._holder(lease))

    def _free_for(self, key: str, claimant: Optional[str]) -> tuple[bool, int]:
        """Whether ``claimant`` would find a free slot and be first in line, and the
        revision that answer is true at."""
        answer = self.connection.txn(
            f"reading {key!r}",
            [],
            [kv.read(self.names.holders(key), prefix=True), kv.read(self.names.mark(key, LINE))],
        )
        held, line = kv.kvs(answer["responses"][0]), kv.kvs(answer["responses"][1])
        limits = [kv.record_of(entry).get("limit") or 1 for entry in held]
        if held and len(held) >= min(limits):
            return False, kv.revision(answer)
        line_value = kv.text_of(line[0]) if line else None
        return first_in_line(line_value, claimant, self.store_time()), kv.revision(answer)

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        deadline = time.monotonic() + timeout
        folder = self.names.folder(key)
        while True:
            free, revision = self._free_for(key, claimant)
            remaining = deadline - time.monotonic()
            if free or remaining <= 0:
                return
            request = kv.ranged(folder, prefix=True, start_revision=str(revision + 1))
            self.connection.watch(request, remaining, f"waiting on {key!r}")

    # --- the operators' view ------------------------------------------------------------

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        infos = [info for held in self._page(prefix).keys for info in held.leases]
        return sorted(infos, key=lambda info: (info.key, info.fencing_token))

    def holders_of(self, key: str) -> list[LeaseInfo]:
        action = f"reading {key!r}"
        found = self.connection.call(action, "kv/range", kv.ranged(self.names.holders(key), True))
        rows = [(key, entry) for entry in found.get("kvs", [])]
        return sorted(self.connection.holders(rows, action), key=lambda i: i.fencing_token)

    def holders_page(
        self,
        prefix: str = "",
        cursor: Optional[str] = None,
        count: int = 100,
        kinds: Sequence[str] = (),
    ) -> HoldersPage:
        return self._page(prefix, cursor, count, kinds)

    def _page(self, prefix, cursor=None, count: Optional[int] = None, kinds=()) -> HoldersPage:
        """Up to ``count`` held keys (None: all): one range over the keys' folders
        (holders and marks side by side, in the order of their encoded names), then the
        time to live of each holder process's etcd lease on it: a few, however many keys
        it holds."""
        action = f"listing holders under {prefix!r}"
        start = self.names.keys + kv.encode(prefix)
        begin = start if cursor is None else kv.range_end(self.names.folder(cursor))
        limit = {} if count is None else {"limit": count * PAGE_ENTRIES}
        body = {**kv.ranged(begin), "range_end": kv.b64(kv.range_end(start)), **limit}
        answer = self.connection.call(action, "kv/range", body)
        folders: dict[str, tuple[list, dict]] = {}
        for entry in answer.get("kvs", []):
            key, kind, rest = self.names.parse(kv.unb64(entry["key"]))
            held, marks = folders.setdefault(key, ([], {}))
            if kind == b"h":
                held.append((key, entry))
            elif kind == b"m" and kv.decode(rest) in kinds:
                marks[kv.decode(rest)] = kv.text_of(entry)
        order = list(folders)
        if answer.get("more") and len(order) > 1:
            order.pop()  # may be cut short by the limit: the next page reads it whole
        keys: list[HeldKey] = []
        last = None
        for key in order:
            if len(keys) == count:
                break
            last = key
            infos = self.connection.holders(folders[key][0], action)
            if infos and key.startswith(prefix):
                infos.sort(key=lambda info: info.fencing_token or 0)
                keys.append(HeldKey(key, tuple(infos), folders[key][1]))
        done = last is None or (last == order[-1] and not answer.get("more"))
        return HoldersPage(keys, None if done else last)

    def force_release(self, key: str) -> int:
        """Delete the key's holder entries this store wrote (named after the owner their
        record names); another client's keys under the same prefix (an ``etcdctl lock``
        pointed at it) are left alone."""
        return self.connection.force_release(self.names.holders(key), f"force-releasing {key!r}")

    # --- records and marks ------------------------------------------------------------

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        action = f"reading the record {name!r}"
        return self.connection.get(self.names.record(lease_key, name), action)

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        record = self.names.record(lease.key, name)
        return self.connection.write_if_held(lease, self._holder(lease), record, value)

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        action = f"reading the {kind} mark of {key!r}"
        return self.connection.get(self.names.mark(key, kind), action)

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        action = f"changing the {kind} mark of {key!r}"
        return self.connection.swap(self.names.mark(key, kind), expected, new, ttl, action)

    # --- the store's clock, the start-up check ---------------------------------------

    def store_time(self) -> float:
        return self.connection.store_time()

    def check(self, probe_key: str) -> list[str]:
        return super().check(probe_key) + self.connection.warnings()
