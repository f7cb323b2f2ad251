"""``?recipe=mutex``: leases taken as etcd's own concurrency mutex, on the key's own name.

etcd's v3 client ships one lock, ``concurrency.Mutex`` (client/v3/concurrency/mutex.go),
which ``etcdctl lock <name>`` takes: ``NewMutex(s, pfx)`` locks the prefix ``pfx + "/"``;
``tryAcquire`` puts ``pfx/<session lease id, hex>`` (empty value, attached to the
session's lease) if it does not exist yet, and reads ``OpGet(pfx, WithFirstCreate())``:
the key of the lowest create revision under the prefix holds the lock, every later
key is a waiter in line. ``Lock`` then waits (``waitDeletes``) until every key created
before its own is deleted; ``TryLock`` deletes its key and returns ``ErrLocked``
instead; ``Unlock`` deletes the key. A holder that dies stops keeping its session's
lease alive, and etcd deletes its key when the lease expires.

With ``etcd://host:2379/<root>?recipe=mutex``, a lease key ``K`` is the mutex named
``<root>/K`` (just ``K`` without a root): a task with ``exclusive_key_prefix=""`` and
``exclusive_key="invoice:{invoice_id}"`` holds the mutex ``etcdctl lock invoice:7``
takes. So:

- **Our holder** makes a foreign client wait or fail as another mutex holder would: a
  grant puts our key ``<root>/K/<owner>`` only while the prefix is empty (one
  transaction, no key left behind on a refusal, where ``TryLock`` puts and deletes),
  attached to our process's etcd lease; a foreign ``Lock`` queues behind it and gets
  the lock when our release deletes it, a ``TryLock`` fails with ``ErrLocked``.
- **A foreign holder** (any key under the prefix: its holder, or a waiter about to
  become one) makes our duplicates skip, wait or requeue, and is named. Our waiters
  watch the prefix, so its release wakes them at once (a waiter of ours that leaves
  our line changes nothing there: the one behind it notices at its next look, within
  a third of the lease ttl).
- **Never touched**: only keys of ours (JSON naming their owner) are ever deleted,
  ``force_release`` included (as everywhere in this store); a foreign holder or
  waiter key never is.

Our fencing token stays ours: the create revision of our key, which rises with every
write to the cluster. A foreign holder gets no token of ours (its own ``Header()``
revision is its fence), and nothing fences its writes but what it does itself.

The rest of a key (its line, marks, records) lives apart, in the store's own encoding
under ``<root>/.celery-exclusive/``, which no key may name. Mutex names nest as etcd's
do: ``a`` and ``a/b`` share keys under ``a/``, so lock one or the other. One holder
per key: the layout has no ``limits``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import Any, Optional

from ...errors import ConfigurationError
from ..base import NO_END, Backend, Capabilities, End, Lease, LeaseInfo, MarkRead
from ..line import LINE, admit, first_in_line
from . import kv
from .connection import CAS_ATTEMPTS, EtcdConnection

#: Where the store keeps what is only its own, under the URL's root.
OWN = ".celery-exclusive/"
FOREIGN = "an etcd concurrency mutex holder (etcdctl lock, concurrency.NewMutex)"


class MutexBackend(Backend):
    """The etcd store speaking the concurrency mutex (see the module docstring)."""

    capabilities = Capabilities(records=True, marks=True)
    connection_class = EtcdConnection
    recipe = "mutex"
    connection: EtcdConnection

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.root = self.connection.root.encode("utf-8", "surrogatepass")
        self.own = kv.Names(self.connection.root + OWN)

    def _mutex(self, key: str) -> bytes:
        """The prefix etcd's ``NewMutex(session, <root>K)`` locks."""
        return self.root + key.encode("utf-8", "surrogatepass") + b"/"

    def _holder(self, lease: Lease) -> bytes:
        return self._mutex(lease.key) + lease.owner.encode()

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
        if not key or key.startswith(OWN):
            raise ConfigurationError(
                f"the lease key {key!r} cannot be an etcd mutex name in {self.safe_url}: "
                f"with ?recipe={self.recipe} it must be non-empty and not start with {OWN!r} "
                "(the store's own entries); change exclusive_key or exclusive_key_prefix."
            )
        value = json.dumps({"owner": owner, "limit": limit, "holder": dict(holder or {})})
        name = self._mutex(key) + owner.encode()

        def grant(lease_id: str) -> Optional[tuple[int, bytes]]:
            token = self._grant(key, kv.put(name, value, lease_id), claimant, read)
            return None if token is None else (token, name)

        granted = self.connection.acquire(owner, ttl, value, [name], grant)
        return None if granted is None else Lease(key, owner, granted[0], ttl, limit)

    def _grant(self, key, put, claimant, read: Optional[MarkRead]) -> Optional[int]:
        """Put our key while nothing is under the mutex's prefix and the line admits the
        claimant; the token is the revision of the put."""
        action = f"acquiring {key!r}"
        mutex, line = self._mutex(key), self.own.mark(key, LINE)
        mark = [] if read is None else [kv.read(self.own.mark(read.key, read.kind))]
        reads = [kv.read(mutex, prefix=True, keys_only=True), kv.read(line), *mark]
        empty = kv.compare(mutex, "CREATE", "0", prefix=True)
        guard, success = [empty, kv.compare(line, "CREATE", "0")], [put, *mark]
        for _ in range(CAS_ATTEMPTS):
            answer = self.connection.txn(action, guard, success, reads)
            if answer.get("succeeded"):
                kv.fill(read, answer)
                return kv.revision(answer)
            held, found = kv.kvs(answer["responses"][0]), kv.kvs(answer["responses"][1])
            line_value = kv.text_of(found[0]) if found else None
            admitted, rest = admit(line_value, claimant, 1 - len(held), self.store_time())
            if not admitted:
                kv.fill(read, answer)
                return None
            guard = [empty, kv.unchanged(line, found)]
            success = [put, *([] if rest == line_value else [kv.rewrite(line, rest)]), *mark]
        raise self.connection.contended(key)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        return self.connection.renew([(lease, self._holder(lease)) for lease in leases])

    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        if end != NO_END:
            return super().release(lease, end)
        return self.connection.release(lease, self._holder(lease))

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        deadline = time.monotonic() + timeout
        mutex = self._mutex(key)
        while True:
            answer = self.connection.txn(
                f"reading {key!r}",
                [],
                [kv.read(mutex, prefix=True, count_only=True), kv.read(self.own.mark(key, LINE))],
            )
            held = int(answer["responses"][0].get("response_range", {}).get("count", 0))
            found = kv.kvs(answer["responses"][1])
            line_value = kv.text_of(found[0]) if found else None
            free = not held and first_in_line(line_value, claimant, self.store_time())
            remaining = deadline - time.monotonic()
            if free or remaining <= 0:
                return
            request = kv.ranged(mutex, prefix=True, start_revision=str(kv.revision(answer) + 1))
            self.connection.watch(request, remaining, f"waiting on {key!r}")

    # --- the operators' view ------------------------------------------------------------

    def holders_of(self, key: str) -> list[LeaseInfo]:
        action = f"reading {key!r}"
        # Every key under the mutex's prefix, first created first: what etcd's
        # OpGet(pfx, WithFirstCreate()) ranks (a nested name's keys included).
        answer = self.connection.call(action, "kv/range", kv.ranged(self._mutex(key), True))
        contenders = sorted(answer.get("kvs", []), key=kv.created)
        if not contenders:
            return []
        first = contenders[0]  # the mutex's holder; the others wait in its line
        if kv.owner_of(first) is not None:
            return self.connection.holders([(key, first)], action)
        name = kv.unb64(first["key"]).decode("utf-8", "replace")
        waiting = f", {len(contenders) - 1} more in its line" if len(contenders) > 1 else ""
        described = {"foreign": f"{FOREIGN} with the key {name!r}{waiting}"}
        expires_in, _ = self.connection.time_to_live(first.get("lease"), action)
        return [LeaseInfo(key, name, None, expires_in, described)]

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        # Ours only: under a prefix, nothing tells a foreign mutex from other data. An
        # entry of ours is its mutex's holder (the first created under its prefix).
        start = self.root + prefix.encode("utf-8", "surrogatepass")
        action = f"listing holders under {prefix!r}"
        found = self.connection.call(action, "kv/range", kv.ranged(start, prefix=True))
        rows = []
        for entry in found.get("kvs", []):
            name = kv.unb64(entry["key"])[len(self.root) :]
            key = name.rpartition(b"/")[0].decode("utf-8", "surrogatepass")
            if kv.owner_of(entry) is not None and not key.startswith(OWN):
                rows.append((key, entry))
        infos = self.connection.holders(rows, action)
        return sorted((i for i in infos if i.key.startswith(prefix)), key=lambda i: i.key)

    def force_release(self, key: str) -> int:
        """Delete our holder of the mutex; a foreign holder or waiter is left alone."""
        return self.connection.force_release(self._mutex(key), f"force-releasing {key!r}")

    # --- records and marks, apart from the mutex --------------------------------------

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        action = f"reading the record {name!r}"
        return self.connection.get(self.own.record(lease_key, name), action)

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        record = self.own.record(lease.key, name)
        return self.connection.write_if_held(lease, self._holder(lease), record, value)

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        action = f"reading the {kind} mark of {key!r}"
        return self.connection.get(self.own.mark(key, kind), action)

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        action = f"changing the {kind} mark of {key!r}"
        return self.connection.swap(self.own.mark(key, kind), expected, new, ttl, action)

    # --- the store's clock, the start-up check ---------------------------------------

    def store_time(self) -> float:
        return self.connection.store_time()

    def check(self, probe_key: str) -> list[str]:
        return super().check(probe_key) + self.connection.warnings()
