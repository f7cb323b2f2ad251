"""The emulator's state store: KV entries, tombstones, sessions, the node and its checks.

Each rule names the hashicorp/consul source file and function it copies. Paths are
relative to that repository; ``state/`` is ``agent/consul/state/``.
"""

from __future__ import annotations

import base64
import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from .durations import parse_go_duration

#: structs.SessionTTLMax ("Invalid Session TTL", agent/consul/session_endpoint.go Apply).
MAX_SESSION_TTL = 86400.0
#: structs.MaxLockDelay: state/session.go deleteSessionTxn caps every lock delay at 60 s.
MAX_LOCK_DELAY = 60.0
#: structs.SerfCheckID, the default check of a session (agent/session_endpoint.go).
SERF_CHECK = "serfHealth"
#: agent/txn_endpoint.go isWrite: the verbs that go through Raft (Txn.Apply).
WRITE_VERBS = {"set", "delete", "delete-cas", "delete-tree", "cas", "lock", "unlock"}


class TxnError(Exception):
    """One failed operation of a transaction (state/txn.go txnKVS returns an error)."""


class ServerError(Exception):
    """An RPC error: agent/http.go wrap answers it with HTTP 500 and its text."""


class BadRequest(Exception):
    """agent/http.go HTTPError{StatusCode: 400}."""


@dataclass
class Session:
    id: str
    name: str
    node: str
    checks: list[str]
    ttl: float
    behavior: str
    lock_delay: float
    create_index: int
    deadline: Optional[float] = None

    def as_json(self) -> dict[str, Any]:
        return {
            "ID": self.id,
            "Name": self.name,
            "Node": self.node,
            "NodeChecks": list(self.checks),
            "TTL": f"{self.ttl:g}s" if self.ttl else "",
            "Behavior": self.behavior,
            "LockDelay": int(self.lock_delay * 1e9),
            "CreateIndex": self.create_index,
            "ModifyIndex": self.create_index,
        }


@dataclass
class KV:
    """The KV table, its graveyard and the raft index (state/kvs.go)."""

    index: int = 1
    kv_index: int = 1
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)
    tombstones: dict[str, int] = field(default_factory=dict)
    #: The "sessions" table index (state/session.go sessionCreateTxn and
    #: deleteSessionTxn update it; SessionList and NodeSessions report it).
    sessions_index: int = 1


class Store:
    """Everything Consul's servers replicate, for one datacenter and one node."""

    def __init__(self, node: str, min_session_ttl: float, ttl_multiplier: float) -> None:
        self.node = node
        self.min_session_ttl = min_session_ttl
        # session_ttl.go createSessionTimer: the timer is armed at TTL x SessionTTLMultiplier (2).
        self.ttl_multiplier = ttl_multiplier
        self.kv = KV()
        self.sessions: dict[str, Session] = {}
        self.lock_delays: dict[str, float] = {}
        self.node_registered = True
        self.checks: dict[str, str] = {SERF_CHECK: "passing"}

    def next_index(self) -> int:
        self.kv.index += 1
        return self.kv.index

    # -- sessions ------------------------------------------------------------------

    def create_session(self, body: dict[str, Any]) -> Session:
        """agent/session_endpoint.go SessionCreate defaults (node, serfHealth, 15 s lock
        delay, release), FixupLockDelay and fixupEmptySessionChecks; then
        session_endpoint.go Apply (behavior, TTL bounds) and state/session.go
        sessionCreateTxn (the node must exist: ErrMissingNode)."""
        lock_delay = _fixup_lock_delay(body.get("LockDelay", "15s"))
        checks = _session_checks(body)
        behavior = body.get("Behavior") or "release"
        if behavior not in ("release", "delete"):
            raise ServerError(f"Invalid Behavior setting '{behavior}'")
        ttl = parse_go_duration(body["TTL"]) if body.get("TTL") else 0.0
        if ttl is None:
            raise ServerError(f"Session TTL '{body['TTL']}' invalid")
        if ttl and not self.min_session_ttl <= ttl <= MAX_SESSION_TTL:
            raise ServerError(
                f"Invalid Session TTL '{int(ttl * 1e9)}', must be between "
                f"[{self.min_session_ttl:g}s={MAX_SESSION_TTL:g}s]"
            )
        if not self.node_registered or body.get("Node", self.node) != self.node:
            raise ServerError("Missing node registration")  # state.ErrMissingNode
        for check in checks:
            # state/session.go validateSessionChecksTxn: a critical check refuses the session.
            if self.checks.get(check) is None:
                raise ServerError(f"Missing check '{check}' registration")
            if self.checks[check] == "critical":
                raise ServerError(f"Check '{check}' is in critical state")
        session = Session(
            id=str(uuid.uuid4()),
            name=body.get("Name", ""),
            node=self.node,
            checks=checks,
            ttl=ttl,
            behavior=behavior,
            lock_delay=lock_delay,
            create_index=self.next_index(),
        )
        self._arm(session)
        self.sessions[session.id] = session
        self.kv.sessions_index = session.create_index
        return session

    def _arm(self, session: Session) -> None:
        if session.ttl:
            session.deadline = time.monotonic() + session.ttl * self.ttl_multiplier

    def renew_session(self, session_id: str) -> Optional[Session]:
        """agent/consul/session_endpoint.go Renew: resets the timer; None (HTTP 404) when
        the session no longer exists."""
        session = self.sessions.get(session_id)
        if session is not None:
            self._arm(session)
        return session

    def expire_sessions(self) -> None:
        now = time.monotonic()
        for session in list(self.sessions.values()):
            if session.deadline is not None and session.deadline <= now:
                self.destroy_session(session.id)

    def destroy_session(self, session_id: str) -> bool:
        """state/session.go deleteSessionTxn: the session's locks are released (Session
        cleared, a new ModifyIndex) or deleted, each key entering a lock delay capped at
        structs.MaxLockDelay."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        index = self.next_index()
        self.kv.sessions_index = index
        delay = min(session.lock_delay, MAX_LOCK_DELAY)
        now = time.monotonic()
        for key, entry in list(self.kv.entries.items()):
            if entry["Session"] != session_id:
                continue
            if session.behavior == "delete":
                self._delete(key, index)
            else:
                self._write(key, {**entry, "Session": None}, index)
            if delay > 0:
                self.lock_delays[key] = now + delay
        return True

    def set_check(self, check: str, status: str) -> None:
        """state/catalog.go ensureCheckTxn: "Delete any sessions for this check if the
        health is critical"."""
        self.checks[check] = status
        if status == "critical":
            for session in list(self.sessions.values()):
                if check in session.checks:
                    self.destroy_session(session.id)

    def deregister_node(self) -> None:
        """state/catalog.go deleteNodeTxn: "Invalidate any sessions for this node", whatever
        checks they were bound to."""
        self.node_registered = False
        for session in list(self.sessions.values()):
            if session.node == self.node:
                self.destroy_session(session.id)

    def register_node(self) -> None:
        self.node_registered = True
        self.checks[SERF_CHECK] = "passing"

    # -- KV --------------------------------------------------------------------------

    def get(self, key: str) -> tuple[int, Optional[dict[str, Any]]]:
        """state/kvs.go kvsGetTxn; agent/consul/kvs_endpoint.go Get reports the entry's
        ModifyIndex, or the table index (never 0) for a missing key."""
        entry = self.kv.entries.get(key)
        return (entry["ModifyIndex"], entry) if entry else (max(self.kv.kv_index, 1), None)

    def list(self, prefix: str) -> tuple[int, list[dict[str, Any]]]:
        """state/kvs.go kvsListTxn: entries under the prefix; the index is the highest of
        theirs and the graveyard's under it, else the table index."""
        entries = [self.kv.entries[k] for k in sorted(self.kv.entries) if k.startswith(prefix)]
        if not prefix:
            return max(self.kv.kv_index, 1), entries
        index = max(
            [e["ModifyIndex"] for e in entries]
            + [i for k, i in self.kv.tombstones.items() if k.startswith(prefix)]
            + [0]
        )
        return (index or max(self.kv.kv_index, 1)), entries

    def in_lock_delay(self, key: str) -> bool:
        """agent/consul/kvs_endpoint.go kvsPreApply: a lock inside the key's lock delay is
        refused before it reaches Raft."""
        return self.lock_delays.get(key, 0.0) > time.monotonic()

    def _write(self, key: str, entry: dict[str, Any], index: int) -> dict[str, Any]:
        """state/kvs.go kvsSetTxn: keeps CreateIndex; an entry equal to the existing one
        (value, flags, session, lock index) is not written and keeps its ModifyIndex."""
        existing = self.kv.entries.get(key)
        entry = {"Flags": 0, "LockIndex": 0, "Session": None, **entry, "Key": key}
        entry["CreateIndex"] = existing["CreateIndex"] if existing else index
        if existing is not None and all(
            existing[f] == entry[f] for f in ("Value", "Flags", "Session", "LockIndex")
        ):
            return existing
        entry["ModifyIndex"] = index
        self.kv.entries[key] = entry
        self.kv.tombstones.pop(key, None)
        self.kv.kv_index = index
        return entry

    def _delete(self, key: str, index: int) -> None:
        """state/kvs.go kvsDeleteTxn: a tombstone keeps the index of the delete, so a key
        created again gets a higher ModifyIndex (LockIndex starts again)."""
        if self.kv.entries.pop(key, None) is not None:
            self.kv.tombstones[key] = index
            self.kv.kv_index = index

    def set(self, key: str, value: Optional[bytes], index: int, flags: int = 0) -> dict[str, Any]:
        """state/kvs.go kvsSetTxn writes the request's entry whole: its ``Flags`` replace
        the stored ones (a write without flags stores 0), its session is kept."""
        existing = self.kv.entries.get(key) or {}
        return self._write(
            key,
            {
                "Value": value,
                "Flags": flags,
                "Session": existing.get("Session"),
                "LockIndex": existing.get("LockIndex", 0),
            },
            index,
        )

    def cas(self, key: str, value: Optional[bytes], cas: int, index: int, flags: int = 0) -> bool:
        """state/kvs.go kvsSetCASTxn: 0 creates only; otherwise the ModifyIndex must match."""
        existing = self.kv.entries.get(key)
        if (cas == 0 and existing is not None) or (
            cas != 0 and (existing is None or existing["ModifyIndex"] != cas)
        ):
            return False
        self.set(key, value, index, flags)
        return True

    def delete_cas(self, key: str, cas: int, index: int) -> bool:
        """state/kvs.go kvsDeleteCASTxn: an absent key counts as deleted."""
        existing = self.kv.entries.get(key)
        if existing is None:
            return True
        if existing["ModifyIndex"] != cas:
            return False
        self._delete(key, index)
        return True

    def delete_tree(self, prefix: str, index: int) -> None:
        for key in [k for k in self.kv.entries if k.startswith(prefix)]:
            self._delete(key, index)

    def lock(
        self, key: str, value: Optional[bytes], session_id: str, index: int, flags: int = 0
    ) -> bool:
        """state/kvs.go kvsLockTxn: an unknown session is an error; a key locked by another
        session refuses; LockIndex grows on each new acquisition; the request's value and
        flags are written (kvsSetTxn with updateSession)."""
        if not session_id:
            raise TxnError("missing session")
        if session_id not in self.sessions:
            raise TxnError(f'invalid session "{session_id}"')
        existing = self.kv.entries.get(key)
        if existing is not None and existing["Session"] not in (None, session_id):
            return False
        lock_index = existing["LockIndex"] if existing else 0
        if existing is None or existing["Session"] is None:
            lock_index += 1
        entry = {"Value": value, "Flags": flags, "Session": session_id, "LockIndex": lock_index}
        self._write(key, entry, index)
        return True

    def unlock(
        self, key: str, value: Optional[bytes], session_id: str, index: int, flags: int = 0
    ) -> bool:
        """state/kvs.go kvsUnlockTxn: only the session holding the lock; the request's
        value and flags are written, the key stays."""
        existing = self.kv.entries.get(key)
        if existing is None or existing["Session"] != session_id:
            return False
        lock_index = existing["LockIndex"]
        entry = {"Value": value, "Flags": flags, "Session": None, "LockIndex": lock_index}
        self._write(key, entry, index)
        return True

    # -- transactions ------------------------------------------------------------------

    def txn(self, ops: list[dict[str, Any]], can) -> tuple[list[dict], list[dict]]:
        """agent/consul/txn_endpoint.go preCheck (ACLs, lock delay) then state/txn.go
        txnDispatch: every operation runs, every failure is reported with its OpIndex,
        and any failure rolls the whole transaction back. ``can(verb, key)`` is the ACL."""
        errors = []
        for i, op in enumerate(ops):
            kv = op.get("KV") or {}
            verb, key = kv.get("Verb"), kv.get("Key", "")
            if not can(verb, key):
                errors.append({"OpIndex": i, "What": "Permission denied"})
            elif verb == "lock" and self.in_lock_delay(key):
                errors.append(
                    {"OpIndex": i, "What": f"failed to lock key {key!r} due to lock delay"}
                )
        if errors:
            return [], errors
        writes = any((op.get("KV") or {}).get("Verb") in WRITE_VERBS for op in ops)
        # Entries are replaced, never changed in place: shallow copies restore the state.
        saved = KV(
            self.kv.index,
            self.kv.kv_index,
            dict(self.kv.entries),
            dict(self.kv.tombstones),
            self.kv.sessions_index,
        )
        index = self.kv.index + 1
        results: list[dict] = []
        for i, op in enumerate(ops):
            try:
                results += self._txn_kv(op["KV"], index)
            except (TxnError, KeyError) as exc:
                errors.append({"OpIndex": i, "What": str(exc)})
        if errors:
            self.kv = saved
            return [], errors
        if writes:
            self.kv.index = index  # state/txn.go TxnRW: one Raft index for the whole txn
        return results, []

    def _txn_kv(self, op: dict[str, Any], index: int) -> list[dict[str, Any]]:
        """state/txn.go txnKVS, verb by verb; write verbs answer the entry without its
        value ("clone and blank out the value")."""
        verb, key = op["Verb"], op["Key"]
        value = base64.b64decode(op["Value"]) if op.get("Value") else None
        # api/kv.go KVTxnOp.Flags becomes the DirEntry's Flags (agent/txn_endpoint.go
        # convertOps), which set, cas, lock and unlock write.
        flags = int(op.get("Flags") or 0)
        entry = self.kv.entries.get(key)
        if verb in ("get", "get-or-empty"):
            if entry is None and verb == "get":
                raise TxnError(f"key {key!r} doesn't exist")
            return [copy.deepcopy(entry or {"Key": key, "Value": None, "ModifyIndex": 0})]
        if verb == "get-tree":
            return copy.deepcopy(self.list(key)[1])
        if verb == "check-index":
            if entry is None:
                raise TxnError(f"failed to check index, key {key!r} doesn't exist")
            if entry["ModifyIndex"] != op.get("Index", 0):
                raise TxnError(
                    f"failed index check for key {key!r}, current modify index "
                    f"{entry['ModifyIndex']} != {op.get('Index', 0)}"
                )
            return [_blank(entry)]
        if verb == "check-session":
            if entry is None:
                raise TxnError(f"failed to check session, key {key!r} doesn't exist")
            if entry["Session"] != op.get("Session"):
                raise TxnError(f"failed session check for key {key!r}")
            return [_blank(entry)]
        if verb == "check-not-exists":
            if entry is not None:
                raise TxnError(f"key {key!r} exists")
            return []
        if verb == "set":
            return [_blank(self.set(key, value, index, flags))]
        if verb == "cas":
            if not self.cas(key, value, op.get("Index", 0), index, flags):
                raise TxnError(f"failed to set key {key!r}, index is stale")
            return [_blank(self.kv.entries[key])]
        if verb == "lock":
            if not self.lock(key, value, op.get("Session", ""), index, flags):
                raise TxnError(f"failed to lock key {key!r}, lock is already held")
            return [_blank(self.kv.entries[key])]
        if verb == "unlock":
            if not self.unlock(key, value, op.get("Session", ""), index, flags):
                raise TxnError(
                    f"failed to unlock key {key!r}, lock isn't held, or is held by another session"
                )
            return [_blank(self.kv.entries[key])]
        if verb == "delete":
            self._delete(key, index)
            return []
        if verb == "delete-cas":
            if not self.delete_cas(key, op.get("Index", 0), index):
                raise TxnError(f"failed to delete key {key!r}, index is stale")
            return []
        if verb == "delete-tree":
            self.delete_tree(key, index)
            return []
        raise TxnError(f"unknown KV verb {verb!r}")


def _blank(entry: dict[str, Any]) -> dict[str, Any]:
    return {**entry, "Value": None}


def _fixup_lock_delay(raw: Any) -> float:
    """agent/session_endpoint.go FixupLockDelay: a string is a Go duration (one Go cannot
    parse is a 400), a number is nanoseconds; either below 1000 ns counts as seconds."""
    if isinstance(raw, str):
        seconds = parse_go_duration(raw)
        if seconds is None:
            raise BadRequest(f'Request decode failed: time: invalid duration "{raw}"')
    elif isinstance(raw, (int, float)):
        seconds = raw / 1e9
    else:
        raise BadRequest("Request decode failed: LockDelay")
    return seconds * 1e9 if 0 < seconds * 1e9 < 1000 else seconds


def _session_checks(body: dict[str, Any]) -> list[str]:
    """agent/session_endpoint.go: Checks and NodeChecks default to serfHealth; an empty
    Checks list empties NodeChecks too (fixupEmptySessionChecks)."""
    checks = body.get("Checks", [SERF_CHECK])
    node_checks = body.get("NodeChecks", [SERF_CHECK])
    if "Checks" in body and not checks:
        node_checks = []
    if "NodeChecks" in body and not node_checks and "Checks" not in body:
        checks = []
    return sorted(set(checks or []) | set(node_checks or []))
