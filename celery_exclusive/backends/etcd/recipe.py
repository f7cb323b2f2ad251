"""``?recipe=mutex``: leases taken as etcd's own concurrency mutex, on the key's own name.

etcd's v3 client ships one lock, ``concurrency.Mutex`` (client/v3/concurrency/mutex.go),
which ``etcdctl lock <name>`` takes: ``NewMutex(s, pfx)`` locks the prefix ``pfx + "/"``;
``tryAcquire`` puts ``pfx/<session lease id, hex>`` (empty value, attached to the
session's lease) if it does not exist yet, and reads ``OpGet(pfx, WithFirstCreate())``:
the key of the lowest create revision under the prefix holds the lock, every later
key is a waiter in line. ``Lock`` then waits (``waitDeletes`` in key.go) until every key
created before its own is deleted, one at a time: it watches the last of them from the
revision it read, for its deletion; ``TryLock`` deletes its key and returns
``ErrLocked`` instead; ``Unlock`` deletes the key. A holder that dies stops keeping its
session's lease alive, and etcd deletes its key when the lease expires.

With ``etcd://host:2379/<root>?recipe=mutex``, a lease key ``K`` is the mutex named
``<root>/K`` (just ``K`` without a root): a task with ``exclusive_key_prefix=""`` and
``exclusive_key="invoice:{invoice_id}"`` holds the mutex ``etcdctl lock invoice:7``
takes. So:

- **Our holder** makes a foreign client wait or fail as another mutex holder would. A
  grant without a wait puts our key ``<root>/K/<owner>`` only while the prefix is empty
  (one transaction, no key left behind on a refusal, where ``TryLock`` puts and
  deletes), attached to our process's etcd lease; a foreign ``Lock`` queues behind it
  and gets the lock when our release deletes it, a ``TryLock`` fails with ``ErrLocked``.
- **Our waiters stand in etcd's queue**, as ``Lock`` does: a claimant that joins the
  key's line puts its own key under the prefix in the same transaction (JSON naming
  the claimant, attached to the line's etcd lease, so it lives no longer than its
  place in line), and the change that takes it out of the line (it gave up, or its
  place lapsed) deletes the key. Its grant comes when its key is the first created
  under the prefix: the same key becomes our holder, keeping its place. Meanwhile it
  watches the key just before its own, for its deletion. Clients that re-lock back to
  back therefore take their turns behind it, not before it; and as etcd serves the
  queue first come, first served, a priority caller cannot pass a waiter standing in it.
- **A foreign holder** (the first key under the prefix that is not ours) makes our
  duplicates skip, wait or requeue, and is named.
- **Never touched**: only keys of ours (JSON naming their owner or claimant) are ever
  deleted, ``force_release`` included (as everywhere in this store); a foreign holder
  or waiter key never is.

Our fencing token stays ours: the revision of the write that granted our key, which
rises with every write to the cluster. A foreign holder gets no token of ours (its own
``Header()`` revision is its fence), and nothing fences its writes but what it does
itself.

The rest of a key (its line, marks, records) lives apart, in the store's own encoding
under ``<root>/.celery-exclusive/``, which no key may name. Mutex names nest as etcd's
do: ``a`` and ``a/b`` share keys under ``a/``, so lock one or the other. One holder
per key: the layout has no ``limits``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Optional

from ...errors import ConfigurationError
from ..base import NO_END, Backend, Capabilities, End, LayoutVersion, Lease, LeaseInfo, MarkRead
from ..line import LINE, admit, entries_of, first_in_line, until_of
from . import kv
from .connection import CAS_ATTEMPTS, EtcdConnection

#: Where the store keeps what is only its own, under the URL's root.
OWN = ".celery-exclusive/"
FOREIGN = "an etcd concurrency mutex holder (etcdctl lock, concurrency.NewMutex)"


class MutexBackend(Backend):
    """The etcd store speaking the concurrency mutex (see the module docstring)."""

    capabilities = Capabilities(records=True, marks=True)
    layout_version = LayoutVersion("etcd+mutex", 1)
    connection_class = EtcdConnection
    recipe = "mutex"
    #: Waiters are served as etcd serves its queue, in the order they came: no priority
    #: passes a waiter standing in it (see the module docstring).
    first_come_only: ClassVar[bool] = True
    connection: EtcdConnection

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.root = self.connection.root.encode("utf-8", "surrogatepass")
        self.own = kv.Names(self.connection.root + OWN)
        #: (key, owner) -> the name of our holder key, for the grants of this process
        self._held: dict[tuple[str, str], bytes] = {}

    def _mutex(self, key: str) -> bytes:
        """The prefix etcd's ``NewMutex(session, <root>K)`` locks."""
        return self.root + key.encode("utf-8", "surrogatepass") + b"/"

    def _holder(self, lease: Lease) -> bytes:
        """Our key of ``lease``: named after its owner, or the waiter's key it was
        granted with."""
        return self._held.get(
            (lease.key, lease.owner), self._mutex(lease.key) + lease.owner.encode()
        )

    def _queue(self, key: str, action: str) -> tuple[list[dict], Optional[str], int]:
        """The keys under the mutex's prefix in etcd's order (:func:`_in_order`), the
        key's line, and the revision they were read at."""
        reads = [kv.read(self._mutex(key), prefix=True), kv.read(self.own.mark(key, LINE))]
        answer = self.connection.txn(action, [], reads)
        line = kv.kvs(answer["responses"][1])
        queue = _in_order(kv.kvs(answer["responses"][0]))
        return queue, kv.text_of(line[0]) if line else None, kv.revision(answer)

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
        names = [self._mutex(key) + owner.encode()]  # where a grant may write: it adds to them

        def grant(lease_id: str) -> Optional[tuple[int, bytes]]:
            return self._grant(key, value, lease_id, claimant, read, names)

        granted = self.connection.acquire(owner, ttl, value, names, grant)
        if granted is None:
            return None
        self._held[key, owner] = granted[1]
        return Lease(key, owner, granted[0], ttl, limit)

    def _grant(
        self,
        key: str,
        value: str,
        lease_id: str,
        claimant: Optional[str],
        read: Optional[MarkRead],
        names: list[bytes],
    ) -> Optional[tuple[int, bytes]]:
        """Put our key while nothing is under the mutex's prefix and the line admits the
        claimant; or, when the claimant's key in etcd's queue is first, make it ours.
        The token is the revision of that write."""
        action = f"acquiring {key!r}"
        mutex, line = self._mutex(key), self.own.mark(key, LINE)
        mark = [] if read is None else [kv.read(self.own.mark(read.key, read.kind))]
        reads = [kv.read(mutex, prefix=True), kv.read(line), *mark]
        empty = kv.compare(mutex, "CREATE", "0", prefix=True)
        name, guard, change = names[0], [empty, kv.compare(line, "CREATE", "0")], []
        for _ in range(CAS_ATTEMPTS):
            success = [kv.put(name, value, lease_id), *change, *mark]
            answer = self.connection.txn(action, guard, success, reads)
            if answer.get("succeeded"):
                kv.fill(read, answer)
                return kv.revision(answer), name
            queue, found = _in_order(kv.kvs(answer["responses"][0])), kv.kvs(answer["responses"][1])
            line_value = kv.text_of(found[0]) if found else None
            if queue and claimant is not None and _waiter(queue[0]) == claimant:
                # Its turn in etcd's queue: its key becomes our holder (nothing can be
                # created before it any more), and the grant takes it out of the line.
                name = kv.unb64(queue[0]["key"])
                names.append(name)
                guard = [kv.unchanged(name, queue[:1])]
                rest = [e for e in entries_of(line_value) if e["id"] != claimant]
                rest_value = json.dumps(rest) if rest else None
            else:
                now = self.store_time()
                admitted, rest_value = admit(line_value, claimant, 1 - len(queue), now)
                if not admitted:
                    kv.fill(read, answer)
                    return None
                name, guard = names[0], [empty]
            guard.append(kv.unchanged(line, found))
            change = [] if rest_value == line_value else [kv.rewrite(line, rest_value)]
        raise self.connection.contended(key)

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        lost = self.connection.renew([(lease, self._holder(lease)) for lease in leases])
        for lease in lost:
            self._held.pop((lease.key, lease.owner), None)
        return lost

    def release(self, lease: Lease, end: End = NO_END) -> Optional[bool]:
        if end != NO_END:
            return super().release(lease, end)
        name = self._held.pop((lease.key, lease.owner), None)
        if name is None:  # granted in another process (whose holder died, say): look it up
            queue, _, _ = self._queue(lease.key, f"releasing {lease.key!r}")
            found = [e["key"] for e in queue if kv.owner_of(e) == lease.owner]
            name = kv.unb64(found[0]) if found else self._holder(lease)
        return self.connection.release(lease, name)

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        deadline = time.monotonic() + timeout
        while True:
            queue, line_value, revision = self._queue(key, f"reading {key!r}")
            waiters = [_waiter(entry) for entry in queue]
            place = waiters.index(claimant) if claimant and claimant in waiters else -1
            if place < 0:  # not in etcd's queue: wait for any change
                free = not queue and first_in_line(line_value, claimant, self.store_time())
                request = kv.ranged(self._mutex(key), prefix=True)
            else:  # as waitDeletes: for the deletion of the key just before its own
                free = place == 0
                before = kv.unb64(queue[place - 1]["key"])
                request = {**kv.ranged(before), "filters": ["NOPUT"]}
            remaining = deadline - time.monotonic()
            if free or remaining <= 0:
                return
            request["start_revision"] = str(revision + 1)
            self.connection.watch(request, remaining, f"waiting on {key!r}")

    # --- the operators' view ------------------------------------------------------------

    def holders_of(self, key: str) -> list[LeaseInfo]:
        action = f"reading {key!r}"
        # Every key under the mutex's prefix, first created first: what etcd's
        # OpGet(pfx, WithFirstCreate()) ranks (a nested name's keys included).
        queue, _, _ = self._queue(key, action)
        if not queue or _waiter(queue[0]) is not None:
            return []  # nobody holds it, or a waiter of ours is about to
        first = queue[0]  # the mutex's holder; the others wait in its line
        if kv.owner_of(first) is not None:
            return self.connection.holders([(key, first)], action)
        name = kv.unb64(first["key"]).decode("utf-8", "replace")
        lease = first.get("lease")  # etcd's lease ids as etcdctl and the mutex write them
        on = f" on the etcd lease {int(lease):x}" if lease else " on no etcd lease"
        waiting = f", {len(queue) - 1} more in its line" if len(queue) > 1 else ""
        described = {"foreign": f"{FOREIGN} with the key {name!r}{on}{waiting}"}
        expires_in, _ = self.connection.time_to_live(lease, action)
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
        name = self.own.mark(key, kind)
        if kind != LINE:
            return self.connection.swap(name, expected, new, ttl, action)
        queue, _, _ = self._queue(key, action)

        def in_step(lease: Optional[str]) -> tuple[list, list]:
            return self._in_step(key, queue, expected, new, lease)

        return self.connection.swap(name, expected, new, ttl, action, in_step)

    def _in_step(
        self,
        key: str,
        queue: list[dict],
        before: Optional[str],
        after: Optional[str],
        lease: Optional[str],
    ) -> tuple[list, list]:
        """etcd's queue kept in step with the line, in the line's own transaction (its
        conditions and writes): a claimant that joins the line puts its key at the back
        of the queue, one that renews its place renews its key, both on the line's new
        etcd lease; one that left the line, or whose place lapsed, deletes its key."""
        stays = {e["id"]: until_of(e) for e in entries_of(after, self.store_time())}
        renewed = {(e["id"], until_of(e)) for e in entries_of(before)}
        waiting = {_waiter(e): e for e in queue if _waiter(e) is not None}
        guards, writes = [], []
        for claimant, entry in waiting.items():
            if (claimant, stays.get(claimant)) not in renewed:
                name = kv.unb64(entry["key"])
                guards.append(kv.unchanged(name, [entry]))
                waiter = json.dumps({"waiter": claimant})
                writes.append(kv.put(name, waiter, lease) if claimant in stays else kv.delete(name))
        # Keys put in one transaction share their create revision: names keep the order.
        joining = uuid.uuid4().hex[:24]
        for place, claimant in enumerate(c for c in stays if c not in waiting):
            name = self._mutex(key) + f"{joining}{place:08x}".encode()
            writes.append(kv.put(name, json.dumps({"waiter": claimant}), lease))
        return guards, writes

    # --- the store's clock, the start-up check ---------------------------------------

    def store_time(self) -> float:
        return self.connection.store_time()

    def check(self, probe_key: str) -> list[str]:
        return super().check(probe_key) + self.connection.warnings()


def _in_order(entries: list[dict]) -> list[dict]:
    """Keys under a mutex's prefix as etcd serves them: first created first (keys
    created in one transaction, as ours can be, by name)."""
    return sorted(entries, key=lambda entry: (kv.created(entry), kv.unb64(entry["key"])))


def _waiter(entry: dict) -> Optional[str]:
    """The claimant a key of ours stands in etcd's queue for; None for any other key."""
    claimant = kv.record_of(entry).get("waiter")
    return claimant if isinstance(claimant, str) else None
