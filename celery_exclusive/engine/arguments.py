"""A call's arguments as the store keeps them for a pending rerun: JSON, as Celery's
messages carry them.

A ``rerun`` duplicate hands its arguments to the key's pending rerun through the store,
and the run takes the newest; a run stopped while it ran as the pending rerun resumes
with them. kombu's JSON is what Celery's own messages use, so dates, UUIDs, decimals
and any type a user registered with kombu come back as they went in.
"""

from __future__ import annotations

from typing import Optional

from kombu.utils.json import dumps, loads

from ..errors import ExclusiveError


def encode_call(
    name: str, args, kwargs, as_of: Optional[float] = None, kept_by: str = "on_duplicate='rerun'"
) -> str:
    """A call's arguments as JSON, for a pending rerun to run with; ``as_of``: when the
    change they carry first reached the library (``marks.changed_at`` reads it), which
    orders changes that join the pending rerun out of order."""
    call: dict = {"args": list(args), "kwargs": dict(kwargs)}
    if as_of is not None:
        call["as_of"] = as_of
    try:
        return dumps(call)
    except TypeError as exc:
        raise ExclusiveError(
            f"{name}: {kept_by} keeps the latest call's arguments in the lease store as "
            f"JSON, and these are not serializable: {exc}."
        ) from None


def decode_call(arguments: str) -> tuple[tuple, dict]:
    """The arguments :func:`encode_call` kept, as ``(args, kwargs)``."""
    call = loads(arguments)
    return tuple(call["args"]), call["kwargs"]
