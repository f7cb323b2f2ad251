"""What both layouts of the Redis store share: one Redis as the URL names it (standalone,
behind Sentinel, or a Cluster: :mod:`.client`), the store's scripts (:mod:`.scripts`)
run on it on the names a layout gives (:mod:`.layout`, or the recipe's), the store's
clock, and the one translator of its failures.

Every operation is one script, one round trip. Fencing tokens are ``max(last + 1, now
in µs)`` by the store's clock, so they keep rising when the store forgets its counters
(a restart without persistence, an eviction, a failover to a replica that missed
writes), as long as the servers' clocks agree to within the time such an event takes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Optional

from redis.connection import SSLConnection
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import MasterNotFoundError

from ...errors import BackendUnavailable, ConfigurationError, ExclusiveError
from ..base import NO_END, Connection, End, Lease, MarkRead
from . import failures, layout, scripts
from .client import SOCKET_TIMEOUT, connect, store_options
from .layout import Names, as_text

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
#: Leases renewed by one script at most: 3-8 µs of Redis time each (the latter on a
#: loaded machine), so no renewal blocks Redis for more than about half a millisecond
#: however many leases a process holds.
RENEW_CHUNK = 50
#: Milliseconds a python-redis-lock wake-up lasts (its ``signal_expire`` default).
FOREIGN_SIGNAL_TTL = 1000


class RedisConnection(Connection):
    """One Redis, its client connected on first use (redis-py's pools open new
    connections in a forked child), and the store's scripts run on it."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.options = store_options(url)
        self.cluster = self.options.topology == "cluster"
        self._client: Any = None
        self._lock = threading.Lock()
        self._scripts: dict[str, Any] = {}
        self._clock: Optional[tuple[float, float]] = None
        self._master_checked = 0.0
        #: Why the server refused a release with a write, once it did: then never again.
        self._writes_refused: Optional[ConfigurationError] = None

    @property
    def client(self) -> Any:
        """The redis-py client, connected on first use (a Cluster client asks the nodes
        for their slots at once: a store down at import must not fail the import)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self.call("connecting", None, connect, self.url)
        return self._client

    # --- failures ---------------------------------------------------------------------

    def translate(
        self, exc: BaseException, action: str, key: Optional[str] = None
    ) -> ExclusiveError:
        error = failures.library_error(exc, self.safe_url, action, key, self.options)
        if isinstance(exc, MasterNotFoundError):
            error = self._why_no_master(action) or error
        return error

    def call(self, action: str, key: Optional[str], fn: Callable[..., Any], *args, **kwargs):
        """``fn(*args, **kwargs)``, a client's exception translated."""
        try:
            return fn(*args, **kwargs)
        except (RedisError, RedisClusterException) as exc:
            raise self.translate(exc, action, key) from None

    def _why_no_master(self, action: str) -> Optional[ExclusiveError]:
        """redis-py reports "no master found" when no sentinel answered, whatever each
        said: ask them again, so that a refused password or certificate is named."""
        for sentinel in self.client.connection_pool.sentinel_manager.sentinels:
            try:
                sentinel.ping()
            except RedisError as exc:
                asking = f"{action}, asking a sentinel"
                error = failures.library_error(exc, self.safe_url, asking, None, self.options)
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

    # --- scripts ----------------------------------------------------------------------

    def _script(self, name: str) -> Any:
        script = self._scripts.get(name)
        if script is None:
            script = self._scripts[name] = self.client.register_script(scripts.ALL[name])
        return script

    def run(
        self,
        name: str,
        action: str,
        key: Optional[str],
        keys: list,
        args: list,
        resent: Optional[list[bool]] = None,
    ) -> Any:
        """Run script ``name``: ``EVALSHA`` straight on a connection of the client's pool
        (what redis-py's ``Script`` does, minus its per-call checks); a store that lost
        its scripts (a restart, a failover, ``SCRIPT FLUSH``) gets the script again.
        ``resent`` (a list) gets True appended if the script was sent again after a
        request that went out lost its answer (see :meth:`_on_a_connection`)."""
        script = self._script(name)
        for attempt in range(2):
            command = ("EVALSHA", script.sha, len(keys), *keys, *args)
            try:
                if self.cluster:
                    return self.client.execute_command(*command)
                return self._on_a_connection(command, resent)
            except NoScriptError:
                if attempt:
                    raise self.translate(NoScriptError(name), action, key) from None
                script.sha = self.call(action, key, self.client.script_load, script.script)
            except (RedisError, RedisClusterException) as exc:
                raise self.translate(exc, action, key) from None

    def _on_a_connection(self, command: tuple, resent: Optional[list[bool]] = None) -> Any:
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

    def _pipelined(
        self, name: str, action: str, key: str, calls: list[tuple[list, list]], *after: tuple
    ) -> list:
        """Script ``name`` once per ``(keys, args)`` of ``calls``, then the commands
        ``after``, in one pipeline: one round trip, and Redis runs them in order. A store
        that lost the script gets it again. Returns the replies, failures among them."""
        script = self._script(name)
        for _ in range(2):
            pipe = self.client.pipeline(transaction=False)
            for keys, args in calls:
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            for command in after:
                pipe.execute_command(*command)
            replies = self.call(action, key, pipe.execute, raise_on_error=False)
            if not any(isinstance(reply, NoScriptError) for reply in replies):
                break
            script.sha = self.call(action, key, self.client.script_load, script.script)
        return replies

    # --- Sentinel -----------------------------------------------------------------------

    def fresh_master(self, force: bool = False) -> None:
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
            self.call("asking the sentinels for the master", None, self._newest_sentinel_first)
            self.call("asking the sentinels for the master", None, pool.get_master_address)

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

    # --- leases, on a layout's names ------------------------------------------------------

    def acquire(
        self,
        names: Names,
        key: str,
        owner: str,
        ttl: float,
        limit: int,
        holder: Optional[Mapping[str, Any]],
        claimant: Optional[str],
        read: Optional[MarkRead],
    ) -> Optional[Lease]:
        """The acquire script; ``read``'s mark read in it, off Cluster (on a cluster the
        mark may live in another hash slot: the caller reads it next). With
        ``min_replicas``, ``WAIT`` follows on the same connection: one round trip."""
        self.fresh_master()
        entries = names.entries(key)
        keys = [entries.lease, entries.fence, entries.holders, entries.line]
        if self.cluster:
            read = None
        if read is not None:
            keys.append(names.mark(read.key, read.kind))
        args = [owner, _ms(ttl), limit, json.dumps(dict(holder or {})), claimant or ""]
        action = f"acquiring {key!r}"
        replicas, acked = self.options.min_replicas, None
        if replicas:
            wait = ("WAIT", replicas, _ms(self.options.min_replicas_timeout))
            answer, acked = self._pipelined("acquire", action, key, [(keys, args)], wait)
            if isinstance(answer, Exception):
                raise self.translate(answer, action, key)
        else:
            answer = self.run("acquire", action, key, keys, args)
        if read is not None:
            answer, value = answer
            read.value, read.done = None if value is None else as_text(value), True
        grant = None if answer is None else Lease(key, owner, int(answer), ttl, limit)
        if replicas:
            self._replicated(names, key, grant, acked)
        return grant

    def _replicated(self, names: Names, key: str, grant: Optional[Lease], acked: Any) -> None:
        """Withdraw ``grant`` and raise unless ``WAIT`` says enough replicas have it (a
        failover would lose it); raise if ``WAIT`` failed (nobody runs under a grant)."""
        replicas, timeout = self.options.min_replicas, self.options.min_replicas_timeout
        if not isinstance(acked, Exception) and (grant is None or acked >= replicas):
            return
        if grant is not None:
            with contextlib.suppress(ExclusiveError):  # else it expires by itself
                self.release(names, grant)
        if isinstance(acked, Exception):
            raise self.translate(acked, f"acquiring {key!r}", key)
        raise BackendUnavailable(
            f"the grant of {key!r} reached {acked} of the {replicas} replica(s) "
            f"min_replicas in exclusive_backend_url asks for within {timeout} s, so it was "
            "withdrawn (a failover could lose it). Check the replicas, or lower "
            "min_replicas.",
            self.safe_url,
        )

    def renew(self, names: Names, leases: Iterable[Lease]) -> set[Lease]:
        leases = list(leases)
        if not leases:
            return set()
        self.fresh_master()
        action, key = f"renewing {len(leases)} lease(s)", leases[0].key
        # A script blocks Redis while it runs: at most RENEW_CHUNK leases per script,
        # every script in one pipeline (one round trip), other clients served between.
        # On a cluster, one script per hash slot too: all its keys on one node.
        groups = [leases]
        if self.cluster:
            by_slot: dict[int, list[Lease]] = {}
            for lease in leases:
                by_slot.setdefault(key_slot(names.lease(lease.key).encode()), []).append(lease)
            groups = list(by_slot.values())
        chunks = [g[i : i + RENEW_CHUNK] for g in groups for i in range(0, len(g), RENEW_CHUNK)]
        calls = [_renewal(names, chunk) for chunk in chunks]
        if len(calls) == 1:
            answers = [self.run("renew", action, key, *calls[0])]
        else:
            answers = self._pipelined("renew", action, key, calls)
        for answer in answers:
            if isinstance(answer, Exception):
                raise self.translate(answer, action, key)
        return {chunk[i - 1] for chunk, lost in zip(chunks, answers) for i in lost}

    def release(self, names: Names, lease: Lease, end: End = NO_END) -> Optional[bool]:
        """The release script, or with an ``end``, END (off Cluster only: its mark and
        its write may live in other hash slots)."""
        # Behind Sentinel a release asks who the master is first, whenever it last
        # asked: a demoted master keeps taking writes for seconds after a switch, so a
        # grant it made that never reached the new master would be "released" there
        # and its run would pass for clean. On the new master the release finds the
        # lease missing, and the holder reports the run lost. A body shorter than a
        # renewal interval has no other moment to learn it.
        self.fresh_master(force=True)
        entries = names.entries(lease.key)
        keys = [entries.lease, entries.holders, entries.line, entries.signal, entries.waiting]
        args = [lease.owner, lease.limit, _ms(max(lease.ttl, 1.0)), FOREIGN_SIGNAL_TTL]
        ending = end.mark is not None or end.write is not None
        if ending:
            self._add_end(names, end, keys, args)
        foreign_signal = names.foreign_signal(lease.key)
        if foreign_signal is not None:
            keys.append(foreign_signal)
        action = f"releasing {lease.key!r}"
        resent: list[bool] = []
        try:
            answer = self.run("end" if ending else "release", action, lease.key, keys, args, resent)
        except ConfigurationError as exc:
            # Refused, not unanswered: the script did not run. Unless it is this one
            # write's key (another kind of value under it), it never will (an ACL, a
            # proxy that splits scripts): writes are left to their owners from now on.
            if end.write is not None and "WRONGTYPE" not in str(exc):
                logger.warning("%s: results are stored by their owner from now on", exc)
                self._writes_refused = exc
            raise
        if answer == -1:
            return None
        if end.write is not None:
            return answer == 1 or (answer == 2 and any(resent))
        # A release sent again after its answer was lost finds the lease gone because
        # the first send freed it: that is a release, not a loss (as the stores that
        # read a lost answer back decide). Not behind Sentinel, where the first send may
        # have reached a demoted master, and a lease missing on the new one is the loss
        # the release is there to find.
        return answer == 1 or (any(resent) and self.options.topology != "sentinel")

    def _add_end(self, names: Names, end: End, keys: list, args: list) -> None:
        """Add what END needs beyond a release to its KEYS and ARGV (see scripts.END)."""
        if self._writes_refused is not None and end.write is not None:
            raise self._writes_refused
        lease_key, mark, write = keys[0], end.mark, end.write
        clear = None if write is None else write.clear_mark
        keys.append(lease_key if mark is None else names.mark(mark.key, mark.kind))
        keys.append(lease_key if write is None else write.key)
        keys.append(lease_key if clear is None else names.mark(clear[0], clear[1]))
        if mark is None:
            args += [0, 0, "", "", 0]
        else:
            args += [1, int(mark.expected is not None), mark.expected or "", mark.new]
            args.append(_ms(mark.ttl))
        if write is None:
            args += [0, 0, 0, "", 0, 0, ""]
        else:
            lease_db = int(self.client.connection_pool.connection_kwargs.get("db") or 0)
            database = lease_db if write.database is None else write.database
            ttl = 0 if write.ttl is None else _ms(write.ttl)
            args += [1, lease_db, database, write.value, ttl, int(write.publish)]
            args.append(write.keep_status or "")
        args += [0, ""] if clear is None else [1, clear[2]]

    def wait(self, names: Names, key: str, timeout: float, claimant: Optional[str]) -> None:
        # BLPOP takes whole or fractional seconds; 0 would mean "forever".
        block = min(timeout, MAX_BLOCK)
        if block <= 0:
            return
        entries = names.entries(key)
        keys = [entries.lease, entries.holders, entries.line, entries.waiting]
        args = [claimant or "", _ms(block + 1.0)]
        if self.run("free_for", f"waiting on {key!r}", key, keys, args):
            return
        # The first in line is woken on its own list; anyone else on the key's.
        signals = [] if claimant is None else [names.signal(key, claimant)]
        self.block(key, [*signals, entries.signal], block)

    def block(self, key: str, signals: list[str], seconds: float) -> None:
        """Block on the wake-up lists ``signals`` of ``key`` for up to ``seconds``."""
        self.call(f"waiting on {key!r}", key, self.client.blpop, signals, seconds)

    def describe(self, names: Names, key: str) -> tuple[str, int, list]:
        """What the store holds for ``key``: its kind, the store's now (ms), and what
        the DESCRIBE script found (see :func:`.layout.leases_of`)."""
        keys = [names.lease(key), names.holders(key)]
        kind, now_ms, held = self.run("describe", f"reading {key!r}", key, keys, [])
        return as_text(kind), int(now_ms), held

    def held_keys(self, names: Names, prefix: str) -> list[str]:
        """The keys under ``prefix`` that have a lease's name, in order (a Cluster client
        scans every primary in turn)."""

        def scan() -> set[str]:
            found = set()
            for raw in self.client.scan_iter(match=names.lease_pattern(prefix), count=1000):
                key = names.key_of(as_text(raw))
                if key is not None and key.startswith(prefix):
                    found.add(key)
            return found

        return sorted(self.call("listing holders", prefix, scan))

    def get(self, name: str, action: str, key: str) -> Optional[str]:
        """The value at the Redis key ``name`` (a mark or a record of ``key``)."""
        value = self.call(action, key, self.client.get, name)
        return None if value is None else as_text(value)

    def write_record(self, names: Names, lease: Lease, name: str, value: str) -> bool:
        self.fresh_master()
        keys = [names.lease(lease.key), names.record(lease.key, name)]
        action = f"writing the record {name!r} of {lease.key!r}"
        return bool(
            self.run("write_record", action, lease.key, keys, [lease.owner, lease.limit, value])
        )

    def swap_mark(
        self,
        names: Names,
        key: str,
        kind: str,
        expected: Optional[str],
        new: Optional[str],
        ttl: float,
    ) -> bool:
        args = [int(expected is not None), expected or "", int(new is not None), new or ""]
        args.append(_ms(ttl))
        action = f"changing the {kind} mark of {key!r}"
        return bool(self.run("swap_mark", action, key, [names.mark(key, kind)], args))

    def delete(self, key: str, *names: str) -> None:
        """Delete the Redis keys ``names`` (entries of ``key``: one hash slot)."""
        self.call("cleaning up the check", key, self.client.delete, *names)

    # --- the connection's side of the protocol --------------------------------------------

    def store_time(self) -> float:
        """The store's clock, read at most every CLOCK_REFRESH seconds (one round trip)
        and told in between by the local monotonic clock, which no NTP step moves."""
        clock = self._clock
        now = time.monotonic()
        if clock is None or now - clock[1] > CLOCK_REFRESH:
            seconds, microseconds = self.call("reading the time", None, self.client.time)
            after = time.monotonic()
            clock = self._clock = (seconds + microseconds / 1e6, (now + after) / 2)
            now = after
        return clock[0] + (now - clock[1])

    def database_for(self, address: Mapping[str, Any]) -> Optional[int]:
        # One server, one user: the script writes with the store's credentials, so the
        # write is one the application's own client may make. Not on a cluster (one
        # script cannot span slots) nor behind Sentinel (the master may move between the
        # two clients' views of it).
        if self.options.topology != "standalone" or address.get("credential_provider"):
            return None
        if self._writes_refused is not None:
            return None
        pool = self.client.connection_pool
        ours = pool.connection_kwargs
        if ours.get("credential_provider") or not _same_server(ours, address):
            return None
        if bool(address.get("ssl")) != issubclass(pool.connection_class, SSLConnection):
            return None
        return int(address.get("db") or 0)

    def append_events(self, feed: str, events: Sequence[str], capacity: int, ttl: float) -> None:
        """A capped stream beside the key prefix ``feed`` (the store's own name for it,
        whatever the layout): one pipeline adds the events, trims the oldest beyond
        ``capacity`` (approximately, as Redis trims cheaply) and sets its expiry."""
        name = layout.events(feed)
        pipe = self.client.pipeline(transaction=False)
        for event in events:
            pipe.xadd(name, {"e": event}, maxlen=capacity, approximate=True)
        pipe.pexpire(name, _ms(ttl))
        self.call(f"adding to the feed of {feed!r}", feed, pipe.execute)

    def read_events(self, feed: str) -> list[str]:
        entries = self.call(
            f"reading the feed of {feed!r}", feed, self.client.xrange, layout.events(feed)
        )
        return [as_text(fields.get(b"e", fields.get("e"))) for _, fields in entries]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _renewal(names: Names, leases: list[Lease]) -> tuple[list, list]:
    """The KEYS and ARGV of one renew script."""
    keys, args = [], []
    for lease in leases:
        entries = names.entries(lease.key)
        keys += [entries.lease, entries.holders]
        args += [lease.owner, _ms(lease.ttl), lease.limit]
    return keys, args


def _same_server(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> bool:
    """Whether two redis-py connection settings reach one server as one user: the same
    socket path, or host and port; the same username and password."""
    where = ("path",) if ours.get("path") or theirs.get("path") else ("host", "port")
    return all(ours.get(name) == theirs.get(name) for name in (*where, "username", "password"))


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))
