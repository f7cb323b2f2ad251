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
per key: ``exclusive_limit`` must be 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Optional
from urllib.parse import unquote, urlsplit

from ...errors import ConfigurationError
from ..base import Lease, LeaseInfo
from .backend import EtcdBackend, _encode, _Layout, _owner_of, _range
from .client import parse_json, unb64

#: The value of ``?recipe=`` this module speaks.
RECIPE = "mutex"
#: Where the store keeps what is only its own, under the URL's root.
OWN = ".celery-exclusive/"
FOREIGN = "an etcd concurrency mutex holder (etcdctl lock, concurrency.NewMutex)"


def _name(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


class MutexLayout(_Layout):
    """The mutex of ``K`` at ``<root>K/``; the store's own entries of ``K`` in its usual
    encoding under ``<root>.celery-exclusive/``."""

    def __init__(self, root: str) -> None:
        super().__init__(root + OWN)
        self.names = _name(root)

    def holders(self, key: str) -> bytes:
        return self.names + _name(key) + b"/"

    def holder(self, key: str, owner: str) -> bytes:
        return self.holders(key) + owner.encode()

    def folder(self, key: str) -> bytes:
        return self.holders(key)  # what wait() watches: the mutex's prefix

    def mark(self, key: str, kind: str) -> bytes:
        return super().folder(key) + b"m/" + _encode(kind)

    def record(self, key: str, name: str) -> bytes:
        return super().folder(key) + b"r/" + _encode(name)

    def parse(self, name: bytes) -> tuple[str, bytes]:
        key = name[len(self.names) :].rpartition(b"/")[0]
        return key.decode("utf-8", "surrogatepass"), b"h"


class MutexBackend(EtcdBackend, recipe=True):
    """The etcd store speaking the concurrency mutex (see the module docstring)."""

    #: One holder per key, as the recipe has.
    capabilities = replace(EtcdBackend.capabilities, limits=False)

    def __init__(self, url: str) -> None:
        super().__init__(url)
        path = unquote(urlsplit(url).path).strip("/")
        self.root = path + "/" if path else ""
        self.layout = MutexLayout(self.root)

    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
    ) -> Optional[Lease]:
        if limit != 1:
            raise ConfigurationError(
                f"{self.safe_url} speaks etcd's concurrency mutex, which has one holder per "
                f"key, but {key!r} was asked for with exclusive_limit={limit}: use a store "
                "URL without ?recipe= for limits."
            )
        if not key or key.startswith(OWN):
            raise ConfigurationError(
                f"the lease key {key!r} cannot be an etcd mutex name in {self.safe_url}: "
                f"with ?recipe={RECIPE} it must be non-empty and not start with {OWN!r} "
                "(the store's own entries); change exclusive_key or exclusive_key_prefix."
            )
        return super().try_acquire(key, owner, ttl, limit, holder, claimant)

    def _contenders(self, key: str, action: str) -> list[dict]:
        """Every key under the mutex's prefix, first created first: what etcd's
        ``OpGet(pfx, WithFirstCreate())`` ranks (a nested name's keys included)."""
        prefix = self.layout.holders(key)
        answer = self._call(action, "kv/range", _range(prefix, prefix=True)["request_range"])
        return sorted(answer.get("kvs", []), key=lambda kv: int(kv["create_revision"]))

    def holders_of(self, key: str) -> list[LeaseInfo]:
        action = f"reading {key!r}"
        contenders = self._contenders(key, action)
        if not contenders:
            return []
        first = contenders[0]  # the mutex's holder; the others wait in its line
        value = parse_json(unb64(first.get("value")))
        ttl = self._time_to_live(first.get("lease"), action)
        if _owner_of(first) is not None:
            return [
                LeaseInfo(
                    key, value["owner"], int(first["create_revision"]), ttl, value.get("holder", {})
                )
            ]
        name = unb64(first["key"]).decode("utf-8", "replace")
        waiting = f", {len(contenders) - 1} more in its line" if len(contenders) > 1 else ""
        described = {"foreign": f"{FOREIGN} with the key {name!r}{waiting}"}
        return [LeaseInfo(key, name, None, ttl, described)]

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        # Ours only: under a prefix, nothing tells a foreign mutex from other data.
        start = self.layout.names + _name(prefix)
        answer = self._call(
            f"listing holders under {prefix!r}",
            "kv/range",
            _range(start, prefix=True)["request_range"],
        )
        keys = set()
        for kv in answer.get("kvs", []):
            name = unb64(kv["key"])
            if name.startswith(self.layout.keys) or "owner" not in parse_json(
                unb64(kv.get("value"))
            ):
                continue
            keys.add(self.layout.parse(name)[0])
        return [
            info
            for key in sorted(k for k in keys if k.startswith(prefix))
            for info in self.holders_of(key)
            if info.fencing_token is not None
        ]
