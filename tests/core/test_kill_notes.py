"""Kill notes: a process killed for its lost lease tells the parent that watches it,
and only that parent, once."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

from celery_exclusive import runtime
from celery_exclusive.core import kill_notes
from celery_exclusive.engine.arguments import decode_call, encode_call

#: A child that leaves a note for call ``argv[1]`` (with the arguments ``argv[2]``, if
#: given), as terminate does before SIGKILL.
NOTE = (
    "import sys; from celery_exclusive.core import kill_notes; kill_notes.note_kill(*sys.argv[1:])"
)


@pytest.fixture
def tmp_notes(tmp_path, monkeypatch):
    """Notes under a temporary directory of this test, for this process and its children."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path


def leave_note(call_id: str, *through: str, arguments: str | None = None) -> int:
    """Run a child (through ``through`` commands first) that leaves a note; its pid."""
    noted = [call_id] if arguments is None else [call_id, arguments]
    child = subprocess.Popen([*through, sys.executable, "-c", NOTE, *noted], cwd=os.getcwd())
    assert child.wait(timeout=30) == 0
    return child.pid


def test_the_parent_takes_the_note_of_its_killed_child_once(tmp_notes):
    pid = leave_note("call-1")
    assert kill_notes.take_kill_note("call-1", pid) == kill_notes.KillNote(arguments=None)
    assert kill_notes.take_kill_note("call-1", pid) is None


def test_the_note_of_a_pending_rerun_carries_the_arguments_its_body_ran_with(tmp_notes):
    arguments = encode_call("sync", ("calendar", 3), {"note": "two\nlines"})
    pid = leave_note("call-1", arguments=arguments)
    note = kill_notes.take_kill_note("call-1", pid)
    assert note is not None and note.arguments == arguments
    assert decode_call(note.arguments) == (("calendar", 3), {"note": "two\nlines"})


def test_a_call_that_left_no_note_was_not_killed_for_its_lease(tmp_notes):
    leave_note("call-1")
    assert kill_notes.take_kill_note("call-2") is None


def test_a_note_for_another_parent_is_not_taken_and_is_removed(tmp_notes):
    # The note's writer is a grandchild: its parent is the shell, not this process.
    leave_note("call-1", "sh", "-c", 'exec "$@" & wait', "sh")
    assert kill_notes.take_kill_note("call-1") is None
    assert os.listdir(kill_notes.notes_dir()) == []


def test_a_note_of_another_child_of_this_parent_is_not_taken(tmp_notes):
    pid = leave_note("call-1")
    assert kill_notes.take_kill_note("call-1", pid + 1) is None


def test_no_note_is_written_where_other_users_could_write(tmp_notes, caplog):
    os.mkdir(os.path.dirname(kill_notes.notes_dir()), 0o700)
    os.mkdir(kill_notes.notes_dir())
    os.chmod(kill_notes.notes_dir(), 0o777)
    kill_notes.note_kill("call-1")
    assert os.listdir(kill_notes.notes_dir()) == []
    assert "is writable by other users" in caplog.text and "call-1" in caplog.text


def test_call_ids_name_no_other_file(tmp_notes):
    kill_notes.note_kill("../../escape")
    assert [name for name in os.listdir(tmp_notes) if "escape" in name] == []
    assert len(os.listdir(kill_notes.notes_dir())) == 1


def test_a_note_nobody_took_is_swept_away_by_a_later_note_once_it_is_stale(tmp_notes):
    """Its parent died first: nobody will take it, and it must not pile up."""
    leave_note("orphaned")
    leave_note("recent")
    orphan = kill_notes._note_path("orphaned")
    old = os.stat(orphan).st_mtime - kill_notes.STALE_AFTER - 60
    os.utime(orphan, (old, old))
    pid = leave_note("fresh")
    assert not os.path.exists(orphan)
    assert os.path.exists(kill_notes._note_path("recent"))  # not stale yet: kept
    assert kill_notes.take_kill_note("fresh", pid) is not None


def test_a_note_written_by_a_process_whose_clock_runs_ahead_sweeps_no_fresh_note(
    tmp_notes, monkeypatch
):
    """Age is read on the file system's clock: a process shown another time (a clock
    stepped or faked, a simulated one) leaves the notes other parents are about to take."""
    pid = leave_note("fresh")
    monkeypatch.setattr(runtime, "wall", lambda: time.time() + 2 * kill_notes.STALE_AFTER)
    kill_notes.note_kill("written-an-hour-ahead")
    assert kill_notes.take_kill_note("fresh", pid) is not None
