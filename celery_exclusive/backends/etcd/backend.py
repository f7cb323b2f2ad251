"""The etcd v3 lease store: keys attached to one etcd lease per process and ttl.

Layout, under the URL's root prefix ``R`` (default ``celery-exclusive/``), for a key
``K`` percent-encoded as ``E`` (every byte but ``A-Za-z0-9_.-~`` escaped, so ``E``
never contains ``/`` and one key's folder ``R k/E/`` never holds another key's
entries, whatever its characters):

``R k/E/h/<owner>``  one per holder: JSON ``{"owner", "limit", "holder"}``, attached to
                     the holder process's etcd lease. Its create_revision is the
                     fencing token: etcd revisions are cluster-wide and only rise.
``R k/E/m/<kind>``   the ``kind`` mark of ``K``, attached to an etcd lease of its own
                     ttl: the server expires it.
``R k/E/r/<name>``   record ``name`` (percent-encoded) of ``K``, no lease: it stays.

A grant is one transaction: "no holder key exists and no line" (``create_revision ==
0`` over the holder range and on the line key) puts the holder key; when that fails,
the same round trip reads the holders and the line, and if the line admits the
claimant (:func:`~..line.admit`) a second transaction puts the holder key and writes
the line back, guarded by "no holder key changed and the line is as read" (the
revisions read). ``wait()`` watches ``R k/E/`` from the revision it read.

Each process keeps one etcd lease per distinct lease ttl (whole seconds, rounded up),
granted on its first acquire and kept alive by ``renew()`` (the heartbeat). A process
that dies stops renewing it, and etcd deletes every key attached to it after its ttl.
A key put on that shared lease lives only as long as the lease has left, so the lease
is granted LEASE_SLACK seconds longer than the ttl and an acquire first keeps it alive
when it was last kept alive more than LEASE_SLACK ago: every grant outlives its ttl.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional
from urllib.parse import quote, unquote

import requests

from ...errors import BackendUnavailable, ExclusiveError
from ..base import Backend, Capabilities, HeldKey, HoldersPage, Lease, LeaseInfo
from ..limits import check_limit
from ..line import LINE, admit, first_in_line
from ..readback import budget, settle_acquire, settle_release
from .client import (
    NOT_FOUND,
    EtcdError,
    Gateway,
    b64,
    cause_of,
    header_revision,
    maybe_sent,
    parse_json,
    settings_from_url,
    translate,
    unb64,
)

#: Times a grant retries when another contender changed the key between read and write.
CAS_ATTEMPTS = 8
#: Operations per transaction (etcd's default --max-txn-ops is 128).
MAX_TXN_OPS = 100
#: Seconds a key whose acquire answer was lost stays on the list of keys to delete: a
#: write etcd had in its pipeline lands within that. A key whose release failed stays
#: on it until a delete succeeds: this process keeps its etcd lease alive, and so the key.
ORPHAN_SECONDS = 60.0
#: Seconds a process's etcd lease outlives the ttl it serves: a key put on it within
#: that long after the lease was last kept alive still lives a full ttl.
LEASE_SLACK = 1
#: Entries a page of held keys reads per key asked for: a holder or a few, its marks.
PAGE_ENTRIES = 6


def _range_end(prefix: bytes) -> bytes:
    """The end of the range of every key starting with ``prefix`` (etcd's ``--prefix``)."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


def _encode(text: str) -> bytes:
    return quote(text, safe="", errors="surrogatepass").encode("ascii")


def _decode(text: bytes) -> str:
    return unquote(text.decode("ascii"), errors="surrogatepass")


class _Layout:
    def __init__(self, root: str) -> None:
        self.keys = root.encode() + b"k/"

    def folder(self, key: str) -> bytes:
        return self.keys + _encode(key) + b"/"

    def holders(self, key: str) -> bytes:
        return self.folder(key) + b"h/"

    def holder(self, key: str, owner: str) -> bytes:
        return self.holders(key) + owner.encode()

    def mark(self, key: str, kind: str) -> bytes:
        return self.folder(key) + b"m/" + _encode(kind)

    def record(self, key: str, name: str) -> bytes:
        return self.folder(key) + b"r/" + _encode(name)

    def parse(self, name: bytes) -> tuple[str, bytes]:
        """(the user key, the entry's kind: b"h", b"m" or b"r") of a stored key."""
        encoded, _, rest = name[len(self.keys) :].partition(b"/")
        return _decode(encoded), rest[:1]


def _range(key: bytes, prefix: bool = False, **extra: Any) -> dict:
    body = {"key": b64(key), **extra}
    if prefix:
        body["range_end"] = b64(_range_end(key))
    return {"request_range": body}


def _compare(key: bytes, target: str, value: Any, result: str = "EQUAL", prefix=False) -> dict:
    field = {"CREATE": "create_revision", "MOD": "mod_revision", "VALUE": "value"}[target]
    body = {"key": b64(key), "target": target, "result": result, field: value}
    if prefix:
        body["range_end"] = b64(_range_end(key))
    return body


def _limit_of(kv: dict) -> Optional[int]:
    """The limit a holder entry of ours was granted with; None for an entry that is not
    ours (etcd's own mutex writes an empty value, which the gateway leaves out)."""
    value = parse_json(unb64(kv.get("value")))
    return value.get("limit") if isinstance(value, dict) else None


def _owner_of(kv: dict) -> Optional[str]:
    """The owner of a holder entry of ours; None for an entry that is not ours."""
    value = parse_json(unb64(kv.get("value")))
    owner = value.get("owner") if isinstance(value, dict) else None
    return owner if isinstance(owner, str) else None


def _kvs(response: dict) -> list[dict]:
    return response.get("response_range", {}).get("kvs", [])


class EtcdBackend(Backend):
    capabilities = Capabilities(limits=True, records=True, marks=True)

    def __new__(cls, url: str) -> EtcdBackend:
        # ?recipe=mutex: etcd's concurrency mutex on the key's own name (recipe.py).
        if cls is EtcdBackend and settings_from_url(url).recipe:
            cls = cls.speaking_recipe()
        return super().__new__(cls)

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.settings = settings_from_url(url)
        self.root = self.settings.root
        self.gateway = Gateway(self.settings, self.safe_url)
        self.layout = _Layout(self.root)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        #: lease ttl in whole seconds -> this process's etcd lease id for it
        self._leases: dict[int, str] = {}
        #: etcd lease id -> monotonic time its last grant or keepalive was sent
        self._kept_alive: dict[str, float] = {}
        #: holder keys whose acquire or release answer was lost -> until when to delete them
        self._orphans: dict[bytes, float] = {}

    # --- requests ---------------------------------------------------------------------

    def _call(self, action: str, path: str, body: dict, timeout: Optional[float] = None) -> dict:
        try:
            if timeout is None:
                return self.gateway.call(path, body)
            return self.gateway.call(path, body, timeout)
        except (EtcdError, requests.RequestException, OSError) as exc:
            raise translate(exc, action, self) from None

    def _txn(self, action: str, compare: list, success: list, failure: list = ()) -> dict:
        body = {"compare": compare, "success": success, "failure": list(failure)}
        return self._call(action, "kv/txn", body)

    def _process_state(self) -> None:
        if self._pid != os.getpid():  # a forked child: its parent's leases are not its own
            self._pid, self._leases, self._orphans = os.getpid(), {}, {}
            self._kept_alive = {}

    def _lease_for(self, ttl: float) -> str:
        """This process's etcd lease for ``ttl``, with at least ``ttl`` seconds left."""
        seconds = max(1, math.ceil(ttl))
        with self._lock:
            self._process_state()
            lease_id = self._leases.get(seconds)
            sent = self._kept_alive.get(lease_id or "", 0.0)
        stale = lease_id is not None and time.monotonic() - sent > LEASE_SLACK
        if stale:
            self._delete_orphans()  # kept alive with the lease: delete them first
            if not self._keep_alive(lease_id):
                lease_id = None
        if lease_id is None:
            sent = time.monotonic()
            answer = self._call(
                "granting an etcd lease", "lease/grant", {"TTL": seconds + LEASE_SLACK}
            )
            with self._lock:
                lease_id = self._leases.setdefault(seconds, answer["ID"])
                self._kept_alive.setdefault(lease_id, sent)
        return lease_id

    def _keep_alive(self, lease_id: str) -> bool:
        """Keep an etcd lease alive; False (and forgotten) if it had expired."""
        sent = time.monotonic()
        answer = self._call("renewing the etcd lease", "lease/keepalive", {"ID": lease_id})
        if int(answer.get("result", {}).get("TTL", 0)) <= 0:
            self._forget_lease(lease_id)  # expired: every key on it is gone
            return False
        with self._lock:
            self._kept_alive[lease_id] = sent
        return True

    def _forget_lease(self, lease_id: str) -> None:
        with self._lock:
            self._kept_alive.pop(lease_id, None)
            for seconds, known in list(self._leases.items()):
                if known == lease_id:
                    del self._leases[seconds]

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
        action = f"acquiring {key!r}"
        value = json.dumps({"owner": owner, "limit": limit, "holder": dict(holder or {})})
        for attempt in (1, 2):
            lease_id = self._lease_for(ttl)
            try:
                token = self._grant(key, owner, limit, claimant, value, lease_id, action)
                return None if token is None else Lease(key, owner, token, ttl, limit)
            except ExclusiveError as error:
                cause = cause_of(error)
                if isinstance(cause, EtcdError) and cause.code == NOT_FOUND and attempt == 1:
                    self._forget_lease(lease_id)  # the process's etcd lease expired
                    continue
                if isinstance(error, BackendUnavailable) and maybe_sent(cause):
                    return self._settle_acquire(key, owner, ttl, limit, error)
                raise
        raise AssertionError("unreachable")

    def _grant(self, key, owner, limit, claimant, value, lease_id, action) -> Optional[int]:
        holders, line_key = self.layout.holders(key), self.layout.mark(key, LINE)
        put = {"request_put": {"key": b64(holders + owner.encode()), "value": b64(value.encode())}}
        put["request_put"]["lease"] = lease_id
        reads = [_range(holders, prefix=True), _range(line_key)]
        # First bet: nobody holds the key and nobody stands in line (one round trip).
        answer = self._txn(
            action,
            [_compare(holders, "CREATE", "0", prefix=True), _compare(line_key, "CREATE", "0")],
            [put],
            reads,
        )
        for _ in range(CAS_ATTEMPTS):
            if answer.get("succeeded"):
                return header_revision(answer)
            revision = header_revision(answer)
            held, line = _kvs(answer["responses"][0]), _kvs(answer["responses"][1])
            check_limit(key, limit, [_limit_of(kv) for kv in held])
            line_value = unb64(line[0]["value"]).decode() if line else None
            admitted, rest = admit(line_value, claimant, limit - len(held), self.store_time())
            if not admitted:
                return None
            success = [put]
            if rest != line_value:  # the grant takes the claimant out of the line
                success.append(
                    {"request_delete_range": {"key": b64(line_key)}}
                    if rest is None
                    else {
                        "request_put": {
                            "key": b64(line_key),
                            "value": b64(rest.encode()),
                            "ignore_lease": True,
                        }
                    }
                )
            guard = [_compare(holders, "MOD", str(revision + 1), "LESS", prefix=True)]
            guard.append(
                _compare(line_key, "MOD", line[0]["mod_revision"])
                if line
                else _compare(line_key, "CREATE", "0")
            )
            answer = self._txn(action, guard, success, reads)
        raise BackendUnavailable(
            f"the key {key!r} in {self.safe_url} kept changing under {CAS_ATTEMPTS} grant "
            "attempts; try again.",
            self.safe_url,
        )

    def _settle_acquire(self, key, owner, ttl, limit, error: BackendUnavailable) -> Lease:
        """The acquire's answer was lost: read back whether it was granted. A grant
        that might still land later is put on the heartbeat's list to delete."""
        holder_key = self.layout.holder(key, owner)
        try:
            token = settle_acquire(lambda: self._created_at(holder_key), error, budget(ttl))
        except BackendUnavailable:
            self._orphan(holder_key)
            raise
        return Lease(key, owner, token, ttl, limit)

    def _created_at(self, holder_key: bytes) -> Optional[int]:
        """The revision ``holder_key`` was created at (its grant's token), if it exists."""
        found = self._call("reading back", "kv/range", {"key": b64(holder_key)}).get("kvs")
        return int(found[0]["create_revision"]) if found else None

    def _orphan(self, holder_key: bytes, seconds: float = ORPHAN_SECONDS) -> None:
        with self._lock:
            self._orphans[holder_key] = time.monotonic() + seconds

    def _delete_orphans(self) -> None:
        """Delete the holder keys left by lost answers and failed releases (one
        transaction); a failed release's key is forgotten once a delete succeeded."""
        with self._lock:
            self._process_state()
            now = time.monotonic()
            self._orphans = {k: until for k, until in self._orphans.items() if until > now}
            orphans = list(self._orphans)
        for start in range(0, len(orphans), MAX_TXN_OPS):  # no orphans: no request
            chunk = orphans[start : start + MAX_TXN_OPS]
            deletes = [{"request_delete_range": {"key": b64(k)}} for k in chunk]
            self._txn("deleting keys left by failed releases", [], deletes)
            with self._lock:
                for k in chunk:
                    if self._orphans.get(k) == math.inf:
                        del self._orphans[k]

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        with self._lock:
            self._process_state()
            lease_ids = {self._leases.get(max(1, math.ceil(lease.ttl))) for lease in leases}
        self._delete_orphans()
        for lease_id in lease_ids - {None}:
            self._keep_alive(lease_id)
        kept: set[bytes] = set()
        reads = [self.layout.holder(lease.key, lease.owner) for lease in leases]
        for start in range(0, len(reads), MAX_TXN_OPS):
            chunk = [_range(name, count_only=True) for name in reads[start : start + MAX_TXN_OPS]]
            answer = self._txn(f"renewing {len(leases)} lease(s)", [], chunk)
            for operation, response in zip(chunk, answer.get("responses", [])):
                if int(response.get("response_range", {}).get("count", 0)):
                    kept.add(unb64(operation["request_range"]["key"]))
        return {lease for lease, name in zip(leases, reads) if name not in kept}

    def release(self, lease: Lease) -> bool:
        holder_key = self.layout.holder(lease.key, lease.owner)

        def send() -> bool:
            answer = self._call(
                f"releasing {lease.key!r}", "kv/deleterange", {"key": b64(holder_key)}
            )
            return int(answer.get("deleted", 0)) > 0

        try:
            return send()
        except BackendUnavailable as error:
            # Deleted later, by the heartbeat or the next acquire: this process keeps its
            # etcd lease alive, so the key would not expire by itself.
            self._orphan(holder_key, math.inf)
            if not maybe_sent(cause_of(error)):
                raise
            return settle_release(
                lambda: self._created_at(holder_key) is not None, send, error, budget(lease.ttl)
            )

    def _free_for(self, key: str, claimant: Optional[str]) -> tuple[bool, int]:
        """Whether ``claimant`` would find a free slot and be first in line, and the
        revision that answer is true at."""
        answer = self._txn(
            f"reading {key!r}",
            [],
            [_range(self.layout.holders(key), prefix=True), _range(self.layout.mark(key, LINE))],
        )
        held, line = _kvs(answer["responses"][0]), _kvs(answer["responses"][1])
        revision = header_revision(answer)
        limits = [_limit_of(kv) or 1 for kv in held]
        if held and len(held) >= min(limits):
            return False, revision
        line_value = unb64(line[0]["value"]).decode() if line else None
        return first_in_line(line_value, claimant, self.store_time()), revision

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        deadline = time.monotonic() + timeout
        folder = self.layout.folder(key)
        while True:
            free, revision = self._free_for(key, claimant)
            remaining = deadline - time.monotonic()
            if free or remaining <= 0:
                return
            request = {
                "create_request": {
                    "key": b64(folder),
                    "range_end": b64(_range_end(folder)),
                    "start_revision": str(revision + 1),
                }
            }
            self._watch_once(request, remaining, f"waiting on {key!r}")

    def _watch_once(self, request: dict, timeout: float, action: str) -> None:
        """Block until the watch reports a change, or ``timeout`` passes.

        ``timeout`` is what is left of the caller's wait, not a bound on how long etcd
        may take to answer: a watch whose answer comes after it saw no change in time,
        and returns. Whether etcd answers at all, the caller's next read says.
        """
        try:
            response = self.gateway.watch(request, max(timeout, 0.05))
        except requests.exceptions.ReadTimeout:
            return
        except (EtcdError, requests.RequestException, OSError) as exc:
            raise translate(exc, action, self) from None
        try:
            for line in response.iter_lines():
                result = json.loads(line).get("result", {}) if line else {}
                if result.get("events") or result.get("canceled"):
                    return
        except (requests.RequestException, ValueError, OSError):
            return  # the read timed out (no change), or the stream broke: read again
        finally:
            response.close()

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        start = self.layout.keys + _encode(prefix)
        found = self._holder_infos(start, f"listing holders under {prefix!r}")
        return sorted(
            (info for info in found if info.key.startswith(prefix)),
            key=lambda info: (info.key, info.fencing_token),
        )

    def holders_of(self, key: str) -> list[LeaseInfo]:
        found = self._holder_infos(self.layout.holders(key), f"reading {key!r}")
        return sorted(found, key=lambda info: info.fencing_token)

    def _holder_infos(self, prefix: bytes, action: str) -> list[LeaseInfo]:
        answer = self._call(action, "kv/range", _range(prefix, prefix=True)["request_range"])
        infos, ttls = [], {}
        for kv in answer.get("kvs", []):
            name = unb64(kv["key"])
            key, kind = self.layout.parse(name)
            if kind != b"h":
                continue
            value = parse_json(unb64(kv.get("value")))
            lease_id = kv.get("lease")
            if lease_id not in ttls:
                ttls[lease_id] = self._time_to_live(lease_id, action)
            if ttls[lease_id] is not None and ttls[lease_id] <= 0:
                continue  # expiring as we read
            infos.append(
                LeaseInfo(
                    key,
                    value.get("owner", ""),
                    int(kv["create_revision"]),
                    ttls[lease_id],
                    value.get("holder", {}),
                )
            )
        return infos

    def _time_to_live(self, lease_id: Optional[str], action: str) -> Optional[float]:
        if not lease_id:
            return None
        answer = self._call(action, "lease/timetolive", {"ID": lease_id})
        return float(answer.get("TTL", 0))

    def holders_page(
        self,
        prefix: str = "",
        cursor: Optional[str] = None,
        count: int = 100,
        kinds: Sequence[str] = (),
    ) -> HoldersPage:
        # One range over the keys' folders (holders and marks side by side, in the
        # order of their encoded names), then the time to live of each holder process's
        # etcd lease on the page: a few, however many keys it holds.
        action = f"listing holders under {prefix!r}"
        start = self.layout.keys + _encode(prefix)
        begin = start if cursor is None else _range_end(self.layout.folder(cursor))
        body = {
            "key": b64(begin),
            "range_end": b64(_range_end(start)),
            "limit": count * PAGE_ENTRIES,
        }
        answer = self._call(action, "kv/range", body)
        folders: dict[str, dict[str, Any]] = {}
        for kv in answer.get("kvs", []):
            name = unb64(kv["key"])
            key, kind = self.layout.parse(name)
            folder = folders.setdefault(key, {"holders": [], "marks": {}})
            if kind == b"h":
                folder["holders"].append(kv)
            elif kind == b"m":
                mark = _decode(name[len(self.layout.folder(key)) + 2 :])
                folder["marks"][mark] = unb64(kv.get("value")).decode()
        order = list(folders)
        if answer.get("more") and len(order) > 1:
            order.pop()  # may be cut short by the limit: the next page reads it whole
        ttls: dict[Optional[str], Optional[float]] = {}
        keys: list[HeldKey] = []
        last = None
        for key in order:
            if len(keys) == count:
                break
            last = key
            folder = folders[key]
            infos = []
            for kv in folder["holders"]:
                lease_id = kv.get("lease")
                if lease_id not in ttls:
                    ttls[lease_id] = self._time_to_live(lease_id, action)
                if ttls[lease_id] is not None and ttls[lease_id] <= 0:
                    continue
                value = parse_json(unb64(kv.get("value")))
                token = int(kv["create_revision"])
                infos.append(
                    LeaseInfo(
                        key, value.get("owner", ""), token, ttls[lease_id], value.get("holder", {})
                    )
                )
            if infos and key.startswith(prefix):
                marks = {k: v for k, v in folder["marks"].items() if k in kinds}
                keys.append(
                    HeldKey(key, tuple(sorted(infos, key=lambda i: i.fencing_token or 0)), marks)
                )
        done = last is None or (last == order[-1] and not answer.get("more"))
        return HoldersPage(keys, None if done else last)

    def renewed_ago(self, info: LeaseInfo) -> Optional[float]:
        """Unknown: a holder's key lives as long as its process's etcd lease, which any
        acquire of that process may keep alive too, and whose ttl is rounded up."""
        return None

    def force_release(self, key: str) -> int:
        """Delete the key's holder entries this store wrote (named after the owner their
        record names); another client's keys under the same prefix (an ``etcdctl lock``
        pointed at it) are left alone."""
        action = f"force-releasing {key!r}"
        holders = self.layout.holders(key)
        answer = self._call(action, "kv/range", _range(holders, prefix=True)["request_range"])
        mine = []
        for kv in answer.get("kvs", []):
            name, value = unb64(kv["key"]), parse_json(unb64(kv.get("value")))
            owner = value.get("owner") if isinstance(value, dict) else None
            if isinstance(owner, str) and name == self.layout.holder(key, owner):
                mine.append(kv["key"])
        for start in range(0, len(mine), MAX_TXN_OPS):
            deletes = [
                {"request_delete_range": {"key": k}} for k in mine[start : start + MAX_TXN_OPS]
            ]
            self._txn(action, [], deletes)
        return len(mine)

    # --- records and marks ------------------------------------------------------------

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        return self._get(self.layout.record(lease_key, name), f"reading the record {name!r}")

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        holder_key = self.layout.holder(lease.key, lease.owner)
        record = self.layout.record(lease.key, name)
        answer = self._txn(
            f"writing the record {name!r} of {lease.key!r}",
            [_compare(holder_key, "CREATE", "0", "GREATER")],
            [{"request_put": {"key": b64(record), "value": b64(value.encode())}}],
        )
        return bool(answer.get("succeeded"))

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        return self._get(self.layout.mark(key, kind), f"reading the {kind} mark of {key!r}")

    def _get(self, name: bytes, action: str) -> Optional[str]:
        kvs = self._call(action, "kv/range", {"key": b64(name)}).get("kvs", [])
        return unb64(kvs[0].get("value")).decode() if kvs else None

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        action = f"changing the {kind} mark of {key!r}"
        name = self.layout.mark(key, kind)
        compare = (
            _compare(name, "CREATE", "0")
            if expected is None
            else _compare(name, "VALUE", b64(expected.encode()))
        )
        if new is None:
            change = {"request_delete_range": {"key": b64(name)}}
        else:
            # A lease of its own: etcd, not any worker's clock, ends the mark.
            grant = self._call(action, "lease/grant", {"TTL": max(1, math.ceil(ttl))})
            change = {
                "request_put": {"key": b64(name), "value": b64(new.encode()), "lease": grant["ID"]}
            }
        return bool(self._txn(action, [compare], [change]).get("succeeded"))

    # --- the store's clock, the start-up check ---------------------------------------

    def store_time(self) -> float:
        if not self.gateway.clock.known:
            self._call("reading the time", "kv/range", {"key": b64(self.layout.keys)})
        return self.gateway.clock.now()

    def check(self, probe_key: str) -> list[str]:
        warnings = super().check(probe_key)
        if self.settings.user and any(e.startswith("http:") for e in self.settings.endpoints):
            warnings.append(f"{self.safe_url} sends the etcd password in clear text; use etcds://.")
        return warnings

    def close(self) -> None:
        self.gateway.close()
