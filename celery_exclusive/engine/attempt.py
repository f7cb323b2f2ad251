"""The attempt engine: one call of an exclusive task or job, from start to end.

Celery's task class, RQ's job class and a function called directly all run a call the
same way, here: take the key (or find what a duplicate gets under its policy), run the
body under the lease, and end the attempt (record that it ended where its message may
be delivered again, give the lease back). The host tells the engine what it can do
(:class:`Host`: send the call again? may its message come twice?) and gets back ONE
:class:`~celery_exclusive.core.outcomes.Outcome`, which it carries out in its own
terms (:meth:`~celery_exclusive.core.outcomes.Outcome.carry_out`). Nothing here knows Celery or RQ.

    call = Call(name, task_id, key, settings, backend, args, kwargs)
    outcome = run(call, Host(can_requeue=True), body)

Each decision is made once: "no queue to go back to, so wait", "gave up after
``requeue_max_retries`` requeues", "a copy of a call that runs now", "run without a
lease because the store is down".
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from contextvars import ContextVar, Token
from typing import Any, Callable, Optional, Union

from .. import runtime, telemetry
from ..backends import Backend, End, FinalWrite, MarkSwap, versions
from ..backends.base import require
from ..core import debounce, marks, outcomes, policies, terminate
from ..core.config import Settings
from ..core.lease import HeldLease, UnlockedLease
from ..core.outcomes import Outcome
from ..core.policies import Granted
from ..errors import BackendUnavailable, ExclusiveError, LayoutMismatch, LeaseLost
from . import enqueue
from .arguments import decode_call, encode_call

logger = logging.getLogger("celery_exclusive")

AnyLease = Union[HeldLease, UnlockedLease]

#: The body of a call: called with the arguments it runs with (a pending rerun's may
#: differ from the call's own).
Body = Callable[[tuple, dict], Any]


def _never(exc: BaseException) -> bool:
    return False


def new_call_id() -> str:
    """A new call's id, as Celery and RQ make one: a random UUID (Celery's ``uuid()``
    and RQ's job ids are ``str(uuid4())``)."""
    return str(uuid.uuid4())


@dataclasses.dataclass(frozen=True)
class Host:
    """What the host running a call can do, as the engine needs to know it."""

    #: Whether the call can be sent again later (a worker's call, with a queue): a
    #: duplicate is requeued. Otherwise (a direct or eager call, a synchronous queue)
    #: it waits in the key's line instead, and a store that does not answer fails it.
    can_requeue: bool
    #: Whether the call's message may be delivered twice, while or after it runs
    #: (Celery's ``acks_late``): a copy is set aside or dropped, never run beside it.
    redelivery: bool = False
    #: Whether the message comes back by itself when its body is stopped by the loss
    #: of its lease (Celery's ``acks_late`` with ``reject_on_worker_lost``).
    redelivered_when_stopped: bool = False
    #: Whether the host sends a call whose process was lost again itself, with its
    #: message's arguments (Celery's ``retry_on_worker_lost``).
    retried_when_lost: bool = False
    #: With ``on_lease_lost="terminate"``: None stops nothing (the body runs in a
    #: process that is not ours to signal), False interrupts the body, True may also
    #: kill its process after ``terminate_grace`` (a pool child, a work horse).
    stop_process: Optional[bool] = None
    #: How long a finished mark lasts (with ``redelivery``): as long as a copy of the
    #: message may still arrive.
    finished_ttl: float = 0.0
    #: Whether an exception leaving the body sends the same message back (Celery's
    #: ``Reject(requeue=True)``): then the attempt has not ended.
    comes_back: Callable[[BaseException], bool] = _never
    #: The write that stores what a body returned with the release of its lease, in
    #: one step (a Celery result, where the result backend is on the lease store's
    #: server): called with the key and the result, in the body's thread, as the
    #: attempt ends; None, or a call that answers None, leaves the result to the host.
    result_write: Optional[Callable[[str, Any], Optional[FinalWrite]]] = None
    #: What the host calls a call, in messages: ``task`` or ``job``.
    noun: str = "task"
    #: How the host spells a setting's name before ``<name>``: ``exclusive_`` on a
    #: Celery task, nothing in ``@exclusive(...)``.
    setting_prefix: str = "exclusive_"
    #: A new call's id, as the host would give it: the call that carries on the run a
    #: pending rerun owed is named in the rerun mark before it is sent.
    new_call_id: Callable[[], str] = new_call_id

    @property
    def resumable(self) -> bool:
        """Whether the call's message may come again with its own arguments after its
        run began: a pending rerun's run keeps the arguments it took for its task id
        until its attempt ends, for that delivery to run with."""
        return self.redelivery or self.retried_when_lost


@dataclasses.dataclass
class Call:
    """One call, as the engine runs it."""

    name: str
    #: The task or job id; None for a direct call.
    task_id: Optional[str]
    key: str
    settings: Settings
    backend: Backend
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    #: How often this call was requeued already (drives the backoff and the limit).
    requeues: int = 0
    #: Which attempt of the task id this is (Celery's ``retries``): what a finished
    #: mark records.
    retries: int = 0
    #: Whether an earlier attempt of this call started its body (and was stopped, or
    #: failed): meeting a holder now, it is no duplicate to skip, only late, so it is
    #: requeued under ``skip`` too.
    resumed: bool = False
    #: Whether its message is a copy the library set aside while another delivery of
    #: the call ran (:class:`~celery_exclusive.core.outcomes.SetAside`).
    set_aside: bool = False
    #: When the change its arguments carry first reached the library (the store's
    #: time, stamped at its first attempt under ``rerun`` and sent along with every
    #: requeue): orders the changes that join a pending rerun out of order. None: now.
    as_of: Optional[float] = None
    #: Whether the call joined its key's burst already and comes back from it (under
    #: ``debounce``): it runs if it is still the burst's latest call, else it is covered.
    debounced: bool = False
    #: The pending rerun whose owed run this call carries (it died or gave up and
    #: handed the run on, :class:`~celery_exclusive.core.outcomes.OwedRun`): the call
    #: never joins it.
    owed_by: Optional[str] = None

    def came_before(self, redelivery: bool) -> bool:
        """Whether an earlier attempt of this call may have held its key: it was
        requeued, retried, resumed or set aside, or its message may be delivered again
        (``redelivery``: acks_late). A first delivery never held it."""
        return redelivery or bool(self.requeues or self.retries or self.resumed or self.set_aside)


_attempts: ContextVar[tuple[Attempt, ...]] = ContextVar("exclusive_attempts", default=())


def current() -> Optional[Attempt]:
    """The innermost attempt running its body in this thread (or task), if any."""
    attempts = _attempts.get()
    return attempts[-1] if attempts else None


def current_lease() -> Optional[AnyLease]:
    """The lease the innermost running body holds, if any."""
    attempt = current()
    return None if attempt is None else attempt.lease


def hand_off(task_id: Optional[str]) -> Optional[Attempt]:
    """The running call ``task_id`` is sending itself again from its body (Celery's
    ``retry()``, as its message goes out): give its lease back first, so that the new
    message does not find the key held by the attempt that sent it. Returns that
    attempt, whose :meth:`~Attempt.handed_off` the host calls once the message went
    out; None, and nothing done, outside such a send (:attr:`Attempt.handing_off`)."""
    attempt = current()
    if attempt is None or not attempt.handing_off or task_id != attempt.call.task_id:
        return None
    attempt.finish(ended=False)
    return attempt


def held_here(key: str) -> Optional[Attempt]:
    """The attempt running here that holds a lease on ``key``, if any."""
    for attempt in reversed(_attempts.get()):
        lease = attempt.lease
        if isinstance(lease, HeldLease) and lease.key == key and not lease.released:
            return attempt
    return None


def entered(attempt: Attempt) -> contextlib.AbstractContextManager[Attempt]:
    """Make ``attempt`` the current one for the ``with`` block (its body runs there)."""
    return _Entered(attempt)


class _Entered:
    """What :func:`entered` returns (a class: it is entered once per call)."""

    __slots__ = ("attempt", "token")

    def __init__(self, attempt: Attempt) -> None:
        self.attempt = attempt
        self.token: Optional[Token[tuple[Attempt, ...]]] = None

    def __enter__(self) -> Attempt:
        self.token = _attempts.set((*_attempts.get(), self.attempt))
        return self.attempt

    def __exit__(self, *exc_info: Any) -> bool:
        token, self.token = self.token, None
        if token is not None:  # left once, however often asked
            _attempts.reset(token)
        return False


def run(call: Call, host: Host, body: Body) -> Outcome:
    """Run ``call`` from start to end on ``host``; see :class:`Attempt`."""
    return Attempt(call, host).run(body)


class Attempt:
    """One attempt of a call: claim, the duplicate's outcome, the body under the lease,
    the end of the attempt."""

    def __init__(self, call: Call, host: Host) -> None:
        self.call = call
        self.host = host
        #: When the change the call's arguments carry first reached the library (see
        #: :attr:`Call.as_of`); stamped at its first attempt under ``rerun``.
        self.as_of = call.as_of
        #: The lease the body runs under, once granted.
        self.lease: Optional[AnyLease] = None
        #: The call's finished mark as read when it took its key (with ``redelivery``):
        #: what the end of the attempt swaps it from.
        self._finished_mark: Optional[str] = None
        self._finished_read = False
        #: Set while the host sends this call again on the body's behalf (Celery's
        #: ``retry()``): the lease goes back as the message goes out.
        self.handing_off = False
        #: Whether the body sent the call again and went on (``retry(throw=False)``): the
        #: call comes back under its id, so its run keeps no window or rate slot to meet.
        self.retry_sent = False
        #: Whether the body was stopped by the loss of its lease (``LeaseLost`` raised
        #: out of it while the lease was lost).
        self.stopped_by_loss = False
        #: Whether what the body returned was stored with the release of its lease
        #: (:attr:`Host.result_write`).
        self.result_written = False
        #: The arguments kept for the call's task id while its attempt runs, as a pending
        #: rerun whose message may come again (see :meth:`_keep_resume`), as read or kept.
        self._resume: Optional[str] = None
        #: Arguments kept for the call's task id just before its claim takes them from
        #: the pending rerun (:meth:`_keep_before_take`), until the claim says it did.
        self._kept_for_take: Optional[str] = None
        #: The arguments (JSON, as stored) the body runs with when it runs as the pending
        #: rerun of its key: the newest duplicate's, not the call's own. A host that
        #: sends the call again on the body's behalf (Celery's ``retry()``) sends these.
        self.arguments: Optional[str] = None
        settings = call.settings
        #: Its spans and events (:mod:`celery_exclusive.telemetry`), while in ``with``.
        self.trace = telemetry.call(
            call.name,
            call.key,
            call.backend.url,
            "priority" if settings.priority else settings.on_duplicate,
            settings.limit,
            settings.key_prefix,
            settings.trace_keys,
            call.task_id,
        )

    # --- the whole call ------------------------------------------------------------------

    def run(self, body: Body) -> Outcome:
        with self.trace:
            outcome = self._run(body)
            self.trace.ended(outcome)
            return outcome

    def _run(self, body: Body) -> Outcome:
        granted = self.claim()
        if isinstance(granted, Unlocked):
            return self._run_unlocked(granted.lease, body)
        if not isinstance(granted, Granted):
            return granted
        self.arguments = granted.arguments
        if isinstance(granted.lease, HeldLease) and granted.lease.lost:
            return self._lost_before_the_body(granted)
        call = self.call
        args, kwargs = (
            (call.args, call.kwargs)
            if granted.arguments is None
            else decode_call(granted.arguments)
        )
        holding = _Holding(self, granted.lease, granted.arguments)
        try:
            try:
                with holding:
                    result = body(args, kwargs)
                    holding.returned(result)
            except BaseException as exc:
                holding.close(exc)  # what an exit cut short by an interrupt left undone
                raise
        except LeaseLost as exc:
            replaced = self._if_replaced(granted.lease)
            if replaced is not None:
                return replaced
            if self.stopped_by_loss and self.host.redelivered_when_stopped:
                return outcomes.Redelivered(granted.lease.key, exc)
            if self.stopped_by_loss and self._requeues_lost():
                return self._requeue_lost(granted.lease, granted.arguments)
            raise
        except Exception:
            # A body that turned the loss into its own error (a write its storage refused
            # for the stale fencing token): replaced all the same.
            replaced = self._if_replaced(granted.lease)
            if replaced is not None:
                return replaced
            raise
        return outcomes.Ran(result, written=self.result_written)

    def _if_replaced(self, lease: AnyLease) -> Optional[outcomes.Replaced]:
        """Under ``replace``, the end of a run whose lease a newer call took (as the
        lease found it, or as the replaced mark says where it found another cause
        first: its deadline passed as the store did not answer)."""
        if (
            self.call.settings.on_duplicate != "replace"
            or not isinstance(lease, HeldLease)
            or not lease.lost
        ):
            return None
        if lease.lost_cause != "replaced":
            try:
                if marks.replaced_by(lease.backend, lease.key, lease.fencing_token) is None:
                    return None
            except ExclusiveError:
                return None
        return self._replaced(lease)

    def _replaced(self, lease: HeldLease) -> outcomes.Replaced:
        """The run was replaced by a newer call (``on_duplicate="replace"``): it says it
        stopped, so that its successor runs now, and the call ends replaced, never sent
        again (a copy of its message delivered later is dropped)."""
        call, token = self.call, lease.fencing_token
        by = "an unknown call"
        try:
            by = marks.replaced_by(call.backend, call.key, token) or by
            marks.note_stopped(call.backend, call.key, token)
        except ExclusiveError as exc:
            logger.warning(
                "%s could not say that its replaced run stopped (%s): its successor runs "
                "once the lease's ttl and grace have passed",
                self._label(),
                exc,
            )
        self._record_end_without_body()
        return outcomes.Replaced(call.key, by)

    # --- before the body -----------------------------------------------------------------

    def claim(self) -> Union[Outcome, Granted, Unlocked]:
        """Take the key, or decide what the call gets instead."""
        with self.trace.acquiring():
            claimed = self._claim()
            if isinstance(claimed, (Granted, Unlocked)):
                self.trace.claimed("granted" if isinstance(claimed, Granted) else "unlocked")
            else:
                self.trace.claimed(claimed)
            return claimed

    def _claim(self) -> Union[Outcome, Granted, Unlocked]:
        call, settings, host = self.call, self.call.settings, self.host
        if (call.resumed or call.debounced) and settings.on_duplicate == "skip":
            # Late, not a duplicate: a run stopped, or the one run its burst left.
            settings = dataclasses.replace(settings, on_duplicate="requeue")
        rerun = settings.on_duplicate == "rerun" and bool(call.task_id)
        if settings.keeps_lease:
            require(call.backend, "windows", call.key)
        try:
            versions.ensure(call.backend, settings.key_prefix)
        except BackendUnavailable as exc:
            return self._without_store(exc)
        except LayoutMismatch as exc:
            return self._in_another_layout(exc)
        try:
            if (
                settings.on_duplicate == "replace"
                and call.task_id
                and call.came_before(host.redelivery)
            ):
                by = marks.call_replaced_by(call.backend, call.key, call.task_id)
                if by is not None:
                    # A copy or retry of a call a newer one replaced: it ends replaced,
                    # and never replaces its successor in turn.
                    self._record_end_without_body()
                    return outcomes.Replaced(call.key, by)
            burst: Optional[debounce.Turn] = None
            if settings.debounce and call.task_id and host.can_requeue:
                burst = self._debounce()
                if not isinstance(burst, debounce.Turn):
                    return burst
                if not burst.taken and settings.on_duplicate == "wait":
                    # Its burst may be taken by the holder it meets: it comes back to
                    # see, rather than wait out that run in line.
                    settings = dataclasses.replace(settings, on_duplicate="requeue")
            arguments = None
            if rerun:
                if self.as_of is None:
                    # Its first attempt: the change it carries reaches the library now.
                    self.as_of = call.backend.store_time()
                arguments = self._resumed_arguments()
                if arguments is None:
                    arguments = encode_call(call.name, call.args, call.kwargs, self.as_of)
                if (call.resumed or self._resume is not None) and not marks.changed_at(arguments):
                    # It resumes a run (one stopped, or one owed to the duplicates of a
                    # pending rerun that died) with arguments no stamp dates: a duplicate
                    # pending since may have brought a newer change, which it joins
                    # without replacing (a run with the newest covers it). Stamped, the
                    # newer of the two stays, whichever it is: the pending rerun's may be
                    # the older (it came before the run that was stopped).
                    settings = dataclasses.replace(settings, rerun_args="first")
            try:
                claimed = policies.claim(
                    settings,
                    call.backend,
                    call.key,
                    call.name,
                    call.task_id,
                    requeues=call.requeues,
                    arguments=arguments,
                    redelivery=host.redelivery and bool(call.task_id),
                    retries=call.retries,
                    resumed=call.resumed,
                    noun=host.noun,
                    owed_by=call.owed_by,
                    keep_taken=self._keep_before_take if rerun and host.resumable else None,
                )
            except BaseException:
                # A take that may have been made (its answer lost): what was kept for it
                # is what the call carries on with.
                self._resume = self._kept_for_take or self._resume
                self._kept_for_take = None
                raise
            self._settle_kept(claimed)
            if isinstance(claimed, Granted) and burst is not None:
                taken = self._take_burst(claimed, burst)
                if isinstance(taken, outcomes.Coalesced):
                    return taken
                claimed = taken
            elif (
                burst is not None
                and not burst.taken
                and not isinstance(claimed, (outcomes.SetAside, outcomes.Dropped))
            ):
                # Refused: the holder may be the call that took its burst meanwhile.
                again = debounce.turn(call.backend, call.key, call.task_id or "")
                if again.covered_by is not None:
                    return self._covered_unless_under_way(again.covered_by)
            if isinstance(claimed, Granted):
                if claimed.finished_read:
                    # What the end of the attempt swaps the finished mark from.
                    self._finished_mark, self._finished_read = claimed.finished, True
                if rerun and host.resumable:
                    claimed = self._keep_resume(claimed)
                return claimed
        except BackendUnavailable as exc:
            return self._without_store(exc)
        if isinstance(claimed, (outcomes.Requeue, outcomes.SetAside)):
            claimed = dataclasses.replace(claimed, as_of=self.as_of)
        if isinstance(claimed, outcomes.Requeue):
            # A duplicate going back to the queue, if it has one and may go once more.
            if host.can_requeue:
                return self._requeue(claimed)
            return self._wait_inline(claimed.reason, claimed.holder_task_id)
        if isinstance(claimed, (outcomes.Skipped, outcomes.Coalesced)):
            self._drop_resume()  # the call ends here: what it resumed runs elsewhere
            self._record_end_without_body()
        # SetAside and Dropped leave the arguments kept for the task id, if any: they are
        # its first delivery's, or a later attempt's (a retry's, running now).
        return claimed

    def _debounce(
        self,
    ) -> Union[
        outcomes.Requeue, outcomes.Coalesced, outcomes.SetAside, outcomes.Dropped, debounce.Turn
    ]:
        """Under ``debounce``: a call arriving makes its arguments its key's burst's and
        goes back to the queue until the burst is due; one coming back waits on if a
        later call moved the burst on, ends covered by the run of the call that took
        it, or goes on to take the key, then the burst (the :class:`~.debounce.Turn`
        it gets)."""
        call, settings = self.call, self.call.settings
        task_id = call.task_id or ""
        if self.host.redelivery:
            # A copy of a delivery that ran (or was covered) is dropped, as the claim
            # drops one: its burst may have been taken since by another call.
            finished = marks.finished_mark(call.backend, call.key, task_id)
            if marks.ended(finished, call.retries, call.resumed):
                return outcomes.Dropped(call.key)
        if call.debounced:
            turn = debounce.turn(call.backend, call.key, task_id)
            reason = f"a later call moved its burst on: due in {turn.wait:.3g}s"
        else:
            if self.as_of is None:
                # Its first attempt: the change it carries reaches the library now.
                self.as_of = call.backend.store_time()
            arguments = encode_call(
                call.name, call.args, call.kwargs, self.as_of, kept_by="debounce"
            )
            turn = debounce.join(
                call.backend,
                call.key,
                task_id,
                arguments,
                settings.debounce,
                settings.debounce_max_wait,
            )
            reason = f"its burst is due in {turn.wait:.3g}s unless a later call of its key comes"
            if not (turn.taken or turn.covered_by):
                return outcomes.Requeue(
                    call.key, turn.wait, reason, "debounce", call.requeues, as_of=self.as_of
                )
        if turn.covered_by is not None:
            return self._covered_unless_under_way(turn.covered_by)
        if turn.wait > 0:
            return outcomes.Requeue(
                call.key, turn.wait, reason, "debounce", call.requeues, as_of=self.as_of
            )
        return turn

    def _take_burst(
        self, granted: Granted, turn: debounce.Turn
    ) -> Union[Granted, outcomes.Coalesced]:
        """Holding the key, take its due burst and run with its arguments; if another
        call took it meanwhile, give the key back: this call is covered by that run."""
        call, lease = self.call, granted.lease
        if not turn.taken:
            with lease.released_on_error():
                turn = debounce.take(call.backend, call.key, call.task_id or "")
            if turn.covered_by is not None:
                lease.release()
                return self._covered(turn.covered_by)
        if turn.arguments is None:
            return granted
        return dataclasses.replace(granted, arguments=turn.arguments)

    def _covered_unless_under_way(
        self, run_by: str
    ) -> Union[outcomes.Coalesced, outcomes.SetAside]:
        """Covered by the run of ``run_by``; but a copy of a call a delivery of which
        holds the key or waits for it now is set aside, as the claim sets one aside: that
        delivery runs the call (a burst taken by it, then a newer burst taken by
        another, would otherwise end the call twice: covered here, and run there)."""
        call = self.call
        if (
            self.host.redelivery
            and call.task_id
            and enqueue.under_way(call.backend, call.key, call.task_id)
        ):
            countdown = policies.requeue_delay(call.settings, call.requeues)
            return outcomes.SetAside(call.key, countdown, call.requeues + 1, as_of=self.as_of)
        return self._covered(run_by)

    def _covered(self, run_by: str) -> outcomes.Coalesced:
        self._drop_resume()
        self._record_end_without_body()
        self._leave_line()
        return outcomes.Coalesced(self.call.key, run_by, debounced=True)

    def _requeue(self, requeue: outcomes.Requeue) -> Union[outcomes.Requeue, outcomes.GaveUp]:
        """Send the call again as ``requeue`` says: unless it was requeued
        ``requeue_max_retries`` times already."""
        call = self.call
        requeues, limit = call.requeues, call.settings.requeue_max_retries
        if limit is not None and requeues >= limit:
            # Said before the end is recorded: a process that dies between the two
            # leaves a copy that finds the record and is dropped, and the line.
            logger.warning(
                "%s gives up after %d requeues: %s while it tried to take %r (%s=%d)",
                self._label(),
                requeues,
                requeue.reason,
                requeue.key,
                f"{self.host.setting_prefix}requeue_max_retries",
                limit,
            )
            self._drop_resume()
            self._record_end_without_body()
            self._leave_line()
            return outcomes.GaveUp(
                requeue.key,
                requeues,
                requeue.reason,
                requeue.cause,
                requeue.holder_task_id,
                owed=self._owed_on_giving_up(),
            )
        return requeue

    def _leave_line(self) -> None:
        """A call that gives up gives up the place it kept in its key's line, too."""
        call = self.call
        if not call.task_id or not call.settings.priority:
            return  # only a priority call keeps its place while away
        # Else its place lapses by itself, within a requeue delay and a lease ttl.
        with contextlib.suppress(ExclusiveError):
            marks.leave_line(call.backend, call.key, call.task_id)

    def _owed_on_giving_up(self) -> Optional[outcomes.OwedRun]:
        """A call that gives up while it is the pending rerun of its key leaves the run
        owed to the duplicates that joined it to a new call, as one that dies does."""
        call = self.call
        if call.settings.on_duplicate != "rerun" or not call.task_id:
            return None
        try:
            return owed_rerun(
                call.backend, call.key, call.task_id, call.settings, self.host.new_call_id
            )
        except ExclusiveError as exc:
            logger.warning(
                "%s[%s] gave up as the pending rerun of %r and could not hand its run on "
                "(%s): the duplicates that joined it run when a later one comes",
                call.name,
                call.task_id,
                call.key,
                exc,
            )
            return None

    def _wait_inline(self, reason: str, holder: Optional[str]) -> Union[outcomes.Waited, Granted]:
        """No queue to go back to: wait in the key's line instead, up to ``wait_timeout``."""
        call = self.call
        lease = policies.wait_for(call.settings, call.backend, call.key, call.name, call.task_id)
        if lease is None:
            return outcomes.Waited(call.key, reason, call.settings.wait_timeout, holder)
        return Granted(lease)

    def _without_store(self, exc: BackendUnavailable) -> Union[Outcome, Unlocked]:
        """The store did not answer: run unlocked, requeue, or fail, as
        ``on_backend_error`` and the host allow."""
        call, host = self.call, self.host
        message = f"{self._label()}: cannot take the lease on {call.key!r}: {exc}"
        setting = f"{host.setting_prefix}on_backend_error"
        taken = exc.arguments if isinstance(exc, marks.LostTake) else None
        if taken is not None:
            self._resume = taken  # what it runs with, or is sent again with
        if call.settings.on_backend_error == "run":
            logger.warning("%s -- running WITHOUT a lease (%s='run')", message, setting)
            return Unlocked(UnlockedLease(call.key, call.name, call.task_id, str(exc)))
        if not host.can_requeue:
            return outcomes.Unanswered(call.key, exc)
        requeue = _resumed(self._unusable_store("the lease store did not answer"), taken)
        ended = self._requeue(requeue)
        if isinstance(ended, outcomes.Requeue):
            logger.warning("%s -- requeued (%s='requeue')", message, setting)
        else:
            logger.warning("%s (%s='requeue')", message, setting)
        return ended

    def _in_another_layout(self, exc: LayoutMismatch) -> Outcome:
        """The store holds a layout this process cannot share (found at the first call,
        the store having been down as the worker started): the call never runs here,
        whatever ``on_backend_error`` says, and goes back to the queue for a process
        of that layout (given up after ``requeue_max_retries``); with no queue to go
        back to, the caller gets the error."""
        logger.error("%s: not run by this process: %s", self._label(), exc)
        if not self.host.can_requeue:
            raise exc
        reason = "this process cannot share the lease store's layout"
        return self._requeue(self._unusable_store(reason))

    def _unusable_store(self, reason: str) -> outcomes.Requeue:
        """The call back to the queue because the lease store cannot be used now, after
        the delay its requeues so far give it."""
        call = self.call
        countdown = policies.requeue_delay(call.settings, call.requeues)
        requeue = outcomes.Requeue(call.key, countdown, reason, "unanswered", call.requeues + 1)
        return dataclasses.replace(requeue, as_of=self.as_of)

    def _label(self) -> str:
        """The call as log lines name it: its task and id, or how it was called."""
        call = self.call
        return f"{call.name}[{call.task_id}]" if call.task_id else f"{call.name} (called directly)"

    def _resumed_arguments(self) -> Optional[str]:
        """Where the call's message may come again (:attr:`Host.resumable`): the arguments
        an earlier delivery of it ran with as the pending rerun of its key, if its attempt
        has not ended (the message comes back with its own). The call goes on with them,
        as a duplicate and as the key's next run alike."""
        call = self.call
        if not (self.host.resumable and call.task_id):
            return None
        self._resume = marks.resume_arguments(call.backend, call.key, call.task_id)
        return self._resume

    def _keep_before_take(self, arguments: str) -> None:
        """The pending rerun's ``arguments``, about to be taken for this call's run: kept
        for its task id first (:meth:`_keep_resume`), so that a process that dies between
        the take and the keep does not lose them with it (its message comes again, and
        runs with them). A store that does not keep them costs only that: the run goes on
        with them, and a delivery that comes back runs with its own."""
        current = self._kept_for_take or self._resume
        if arguments != current and self._kept(arguments, current):
            self._kept_for_take = arguments

    def _settle_kept(self, claimed: Any) -> None:
        """After the claim: arguments kept before a take that took them are the ones the
        call resumes with; kept before a take that found the rerun no longer its own,
        they go (the resume mark back to what it held), or a delivery that comes back
        would run a change another call runs."""
        kept, self._kept_for_take = self._kept_for_take, None
        if kept is None:
            return
        if isinstance(claimed, Granted) and claimed.arguments == kept:
            self._resume = kept
            return
        call = self.call
        try:
            if self._resume is None:
                marks.drop_resume(call.backend, call.key, call.task_id or "", kept)
            else:
                ttl = max(self.host.finished_ttl, marks.RESUME_TTL)
                marks.keep_resume(
                    call.backend, call.key, call.task_id or "", self._resume, ttl, kept
                )
        except ExclusiveError as exc:
            logger.warning(
                "could not put back what %s[%s] keeps to resume on %r (%s): a delivery of "
                "its message that comes back may run the pending rerun's change once more",
                call.name,
                call.task_id,
                call.key,
                exc,
            )

    def _keep_resume(self, outcome: Granted) -> Granted:
        """The call took its key as the pending rerun (or resumes a run that did): keep
        the arguments it runs with for its task id until its attempt ends, for a
        delivery of its message that comes back before then (its process lost, its
        body stopped with ``reject_on_worker_lost``, a ``retry_on_worker_lost``).

        The pending rerun's mark is gone once its run took them, so a store that does
        not answer now costs only a delivery that comes back: the run goes on with them.
        """
        arguments = outcome.arguments or self._resume
        if arguments is None:
            return outcome
        if arguments != self._resume and self._kept(arguments, self._resume):
            self._resume = arguments
        return dataclasses.replace(outcome, arguments=arguments)

    def _kept(self, arguments: str, current: Optional[str]) -> bool:
        """Keep ``arguments`` for the call's task id, over ``current`` (what the resume
        mark holds); False, said in a WARNING, where the store does not take them."""
        call = self.call
        try:
            marks.keep_resume(
                call.backend,
                call.key,
                call.task_id or "",
                arguments,
                max(self.host.finished_ttl, marks.RESUME_TTL),
                current,
            )
            return True
        except ExclusiveError as exc:
            logger.warning(
                "could not keep the arguments %s[%s] runs with on %r (%s): a delivery "
                "of its message that comes back before it ends runs with its own",
                call.name,
                call.task_id,
                call.key,
                exc,
            )
            return False

    # --- the body --------------------------------------------------------------------------

    def _run_unlocked(self, lease: UnlockedLease, body: Body) -> outcomes.Ran:
        """``on_backend_error="run"``: the body runs without a lease, and says so; with
        the arguments of the run it resumes, if the store gave them before it failed."""
        self.lease = lease
        args, kwargs = self.call.args, self.call.kwargs
        if self._resume is not None:
            self.arguments = self._resume
            args, kwargs = decode_call(self._resume)
        with entered(self):
            result = body(args, kwargs)
        if self.host.redelivery and self.call.task_id:
            self._record_unlocked_end()
        return outcomes.Ran(result, owed=self._owed_after_unlocked_run())

    def _record_unlocked_end(self) -> None:
        """An unlocked run's end is recorded as any run's, if the store answers now: a
        copy of its message delivered later is dropped rather than run again."""
        call = self.call
        try:
            marks.mark_finished(
                call.backend, call.key, call.task_id or "", call.retries, self.host.finished_ttl
            )
        except ExclusiveError as exc:
            logger.warning(
                "could not record that %s[%s] ended (%s): a copy of its message "
                "delivered again may run it once more",
                call.name,
                call.task_id,
                exc,
            )

    def _owed_after_unlocked_run(self) -> Optional[outcomes.OwedRun]:
        """A pending rerun that ran unlocked may have run without taking its mark (the
        store did not answer): duplicates that joined it since are owed a run, which a
        new call does. Nothing if the mark is gone or another's, or the store is down."""
        call = self.call
        if call.settings.on_duplicate != "rerun" or not call.task_id:
            return None
        try:
            return owed_rerun(
                call.backend, call.key, call.task_id, call.settings, self.host.new_call_id
            )
        except ExclusiveError:
            return None  # a duplicate that finds the mark not alive takes its place

    def holding(self, lease: AnyLease) -> contextlib.AbstractContextManager[AnyLease]:
        """Run the ``with`` block as the body under ``lease``, and end the attempt on
        every exit.

        With ``on_lease_lost="terminate"`` and a host that lets it, a body whose lease
        is lost is stopped (:func:`celery_exclusive.core.terminate.stop_on_loss`). Under
        ``terminate`` and ``abort`` a body whose lease was lost fails with ``LeaseLost``
        when it returns: its result is not to be trusted.
        """
        return _Holding(self, lease)

    # --- a body stopped by the loss of its lease ----------------------------------------------

    def _lost_before_the_body(self, granted: Granted) -> Outcome:
        """The grant lapsed before the body started (its process paused after the claim,
        past the lease's ttl): another call may hold the key, or its window, now. The
        body does not start under a lease known lost, whatever ``on_lease_lost`` says
        of a body that runs; the call is sent again, with the arguments it would have
        run (nothing ran), or, with no queue to send it to, fails with LeaseLost."""
        lease = granted.lease
        self.lease = lease
        self.finish(ended=False)
        if not self.host.can_requeue:
            lease.ensure_held()  # raises LeaseLost, naming its cause
        requeue = self._requeue_lost(lease, granted.arguments)
        return self._requeue(requeue)  # up to requeue_max_retries, as any requeue

    def _requeues_lost(self) -> bool:
        """Whether a body stopped by the loss of its lease is sent again (``requeue_lost``),
        which only a host with a queue can do, and only ``requeue_max_retries`` times."""
        settings, requeues = self.call.settings, self.call.requeues
        limit = settings.requeue_max_retries
        return (
            settings.requeue_lost and self.host.can_requeue and (limit is None or requeues < limit)
        )

    def _requeue_lost(self, lease: AnyLease, arguments: Optional[str]) -> outcomes.Requeue:
        """Send the stopped call again: it takes a fresh lease when it comes back, under
        its duplicate policy like any call, and is no duplicate of the run it resumes.

        It resumes the run with the arguments that run had: ``arguments``, those of the
        pending rerun it ran as (JSON, as stored), or else its own."""
        call = self.call
        reason = f"its lease was lost ({getattr(lease, 'lost_reason', None)})"
        countdown = policies.requeue_delay(call.settings, call.requeues)
        requeue = outcomes.Requeue(call.key, countdown, reason, "lost", call.requeues + 1)
        return _resumed(dataclasses.replace(requeue, as_of=self.as_of), arguments)

    # --- the end ---------------------------------------------------------------------------

    def finish(
        self, ended: bool = True, write: Optional[FinalWrite] = None, failed: bool = False
    ) -> None:
        """Release the lease; first, if the attempt ended and its message may come
        again, record that it ended. With ``write`` (the body's result, as the host
        stores it), make it in the same step, only if the lease was still held. A run
        that ended (``failed``: by raising) under ``unique_for`` keeps the lease for
        its window instead (:meth:`_keep_window`).

        The record (a finished mark per task id, kept past the time a copy may still
        arrive) is written while the lease is still held, so a copy of the message
        that takes the key after the release always finds it.
        """
        lease = self.lease
        if not isinstance(lease, HeldLease) or lease.released:
            return
        keeps = self.call.settings.keeps_lease and not self.retry_sent
        keep = self._kept_after(lease, failed) if keeps and ended and not lease.lost else 0.0
        if keep > 0:
            self._keep_window(lease, keep)
        else:
            self._release(lease, ended, write)
        if ended:
            self._drop_resume()

    def _kept_after(self, lease: HeldLease, failed: bool) -> float:
        """Seconds the run's lease is kept once it ended (:meth:`Settings.kept_after`),
        its rate's period counted from the grant's answer (the store granted it before)."""
        return self.call.settings.kept_after(failed, runtime.monotonic() - lease.answered_at)

    def _keep_window(self, lease: HeldLease, seconds: float) -> None:
        """The run's uniqueness window: its end recorded as a release records it, then
        its lease kept for ``seconds`` and left to lapse. Its result is the host's to
        store (no release carries it)."""
        if self.host.redelivery and self.call.task_id:
            self._record_end_on_its_own(lease, "ended")
        lease.keep_for(seconds)

    def handed_off(self) -> None:
        """The call's next attempt went out (:func:`hand_off`): this one has ended, and
        a copy of its message delivered later is dropped. Recorded once the message went
        out, never before: a process that dies in between leaves its message to come
        again (where the broker hands it back), not a call ended with nothing sent."""
        call, lease = self.call, self.lease
        if self.host.redelivery and call.task_id and isinstance(lease, HeldLease):
            self._record_end_on_its_own(lease, "handed off to its retry")
        self._drop_resume()

    def _release(self, lease: HeldLease, ended: bool, write: Optional[FinalWrite]) -> None:
        call = self.call
        if ended and self.host.redelivery and call.task_id:
            try:
                if self._record_end_and_release(lease, write):
                    return
            except ExclusiveError as exc:
                # The step with the release went unanswered (the lease was then given
                # back the plain way): the mark may be missing. Written on its own now
                # it still keeps a copy delivered later from running once more.
                self._record_end_on_its_own(lease, "ended", cause=exc)
        lease.release(End(write=write))
        self.result_written = lease.written

    def _record_end_without_body(self) -> None:
        """The call ends without its body (skipped, coalesced, given up): where its
        message may come again, record that its attempt ended, as the end of a run does.
        A copy delivered later is then dropped: it neither runs once the key is free
        (a second settlement of what ``skip`` kept from running twice) nor joins the
        pending rerun again (handing it older arguments than a later duplicate's).

        Not for a copy the library set aside while its first delivery ran: it is a copy
        of an attempt that may go on elsewhere, whose next delivery must not find it
        ended. A call the library sent again otherwise (a requeued duplicate, a run
        resumed or owed) is the one continuation of its call, and records its end as its
        first delivery would (a resumed one ignores a duplicate's end: ``marks.ended``)."""
        call = self.call
        if not (self.host.redelivery and call.task_id) or call.set_aside:
            return
        try:
            marks.mark_finished(
                call.backend,
                call.key,
                call.task_id,
                call.retries,
                self.host.finished_ttl,
                as_duplicate=True,
            )
        except ExclusiveError as exc:
            logger.warning(
                "could not record that %s[%s] ended without running (%s): a copy of its "
                "message delivered again is taken for a new duplicate",
                call.name,
                call.task_id,
                exc,
            )

    def _drop_resume(self) -> None:
        """The attempt ended: the arguments kept for its task id, if any, go (a copy of
        its message that comes later is dropped by its finished mark)."""
        call = self.call
        if self._resume is None:
            return
        try:
            marks.drop_resume(call.backend, call.key, call.task_id or "", self._resume)
            self._resume = None
        except ExclusiveError as exc:
            logger.warning(
                "could not drop the arguments kept for %s[%s] on %r (%s); they expire "
                "by themselves",
                call.name,
                call.task_id,
                call.key,
                exc,
            )

    def _record_end_and_release(self, lease: HeldLease, write: Optional[FinalWrite]) -> bool:
        """Write the finished mark of this attempt; True if the lease went back with it
        (and ``write`` was made with it, where it could be).

        The mark as read when the call took its key is what it is swapped from, so
        mark and release go in one round trip where the store can. Should the mark
        have changed meanwhile, it is written the long way, and the caller releases.
        """
        call, ttl = self.call, self.host.finished_ttl
        task_id = call.task_id or ""
        if self._finished_read and not marks.run_recorded(self._finished_mark, call.retries):
            mark = MarkSwap(
                marks.finished_key(lease.key, task_id),
                marks.DONE,
                self._finished_mark,
                str(call.retries),
                ttl,
            )
            if lease.release(End(mark, write)) is not None:
                self.result_written = lease.written
                return True
        self._mark_finished(lease)
        return False

    def _record_end_on_its_own(
        self, lease: HeldLease, what: str, cause: Optional[ExclusiveError] = None
    ) -> None:
        """:meth:`_mark_finished`, a store that does not take it said in a WARNING (naming
        ``cause``, the failure that left the record to be written on its own, if any): a
        copy of the message delivered again may then run the call once more."""
        call = self.call
        try:
            self._mark_finished(lease)
        except ExclusiveError as exc:
            logger.warning(
                "could not record that %s[%s] %s (%s): a copy of its message delivered "
                "again may run it once more",
                call.name,
                call.task_id,
                what,
                cause or exc,
            )

    def _mark_finished(self, lease: HeldLease) -> None:
        """Record that this attempt ended, on its own (not with the release)."""
        call = self.call
        marks.mark_finished(
            lease.backend, lease.key, call.task_id or "", call.retries, self.host.finished_ttl
        )


def owed_rerun(
    backend: Backend,
    key: str,
    task_id: Optional[str],
    settings: Settings,
    carrier: Callable[[], str] = new_call_id,
) -> Optional[outcomes.OwedRun]:
    """The call ``task_id`` died (its process killed, its job stopped) or gave up
    without ending its attempt: if it was the pending rerun of ``key``, the duplicates
    that joined it are owed its run. Returns what the host sends a new call with, under
    the id ``carrier()`` gave, which the rerun mark names as the pending rerun now
    (:func:`marks.hand_on_rerun`); or None.

    A hand-on whose answer was lost may have been made: the arguments are handed on all
    the same (at worst one change is run twice, never lost)."""
    if not task_id:
        return None
    carried: list[str] = []

    def named() -> str:
        carried.append(carrier())
        return carried[-1]

    try:
        arguments = marks.hand_on_rerun(backend, key, task_id, named, settings.lease_ttl)
    except marks.LostTake as lost:
        arguments = lost.arguments
    if arguments is None:
        return None
    args, kwargs = decode_call(arguments)
    return outcomes.OwedRun(args, kwargs, carried[-1], marks.changed_at(arguments))


def rerun_of_killed(
    settings: Settings,
    key: str,
    requeues: int,
    arguments: Optional[str] = None,
    as_of: Optional[float] = None,
) -> Optional[outcomes.Requeue]:
    """A call whose process was killed because its body did not stop within
    ``terminate_grace`` of losing its lease: it is sent again, as a body that stopped
    would be (``requeue_lost``, up to ``requeue_max_retries`` requeues), by the host
    that saw the process die. Returns the requeue, or None if the call stays failed.

    ``arguments``: those of the pending rerun the killed body ran as (JSON, as its kill
    note carries them), which the call is sent again with; None: its own, whose change
    ``as_of`` stamped (:attr:`Call.as_of`)."""
    limit = settings.requeue_max_retries
    if not settings.requeue_lost or (limit is not None and requeues >= limit):
        return None
    reason = "its lease was lost and its process killed when its body did not stop"
    countdown = policies.requeue_delay(settings, requeues)
    requeue = outcomes.Requeue(key, countdown, reason, "lost", requeues + 1, as_of=as_of)
    return _resumed(requeue, arguments)


def _resumed(requeue: outcomes.Requeue, arguments: Optional[str]) -> outcomes.Requeue:
    """``requeue``, carrying the arguments of the pending rerun its call ran as, if it
    did (decoded anew from the stored JSON: as the duplicate gave them, whatever the
    body did to the objects it was handed)."""
    if arguments is None:
        return requeue
    args, kwargs = decode_call(arguments)
    as_of = marks.changed_at(arguments) or requeue.as_of
    return dataclasses.replace(requeue, args=args, kwargs=kwargs, as_of=as_of)


class _Holding:
    """What :meth:`Attempt.holding` returns: the body's ``with`` block under its lease.

    It does what this would, in this order::

        with entered(attempt), stop_on_loss(lease):  # if the body is to be stopped
            yield lease
        # ... then, on every exit, attempt.finish(ended), and for a lost lease whose
        # body returned, LeaseLost.

    but each step once, however it is cut short: the loss's interrupt raises LeaseLost
    wherever the body's thread is, once, and it may land as the exit begins, before the
    stopper was left (its grace timer would kill the process later, under another call)
    or the attempt ended (its lease would be held, and renewed, for as long as the
    process lives). :meth:`close` does what is left, whoever calls it.
    """

    __slots__ = ("attempt", "lease", "arguments", "entered", "stop", "write", "finished")

    def __init__(self, attempt: Attempt, lease: AnyLease, arguments: Optional[str] = None) -> None:
        self.attempt = attempt
        self.lease = lease
        #: The pending rerun's arguments (JSON) the body runs with, if it runs as one:
        #: a process killed for not stopping notes them for the host that sends it again.
        self.arguments = arguments
        self.entered = _Entered(attempt)
        self.stop: Optional[contextlib.AbstractContextManager[None]] = None
        #: The write that stores the body's result with the release (see :meth:`returned`).
        self.write: Optional[FinalWrite] = None
        #: Whether the attempt was ended (:meth:`close` got to ``finish``).
        self.finished = False

    def returned(self, result: Any) -> None:
        """The body returned ``result``: ask the host for the write that stores it with
        the release of the lease, if the lease's store can make one."""
        result_write = self.attempt.host.result_write
        lease = self.lease
        if (
            result_write is not None
            and isinstance(lease, HeldLease)
            and lease.backend.capabilities.final_writes
        ):
            self.write = result_write(lease.key, result)

    def __enter__(self) -> AnyLease:
        attempt, lease = self.attempt, self.lease
        settings, host = attempt.call.settings, attempt.host
        attempt.lease = lease
        self.entered.__enter__()
        if (
            settings.on_lease_lost == "terminate"
            and host.stop_process is not None
            and isinstance(lease, HeldLease)
        ):
            stop = terminate.stop_on_loss(
                lease, settings.terminate_grace, host.stop_process, self.arguments
            )
            try:
                stop.__enter__()
            except BaseException as exc:
                self.close(exc)  # leaves and ends the attempt, as the exit would
                raise
            self.stop = stop
        return lease

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> bool:
        self.close(exc)
        if exc is None and self.lease.lost and self.attempt.call.settings.on_lease_lost != "log":
            self.lease.ensure_held()  # raises LeaseLost: the result is not to be trusted
        return False

    def close(self, error: Optional[BaseException]) -> None:
        """Leave the inner contexts and end the attempt (``error``: what left the block,
        None if it returned), each step once."""
        try:
            self._leave(error)
        finally:
            if not self.finished:
                self.finished = True
                ended = self._ended(error)
                self.attempt.finish(ended, None if error else self.write, error is not None)

    def _ended(self, error: Optional[BaseException]) -> bool:
        """Whether the block's exit ends the attempt: not when the call runs again (its
        body stopped by the loss of its lease, and sent again or delivered again), nor
        when the body sent its own message back (Celery's ``Reject(requeue=True)``)."""
        attempt, lease, host = self.attempt, self.lease, self.attempt.host
        if error is None:
            # A loss found as the body returns stops it there: its result is not trusted.
            attempt.stopped_by_loss = lease.lost and attempt.call.settings.on_lease_lost != "log"
        elif isinstance(error, LeaseLost):
            attempt.stopped_by_loss = lease.lost
        elif host.comes_back(error):
            return False
        runs_again = host.redelivered_when_stopped or attempt._requeues_lost()
        return not (attempt.stopped_by_loss and runs_again)

    def _leave(self, error: Optional[BaseException]) -> None:
        """Leave the inner contexts, innermost first, as nested ``with`` blocks do; each
        once (a stopper left is forgotten only once its exit has run)."""
        try:
            stop = self.stop
            if stop is not None:
                tb = None if error is None else error.__traceback__
                stop.__exit__(None if error is None else type(error), error, tb)
                self.stop = None
        finally:
            self.entered.__exit__(None, None, None)


@dataclasses.dataclass(frozen=True)
class Unlocked:
    """The store did not answer and ``on_backend_error="run"``: run under ``lease``."""

    lease: UnlockedLease
