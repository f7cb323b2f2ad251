"""Each protocol bug the simulation found, kept as its seed: the schedule that showed it
holds on the engine, and still shows the bug when the bug is put back (the bug is the
seeded one of the same name in mutants.py).

Each seed replays in the world it was found in (its faults' version): a world that
gains faults keeps the older seeds' schedules. A change that still moves a schedule
away from its bug fails the second test: find the bug's new first seed with
``python -m tests.simulation.mutants --only NAME`` and pin it here.
"""

from __future__ import annotations

import pytest

from .mutants import MUTANTS, PACKAGE, run_mutant
from .run import run_beat_seed, run_seed

#: (the seeded bug of mutants.py, the first seed that caught it, the world it was found
#: in: the version of the workers' faults (tests/simulation/world.py's FAULTS) or
#: "beat" (tests/simulation/beat.py), what was fixed).
FOUND = [
    (
        "older-change-replaces-newer",
        68,
        1,
        "a change that joins the pending rerun late no longer replaces a newer one: "
        "changes carry when they were sent (exclusive_as_of)",
    ),
    (
        "dead-rerun-args-dropped",
        272,
        1,
        "a duplicate taking a dead pending rerun's place keeps the newer of the two changes",
    ),
    (
        "owed-run-never-handed-on",
        500,
        1,
        "a pending rerun that gives up or dies hands its run on to a new call",
    ),
    (
        "taken-arguments-lost",
        8069,
        1,
        "arguments a pending rerun took go with the call when the store fails right after",
    ),
    (
        "priority-waits-on-the-away",
        114,
        1,
        "a waiting priority call passes one that is away on a requeue",
    ),
    (
        "skip-records-no-end",
        32,
        1,
        "a requeued or skipped duplicate records its end, so its copy is dropped",
    ),
    (
        "finished-mark-expires-at-once",
        10,
        1,
        "a finished mark lasts as long as a copy may come (an hour at least)",
    ),
    (
        "copy-of-an-ended-attempt-runs",
        32,
        1,
        "a copy refused or granted the key reads the finished mark before it runs",
    ),
    (
        "gives-up-silently",
        13650,
        2,
        "a call that gives up says so before it records its end: a process that dies "
        "between the two leaves the line, and the copy that finds the record is dropped",
    ),
    (
        "own-orphan-grant-skips-the-call",
        113,
        3,
        "a call whose grant's answer was lost meets that grant as an earlier attempt of "
        "itself, and is requeued until it lapses rather than skipped as its own duplicate",
    ),
    (
        "retry-recorded-before-it-is-sent",
        484,
        3,
        "retry() gives the lease back first and records the attempt's end only once the "
        "retry went out: a process killed in between leaves its message to come again",
    ),
    (
        "handed-back-call-loses-its-enqueue-mark",
        1558,
        3,
        "a call whose message the broker takes back keeps its enqueue mark: no second "
        "call of its key is sent while it is queued again",
    ),
    (
        "duplicate-of-nobody-skipped",
        91,
        3,
        "a call refused as its holder let go tries once more, and one that still finds "
        "nobody holding comes back rather than skipped: a body's own retry(throw=False) "
        "meeting its run as it ended was lost",
    ),
    (
        "dead-holders-slot-freed",
        6,
        6,
        "the worker keeps a dead holder's lease as a failed run's end keeps it: a rate's "
        "slot to a period after its grant, a window after every end; freed at once, the "
        "rate admitted a run more in the period",
    ),
    (
        "dead-holders-kept-lease-shortened",
        9038,
        6,
        "a dead holder's lease kept already (its run ended and kept its rate slot, then its "
        "process was killed; or the worker looked at it before) is never kept for less than "
        "it has left: read with its shortened ttl, it seemed older than it was, and was cut",
    ),
    (
        "second-replacer-says-it-stopped",
        8572,
        6,
        "of two calls replacing one running call at once, the one whose release found the "
        "grant freed by the other no longer says the run stopped: the call that ran next "
        "started beside it",
    ),
    (
        "older-change-replaces-a-bursts-newer",
        29,
        5,
        "a debounced call whose first try failed joins its burst late without replacing "
        "the newer change the burst holds (changes ordered by when they were sent)",
    ),
    (
        "burst-taken-before-the-key",
        62,
        5,
        "a call takes its due burst only once it holds the key: one killed before could "
        "leave the burst taken by a run that never starts",
    ),
    (
        "replacing-call-runs-at-once",
        203,
        6,
        "a call granted a key whose run a newer call replaced waits for that run to stop, "
        "whoever it is: the replacing call, sent back to the queue, came back to a free key",
    ),
    (
        "retried-call-skips-itself",
        897,
        3,
        "a retry whose earlier attempt's release went unanswered meets that grant as its "
        "own, and is requeued until it lapses rather than skipped as its own duplicate",
    ),
    (
        "library-sends-refused-at-enqueue",
        25,
        3,
        "a call the library sends again (a requeue, a copy set aside, an owed run) is "
        "never refused at enqueue: it goes on, taking the enqueue mark only if free",
    ),
    (
        "replaced-bound-from-the-mark",
        36649,
        6,
        "the bound on a replaced run's stop counts from when its grant was freed: counted "
        "from the mark, a release held up (its request lost and sent again) let a later "
        "call start beside the run, which had renewed its grant until then",
    ),
    (
        "owed-run-joins-its-giver",
        47135,
        6,
        "a call carrying the run a pending rerun owed (it gave up, and the answer to its "
        "take of the rerun mark was lost) never joins that pending rerun: it coalesced "
        "into it, and the change it carried was lost",
    ),
    (
        "owed-run-carrier-not-named",
        46365,
        6,
        "the call a dead pending rerun's hand-on sends with the run it owed is named in "
        "the rerun mark before it goes: it died waiting for the key (acks_late without "
        "reject_on_worker_lost: its message gone), and with the mark emptied nobody owed "
        "the run any more, the newest change never ran",
    ),
    (
        "resumed-run-yields-to-an-older-change",
        49843,
        6,
        "a call sent again to resume its run stopped by a lost lease joins the pending "
        "rerun with its change if that is the newer (stamped) one: it had joined without "
        "it, and the pending rerun, an older change, ran last",
    ),
    (
        "rerun-arguments-kept-after-the-take",
        66480,
        6,
        "a pending rerun whose message may come again keeps the arguments it takes for its "
        "task id before it takes them from the rerun mark: killed between the take and the "
        "keep, its delivery that came back ran its own older change, and the newest was lost",
    ),
    (
        "body-starts-on-a-lost-grant",
        34683,
        6,
        "a call whose grant lapsed before its body started (its process paused after the "
        "claim) is sent again rather than run: under on_lease_lost='log' the body started "
        "in the window of the run that took the key meanwhile",
    ),
    (
        "covered-copy-of-a-running-call",
        18827,
        6,
        "a copy of a debounced call delivered again while its first delivery runs the "
        "burst it took is set aside, not ended covered by the next burst's run: the call "
        "ended twice, covered and run",
    ),
    (
        "beat-sends-after-its-lease-lapsed",
        208,
        "beat",
        "a beat held up past its lease's deadline after recording a tick does not send "
        "it late, after the ticks the next leader sent",
    ),
]

MUTANT = {mutant.name: mutant for mutant in MUTANTS}


@pytest.mark.parametrize(("bug", "seed", "faults", "fixed"), FOUND, ids=[f[0] for f in FOUND])
def test_the_schedule_that_found_a_bug_holds_every_invariant(bug, seed, faults, fixed):
    failure = run_beat_seed(seed) if faults == "beat" else run_seed(seed, faults=faults)
    assert failure is None, f"{bug} is back ({fixed}):\n{failure}"


@pytest.mark.parametrize(("bug", "seed", "faults", "fixed"), FOUND, ids=[f[0] for f in FOUND])
def test_the_schedule_that_found_a_bug_still_finds_it_when_it_is_put_back(bug, seed, faults, fixed):
    world = None if faults == "beat" else faults
    caught, _, said = run_mutant(MUTANT[bug], seeds=1, first=seed, faults=world)
    assert caught == seed, (
        f"seed {seed} no longer reaches {bug!r} ({said}); find its first seed with "
        f"python -m tests.simulation.mutants --only {bug} and pin it in FOUND"
    )


@pytest.mark.parametrize("mutant", MUTANTS, ids=[mutant.name for mutant in MUTANTS])
def test_every_seeded_bug_still_applies_once_to_the_package(mutant):
    text = (PACKAGE / mutant.path).read_text()
    assert text.count(mutant.old) == 1, (
        f"{mutant.name}: its patch no longer applies to {mutant.path}; rewrite it against "
        "the code as it is now, and check it is still caught"
    )
