"""A check every store makes: all holders of one key must agree on its limit."""

from __future__ import annotations

from collections.abc import Collection

from ..errors import ConfigurationError


def check_limit(key: str, limit: int, held_with: Collection[int]) -> None:
    """Refuse a grant whose limit differs from the limit the key is held with.

    Two tasks that share a key with different ``exclusive_limit`` values would each
    count slots their own way; the only safe answer is to say so.
    """
    other = next((n for n in held_with if n != limit), None)
    if other is not None:
        raise ConfigurationError(
            f"the key {key!r} is held with exclusive_limit={other} but was requested "
            f"with exclusive_limit={limit}; every task sharing a key must use the same limit."
        )
