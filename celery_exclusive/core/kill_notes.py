"""Notes a process leaves before it kills itself for a lost lease, for its parent.

A body that does not stop within ``terminate_grace`` of losing its lease has its
process killed (:mod:`.terminate`): a Celery prefork child, an RQ work horse. The call
must run again, but only the parent that watched the process die can send it, and to
the parent a SIGKILL looks like any other (the OOM killer, a hard time limit,
``revoke(terminate=True)``), none of which may send the call again. So the dying
process first writes a note, and the parent reads it when it sees the death.

The note is local, not in the lease store: the store may well be why the lease was
lost. It is a file named by the call's id, in a directory private to the user
(0700, owned by them), and holds the pids of the killed process and of its parent,
and, when the body ran as the pending rerun of its key, the arguments it ran with (the
newest duplicate's, not those of the call's own message), which the call is sent
again with. A parent takes a note only if it names the parent itself, so a note left
behind by a parent that died first (or by another worker) is never read as a death of
its own. Taking a note removes it: the call is sent again at most once. A note nobody
took (its parent died first) is swept away by the next note written, once it is
:data:`STALE_AFTER` old.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import tempfile
from dataclasses import dataclass
from typing import Optional

from .. import runtime

__all__ = ["KillNote", "note_kill", "take_kill_note", "notes_dir"]

logger = logging.getLogger("celery_exclusive")


#: A parent takes its child's note within seconds of the death; a note this old (s) was
#: left by a parent that died first, and nobody will take it.
STALE_AFTER = 3600.0


def notes_dir() -> str:
    """The directory of kill notes: private to the user running the workers."""
    return os.path.join(tempfile.gettempdir(), f"celery-exclusive-{os.getuid()}", "killed")


def _ensure_private(path: str) -> None:
    """Create ``path`` (and its parent) 0700, and refuse one another user could write."""
    for directory in (os.path.dirname(path), path):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            raise PermissionError(f"{directory} is not a directory of this user")
        if info.st_mode & 0o022:
            raise PermissionError(f"{directory} is writable by other users")


def _note_path(call_id: str) -> str:
    # Call ids are chosen by callers: hashed, they can name no other file.
    return os.path.join(notes_dir(), hashlib.sha256(call_id.encode()).hexdigest()[:40])


@dataclass(frozen=True)
class KillNote:
    """What a process killed for its lost lease told its parent."""

    #: The arguments (JSON, as a pending rerun keeps them) its body ran with, when it
    #: ran as the pending rerun of its key: the call is sent again with them. None: the
    #: call's own.
    arguments: Optional[str] = None


def note_kill(call_id: Optional[str], arguments: Optional[str] = None) -> None:
    """Say that this process is about to be killed because ``call_id`` lost its lease;
    ``arguments``: those of the pending rerun its body runs as (JSON), if it does.

    Never raises: the kill goes ahead whether or not the note could be written.
    """
    if not call_id:
        return
    try:
        _ensure_private(notes_dir())
        path = _note_path(call_id)
        scratch = f"{path}.{runtime.getpid()}"
        with open(scratch, "w") as note:
            note.write(f"{runtime.getpid()} {runtime.getppid()}\n")
            if arguments is not None:
                note.write(arguments)
        os.replace(scratch, path)
        _sweep_stale(keep=path)
    except OSError as exc:
        logger.error(
            "could not leave a note that %s is killed for its lost lease (%s): its parent "
            "will not send it again",
            call_id,
            exc,
        )


def _sweep_stale(keep: str) -> None:
    """Remove the notes older than :data:`STALE_AFTER` (not ``keep``, just written).

    Their age is read on one clock, the file system's: against ``keep``'s time of
    writing, not this process's clock, which may be another (a clock stepped or faked,
    a simulated one) and would then sweep notes their parents are about to take."""
    too_old = os.stat(keep).st_mtime - STALE_AFTER
    with os.scandir(notes_dir()) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.path != keep and entry.stat(follow_symlinks=False).st_mtime < too_old:
                    os.unlink(entry.path)


def take_kill_note(call_id: Optional[str], pid: Optional[int] = None) -> Optional[KillNote]:
    """The note of a child of this process killed because ``call_id`` lost its lease
    (``pid``: that child's pid, where the parent knows it), or None if it was not.
    Removes the note."""
    if not call_id:
        return None
    path = _note_path(call_id)
    try:
        with open(path) as note:
            content = note.read()
        os.unlink(path)
    except OSError:  # no note: killed for another reason, or someone took it first
        return None
    pids, _, arguments = content.partition("\n")
    try:
        killed, parent = (int(part) for part in pids.split())
    except ValueError:
        return None
    if parent != runtime.getpid() or (pid is not None and killed != pid):
        # Said, not silent: the call is then handled as any death, and not sent again.
        logger.warning(
            "the kill note of %s names process %d (a child of %d), not the one that died "
            "(%s, a child of %d): the call is not sent again",
            call_id,
            killed,
            parent,
            pid if pid is not None else "unknown",
            runtime.getpid(),
        )
        return None
    return KillNote(arguments or None)
