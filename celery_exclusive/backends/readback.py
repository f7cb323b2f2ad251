"""A write whose answer was lost, settled by reading the store back: one rule for every
store reached over a network (PostgreSQL, MongoDB, etcd, Consul).

A write can be applied and its answer lost (a reset, a timeout, a failover). Neither
guess is safe: "granted" would run a body without a lease, "not granted" would leave a
grant nobody knows of. So the store reads back, and the outcome is decided here:

- An acquire is **won** when the read-back shows the owner among the key's holders:
  its fencing token is the one the store shows. Until then it is read again, while the
  store does not answer and while the owner is not there yet (a write the store still
  holds may land), until the budget ends; then it is **unknown**, and the error of the
  lost answer is raised: the caller requeues, and a grant that lands later is the
  store's to clean (it expires, or the store deletes it as an orphan).
- A release is **done** when the read-back no longer shows the owner (the lost delete
  landed, or the lease expired meanwhile); while the owner is still there it is sent
  again, and that answer counts. Unknown at the end of the budget: the error is raised.

Each store keeps what is its own: how it reads a holder back, and what it does with
an unknown outcome (etcd and Consul delete a late grant as an orphan).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, TypeVar

from ..errors import BackendUnavailable, ExclusiveError
from .base import Backend

T = TypeVar("T")

#: A lost answer about a lease is read back for at most this long (seconds), and at
#: most the lease's ttl: a grant nobody knows of expires by itself after that.
LIMIT = 5.0
#: The first pause between read-backs, doubled after each up to the longest.
FIRST_PAUSE, LONGEST_PAUSE = 0.05, 1.0


class LostAnswer(Exception):
    """A write was sent and its answer lost: it may or may not have been applied.
    ``error`` is what the caller raises if reading back cannot tell."""

    def __init__(self, error: ExclusiveError) -> None:
        super().__init__(str(error))
        self.error = error


#: What a read-back takes for "the store did not answer": try again.
NOT_ANSWERED: tuple[type[BaseException], ...] = (BackendUnavailable, LostAnswer)


def budget(ttl: float) -> float:
    """How long a lost answer about a lease of ``ttl`` seconds is read back."""
    return min(max(ttl, 1.0), LIMIT)


def token_of(store: Backend, key: str, owner: str) -> Optional[int]:
    """The fencing token of ``owner``'s live grant of ``key``, as the store's holders
    show it; None if ``owner`` holds none."""
    return next((i.fencing_token for i in store.holders_of(key) if i.owner == owner), None)


def settle_acquire(
    token_of_owner: Callable[[], Optional[int]],
    lost: BaseException,
    seconds: float,
    not_answered: tuple[type[BaseException], ...] = NOT_ANSWERED,
) -> int:
    """The fencing token of an acquire whose answer was lost, if it was granted;
    ``token_of_owner()`` reads it back (None: the owner holds no grant of the key).
    Raises ``lost`` if that is not known within ``seconds``."""
    token = _until_decided(token_of_owner, seconds, not_answered)
    if token is None:
        raise lost
    return token


def settle_release(
    held: Callable[[], bool],
    send: Callable[[], bool],
    lost: BaseException,
    seconds: float,
    not_answered: tuple[type[BaseException], ...] = NOT_ANSWERED,
) -> bool:
    """What a release whose answer was lost did: True once ``held()`` (the owner still
    holds the lease) reads False; while it reads True, ``send()`` the release again
    and return its answer. Raises ``lost`` if neither is known within ``seconds``."""
    outcome = _until_decided(lambda: send() if held() else True, seconds, not_answered)
    if outcome is None:
        raise lost
    return outcome


def until_answered(
    call: Callable[[], T],
    seconds: float,
    not_answered: tuple[type[BaseException], ...] = NOT_ANSWERED,
) -> T:
    """``call()`` (a read, or a write that may be sent twice), tried again while the
    store does not answer, for up to ``seconds``; the last failure is raised when they
    have passed."""
    failure: list[BaseException] = []

    def attempt() -> tuple[T]:
        try:
            return (call(),)
        except not_answered as exc:
            failure[:] = [exc]
            raise

    answer = _until_decided(attempt, seconds, not_answered)
    if answer is None:
        raise failure[-1]
    return answer[0]


def _until_decided(
    decide: Callable[[], Optional[T]],
    seconds: float,
    not_answered: tuple[type[BaseException], ...],
) -> Optional[T]:
    """``decide()`` until it returns something (None: not known yet; an exception in
    ``not_answered``: the store did not answer), with growing pauses, for up to
    ``seconds``; None when they passed undecided."""
    deadline = time.monotonic() + seconds
    pause = FIRST_PAUSE
    while True:
        try:
            outcome = decide()
        except not_answered:
            outcome = None
        if outcome is not None:
            return outcome
        if time.monotonic() + pause > deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 2, LONGEST_PAUSE)
