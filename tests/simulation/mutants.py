"""Seeded protocol bugs, each a small patch a reviewer could plausibly write, and the
proof that the simulation catches every one within the CI seed budget.

``python -m tests.simulation.mutants`` applies each patch, one at a time, to a copy of
the package, runs the CI seeds against it in a process of its own (so the copy is the
``celery_exclusive`` it imports), and reports which seed caught it, and how soon.
``--only NAME`` runs one; ``--seeds N`` sets the budget (by default CI's: its seeds of
the workers' worlds, or of beat's for a bug of the beat leader). Exit status 1 if any
bug was not caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .world import FAULTS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_exclusive"


@dataclass(frozen=True)
class Mutant:
    """One seeded bug: in ``path`` (under the package), ``old`` becomes ``new``."""

    name: str
    what: str
    path: str
    old: str
    new: str
    #: The world (its faults' version) it is explored in: the one that catches it
    #: within the CI seed budget.
    faults: int = FAULTS
    #: Explored in the beat leader's worlds (tests/simulation/beat.py).
    beat: bool = False


MUTANTS = [
    Mutant(
        "release-without-owner-check",
        "the store frees whichever grant of the key it finds, not the owner's",
        "backends/memory.py",
        "            if grants.pop(lease.owner, None) is None:",
        "            if grants.pop(next(iter(grants), lease.owner), None) is None:",
    ),
    Mutant(
        "renew-without-owner-check",
        "a renewal extends the key's first grant, whoever holds it",
        "backends/memory.py",
        "                grant = store.live(lease.key, now).get(lease.owner)",
        "                grant = next(iter(store.live(lease.key, now).values()), None)",
    ),
    Mutant(
        "limit-off-by-one",
        "the store grants one slot more than the key's limit",
        "backends/memory.py",
        "            admitted, rest = admit(line, claimant, limit - len(grants), store.clock())",
        "            admitted, rest = admit(line, claimant, limit - len(grants) + 1, "
        "store.clock())",
    ),
    Mutant(
        "deadline-past-the-ttl",
        "the holder's deadline adds the safety margin instead of taking it off",
        "core/lease.py",
        "        return self.renewed_at + self.ttl - self.margin",
        "        return self.renewed_at + self.ttl + self.margin",
    ),
    Mutant(
        "lost-ignores-the-deadline",
        "a lease counts as lost only once someone flagged it, not when its deadline passed",
        "core/lease.py",
        "        return (runtime.monotonic() if ended_at is None else ended_at) >= self.deadline",
        "        return False",
    ),
    Mutant(
        "no-interrupt-on-loss",
        "a body whose lease is lost is never interrupted",
        "core/terminate.py",
        "        if not self.running:\n            return\n        if not self.interrupt:",
        "        if True:\n            return\n        if not self.interrupt:",
    ),
    Mutant(
        "finished-mark-forgotten",
        "the end of a run whose message may come again is never recorded",
        "engine/attempt.py",
        "        if ended and self.host.redelivery and call.task_id:\n            try:\n"
        "                if self._record_end_and_release(lease, write):",
        "        if False:\n            try:\n"
        "                if self._record_end_and_release(lease, write):",
    ),
    Mutant(
        "ended-off-by-one",
        "an attempt counts as ended only if a later one did",
        "core/marks.py",
        "    return not resumed and finished is not None and finished >= retries",
        "    return not resumed and finished is not None and finished > retries",
    ),
    Mutant(
        "copy-runs-beside-its-first-delivery",
        "a copy of a call whose first delivery holds the key is taken for a duplicate",
        "core/policies.py",
        "    if redelivery and task_id and (task_id in holding or marks.waiting(backend, key, "
        "task_id)):",
        "    if False:",
    ),
    Mutant(
        "take-the-rerun-twice",
        "taking a pending rerun's arguments leaves them pending",
        "core/marks.py",
        "            if backend.swap_mark(key, RERUN, current, None, 0):",
        "            if backend.swap_mark(key, RERUN, current, current, RERUN_TTL):",
    ),
    Mutant(
        "older-change-replaces-newer",
        "a change that joins the pending rerun late replaces a newer one",
        "core/marks.py",
        '        elif latest and changed_at(arguments) >= changed_at(pending["arguments"]):',
        "        elif latest:",
    ),
    Mutant(
        "dead-rerun-args-dropped",
        "a duplicate taking a dead pending rerun's place drops its newer change",
        "core/marks.py",
        '            if pending is not None and changed_at(pending["arguments"]) > '
        "changed_at(arguments):",
        "            if False:",
    ),
    Mutant(
        "owed-run-never-handed-on",
        "the run a dead pending rerun owed its duplicates is never sent",
        "engine/attempt.py",
        "    try:\n        arguments = marks.hand_on_rerun(backend, key, task_id, named, "
        "settings.lease_ttl)\n"
        "    except marks.LostTake as lost:\n        arguments = lost.arguments\n",
        "    arguments = None\n",
    ),
    Mutant(
        "skip-records-no-end",
        "a duplicate that ends without running never records its end",
        "engine/attempt.py",
        "        if not (self.host.redelivery and call.task_id) or call.set_aside:",
        "        if True:",
    ),
    Mutant(
        "taken-arguments-lost",
        "the arguments a pending rerun took are lost when the store fails right after",
        "engine/attempt.py",
        "        taken = exc.arguments if isinstance(exc, marks.LostTake) else None",
        "        taken = None",
    ),
    Mutant(
        "priority-waits-on-the-away",
        "a waiting priority call stays behind one that is away",
        "core/marks.py",
        '        while priority and not away and place > 0 and entries[place - 1].get("away") '
        "is True:",
        "        while False:",
    ),
    Mutant(
        "no-kill-after-the-grace",
        "a body that swallows its interrupt is never killed once its grace ends",
        "core/terminate.py",
        "        if self.kill_process:\n            logger.error(\n"
        '                "%s did not stop within',
        '        if False:\n            logger.error(\n                "%s did not stop within',
    ),
    Mutant(
        "copy-of-an-ended-attempt-runs",
        "a copy granted the key runs although its attempt already ended",
        "core/policies.py",
        "    if marks.ended(finished, retries, resumed):\n        lease.release()\n"
        "        return Dropped(lease.key)",
        "    if False:\n        lease.release()\n        return Dropped(lease.key)",
    ),
    Mutant(
        "finished-mark-expires-at-once",
        "the finished mark of a run lasts a second, not as long as a copy may come",
        "engine/attempt.py",
        "        call, ttl = self.call, self.host.finished_ttl",
        "        call, ttl = self.call, 1.0",
    ),
    Mutant(
        "deadline-from-the-answer",
        "a confirmed renewal extends the lease from when its answer came, not when it was sent",
        "core/heartbeat.py",
        "                    lease.renewed_at = renewal.started",
        "                    lease.renewed_at = runtime.monotonic()",
    ),
    Mutant(
        "failed-renewal-confirms",
        "a renewal the store did not answer counts as confirmed",
        "core/heartbeat.py",
        "        except ExclusiveError as exc:  # unavailable, or refused (a permission changed)\n"
        "            self.heartbeat._failed(self, exc)",
        "        except ExclusiveError as exc:  # unavailable, or refused (a permission changed)\n"
        "            self.heartbeat._confirmed(self, set())",
    ),
    Mutant(
        "grant-timed-from-the-answer",
        "a grant's lease is counted from when its answer came, not when it was asked for",
        "core/lease.py",
        "    return None if grant is None else _hold(backend, grant, name, task_id, sent_at)",
        "    return None if grant is None else _hold(\n"
        "        backend, grant, name, task_id, runtime.monotonic()\n    )",
    ),
    Mutant(
        "release-before-recording-the-end",
        "the lease goes back first, and the end is recorded after, in a call of its own",
        "engine/attempt.py",
        "            if lease.release(End(mark, write)) is not None:",
        "            if lease.release(End(None, write)) is not None and not self._mark_finished(\n"
        "                lease\n            ):",
    ),
    Mutant(
        "gives-up-silently",
        "a call that gives up says so only at DEBUG, after its end is recorded",
        "engine/attempt.py",
        '            logger.warning(\n                "%s gives up after',
        '            logger.debug(\n                "%s gives up after',
        faults=1,
    ),
    Mutant(
        "unanswered-end-not-recorded-again",
        "when the release that carries the record of the end goes unanswered, the record "
        "is not written again on its own",
        "engine/attempt.py",
        '                self._record_end_on_its_own(lease, "ended", cause=exc)',
        "                pass",
    ),
    Mutant(
        "own-orphan-grant-skips-the-call",
        "a call meeting the grant of its own earlier attempt (its answer lost) is skipped "
        "as a duplicate of itself",
        "core/policies.py",
        '        settings = replace(settings, on_duplicate="requeue")\n    elif holder',
        "        pass\n    elif holder",
    ),
    Mutant(
        "retried-call-skips-itself",
        "a retry meeting the grant of its own earlier attempt (its release unanswered) "
        "is skipped as a duplicate of itself",
        "core/policies.py",
        "    if task_id and (requeues or retries or resumed) and task_id in holding:",
        "    if task_id and requeues and task_id in holding:",
        faults=4,
    ),
    Mutant(
        "library-sends-refused-at-enqueue",
        "a requeue, a copy set aside or an owed run is refused at enqueue when another "
        "call holds the key's enqueue mark",
        "engine/enqueue.py",
        "    return None if queued == task_id or going_on else queued",
        "    return None if queued == task_id else queued",
    ),
    Mutant(
        "retry-recorded-before-it-is-sent",
        "retry() records the attempt's end with its release, before the message goes out",
        "engine/attempt.py",
        "    attempt.finish(ended=False)",
        "    attempt.finish(ended=True)",
    ),
    Mutant(
        "handed-back-call-loses-its-enqueue-mark",
        "a call whose message the broker takes back (stopped for its lost lease) clears "
        "its enqueue mark as if it were over",
        "engine/enqueue.py",
        "outcomes.Dropped, outcomes.Redelivered)",
        "outcomes.Dropped)",
    ),
    Mutant(
        "enqueue-mark-claimed-over-another",
        "a send claims the enqueue mark whoever holds it",
        "core/marks.py",
        "lambda current: current or value, ttl, only_if=value)",
        "lambda current: value, ttl)",
    ),
    Mutant(
        "enqueue-mark-cleared-whoever-holds-it",
        "a call that ends clears its key's enqueue mark even when another call holds it",
        "core/marks.py",
        "    return backend.swap_mark(key, kind, value, None, 0)",
        "    return backend.swap_mark(key, kind, backend.read_mark(key, kind), None, 0)",
    ),
    Mutant(
        "beat-sends-whatever-the-claim-says",
        "beat sends a due tick even when the record refused it or could not be written",
        "beat/scheduler.py",
        "            if claimed:\n                self.inner.apply_entry(",
        "            if True:\n                self.inner.apply_entry(",
        beat=True,
    ),
    Mutant(
        "beat-sends-after-its-lease-lapsed",
        "a beat held up past its lease's deadline after recording a tick still sends it",
        "beat/scheduler.py",
        "        if self._leading_now():\n            return True",
        "        if True:\n            return True",
        beat=True,
    ),
    Mutant(
        "window-not-kept",
        "a run under unique_for or a rate gives its key back as it ends instead of keeping it",
        "engine/attempt.py",
        "            self._keep_window(lease, keep)",
        "            self._release(lease, ended, write)",
    ),
    Mutant(
        "window-kept-from-the-grant",
        "the window is counted from the run's grant, not its end",
        "core/lease.py",
        "            kept = dataclasses.replace(self.grant, ttl=seconds)",
        "            since = runtime.monotonic() - self.acquired_at\n"
        "            kept = dataclasses.replace(self.grant, ttl=max(0.001, seconds - since))",
    ),
    Mutant(
        "rate-slot-given-back-at-the-end",
        "under a rate, a run gives its slot back as it ends, not a period after its grant",
        "core/config.py",
        "            keep = max(keep, period - since_grant + RATE_MARGIN)",
        "            keep = max(keep, 0.0 * since_grant)",
    ),
    Mutant(
        "dead-holders-slot-freed",
        "the worker frees the rate slot (or window) of a run whose process died at once",
        "core/reaper.py",
        "    if not settings.keeps_lease:\n        return 0.0\n    since_grant",
        "    if True:\n        return 0.0\n    since_grant",
    ),
    Mutant(
        "dead-holders-kept-lease-shortened",
        "the worker keeps a dead holder's lease for what its time since its last extension "
        "says is left, though the lease was kept already (and reads back with less)",
        "core/reaper.py",
        "        keep = max(keep, min(left.expires_in or 0.0, longest))",
        "        keep = max(keep, 0.0 * longest)",
    ),
    Mutant(
        "duplicate-of-nobody-skipped",
        "a call refused as the key came free, that then finds no holder, is skipped anyway",
        "core/policies.py",
        "    elif holder is None and described is None:",
        "    elif False:",
        faults=3,
    ),
    Mutant(
        "debounce-runs-its-own-arguments",
        "the call that takes a burst runs with its own message's arguments, not the burst's",
        "engine/attempt.py",
        "        return dataclasses.replace(granted, arguments=turn.arguments)",
        "        return granted",
    ),
    Mutant(
        "older-change-replaces-a-bursts-newer",
        "a call joining its burst late replaces the burst's newer change with its own",
        "core/debounce.py",
        'marks.changed_at(burst["arguments"]) > marks.changed_at(arguments)',
        "False",
    ),
    Mutant(
        "burst-taken-before-the-key",
        "a call takes its due burst before it holds the key: a process that dies in between "
        "leaves the burst taken by a run that never starts",
        "core/debounce.py",
        'return Turn(wait=wait) if wait > 0 else Turn(arguments=burst["arguments"])',
        "return Turn(wait=wait) if wait > 0 else take(backend, key, task_id)",
    ),
    Mutant(
        "replacing-call-runs-at-once",
        "a call that replaced the running one runs as it takes the key, before that one stopped",
        "core/policies.py",
        "        left = marks.replaced_runs_left(backend, lease.key, lease.fencing_token)\n",
        "        left = {}\n",
    ),
    Mutant(
        "second-replacer-says-it-stopped",
        "a call whose release of a run another call replaced first finds it freed, and "
        "says the run stopped",
        "core/policies.py",
        "    if released is False and first:",
        "    if released is False:",
    ),
    Mutant(
        "replaced-bound-from-the-mark",
        "a replaced run's stop is bounded from when its replacing call marked it, not from "
        "when its grant was freed",
        "core/marks.py",
        '    unconfirmed = [e for e in entries if not e.get("freed", True)]',
        "    unconfirmed: list = []",
    ),
    Mutant(
        "owed-run-joins-its-giver",
        "a call carrying the run a pending rerun owed joins that pending rerun, which the "
        "mark still names when the answer to its take was lost",
        "core/policies.py",
        "        gone=d.owed_by,",
        "        gone=None,",
    ),
    Mutant(
        "owed-run-carrier-not-named",
        "a dead pending rerun's hand-on empties the rerun mark instead of naming the call "
        "it sends with the run: that call's death before it stands in line loses the run",
        "core/marks.py",
        "            swapped = backend.swap_mark(key, RERUN, current, handed, RERUN_TTL)",
        "            swapped = backend.swap_mark(key, RERUN, current, None, 0)",
    ),
    Mutant(
        "resumed-run-yields-to-an-older-change",
        "a call resuming a stopped run joins the pending rerun without its newer change, "
        "whatever the stamps say",
        "engine/attempt.py",
        "                if (call.resumed or self._resume is not None) and not marks.changed_at("
        "arguments):\n",
        "                if call.resumed or self._resume is not None:\n",
    ),
    Mutant(
        "rerun-arguments-kept-after-the-take",
        "a pending rerun whose message may come again keeps the arguments it takes for its "
        "task id only after taking them: a death in between loses the change",
        "engine/attempt.py",
        "                    keep_taken=self._keep_before_take if rerun and host.resumable "
        "else None,",
        "                    keep_taken=None,",
    ),
    Mutant(
        "replaced-run-sent-again",
        "a run a newer call replaced is sent again as a run that lost its lease, not ended",
        "engine/attempt.py",
        "        return self._replaced(lease)\n",
        "        return None\n",
    ),
    Mutant(
        "body-starts-on-a-lost-grant",
        "a body starts under a grant that lapsed after the claim, before the body",
        "engine/attempt.py",
        "        if isinstance(granted.lease, HeldLease) and granted.lease.lost:",
        "        if False:",
    ),
    Mutant(
        "covered-copy-of-a-running-call",
        "a copy of a debounced call whose own delivery runs ends covered by a newer burst",
        "engine/attempt.py",
        "            return self._covered_unless_under_way(turn.covered_by)",
        "            return self._covered(turn.covered_by)",
    ),
    Mutant(
        "beat-admits-every-tick",
        "the leader sends what its scheduler says is due, whatever the record shows",
        "beat/scheduler.py",
        "        return not sent",
        "        return True",
        beat=True,
    ),
]


def run_mutant(
    mutant: Mutant, seeds: int, first: int = 0, faults: Optional[int] = None
) -> tuple[Optional[int], float, str]:
    """Apply ``mutant`` to a copy of the package and explore ``seeds`` schedules on it,
    from seed ``first``, in the world of ``faults``: (the first seed that caught it or
    None, seconds taken, what it said)."""
    with tempfile.TemporaryDirectory() as work:
        copy = Path(work) / "celery_exclusive"
        shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
        target = copy / mutant.path
        text = target.read_text()
        if text.count(mutant.old) != 1:
            raise SystemExit(f"{mutant.name}: the patch does not apply once to {mutant.path}")
        target.write_text(text.replace(mutant.old, mutant.new))
        env = {**os.environ, "PYTHONPATH": f"{work}{os.pathsep}{ROOT}"}
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "tests.simulation.run", "--seeds", str(seeds)]
            + ["--first", str(first), "--faults", str(mutant.faults if faults is None else faults)]
            + (["--beat"] if mutant.beat else []),
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
        )
        took = time.monotonic() - started
    first = done.stdout.splitlines()[0] if done.stdout else done.stderr[-300:]
    if done.returncode == 0:
        return None, took, first
    said = first.removeprefix("beat ")
    seed = int(said.split()[1]) if said.startswith("seed ") else -1
    return seed, took, first


def main(argv: Optional[list[str]] = None) -> int:
    from .test_schedules import BEAT_SEEDS, CI_SEEDS

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--seeds", type=int, help=f"the budget (CI's: {CI_SEEDS}, beat's {BEAT_SEEDS})"
    )
    parser.add_argument("--only", help="run the mutant of this name only")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.only in (None, m.name)]
    missed = 0
    print(f"{'seeded bug':38} {'world':>5} {'caught by seed':>14} {'seconds':>8}  what it said")
    for mutant in chosen:
        budget = args.seeds or (BEAT_SEEDS if mutant.beat else CI_SEEDS)
        seed, took, said = run_mutant(mutant, budget)
        missed += seed is None
        caught = f"NOT in {budget}" if seed is None else str(seed)
        world = "beat" if mutant.beat else str(mutant.faults)
        print(f"{mutant.name:38} {world:>5} {caught:>14} {took:8.1f}  {said[:100]}")
    caught = len(chosen) - missed
    print(f"caught {caught} of {len(chosen)} within the CI budget")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
