"""How the CLI shows leases to people: durations, times and odd keys.

Only the human table and ``inspect`` text go through here; ``--json`` gives every value
exactly as the store holds it.
"""

from __future__ import annotations

import datetime
import unicodedata
from typing import Optional

#: Longest key (or other value) a table cell shows; longer ones end with an ellipsis.
MAX_CELL = 60


def counted(count: int, one: str, many: str) -> str:
    """``1 lease``, ``2 leases``: a count with its noun in the right number."""
    return f"{count} {one if count == 1 else many}"


def duration(seconds: Optional[float]) -> str:
    """``3.2s``, ``4m05s``, ``2h03m``, ``3d04h``: short, and exact enough to act on."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def ago(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{duration(seconds)} ago"


def within(seconds: Optional[float]) -> str:
    """Time left: ``in 3.2s``; ``due`` once it has passed (the store expires it)."""
    if seconds is None:
        return "-"
    return f"in {duration(seconds)}" if seconds > 0 else "due"


def local_time(epoch: float) -> str:
    """An epoch time as the local ISO time, to the millisecond, with its UTC offset."""
    moment = datetime.datetime.fromtimestamp(epoch).astimezone()
    return moment.isoformat(timespec="milliseconds")


def one_line(value: object, limit: Optional[int] = MAX_CELL) -> str:
    """``value`` as one line of printable text: control characters (newlines, tabs,
    escape sequences) and other unprintable ones escaped as in a Python string, and cut
    to ``limit`` terminal columns with an ellipsis."""
    text = str(value)
    if not text.isprintable():
        text = "".join(_escaped(char) for char in text)
    if limit is None or width(text) <= limit:
        return text
    kept, used = [], 0
    for char in text:
        used += _columns(char)
        if used > limit - 1:
            break
        kept.append(char)
    return "".join(kept) + "…"


def width(text: str) -> int:
    """Columns ``text`` takes in a terminal: East Asian wide characters take two."""
    return sum(_columns(char) for char in text)


def _columns(char: str) -> int:
    return 2 if unicodedata.east_asian_width(char) in "WF" else 1


def pad(text: str, columns: int) -> str:
    return text + " " * (columns - width(text))


def _escaped(char: str) -> str:
    if char.isprintable():
        return char
    return repr(char)[1:-1] if char != " " else char
