"""The plumbing every part of the Consul store shares: one transaction, one read, the
failure translator around them, and this process's session (``session.py``).

A write whose answer was lost is never guessed at (:mod:`..readback`): ``_settled_read``
reads back with ``?consistent`` while the store is unavailable, and ``_retried`` sends an
idempotent transaction again.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Callable, Optional

from ..base import Backend
from ..readback import until_answered
from .errors import translate
from .http import Ambiguous, ConsulError, ConsulHTTP, Denied, Unavailable, settings_from_url
from .kv import WRITE_VERBS, Entry, Layout, op
from .session import MAX_SESSION_TTL, MIN_SESSION_TTL, ProcessState, create_body, lock_delay_for

logger = logging.getLogger("celery_exclusive")

#: Consul refuses transactions with more operations than this (agent/txn_endpoint.go).
MAX_TXN_OPS = 64
#: How often a compare-and-swap is tried again when another writer changed its entry first.
CAS_ATTEMPTS = 8
#: How long an ambiguous write is read back and retried before it becomes an orphan.
SETTLE_BUDGET = 10.0


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


class ConsulCore(Backend):
    """A backend's connection to Consul: the HTTP client, the KV layout, the session."""

    #: The shortest session TTL the server accepts. Consul's is 10 s; only a test
    #: emulator configured with a shorter minimum may lower it.
    min_session_ttl: float = MIN_SESSION_TTL
    #: How long an ambiguous write is read back and retried before it becomes an orphan.
    settle_budget: float = SETTLE_BUDGET

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.settings = settings_from_url(url)
        self.http = ConsulHTTP(self.settings)
        self.layout = Layout(self.settings.root)
        self._state = ProcessState()

    def _process(self) -> ProcessState:
        if self._state.pid != os.getpid():
            self._state = ProcessState()
        return self._state

    def _call(self, action: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn``; every client exception leaves as an ExclusiveError (``errors.py``)."""
        try:
            return fn(*args, **kwargs)
        except ConsulError as exc:
            raise translate(exc, action, self) from None
        except (ValueError, KeyError) as exc:  # an answer we cannot read
            raise self.unavailable(action, exc) from None

    def _txn(self, ops: list[dict[str, Any]]) -> list[Entry]:
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

    def _get(self, path: str, consistent: bool = False) -> Optional[Entry]:
        query = {"consistent": True} if consistent else None
        answer = self.http.call("GET", f"/v1/kv/{path}", query=query, expect=(200, 404))
        raw = answer.json() if answer.status == 200 else None
        return Entry.from_json(raw[0]) if raw else None

    def _list(self, prefix: str, consistent: bool = False) -> dict[str, Entry]:
        query = {"recurse": True, **({"consistent": True} if consistent else {})}
        answer = self.http.call("GET", f"/v1/kv/{prefix}", query=query, expect=(200, 404))
        raw = answer.json() if answer.status == 200 else None
        return {entry.key: entry for entry in map(Entry.from_json, raw or [])}

    def _read(self, *prefixes: str) -> dict[str, Entry]:
        """Every entry under each prefix, in one read-only transaction (one round trip)."""
        entries = self._txn([op("get-tree", prefix) for prefix in prefixes])
        return {entry.key: entry for entry in entries}

    def _settled_read(self, path: str) -> Optional[Entry]:
        """A consistent read of ``path``, retried for SETTLE_BUDGET while the store is
        unavailable."""
        return until_answered(lambda: self._get(path, consistent=True), *self._settling)

    def _retried(self, ops: list[dict]) -> bool:
        """An idempotent transaction, sent again while its answer is lost."""
        try:
            until_answered(lambda: self._txn(ops), self.settle_budget, (Ambiguous,))
        except TxnConflict:
            return False
        return True

    @property
    def _settling(self) -> tuple[float, tuple[type[BaseException], ...]]:
        """How a lost answer is settled here (:mod:`..readback`): for how long, and
        which failures mean that Consul did not answer."""
        return self.settle_budget, (Unavailable,)

    # -- the session ----------------------------------------------------------

    def _session(self, ttl: float) -> tuple[str, float]:
        """This process's session id and TTL, created with ``ttl`` if there is none.

        A session last renewed more than a third of its TTL ago is renewed first: a key
        locked now must live a full TTL, and Consul counts that from the last renewal
        (an idle process's heartbeat renews nothing).
        """
        state = self._process()
        with state.lock:
            session_id, session_ttl, renewed_at = (
                state.session_id,
                state.session_ttl,
                state.renewed_at,
            )
        stale = session_id is not None and time.monotonic() - renewed_at > session_ttl / 3
        if stale and self._keep_session_alive(session_id, "renewing the session"):
            self._settle_orphans()  # locks left by lost answers live as long as the session
        with state.lock:
            if state.session_id is None:
                session_ttl = self._session_ttl(ttl)
                state.session_id = self._create_session(session_ttl)
                state.session_ttl = session_ttl
                state.renewed_at = time.monotonic()
            return state.session_id, state.session_ttl

    def _session_ttl(self, ttl: float) -> float:
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

    def _create_session(self, ttl: float) -> str:
        body = create_body(
            f"celery-exclusive {socket.gethostname()} pid {os.getpid()}",
            ttl,
            self.settings.behavior,
            lock_delay_for(ttl, self.settings.lock_delay),
        )
        answer = self.http.call("PUT", "/v1/session/create", body=body, write=True)
        return answer.json()["ID"]

    def _keep_session_alive(self, session_id: str, action: str) -> bool:
        """Renew the session, noting when the request was sent; False, with the session
        and its locks forgotten, if Consul no longer knows it."""
        state = self._process()
        sent = time.monotonic()
        if not self._call(action, self._renew_session, session_id):
            state.forget_session(session_id)
            return False
        state.renewed_at = sent
        return True

    def _renew_session(self, session_id: str) -> bool:
        """Renew the session; False if Consul no longer knows it (HTTP 404)."""
        answer = self.http.call("PUT", f"/v1/session/renew/{session_id}", expect=(200, 404))
        return answer.status == 200

    def _settle_orphans(self) -> None:
        """Free locks this process's session holds without a lease (see ``Orphan``)."""
        state = self._process()
        with state.lock:
            orphans, session_id = list(state.orphans.values()), state.session_id
        for orphan in orphans:
            try:
                entry = self._get(orphan.path, consistent=True)
                mine = (
                    entry is not None
                    and entry.session == session_id
                    and entry.record().get("owner") == orphan.owner
                )
                if mine:
                    self._txn(
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
