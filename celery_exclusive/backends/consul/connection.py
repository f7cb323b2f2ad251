"""What every layout of the Consul store shares: the HTTP client, this process's
session, one transaction and one read, and the one failure translator around them.

Every client exception leaves as :class:`~celery_exclusive.errors.BackendUnavailable`
(retrying may help) or as one of the named
:class:`~celery_exclusive.errors.ConfigurationError` subclasses below (it cannot: a
token's permissions, a size limit, the datacenter, TLS, a path).

A write whose answer was lost is never guessed at (:mod:`..readback`): a lock is read
back with ``?consistent`` while the store is unavailable, an idempotent transaction is
sent again, and what stays unknown becomes an *orphan* (``session.Orphan``) that the
next heartbeat frees if it turns up under this process's session, so a session kept
alive for other leases never keeps an abandoned lock with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

from ...errors import ConfigurationError, ExclusiveError
from ..base import Connection, Lease, LeaseInfo, unavailable
from ..readback import settle_acquire, settle_release, until_answered
from .http import (
    Ambiguous,
    ConsulError,
    ConsulHTTP,
    Denied,
    Refused,
    TooLarge,
    Unavailable,
    settings_from_url,
)
from .kv import WRITE_VERBS, Entry, mark_value, op, pack_mark
from .session import (
    MAX_SESSION_TTL,
    MIN_SESSION_TTL,
    ProcessState,
    SessionLeaseInfo,
    create_body,
    lock_delay_for,
    ttl_seconds,
)

logger = logging.getLogger("celery_exclusive")

#: Consul refuses transactions with more operations than this (agent/txn_endpoint.go).
MAX_TXN_OPS = 64
#: How often a compare-and-swap is tried again when another writer changed its entry first.
CAS_ATTEMPTS = 8
#: How long an ambiguous write is read back and retried before it becomes an orphan.
SETTLE_BUDGET = 10.0
#: How long a lock whose acquire answer was lost is watched for: Consul holds a request
#: up to 7 s for a leader, and a commit can land that much after the client gave up.
ORPHAN_WATCH = 30.0


class ConsulPermissionDenied(ConfigurationError):
    """The ACL token lacks ``key_prefix`` write on the store's folder, or ``session``
    write on its agent's node."""


class ConsulValueTooLarge(ConfigurationError):
    """A value or transaction past Consul's limits (512 KiB per value and per
    transaction by default)."""


class ConsulDatacenterError(ConfigurationError):
    """Sessions cannot be created where the URL points (another datacenter)."""


class TxnConflict(Exception):
    """Consul rolled a transaction back (HTTP 409). ``failed`` holds the positions of
    the operations that failed, which tell a failed guard from a failed lock without
    parsing Consul's messages."""

    def __init__(self, errors: list[dict]) -> None:
        self.reasons = [str(error.get("What", "")) for error in errors]
        self.failed = {int(error.get("OpIndex", 0)) for error in errors}
        super().__init__("; ".join(self.reasons))

    @property
    def session_invalid(self) -> bool:
        return any("invalid session" in reason.lower() for reason in self.reasons)


class SessionGone(Exception):
    """Consul no longer knows the session a lock named: open a new one and retry once."""


def policy_for(root: str) -> str:
    """The ACL rules the store needs, for messages."""
    return (
        f'key_prefix "{root}" {{ policy = "write" }} and session_prefix "" '
        '{ policy = "write" } (or session "<this agent\'s node>")'
    )


class ConsulConnection(Connection):
    """One Consul agent, as the URL names it: its HTTP client (one pool per process),
    this process's session, and the translator of every failure."""

    #: The shortest session TTL the server accepts. Consul's is 10 s; only a test
    #: emulator configured with a shorter minimum may lower it.
    min_session_ttl: float = MIN_SESSION_TTL
    #: How long an ambiguous write is read back and retried before it becomes an orphan.
    settle_budget: float = SETTLE_BUDGET

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.settings = settings_from_url(url)
        self.http = ConsulHTTP(self.settings)
        self._state = ProcessState()

    def process(self) -> ProcessState:
        """This process's session and what it holds; a forked child starts afresh."""
        if self._state.pid != os.getpid():
            self._state = ProcessState()
        return self._state

    # -- failures --------------------------------------------------------------------------

    def translate(
        self, exc: BaseException, action: str, key: Optional[str] = None
    ) -> ExclusiveError:
        url, root = self.safe_url, self.settings.root
        if isinstance(exc, Denied):
            if exc.path.startswith("/v1/session/"):
                what = "create or renew sessions (session:write on its agent's node)"
            else:
                what = f"write keys under {root or '/'!r} of Consul's KV store (key:write)"
            return ConsulPermissionDenied(
                f"the Consul ACL token of {url} may not {what}: permission denied while "
                f"{action} ({exc}). Grant its policy {policy_for(root)}, or set the token "
                "with ?token= or CONSUL_HTTP_TOKEN."
            )
        if isinstance(exc, TooLarge):
            return ConsulValueTooLarge(
                f"Consul at {url} refused a request as too large while {action} ({exc}). "
                "One value, and one transaction, must stay under kv_max_value_size and "
                "txn_max_req_len (512 KiB by default): pass smaller arguments (an id rather "
                "than the data), or raise those limits on the Consul servers."
            )
        if isinstance(exc, Refused):
            if any(reason in str(exc) for reason in ("node registration", "datacenter")):
                dc = self.settings.dc
                return ConsulDatacenterError(
                    f"Consul at {url} cannot keep sessions for this agent's node "
                    f"{'in datacenter ' + repr(dc) + ' ' if dc else ''}({exc}) while "
                    f"{action}. A session lives on the node of the agent the URL names: "
                    "point exclusive_backend_url at an agent of the datacenter whose KV "
                    "holds the leases, and leave out ?dc= (or name that agent's own "
                    "datacenter)."
                )
            return ConfigurationError(
                f"Consul at {url} refused a request while {action} ({exc}); retrying "
                "cannot fix it. Check the URL's options (ns and partition need Consul "
                "Enterprise) and, for consuls://, the CA (cacert / CONSUL_CACERT) and "
                "client certificate."
            )
        return unavailable(url, action, exc)  # Unavailable, or an answer we cannot read

    def call(self, action: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn``; every client exception leaves through :meth:`translate`."""
        try:
            return fn(*args, **kwargs)
        except (ConsulError, ValueError, KeyError) as exc:
            raise self.translate(exc, action) from None

    # -- one transaction, one read ------------------------------------------------------------

    def txn(self, ops: list[dict[str, Any]]) -> list[Entry]:
        """One transaction: its KV results, or :class:`TxnConflict` with Consul's reasons.
        A per-operation "Permission denied" is an ACL denial, never a conflict."""
        ns, partition = self.settings.ns, self.settings.partition
        if ns or partition:
            for each in ops:
                each["KV"].update(
                    {k: v for k, v in (("Namespace", ns), ("Partition", partition)) if v}
                )
        write = any(each["KV"]["Verb"] in WRITE_VERBS for each in ops)
        answer = self.http.call("PUT", "/v1/txn", body=ops, write=write, expect=(200, 409))
        payload = answer.json() or {}
        if answer.status == 200:
            return [Entry.from_json(r["KV"]) for r in payload.get("Results") or [] if r.get("KV")]
        errors = payload.get("Errors") or []
        denied = [e.get("What", "") for e in errors if "Permission denied" in str(e.get("What"))]
        if denied:
            raise Denied(f"{denied[0]} (transaction)", 409, answer.text, "/v1/txn")
        raise TxnConflict(errors)

    def txns(self, ops: Sequence[dict[str, Any]]) -> None:
        """``ops`` in as few transactions as Consul allows (each all or nothing)."""
        for start in range(0, len(ops), MAX_TXN_OPS):
            self.txn(list(ops[start : start + MAX_TXN_OPS]))

    def get(self, path: str, consistent: bool = False) -> Optional[Entry]:
        query = {"consistent": True} if consistent else None
        answer = self.http.call("GET", f"/v1/kv/{path}", query=query, expect=(200, 404))
        raw = answer.json() if answer.status == 200 else None
        return Entry.from_json(raw[0]) if raw else None

    def read(self, *prefixes: str) -> dict[str, Entry]:
        """Every entry under each prefix, in one read-only transaction (one round trip)."""
        entries = self.txn([op("get-tree", prefix) for prefix in prefixes])
        return {entry.key: entry for entry in entries}

    def list(
        self, prefix: str, index: int = 0, wait: float = 0.0, keys: bool = False
    ) -> tuple[int, list[Any]]:
        """Every entry under ``prefix`` (only their paths, with ``keys``) and the index to
        block on next; with ``index``, a blocking query that answers once something
        under ``prefix`` changed past it, or after ``wait`` seconds."""
        query: dict[str, Any] = {"keys" if keys else "recurse": True}
        if index:
            query.update(index=index, wait=f"{max(1, int(wait * 1000))}ms")
        answer = self.http.call(
            "GET",
            f"/v1/kv/{prefix}",
            query=query,
            expect=(200, 404),
            timeout=self.http.timeout + wait,
        )
        found = (answer.json() or []) if answer.status == 200 else []
        return answer.index, found if keys else [Entry.from_json(each) for each in found]

    @property
    def settling(self) -> tuple[float, tuple[type[BaseException], ...]]:
        """How a lost answer is settled here (:mod:`..readback`): for how long, and
        which failures mean that Consul did not answer."""
        return self.settle_budget, (Unavailable,)

    def settled_read(self, path: str) -> Optional[Entry]:
        """A consistent read of ``path``, retried for the settle budget while the store
        is unavailable."""
        return until_answered(lambda: self.get(path, consistent=True), *self.settling)

    # -- the session ----------------------------------------------------------------------

    def session(self, ttl: float) -> tuple[str, float]:
        """This process's session id and TTL, created with ``ttl`` if there is none.

        A session last renewed more than a third of its TTL ago is renewed first: a key
        locked now must live a full TTL, and Consul counts that from the last renewal
        (an idle process's heartbeat renews nothing).
        """
        state = self.process()
        self.refresh()
        with state.lock:
            if state.session_id is None:
                session_ttl = self.session_ttl(ttl)
                state.session_id = self.create_session(session_ttl, self.settings.behavior)
                state.session_ttl = session_ttl
                state.renewed_at = time.monotonic()
            return state.session_id, state.session_ttl

    def refresh(self) -> None:
        """Renew this process's session if it was last renewed more than a third of its
        TTL ago (see :meth:`session`)."""
        state = self.process()
        with state.lock:
            session_id, session_ttl, renewed_at = (
                state.session_id,
                state.session_ttl,
                state.renewed_at,
            )
        stale = session_id is not None and time.monotonic() - renewed_at > session_ttl / 3
        if stale and self.keep_alive(session_id, "renewing the session"):
            self.settle_orphans()  # locks left by lost answers live as long as the session

    def session_ttl(self, ttl: float) -> float:
        clamped = min(max(ttl, self.min_session_ttl), MAX_SESSION_TTL)
        if clamped != ttl:
            logger.warning(
                "Consul session TTLs must be %gs-%gs: the lease ttl %gs became a session "
                "TTL of %gs, so a dead worker's leases expire after %gs-%gs.",
                self.min_session_ttl,
                MAX_SESSION_TTL,
                ttl,
                clamped,
                clamped,
                2 * clamped,
            )
        return clamped

    def create_session(self, ttl: float, behavior: str, purpose: str = "") -> str:
        body = create_body(
            f"celery-exclusive {socket.gethostname()} pid {os.getpid()}{purpose}",
            ttl,
            behavior,
            lock_delay_for(ttl, self.settings.lock_delay),
        )
        answer = self.http.call("PUT", "/v1/session/create", body=body, write=True)
        return answer.json()["ID"]

    def keep_alive(self, session_id: str, action: str) -> bool:
        """Renew this process's session, noting when the request was sent; False, with
        the session and its locks forgotten, if Consul no longer knows it."""
        state = self.process()
        sent = time.monotonic()
        if not self.call(action, self.renew_session, session_id):
            state.forget_session(session_id)
            return False
        state.renewed_at = sent
        return True

    def renew_session(self, session_id: str) -> bool:
        """Renew a session; False if Consul no longer knows it (HTTP 404)."""
        answer = self.http.call("PUT", f"/v1/session/renew/{session_id}", expect=(200, 404))
        return answer.status == 200

    def destroy(self, session_id: str) -> None:
        """Destroy a session of ours (best effort: it expires on its own)."""
        try:
            self.http.call("PUT", f"/v1/session/destroy/{session_id}", write=True)
        except ConsulError as exc:
            logger.warning(
                "Could not destroy Consul session %s at %s (%s); it expires on its own.",
                session_id,
                self.safe_url,
                exc,
            )

    def settle_orphans(self) -> None:
        """Free locks this process's session holds without a lease (see ``Orphan``)."""
        state = self.process()
        with state.lock:
            orphans, session_id = list(state.orphans.values()), state.session_id
        for orphan in orphans:
            try:
                entry = self.get(orphan.path, consistent=True)
                mine = (
                    entry is not None
                    and entry.session == session_id
                    and entry.record().get("owner") == orphan.owner
                )
                if mine:
                    self.txn(
                        [
                            op("check-index", orphan.path, index=entry.modify_index),
                            op("delete", orphan.path),
                        ]
                    )
                    logger.warning("freed %s, a lock left by a lost answer", orphan.path)
                if mine or time.monotonic() > orphan.until:
                    with state.lock:
                        state.orphans.pop(orphan.path, None)
            except (ConsulError, TxnConflict) as exc:
                logger.warning("could not yet free %s (%s); trying again", orphan.path, exc)

    def lease_info(
        self,
        key: str,
        owner: str,
        entry: Entry,
        holder: Mapping[str, Any],
        expiries: dict[str, Optional[float]],
    ) -> LeaseInfo:
        """A lease held by ``entry``'s session, whose ModifyIndex is its fencing token;
        ``expiries`` keeps each session's expiry across one listing."""
        session_id = entry.session or ""
        if session_id not in expiries:
            expiries[session_id] = self.expires_in(session_id)
        return SessionLeaseInfo(key, owner, entry.modify_index, expiries[session_id], holder)

    def expires_in(self, session_id: str) -> Optional[float]:
        """Seconds until the session needs renewing: known for ours, its TTL for others.

        Consul does not say when another session was last renewed, and may keep an
        unrenewed session up to twice its TTL: the answer is an approximation.
        """
        state = self.process()
        if session_id == state.session_id:
            return max(0.0, state.session_ttl - (time.monotonic() - state.renewed_at))
        info = self.session_info(session_id)
        return ttl_seconds(info["TTL"]) if info.get("TTL") else None

    def session_info(self, session_id: str) -> dict[str, Any]:
        """What Consul says of a session (``/v1/session/info``); empty if it is gone."""
        answer = self.http.call("GET", f"/v1/session/info/{session_id}")
        return (answer.json() or [None])[0] or {}

    # -- limit-1 locks held by the session --------------------------------------------------

    def acquire(self, action: str, attempt: Callable[[], Optional[Lease]]) -> Optional[Lease]:
        """Run a grant ``attempt``; once more, on a new session, if the session it used
        had died since its last use."""
        for _ in range(2):
            try:
                return self.call(action, attempt)
            except SessionGone:
                continue
        return None

    def lock(
        self, key: str, owner: str, ttl: float, path: str, lock: Callable[[str], Optional[int]]
    ) -> Optional[Lease]:
        """A limit-1 lease of ``key``: the lock at ``path`` that ``lock(session_id)`` takes
        (its fencing token, or None if refused) for this process's session.

        Consul lets a session lock a key it already holds again (overwriting the value),
        so leases of one process are kept apart here, before the request.
        """
        if not self._reserve(key, owner, path):
            return None
        state = self.process()
        token = 0
        try:
            session_id, session_ttl = self.session(ttl)
            token = lock(session_id) or 0
            if not token:
                return None
            with state.lock:
                state.held[key] = (owner, token)
            return Lease(key, owner, token, min(ttl, session_ttl), 1)
        finally:
            if not token:
                with state.lock:
                    if state.held.get(key) == (owner, 0):
                        del state.held[key]

    def _reserve(self, key: str, owner: str, path: str) -> bool:
        """Claim ``key`` for ``owner`` among this process's leases, before asking Consul.

        If another lease of this process is on record for it, ask Consul whether the
        lock at ``path`` still carries that grant (it may have expired or been
        force-released).
        """
        state = self.process()
        with state.lock:
            previous = state.held.get(key)
            if previous is None:
                state.held[key] = (owner, 0)
                return True
        if previous[1] == 0 or self._still_granted(path, previous[1]):
            return False
        with state.lock:
            if state.held.get(key) == previous:
                state.held[key] = (owner, 0)
                return True
        return False

    def _still_granted(self, path: str, token: int) -> bool:
        try:
            self.txn([op("check-index", path, index=token)])
        except TxnConflict:
            return False
        return True

    def check_session(self, failed: TxnConflict, session_id: str) -> None:
        """A lock's transaction failed: if for its session being gone, forget it and
        raise SessionGone (:meth:`acquire` opens a new one); else the caller reads why."""
        if failed.session_invalid:
            self.process().forget_session(session_id)
            raise SessionGone() from None

    def settle_acquire(self, path: str, owner: str, session_id: str, lost: Ambiguous) -> int:
        """A lock's answer was lost: read it back (:mod:`..readback`). Ours: the grant's
        token. Not known to be ours in time: the lock may still land later, so it is
        watched for as an orphan, and the store did not answer (the caller requeues;
        never "held")."""
        state = self.process()
        state.add_orphan(path, owner, ORPHAN_WATCH)

        def token() -> Optional[int]:
            entry = self.get(path, consistent=True)
            mine = entry is not None and entry.session == session_id
            return entry.modify_index if mine and entry.record().get("owner") == owner else None

        granted = settle_acquire(token, lost, *self.settling)  # unknown: stays an orphan
        with state.lock:
            state.orphans.pop(path, None)
        return granted

    def held_by_this_process(self, lease: Lease) -> bool:
        """Whether ``lease`` is this process's own limit-1 grant; forgotten here, since
        it is being released."""
        state = self.process()
        with state.lock:
            mine = state.held.get(lease.key) == (lease.owner, lease.fencing_token)
            if mine:
                del state.held[lease.key]
        return mine

    def granted(self, path: str, lease: Lease) -> Optional[Entry]:
        """The lock at ``path`` if it still carries ``lease`` (its token and its owner),
        read consistently: how a lease of another process (the worker's main process
        freeing a killed child's) is found before it is released."""
        entry = self.get(path, consistent=True)
        if entry is None or entry.modify_index != lease.fencing_token:
            return None
        return entry if entry.record().get("owner") == lease.owner else None

    def settle_release(
        self,
        path: str,
        lease: Lease,
        ops: list[dict],
        index: Optional[int] = None,
        guarded: bool = False,
        orphan: bool = True,
    ) -> bool:
        """Run a release transaction until its outcome is known: a lost answer is read
        back (``path`` still at ``index``, the ModifyIndex it had while held, by default
        the lease's token: sent again). Unknown after the settle budget:
        BackendUnavailable, and (``orphan``) the lock is left for the heartbeat to free.
        A conflict means the grant is gone, unless the transaction is ``guarded`` by
        other reads (then the caller reads again)."""
        held_at = lease.fencing_token if index is None else index

        def send() -> bool:
            try:
                self.txn(ops)
                return True
            except TxnConflict:
                if guarded:
                    raise
                return False  # no longer this grant: released, expired or taken

        def held() -> bool:  # False: our write landed (or the lease expired meanwhile)
            entry = self.get(path, consistent=True)
            return entry is not None and entry.modify_index == held_at

        try:
            return send()
        except Unavailable as lost:  # not applied, or not known to be: read back
            try:
                return settle_release(held, send, lost, *self.settling)
            except Unavailable:
                if orphan:
                    self.process().add_orphan(path, lease.owner)
                raise Unavailable(f"the release of {lease.key!r} was not answered") from None

    def renew(self, leases: list[Lease], proof: Callable[[Lease, str], dict]) -> set[Lease]:
        """Renew this process's session once for all ``leases``, then prove each still
        held in as few transactions as Consul allows (``proof(lease, session_id)``: the
        read-only operation that holds exactly when it is): a live session does not mean
        every key is still ours (an operator's force-release deletes the key)."""
        state = self.process()
        self.settle_orphans()
        session_id = state.session_id
        action = f"renewing {len(leases)} lease(s)"
        if session_id is None or not self.keep_alive(session_id, action):
            return set(leases)
        lost = self.prove(leases, lambda lease: proof(lease, session_id), action)
        with state.lock:
            for lease in lost:
                if state.held.get(lease.key) == (lease.owner, lease.fencing_token):
                    del state.held[lease.key]
        return lost

    def prove(self, leases: list[Lease], proof: Callable[[Lease], dict], action: str) -> set[Lease]:
        """The leases whose proof fails (a failed check names its operation)."""
        lost = set()
        for start in range(0, len(leases), MAX_TXN_OPS):
            chunk = leases[start : start + MAX_TXN_OPS]
            try:
                self.call(action, self.txn, [proof(lease) for lease in chunk])
            except TxnConflict as failed:
                lost |= {chunk[i] for i in failed.failed if i < len(chunk)}
        return lost

    def write_fenced(self, action: str, proof: dict, path: str, value: str) -> bool:
        """Set ``path`` to ``value`` in one transaction with ``proof`` that a lease is
        still held; a lost answer is sent again (the write is idempotent)."""

        def send() -> bool:
            try:
                ops = [proof, op("set", path, value.encode("utf-8", "surrogatepass"))]
                until_answered(lambda: self.txn(ops), self.settle_budget, (Ambiguous,))
            except TxnConflict:
                return False
            return True

        return self.call(action, send)

    # -- marks ------------------------------------------------------------------------------

    def read_mark(self, path: str, action: str) -> Optional[str]:
        return mark_value(self.call(action, self.get, path), self.store_time())

    def swap_mark(
        self, path: str, expected: Optional[str], new: Optional[str], ttl: float, action: str
    ) -> bool:
        """Read, compare in Python (Consul cannot compare values), then write with the
        KV endpoint's ``?cas=`` on the ModifyIndex read (its raw body: no base64, up to
        Consul's 512 KiB per value). A lost race is no answer: the winner may have left a
        value that still equals ``expected`` (a refresh, an A-B-A), so compare again.
        A write whose answer was lost is read back: finding what it wrote (the expiry
        makes each write's bytes its own) proves it landed, however late."""

        def swap() -> bool:
            sent: list[Optional[bytes]] = []  # writes whose answers were lost
            for _ in range(CAS_ATTEMPTS):
                entry = self.settled_read(path) if sent else self.get(path)
                if sent and (entry.value if entry is not None else None) in sent:
                    return True
                now = self.store_time()
                if mark_value(entry, now) != expected:
                    return False
                if new is None and entry is None:
                    return True  # nothing to delete
                index = entry.modify_index if entry is not None else 0  # 0: create only
                data = None if new is None else pack_mark(new, now + ttl)
                method = "DELETE" if data is None else "PUT"
                try:
                    answer = self.http.call(
                        method, f"/v1/kv/{path}", query={"cas": index}, raw=data, write=True
                    )
                except Ambiguous:
                    sent.append(data)
                    continue
                if answer.json() is True:
                    return True
            raise Unavailable(
                f"the mark {path} changed under {CAS_ATTEMPTS} compare-and-swaps in a row"
            )

        return self.call(action, swap)

    # -- the clock, the start-up check, close --------------------------------------------------

    def store_time(self) -> float:
        """The agent's clock (its ``Date`` header; see ``http.AgentClock``).

        Consul has no server clock API: KV entries carry no timestamps, and sessions
        are timed by the leader without saying when. The agent's clock is one clock for
        every worker that talks to the same agent (or to agents kept in time by NTP);
        marks expire and line entries lapse by it.
        """
        now = self.http.clock.now()
        if now is None:
            try:
                self.http.call("GET", "/v1/status/leader")
            except ConsulError:
                return time.time()
            now = self.http.clock.now()
        return time.time() if now is None else now

    def warnings(self) -> list[str]:
        """What only Consul can get wrong, for the start-up check."""
        warnings = []
        if self.settings.lock_delay == 0:
            warnings.append(
                f"{self.safe_url}: lock_delay=0, so when a worker's session is invalidated "
                "(its node deregistered, an operator's destroy) another worker can take its "
                "keys before it notices; leave lock_delay out for the safe default."
            )
        skew = self.store_time() - time.time()
        if abs(skew) > 1.0:
            warnings.append(
                f"{self.safe_url}: the Consul agent's clock is {skew:+.1f}s from this host's; "
                "marks and waiters' places in line follow the agent's."
            )
        return warnings

    def close(self, free: Callable[[str, int, str], Any]) -> None:
        """Free each lock this process still holds (``free(key, token, session_id)``, at
        once: a destroyed session's keys would wait out its lock delay), then destroy
        its sessions."""
        state = self.process()
        with state.lock:
            session_id, state.session_id = state.session_id, None
            held = [(key, token) for key, (_owner, token) in state.held.items() if token]
            slots = list(state.slot_sessions.values())
            state.held.clear()
            state.slot_sessions.clear()
        try:
            for key, token in held:
                with contextlib.suppress(TxnConflict):  # no longer ours
                    free(key, token, session_id)
        except (ConsulError, ExclusiveError) as exc:
            logger.warning("Could not free the locks held at %s (%s).", self.safe_url, exc)
        for each in slots + ([session_id] if session_id else []):
            self.destroy(each)
        self.http.close()
