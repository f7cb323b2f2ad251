"""The words both etcd layouts speak: requests of etcd's JSON gateway (keys and values
travel base64-encoded), the entries of ours they read, and the store's own names.

The store's own entries of a key ``K`` live in its folder, ``<root>k/E/``, for ``K``
percent-encoded as ``E`` (every byte but ``A-Za-z0-9_.-~`` escaped), so ``E`` never
contains ``/`` and one key's folder never holds another key's entries, whatever its
characters: ``h/<owner>``, a holder (the library's own layout); ``m/<kind>``, the
``kind`` mark, attached to an etcd lease of its own ttl (the server expires it);
``r/<name>``, record ``name``, on no lease (it stays).
"""

from __future__ import annotations

import base64
import json
from typing import Any, Optional
from urllib.parse import quote, unquote

from ..base import MarkRead


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: Optional[str]) -> bytes:
    return base64.b64decode(text or "")


def encode(text: str) -> bytes:
    return quote(text, safe="", errors="surrogatepass").encode("ascii")


def decode(text: bytes) -> str:
    return unquote(text.decode("ascii"), errors="surrogatepass")


def range_end(prefix: bytes) -> bytes:
    """The end of the range of every key starting with ``prefix`` (etcd's ``--prefix``)."""
    end = bytearray(prefix.rstrip(b"\xff"))
    if not end:
        return b"\0"
    end[-1] += 1
    return bytes(end)


def ranged(key: bytes, prefix: bool = False, **extra: Any) -> dict:
    """``key``, or with ``prefix`` every key starting with it, as a request names it."""
    body = {"key": b64(key), **extra}
    if prefix:
        body["range_end"] = b64(range_end(key))
    return body


def read(key: bytes, prefix: bool = False, **extra: Any) -> dict:
    return {"request_range": ranged(key, prefix, **extra)}


def put(key: bytes, value: str, lease: Optional[str] = None) -> dict:
    """A write of ``value`` to ``key`` on the etcd lease ``lease`` (None: on none)."""
    body = {"key": b64(key), "value": b64(value.encode())}
    return {"request_put": body if lease is None else {**body, "lease": lease}}


def rewrite(key: bytes, value: Optional[str]) -> dict:
    """A change of ``key`` to ``value`` that keeps its etcd lease (None: a delete)."""
    if value is None:
        return delete(key)
    return {"request_put": {"key": b64(key), "value": b64(value.encode()), "ignore_lease": True}}


def delete(key: bytes) -> dict:
    return {"request_delete_range": {"key": b64(key)}}


def compare(key: bytes, target: str, value: Any, result: str = "EQUAL", prefix=False) -> dict:
    """A condition on ``key`` (with ``prefix``, on every key of the range: an empty range
    compares as a key that does not exist)."""
    field = {"CREATE": "create_revision", "MOD": "mod_revision", "VALUE": "value"}[target]
    return {**ranged(key, prefix), "target": target, "result": result, field: value}


def unchanged(key: bytes, found: list[dict]) -> dict:
    """The condition that ``key``, read as ``found``, has not changed since."""
    return compare(key, "MOD", found[0]["mod_revision"]) if found else compare(key, "CREATE", "0")


def kvs(response: dict) -> list[dict]:
    """The entries a transaction's read found."""
    return response.get("response_range", {}).get("kvs", [])


def revision(answer: dict) -> int:
    """The revision an answer is true at: that of its writes, if it made any."""
    return int(answer["header"]["revision"])


def token(entry: dict) -> int:
    """A holder entry's fencing token: the revision of the write that granted it."""
    return int(entry["mod_revision"])


def created(entry: dict) -> int:
    """An entry's place in etcd's order of arrival: the revision that created it."""
    return int(entry["create_revision"])


def text_of(entry: dict) -> str:
    return unb64(entry.get("value")).decode()


def record_of(entry: dict) -> dict:
    """The JSON object an entry of ours holds; ``{}`` for anything else (etcd's own
    mutex writes an empty value, which the gateway leaves out)."""
    try:
        value = json.loads(unb64(entry.get("value")))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def owner_of(entry: dict) -> Optional[str]:
    """The owner a holder entry of ours names; None for any other entry."""
    owner = record_of(entry).get("owner")
    return owner if isinstance(owner, str) else None


def fill(mark: Optional[MarkRead], answer: dict) -> None:
    """Fill in ``mark`` from the last read of a transaction's answer."""
    if mark is not None:
        found = kvs(answer["responses"][-1])
        mark.value, mark.done = (text_of(found[0]) if found else None), True


class Names:
    """Where the store's own entries of a key live, under ``root`` (see the module)."""

    def __init__(self, root: str) -> None:
        self.keys = root.encode() + b"k/"

    def folder(self, key: str) -> bytes:
        return self.keys + encode(key) + b"/"

    def holders(self, key: str) -> bytes:
        return self.folder(key) + b"h/"

    def mark(self, key: str, kind: str) -> bytes:
        return self.folder(key) + b"m/" + encode(kind)

    def record(self, key: str, name: str) -> bytes:
        return self.folder(key) + b"r/" + encode(name)

    def parse(self, name: bytes) -> tuple[str, bytes, bytes]:
        """(the key, the kind: b"h", b"m" or b"r", the rest) of an entry's name."""
        encoded, _, rest = name[len(self.keys) :].partition(b"/")
        return decode(encoded), rest[:1], rest[2:]
