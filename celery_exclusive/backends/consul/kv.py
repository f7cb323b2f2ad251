"""Where a lease key's entries live in Consul's KV store, and how they are written.

Keys are data, never structure: a user key is encoded into one path segment made only
of ``A-Z a-z 0-9 -`` and ``_XX`` escapes (the UTF-8 bytes of every other character, in
upper-case hex), so no key can hold ``/``, ``.``, ``%`` or anything an HTTP router
rewrites (Go's ServeMux answers ``//``, ``/./`` and ``/../`` with a 301 to another
path) or a recent agent refuses (its KV endpoint accepts only ``a-zA-Z0-9,-_./``).
The code is prefix-free, so a key starts with ``p`` exactly when its segment starts with
the encoding of ``p``: ``holders(prefix)`` reads one KV prefix and decodes it back.

Everything of key ``K`` lives in its own folder ``<root><enc(K)>/``, so a read of one
key's folder can never catch another key (``invoice:1`` vs ``invoice:1xxxx``)::

    lock             limit 1: locked by the holder's session; JSON {"owner", "limit", "holder"}
    sem              limit > 1 (Consul's semaphore recipe): {"Limit": N, "Holders": [...]}
    sem/<owner>      limit > 1: one contender entry per holder, locked by its session
    mark/<kind>      a mark: "<expires_at>\\n<value>" (no JSON escaping: a rerun's
                     arguments are stored as given, up to Consul's 512 KiB per value)
    record/<name>    a record: the string as written
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from ..line import admit

#: Characters kept as they are in a key's segment; every other byte becomes ``_XX``.
_PLAIN = re.compile(r"[A-Za-z0-9-]")
_SEGMENT = re.compile(r"(?:[A-Za-z0-9-]|_[0-9A-F]{2})*")
#: The segment of the empty key (an empty segment would make ``//``).
_EMPTY = "_"

LOCK, SEM = "lock", "sem"
#: agent/txn_endpoint.go isWrite: the verbs that go through Raft.
WRITE_VERBS = {"set", "delete", "delete-cas", "delete-tree", "cas", "lock", "unlock"}


def encode(key: str) -> str:
    """The path segment of ``key``: readable where the key is plain, escaped elsewhere."""
    if key == "":
        return _EMPTY
    return "".join(
        char
        if _PLAIN.fullmatch(char)
        else "".join(f"_{byte:02X}" for byte in char.encode("utf-8", "surrogatepass"))
        for char in key
    )


def encode_prefix(prefix: str) -> str:
    """The start every segment of a key starting with ``prefix`` has ("" for none)."""
    return encode(prefix) if prefix else ""


def decode(segment: str) -> Optional[str]:
    """The key of a segment, or None if ``segment`` is not one ``encode`` made."""
    if segment == _EMPTY:
        return ""
    if not segment or not _SEGMENT.fullmatch(segment):
        return None
    raw = bytearray()
    i = 0
    while i < len(segment):
        if segment[i] == "_":
            raw.append(int(segment[i + 1 : i + 3], 16))
            i += 3
        else:
            raw += segment[i].encode()
            i += 1
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None


class Layout:
    """KV paths under the URL's root folder (``""`` or ``"a/b/"``)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def folder(self, key: str) -> str:
        return f"{self.root}{encode(key)}/"

    def lock(self, key: str) -> str:
        return self.folder(key) + LOCK

    def sem(self, key: str) -> str:
        return self.folder(key) + SEM

    def slot(self, key: str, owner: str) -> str:
        return f"{self.folder(key)}{SEM}/{encode(owner)}"

    def mark(self, key: str, kind: str) -> str:
        return f"{self.folder(key)}mark/{encode(kind)}"

    def record(self, key: str, name: str) -> str:
        return f"{self.folder(key)}record/{encode(name)}"

    def prefix(self, key_prefix: str) -> str:
        """The KV prefix holding the folders of every key starting with ``key_prefix``."""
        return self.root + encode_prefix(key_prefix)

    def parse(self, path: str) -> Optional[tuple[str, str]]:
        """``(key, what)`` of an entry's path (``what``: "lock", "sem/<owner>", ...),
        or None for entries that are not this library's."""
        if not path.startswith(self.root):
            return None
        segment, _, what = path[len(self.root) :].partition("/")
        key = decode(segment)
        return None if key is None or not what else (key, what)


@dataclass
class Entry:
    """One KV entry, from a KV read or a transaction result."""

    key: str
    modify_index: int
    session: Optional[str]
    value: bytes
    flags: int = 0

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Entry:
        """Consul's JSON of an entry (``Value`` base64; absent for write results)."""
        value = base64.b64decode(raw["Value"]) if raw.get("Value") else b""
        session = raw.get("Session") or None
        flags = int(raw.get("Flags") or 0)
        return cls(raw["Key"], int(raw.get("ModifyIndex") or 0), session, value, flags)

    def record(self) -> dict[str, Any]:
        try:
            record = json.loads(self.value or b"null")
        except ValueError:
            return {}
        return record if isinstance(record, dict) else {}

    @property
    def is_lease(self) -> bool:
        """Whether this library wrote the entry as a lease (``lock`` or a contender
        entry): flags 0 and a JSON record naming its owner. Anything else at a lease's
        path is another client's, and is never deleted or rewritten."""
        return self.flags == 0 and "owner" in self.record()

    @property
    def is_semaphore(self) -> bool:
        """Whether this library wrote the entry as a ``sem`` record (Holders a list)."""
        return self.flags == 0 and isinstance(self.record().get("Holders"), list)


def op(
    verb: str,
    path: str,
    value: Any = None,
    session: Optional[str] = None,
    index: Optional[int] = None,
    flags: int = 0,
) -> dict[str, Any]:
    """One ``/v1/txn`` KV operation; ``value`` is bytes, or JSON-encoded if not.
    ``flags``: the entry's ``Flags``, which set, cas, lock and unlock write (0 if left out)."""
    kv: dict[str, Any] = {"Verb": verb, "Key": path}
    if flags:
        kv["Flags"] = flags
    if value is not None:
        raw = value if isinstance(value, bytes) else json.dumps(value).encode()
        kv["Value"] = base64.b64encode(raw).decode()
    if session is not None:
        kv["Session"] = session
    if index is not None:
        kv["Index"] = index
    return {"KV": kv}


def pack_mark(value: str, expires_at: float) -> bytes:
    """A mark's stored bytes: its expiry (store time), a newline, the value as given."""
    return f"{expires_at!r}\n".encode() + value.encode("utf-8", "surrogatepass")


def unpack_mark(raw: bytes) -> Optional[tuple[str, float]]:
    """``(value, expires_at)`` of a mark's bytes, or None if they are not a mark."""
    head, newline, body = raw.partition(b"\n")
    try:
        expires_at = float(head)
        return (body.decode("utf-8", "surrogatepass"), expires_at) if newline else None
    except ValueError:
        return None


def mark_value(entry: Optional[Entry], now: float) -> Optional[str]:
    """The live value of a mark entry: None when absent, expired or not a mark."""
    mark = unpack_mark(entry.value) if entry is not None else None
    return mark[0] if mark is not None and mark[1] > now else None


def line_guard(
    path: str, entry: Optional[Entry], claimant: Optional[str], free: int, now: float
) -> Optional[dict[str, Any]]:
    """The operation that pins a grant to the key's line (the mark at ``path``) as read,
    or None when the line puts others ahead of ``claimant`` for the ``free`` slots.

    No line: ``check-not-exists``. An expired one: a ``delete-cas`` tidying it. A line
    admitting ``claimant``: a ``cas`` (or, for its last entry, a ``delete-cas``) on the
    ModifyIndex read, taking the claimant out with the grant, or a ``check-index`` if
    the claimant was not in it.
    """
    if entry is None:
        return op("check-not-exists", path)
    mark = unpack_mark(entry.value)
    if mark is None or mark[1] <= now:
        return op("delete-cas", path, index=entry.modify_index)
    line, expires_at = mark
    admitted, rest = admit(line, claimant, free, now)
    if not admitted:
        return None
    if rest == line:
        return op("check-index", path, index=entry.modify_index)
    if rest is None:
        return op("delete-cas", path, index=entry.modify_index)
    return op("cas", path, pack_mark(rest, expires_at), index=entry.modify_index)
