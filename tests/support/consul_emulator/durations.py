"""Go's time.ParseDuration, which every duration Consul reads goes through."""

from __future__ import annotations

import re
from typing import Optional

_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_PART = r"(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|μs|ms|s|m|h)"
_DURATION = re.compile(rf"[+-]?(?:{_PART})+")
_PARTS = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_go_duration(text: str) -> Optional[float]:
    """Seconds in ``text`` as Go parses it ("1m30s", "250ms", "0"), or None where Go
    answers "time: invalid duration" (a bare number other than 0, an exponent: "1e-05s")."""
    text = str(text)
    if text in ("0", "+0", "-0"):
        return 0.0
    if not _DURATION.fullmatch(text):
        return None
    sign = -1.0 if text.startswith("-") else 1.0
    return sign * sum(float(n) * _UNITS[u] for n, u in _PARTS.findall(text))
