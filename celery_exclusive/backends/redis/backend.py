"""The Redis lease store: one Lua script per operation, one round trip.

Where each entry lives is :mod:`.layout`; the scripts are :mod:`.scripts`; the URL's
forms and options are :mod:`.client`; every client exception passes through
:func:`.failures.translate`; the start-up check is :mod:`.checks`.

Fencing tokens are ``max(last + 1, now in µs)`` by the store's clock, so they keep
rising when the store forgets its counters (a restart without persistence, an
eviction, a failover to a replica that missed writes), as long as the servers'
clocks agree to within the time such an event takes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Optional

from redis.cluster import RedisCluster
from redis.connection import SSLConnection
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import MasterNotFoundError

from ...errors import BackendUnavailable, ConfigurationError, ExclusiveError
from ..base import (
    Backend,
    Capabilities,
    FinalWrite,
    HeldKey,
    HoldersPage,
    Lease,
    LeaseInfo,
    MarkSwap,
)
from . import checks, layout, scripts
from .client import SOCKET_TIMEOUT, StoreOptions, connect, store_options
from .failures import translate

logger = logging.getLogger("celery_exclusive")

#: A BLPOP never blocks longer than this, so it always returns inside SOCKET_TIMEOUT.
MAX_BLOCK = SOCKET_TIMEOUT - 1.0
#: Seconds between readings of the store's clock; between them it is told by the
#: local monotonic clock (which drifts by parts per million).
CLOCK_REFRESH = 10.0
#: Seconds between asking the sentinels who the master is (redis-py alone asks only
#: after a connection error or a READONLY reply, which a demoted master may not send
#: for several seconds after the switch).
MASTER_CHECK_INTERVAL = 1.0
#: Names a page of held keys looks at, at most, inside one script: with SCAN's
#: COUNT 100 a few milliseconds of Redis time, however few of them are leases.
PAGE_BUDGET = 2000
#: Leases renewed by one script at most: 3-8 µs of Redis time each (the latter on a
#: loaded machine), so no renewal blocks Redis for more than about half a millisecond
#: however many leases a process holds.
RENEW_CHUNK = 50


class RedisBackend(Backend):
    capabilities = Capabilities(limits=True, records=True, marks=True, final_writes=True)

    #: Where each entry of a key lives: :mod:`.layout`, or the recipe's (recipe.py).
    layout: Any = layout

    def __new__(cls, url: str, client: Any = None) -> RedisBackend:
        # ?recipe=set-nx: Redis's own lock recipe on the key's own name (recipe.py).
        if cls is RedisBackend and client is None and store_options(url).recipe:
            cls = cls.speaking_recipe()
        return super().__new__(cls)

    def __init__(self, url: str, client: Any = None) -> None:
        super().__init__(url)
        self._lock = threading.Lock()
        self._client = client
        if client is None:
            self.options = store_options(url)
        else:
            topology = "cluster" if isinstance(client, RedisCluster) else "standalone"
            self.options = StoreOptions(topology=topology)
        self.cluster = self.options.topology == "cluster"
        self._scripts: dict = {}
        self._clock: Optional[tuple[float, float]] = None
        #: Why the server refused a release with a write, once it did: then never again.
        self._final_writes_refused: Optional[ConfigurationError] = None
        self._master_checked = 0.0

    # --- connection -----------------------------------------------------------------

    @property
    def client(self):
        """The redis-py client, connected on first use (a Cluster client asks the nodes
        for their slots at once: a store down at import must not fail the import)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._call("connecting", None, connect, self.url)
        return self._client

    def _script(self, name: str):
        script = self._scripts.get(name)
        if script is None:
            script = self._scripts[name] = self.client.register_script(scripts.ALL[name])
        return script

    def _call(self, action: str, key: Optional[str], fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RedisError, RedisClusterException) as exc:
            error = translate(exc, self.safe_url, action, key, self.cluster)
            if isinstance(exc, MasterNotFoundError):
                error = self._why_no_master(action) or error
            raise error from None

    def _why_no_master(self, action: str) -> Optional[ExclusiveError]:
        """redis-py reports "no master found" when no sentinel answered, whatever each
        said: ask them again, so that a refused password or certificate is named."""
        for sentinel in self.client.connection_pool.sentinel_manager.sentinels:
            try:
                sentinel.ping()
            except RedisError as exc:
                error = translate(exc, self.safe_url, f"{action}, asking a sentinel")
                if not isinstance(error, ConfigurationError):
                    continue
                if "credentials" in str(error):
                    return ConfigurationError(
                        f"the sentinels of exclusive_backend_url {self.safe_url} refused "
                        f"its Sentinel credentials ({type(exc).__name__}: {exc}); correct "
                        "sentinel_username / sentinel_password in the URL's query (the "
                        "user and password before the hosts are the data nodes')."
                    )
                return error
        return None

    def _run(
        self,
        name: str,
        action: str,
        key: str,
        keys: list,
        args: list,
        resent: Optional[list[bool]] = None,
    ):
        """Run script ``name``; ``resent`` (a list) gets True appended if the script was
        sent again after a request that went out lost its answer (see
        :meth:`_on_a_connection`)."""
        return self._call(action, key, self._evalsha, self._script(name), keys, args, resent)

    def _evalsha(self, script, keys: list, args: list, resent: Optional[list[bool]] = None):
        """``EVALSHA`` straight on a connection of the client's pool (what redis-py's
        ``Script`` does, minus its per-call checks); a store that lost its scripts (a
        restart, a failover, ``SCRIPT FLUSH``) gets the script again."""
        client = self.client
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        try:
            if self.cluster:
                return client.execute_command(*command)
            return self._on_a_connection(command, resent)
        except NoScriptError:
            script.sha = client.script_load(script.script)
            command = ("EVALSHA", script.sha, len(keys), *keys, *args)
            if self.cluster:
                return client.execute_command(*command)
            return self._on_a_connection(command, resent)

    def _on_a_connection(self, command: tuple, resent: Optional[list[bool]] = None):
        """One command on a pooled connection, retried as the client retries its own
        (the client's ``Retry``, a failed connection dropped before the next try), without
        redis-py's per-command bookkeeping: about 10 µs less per call, twice per task.
        A Cluster client routes each command by slot itself and is not used this way.

        ``resent`` gets True appended when the command went out more than once: the
        first request may have been carried out, its answer lost.
        """
        pool = self.client.connection_pool
        connection = pool.get_connection()
        sends = 0

        def once():
            nonlocal sends
            connection.send_command(*command)
            sends += 1
            return connection.read_response()

        try:
            return connection.retry.call_with_retry(once, lambda error: connection.disconnect())
        finally:
            pool.release(connection)
            if resent is not None:
                resent.append(sends > 1)

    def _fresh_master(self, force: bool = False) -> None:
        """Behind Sentinel: follow a switch of master within MASTER_CHECK_INTERVAL, or
        at once when ``force`` is set.

        Sentinels that do not answer leave the master as it was (nobody can promote
        another meanwhile); sentinels that refuse the URL's credentials stop the caller.
        """
        if self.options.topology != "sentinel":
            return
        now = time.monotonic()
        if not force and now - self._master_checked < MASTER_CHECK_INTERVAL:
            return
        self._master_checked = now
        pool = self.client.connection_pool
        with contextlib.suppress(BackendUnavailable):
            self._call("asking the sentinels for the master", None, self._newest_sentinel_first)
            self._call("asking the sentinels for the master", None, pool.get_master_address)

    def _newest_sentinel_first(self) -> None:
        """Ask every sentinel, and put first the one whose view of the master is the
        newest (the highest ``config-epoch``): redis-py takes the first sentinel's
        answer, and a sentinel that did not run the failover learns of it only from
        the others' hello messages, seconds later. Meanwhile it names the old master,
        which may be back up and taking writes."""
        pool = self.client.connection_pool
        manager, service = pool.sentinel_manager, pool.service_name
        newest: Optional[tuple[int, int]] = None  # (config-epoch, index)
        for index, sentinel in enumerate(manager.sentinels):
            try:
                state = sentinel.sentinel_masters().get(service)
            except (RedisConnectionError, RedisTimeoutError):
                continue  # not answering: the others decide
            if state and manager.check_master_state(state, service):
                epoch = int(state.get("config-epoch") or 0)
                if newest is None or epoch > newest[0]:
                    newest = (epoch, index)
        if newest is not None and newest[1]:
            sentinels = manager.sentinels
            sentinels[0], sentinels[newest[1]] = sentinels[newest[1]], sentinels[0]

    # --- leases ---------------------------------------------------------------------

    def try_acquire(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int = 1,
        holder: Optional[Mapping[str, Any]] = None,
        claimant: Optional[str] = None,
    ) -> Optional[Lease]:
        self._fresh_master()
        if self.options.min_replicas:
            return self._acquire_replicated(key, owner, ttl, limit, holder, claimant)
        keys, args = _acquisition(self.layout, key, owner, ttl, limit, holder, claimant)
        token = self._run("acquire", f"acquiring {key!r}", key, keys, args)
        return None if token is None else Lease(key, owner, int(token), ttl, limit)

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
        # One pipeline on one connection: Redis runs its commands in order, so the read
        # follows the grant, one round trip for both. Not on a cluster, where the mark
        # may live on another node and nothing orders the two; not with min_replicas,
        # whose grant counts only once WAIT confirms it.
        if self.cluster or self.options.min_replicas:
            return super().try_acquire_and_read_mark(key, owner, ttl, limit, holder, claimant, mark)
        self._fresh_master()
        claim = (key, owner, ttl, limit, holder, claimant)
        grant, value = self._acquire_then(*claim, "GET", self.layout.mark(*mark))
        return grant, None if value is None else _text(value)

    def _acquire_then(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int,
        holder: Optional[Mapping[str, Any]],
        claimant: Optional[str],
        *command,
    ) -> tuple[Optional[Lease], Any]:
        """Acquire, then send ``command`` on the same connection: one round trip, and
        Redis runs the command after the grant. A store that lost its scripts gets the
        acquire script again.

        Returns the grant (None if refused) and the command's reply. A command that
        fails after a grant gives the grant back, then raises: nobody runs under it.
        """
        keys, args = _acquisition(self.layout, key, owner, ttl, limit, holder, claimant)
        action = f"acquiring {key!r}"
        script = self._script("acquire")
        for _ in range(2):
            pipe = self.client.pipeline(transaction=False)
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            pipe.execute_command(*command)
            token, reply = self._call(action, key, pipe.execute, raise_on_error=False)
            if not isinstance(token, NoScriptError):
                break
            script.sha = self._call(action, key, self.client.script_load, script.script)
        if isinstance(token, Exception):
            raise translate(token, self.safe_url, action, key, self.cluster)
        grant = None if token is None else Lease(key, owner, int(token), ttl, limit)
        if isinstance(reply, Exception):
            if grant is not None:
                self.give_back(grant)
            raise translate(reply, self.safe_url, action, key, self.cluster)
        return grant, reply

    def _acquire_replicated(
        self,
        key: str,
        owner: str,
        ttl: float,
        limit: int,
        holder: Optional[Mapping[str, Any]],
        claimant: Optional[str],
    ) -> Optional[Lease]:
        """Acquire, then ``WAIT`` on the same connection (one round trip for both); a
        grant that too few replicas acknowledged is withdrawn: a failover would lose it."""
        replicas, timeout = self.options.min_replicas, self.options.min_replicas_timeout
        claim = (key, owner, ttl, limit, holder, claimant)
        grant, acked = self._acquire_then(*claim, "WAIT", replicas, _ms(timeout))
        if grant is None or acked >= replicas:
            return grant
        self.release(grant)
        raise BackendUnavailable(
            f"the grant of {key!r} reached {acked} of the {replicas} replica(s) "
            f"min_replicas in exclusive_backend_url asks for within {timeout} s, so it was "
            "withdrawn (a failover could lose it). Check the replicas, or lower "
            "min_replicas.",
            self.safe_url,
        )

    def renew(self, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        if not leases:
            return set()
        self._fresh_master()
        action = f"renewing {len(leases)} lease(s)"
        # A script blocks Redis while it runs: at most RENEW_CHUNK leases per script,
        # every script in one pipeline (one round trip), other clients served between.
        # On a cluster, one script per hash slot too: all its keys on one node.
        if self.cluster:
            by_slot: dict[int, list[Lease]] = {}
            for lease in leases:
                slot = key_slot(self.layout.lease(lease.key).encode())
                by_slot.setdefault(slot, []).append(lease)
            groups = list(by_slot.values())
        else:
            groups = [leases]
        chunks = [g[i : i + RENEW_CHUNK] for g in groups for i in range(0, len(g), RENEW_CHUNK)]
        if len(chunks) == 1:
            lost = self._run("renew", action, leases[0].key, *_renewal(self.layout, leases))
            return {leases[i - 1] for i in lost}
        script = self._script("renew")
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for chunk in chunks:
                keys, args = _renewal(self.layout, chunk)
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            try:
                answers = self._call(action, leases[0].key, pipe.execute)
                break
            except Exception as exc:
                if attempt or "NOSCRIPT" not in str(exc).upper():
                    raise
                self._call(action, leases[0].key, self.client.script_load, script.script)
        return {chunk[i - 1] for chunk, lost in zip(chunks, answers) for i in lost}

    def release(self, lease: Lease) -> bool:
        # Behind Sentinel a release asks who the master is first, whenever it last
        # asked: a demoted master keeps taking writes for seconds after a switch, so a
        # grant it made that never reached the new master would be "released" there
        # and its run would pass for clean. On the new master the release finds the
        # lease missing, and the holder reports the run lost. A body shorter than a
        # renewal interval has no other moment to learn it.
        self._fresh_master(force=True)
        keys, args = _release(self.layout, lease)
        resent: list[bool] = []
        freed = bool(
            self._run("release", f"releasing {lease.key!r}", lease.key, keys, args, resent)
        )
        return self.freed_unless_resent(freed, resent)

    def freed_unless_resent(self, freed: bool, resent: list[bool]) -> bool:
        """A release sent again after its answer was lost finds the lease gone because
        the first send freed it: that is a release, not a loss (as the stores that read a
        lost answer back decide). Not behind Sentinel, where the first send may have
        reached a demoted master, and a lease missing on the new one is the loss the
        release is there to find."""
        return freed or (any(resent) and self.options.topology != "sentinel")

    def swap_mark_and_release(
        self,
        lease: Lease,
        mark: tuple[str, str],
        expected: Optional[str],
        new: str,
        ttl: float,
    ) -> Optional[bool]:
        # One script off Cluster; on a cluster the mark may live in another hash slot.
        if self.cluster:
            return super().swap_mark_and_release(lease, mark, expected, new, ttl)
        self._fresh_master(force=True)  # as release() does
        keys, args = _release(self.layout, lease)
        keys.append(self.layout.mark(*mark))
        args += [int(expected is not None), expected or "", new, _ms(ttl)]
        action = f"releasing {lease.key!r}"
        resent: list[bool] = []
        freed = self._run("swap_mark_and_release", action, lease.key, keys, args, resent)
        return None if freed == -1 else self.freed_unless_resent(bool(freed), resent)

    def database_for(self, address: Mapping[str, Any]) -> Optional[int]:
        # One server, one user: the script writes with the store's credentials, so the
        # write is one the application's own client may make. Not on a cluster (one
        # script cannot span slots) nor behind Sentinel (the master may move between the
        # two clients' views of it).
        if self.options.topology != "standalone" or address.get("credential_provider"):
            return None
        if self._final_writes_refused is not None:
            return None
        pool = self.client.connection_pool
        ours = pool.connection_kwargs
        if ours.get("credential_provider") or not _same_server(ours, address):
            return None
        if bool(address.get("ssl")) != issubclass(pool.connection_class, SSLConnection):
            return None
        return int(address.get("db") or 0)

    def release_and_write(
        self,
        lease: Lease,
        write: FinalWrite,
        mark: Optional[MarkSwap] = None,
    ) -> Optional[tuple[bool, bool]]:
        keys, args = _release(self.layout, lease)
        keys.append(write.key)
        lease_db = int(self.client.connection_pool.connection_kwargs.get("db") or 0)
        database = lease_db if write.database is None else write.database
        ttl = 0 if write.ttl is None else _ms(write.ttl)
        args += [lease_db, database, write.value, ttl, int(write.publish), write.keep_status or ""]
        # An unused mark's slot holds the lease key: ACLs check every declared name.
        if mark is not None:
            (mark_key, kind), expected, new, mark_ttl = mark
            keys.append(self.layout.mark(mark_key, kind))
            args += [1, int(expected is not None), expected or "", new, _ms(mark_ttl)]
        else:
            keys.append(keys[0])
            args += [0, 0, "", "", 0]
        if write.clear_mark is not None:
            mark_key, kind, value = write.clear_mark
            keys.append(self.layout.mark(mark_key, kind))
            args += [1, value]
        else:
            keys.append(keys[0])
            args += [0, ""]
        if self._final_writes_refused is not None:
            raise self._final_writes_refused
        resent: list[bool] = []
        try:
            answer = self._run(
                "release_and_write", f"releasing {lease.key!r}", lease.key, keys, args, resent
            )
        except ConfigurationError as exc:
            # Refused, not unanswered: the script did not run. Unless it is this one
            # write's key (another kind of value under it), it never will (an ACL, a
            # proxy that splits scripts): writes are left to their owners from now on.
            if "WRONGTYPE" not in str(exc):
                logger.warning("%s: results are stored by their owner from now on", exc)
                self._final_writes_refused = exc
            raise
        if answer == -1:
            return None
        return self.freed_unless_resent(bool(answer), resent), bool(answer) and not any(resent)

    def wait(self, key: str, timeout: float, claimant: Optional[str] = None) -> None:
        # BLPOP takes whole or fractional seconds; 0 would mean "forever".
        block = min(timeout, MAX_BLOCK)
        if block <= 0:
            return
        action = f"waiting on {key!r}"
        names = self.layout.entries(key)
        keys = [names.lease, names.holders, names.line, names.waiting]
        if self._run("free_for", action, key, keys, [claimant or "", _ms(block + 1.0)]):
            return
        # The first in line is woken on its own list; anyone else on the key's.
        signals = [] if claimant is None else [self.layout.signal(key, claimant)]
        signals.append(self.layout.signal(key))
        self._call(action, key, self.client.blpop, signals, block)

    def force_release(self, key: str) -> int:
        names = self.layout.entries(key)
        keys = [names.lease, names.holders, names.line, names.signal, names.waiting]
        return self._run("force_release", f"force-releasing {key!r}", key, keys, [30_000])

    # --- what the CLI sees ----------------------------------------------------------

    def holders(self, prefix: str = "") -> list[LeaseInfo]:
        def scan() -> set[str]:
            found = set()
            # A Cluster client scans every primary in turn.
            for raw in self.client.scan_iter(match=self.layout.lease_pattern(prefix), count=1000):
                key = self.layout.key_of(raw.decode() if isinstance(raw, bytes) else raw)
                if key is not None and key.startswith(prefix):
                    found.add(key)
            return found

        keys = self._call("listing holders", prefix, scan)
        return [info for key in sorted(keys) for info in self.holders_of(key)]

    def holders_of(self, key: str) -> list[LeaseInfo]:
        names = [self.layout.lease(key), self.layout.holders(key)]
        found = self._run("describe", f"reading {key!r}", key, names, [])
        kind, now_ms = _text(found[0]), int(found[1])
        if kind == "string":
            pttl, value = found[2], found[3]
            if value is None:
                return []
            owner, token, holder = _parse_value(_text(value))
            return [LeaseInfo(key, owner, token, _seconds(pttl), holder)]
        return [
            _member(key, _text(found[i]), float(found[i + 1]), _text(found[i + 2]), now_ms)
            for i in range(2, len(found), 3)
        ]

    def holders_page(
        self,
        prefix: str = "",
        cursor: Optional[str] = None,
        count: int = 100,
        kinds: Sequence[str] = (),
    ) -> HoldersPage:
        # One script off Cluster: SCAN's order, pages of about ``count`` keys. A
        # cluster scans node by node, which one script cannot: the default reads there.
        if self.cluster:
            return super().holders_page(prefix, cursor, count, kinds)
        args = [layout.lease_pattern(prefix), cursor or "0", count, PAGE_BUDGET, *kinds]
        found = self._run("holders_page", f"listing holders under {prefix!r}", prefix, [], args)
        next_cursor, now_ms = _text(found[0]), int(found[1])
        keys = []
        for name, kind, held, marks in found[2:]:
            key = layout.key_of(_text(name))
            if key is None or not key.startswith(prefix):
                continue
            if _text(kind) == "string":
                owner, token, holder = _parse_value(_text(held[1]))
                leases = [LeaseInfo(key, owner, token, _seconds(held[0]), holder)]
            else:
                leases = [
                    _member(key, _text(held[i]), float(held[i + 1]), _text(held[i + 2]), now_ms)
                    for i in range(0, len(held), 3)
                ]
            values = {kind: _text(v) for kind, v in zip(kinds, marks) if v is not None}
            keys.append(HeldKey(key, tuple(sorted(leases, key=_by_token)), values))
        keys.sort(key=lambda held_key: held_key.key)
        return HoldersPage(keys, None if next_cursor == "0" else next_cursor)

    # --- the feed of events ---------------------------------------------------------

    def append_events(self, feed: str, events: Sequence[str], capacity: int, ttl: float) -> None:
        """A capped stream: one pipeline adds the events, trims the oldest beyond
        ``capacity`` (approximately, as Redis trims cheaply) and sets its expiry."""
        name = layout.events(feed)
        pipe = self.client.pipeline(transaction=False)
        for event in events:
            pipe.xadd(name, {"e": event}, maxlen=capacity, approximate=True)
        pipe.pexpire(name, _ms(ttl))
        self._call(f"adding to the feed of {feed!r}", feed, pipe.execute)

    def read_events(self, feed: str) -> list[str]:
        entries = self._call(
            f"reading the feed of {feed!r}", feed, self.client.xrange, layout.events(feed)
        )
        return [_text(fields.get(b"e", fields.get("e"))) for _, fields in entries]

    # --- records and marks ----------------------------------------------------------

    def read_record(self, lease_key: str, name: str) -> Optional[str]:
        action = f"reading the record {name!r} of {lease_key!r}"
        value = self._call(action, lease_key, self.client.get, self.layout.record(lease_key, name))
        return None if value is None else _text(value)

    def write_record(self, lease: Lease, name: str, value: str) -> bool:
        self._fresh_master()
        keys = [self.layout.lease(lease.key), self.layout.record(lease.key, name)]
        action = f"writing the record {name!r} of {lease.key!r}"
        return bool(
            self._run("write_record", action, lease.key, keys, [lease.owner, lease.limit, value])
        )

    def read_mark(self, key: str, kind: str) -> Optional[str]:
        action = f"reading the {kind} mark of {key!r}"
        value = self._call(action, key, self.client.get, self.layout.mark(key, kind))
        return None if value is None else _text(value)

    def swap_mark(
        self, key: str, kind: str, expected: Optional[str], new: Optional[str], ttl: float
    ) -> bool:
        args = [int(expected is not None), expected or "", int(new is not None), new or ""]
        args.append(_ms(ttl))
        action = f"changing the {kind} mark of {key!r}"
        return bool(self._run("swap_mark", action, key, [self.layout.mark(key, kind)], args))

    # --- the store's clock, the start-up check --------------------------------------

    def store_time(self) -> float:
        """The store's clock, read at most every CLOCK_REFRESH seconds (one round trip)
        and told in between by the local monotonic clock, which no NTP step moves."""
        clock = self._clock
        now = time.monotonic()
        if clock is None or now - clock[1] > CLOCK_REFRESH:
            seconds, microseconds = self._call("reading the time", None, self.client.time)
            after = time.monotonic()
            clock = self._clock = (seconds + microseconds / 1e6, (now + after) / 2)
            now = after
        return clock[0] + (now - clock[1])

    def check(self, probe_key: str) -> list[str]:
        try:
            warnings = checks.server_warnings(self)
        except BackendUnavailable:
            checks.refuse_plain_text_to_tls(self)
            raise
        warnings += super().check(probe_key)
        checks.exercise(self, probe_key, self._delete_probe)
        return warnings

    def _delete_probe(self, key: str, *names: str) -> None:
        self._call("cleaning up the check", key, self.client.delete, *names)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _renewal(where: Any, leases: list[Lease]) -> tuple[list, list]:
    keys, args = [], []
    for lease in leases:
        names = where.entries(lease.key)
        keys += [names.lease, names.holders]
        args += [lease.owner, _ms(lease.ttl), lease.limit]
    return keys, args


def _member(key: str, owner: str, expiry: float, detail: str, now_ms: int) -> LeaseInfo:
    """A semaphore holder: its expiry (ms) in the key's sorted set, and its detail in
    the holders hash (see :mod:`.scripts`)."""
    token, _, holder = detail.partition(" ")
    return LeaseInfo(key, owner, int(token), (expiry - now_ms) / 1000, _json(holder))


def _by_token(info: LeaseInfo) -> int:
    return info.fencing_token or 0


def _parse_value(value: str) -> tuple[str, int, dict]:
    """Owner, token and holder record of a limit-1 lease value (see :mod:`.scripts`)."""
    length, _, rest = value.partition(":")
    try:
        owner, rest = rest[: int(length)], rest[int(length) + 1 :]
        token, _, holder = rest.partition(" ")
        return owner, int(token), _json(holder)
    except ValueError:  # not written by this store: show it, never crash the CLI
        return value, 0, {}


def _json(text: str) -> dict:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _acquisition(
    where: Any,
    key: str,
    owner: str,
    ttl: float,
    limit: int,
    holder: Optional[Mapping[str, Any]],
    claimant: Optional[str],
) -> tuple[list, list]:
    """The KEYS and ARGV of the acquire script (``where``: the layout)."""
    names = where.entries(key)
    keys = [names.lease, names.fence, names.holders, names.line]
    return keys, [owner, _ms(ttl), limit, json.dumps(dict(holder or {})), claimant or ""]


def _release(where: Any, lease: Lease) -> tuple[list, list]:
    """The KEYS and ARGV of the release script (``where``: the layout)."""
    names = where.entries(lease.key)
    keys = [names.lease, names.holders, names.line, names.signal, names.waiting]
    return keys, [lease.owner, lease.limit, _ms(max(lease.ttl, 1.0))]


def _same_server(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> bool:
    """Whether two redis-py connection settings reach one server as one user: the same
    socket path, or host and port; the same username and password."""
    where = ("path",) if ours.get("path") or theirs.get("path") else ("host", "port")
    return all(ours.get(name) == theirs.get(name) for name in (*where, "username", "password"))


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _seconds(pttl) -> Optional[float]:
    return None if pttl is None or pttl < 0 else pttl / 1000
