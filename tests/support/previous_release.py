"""The package as of its previous store layout, installed from the repository's history
into a virtual environment of its own, beside the current package the tests run.

What a store holds (its layout) is read and written by every worker of a deployment; in
a rolling upgrade, workers of two releases share one store. The previous layout is the
package as of :data:`PREVIOUS_LAYOUT_COMMIT`: ``git archive`` of that commit, installed
(not editable, without dependencies) into a venv built once per commit in the temp dir.
The venv's dependencies (celery, kombu, redis...) are the running test environment's:
a ``.pth`` file puts its site-packages after the venv's own, so that ``celery_exclusive``
is the old copy and everything else the one the tests run with.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PREVIOUS_LAYOUT_COMMIT = "3420beb751ccd56c0dcb1e0230455e8406d57525"
"""The last commit of the package before the current store layout.

A change to what a store holds bumps the layout version and moves this constant to the
last commit before that change, so this test always runs the previous layout beside the
current one.
"""

#: Where the venvs are kept, one per commit (and running environment), across sessions.
CACHE = Path(tempfile.gettempdir()) / "celery-exclusive-previous"

#: The file, in the venv's site-packages, naming the running environment's.
DEPENDENCIES_PTH = "zz-running-environment.pth"

#: Written last: the venv is complete and checked.
COMPLETE = "complete"


@dataclass(frozen=True)
class PreviousRelease:
    """The package as of ``commit``, installed in ``venv``."""

    commit: str
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @functools.cached_property
    def package(self) -> Path:
        """The directory ``celery_exclusive`` is imported from by the venv's python."""
        return Path(imported_from(self.python)).parent

    def env(self, pythonpath: Path) -> dict:
        """An environment for a process of the venv's python whose own modules (an app)
        lie in ``pythonpath``: nothing of the repository's checkout on its path."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env["PYTHONPATH"] = str(pythonpath)
        return env


def imported_from(python: Path) -> str:
    """The ``celery_exclusive/__init__.py`` that ``python`` imports, run outside the
    repository (neither its cwd nor PYTHONPATH names the checkout); celery must import
    too (from the running environment)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run(
        [
            str(python),
            "-c",
            "import sys, celery_exclusive, celery; "
            "assert not [m for m in sys.modules if m.startswith('__editable__')], "
            "'an editable finder was loaded'; "
            "print(celery_exclusive.__file__)",
        ],
        env=env,
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.fail(f"{python} cannot import celery_exclusive and celery:\n{done.stderr}")
    return done.stdout.strip()


def previous_release(commit: str = PREVIOUS_LAYOUT_COMMIT) -> PreviousRelease:
    """The package as of ``commit`` in a venv of its own, built on first use (once per
    commit and running environment; concurrent sessions and pytest-xdist processes wait
    for the one that builds it), and checked to import the old copy, not this checkout."""
    return _previous_release(_full_hash(commit))


@functools.cache
def _previous_release(commit: str) -> PreviousRelease:
    # The .pth names the running environment: a venv is kept per commit and environment.
    running = "\n".join(_running_site_packages())
    tag = hashlib.sha256(f"{sys.version}\n{running}".encode()).hexdigest()[:10]
    target = CACHE / f"{commit}-{tag}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with _locked(CACHE / f"{commit}-{tag}.lock"):
        if not (target / COMPLETE).exists():
            shutil.rmtree(target, ignore_errors=True)  # a build cut short
            _build(commit, target)
    release = PreviousRelease(commit, target / "venv")
    _check(release)
    return release


def _full_hash(commit: str) -> str:
    """``commit``'s full hash, from the repository's history: a clear failure if the
    checkout has none (a shallow clone, an sdist) rather than a skip."""
    verify = ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"]
    done = subprocess.run(verify, capture_output=True, text=True)
    if done.returncode != 0:
        # A shallow clone: fetch that one commit from where the clone came from.
        subprocess.run(
            ["git", "-C", str(ROOT), "fetch", "--quiet", "origin", commit],
            capture_output=True,
            timeout=120,
        )
        done = subprocess.run(verify, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(
            f"commit {commit} (the previous store layout) is not in the history of {ROOT}: "
            "the rolling-upgrade tests install the package as of that commit from the "
            "repository's own history. Run them in a full clone (git fetch --unshallow)."
            + (f"\n{done.stderr}" if done.stderr else ""),
            pytrace=False,
        )
    return done.stdout.strip()


def _running_site_packages() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(args: list[str], **kwargs) -> None:
    done = subprocess.run(args, capture_output=True, **kwargs)
    if done.returncode != 0:
        pytest.fail(
            f"building the previous release: {' '.join(args)} exited {done.returncode}:\n"
            + (done.stdout or b"").decode(errors="replace")
            + (done.stderr or b"").decode(errors="replace")
        )


def _build(commit: str, target: Path) -> None:
    source, venv = target / "source", target / "venv"
    source.mkdir(parents=True)
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", commit], stdout=subprocess.PIPE)
    _run(["tar", "-x", "-C", str(source)], stdin=archive.stdout)
    archive.stdout.close()
    if archive.wait() != 0:
        pytest.fail(f"git archive {commit} exited {archive.returncode}")
    _run([sys.executable, "-m", "venv", str(venv)])
    python = str(venv / "bin" / "python")
    # Only the package: its dependencies are the running environment's.
    _run([python, "-m", "pip", "install", "-q", "--no-deps", str(source)], cwd=str(target))
    site_packages = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Directory lines come after the venv's own site-packages on sys.path; the .pth files
    # inside those directories (this checkout's editable finder) are not processed.
    Path(site_packages, DEPENDENCIES_PTH).write_text("\n".join(_running_site_packages()) + "\n")
    _check(PreviousRelease(commit, venv))
    (target / COMPLETE).write_text(commit + "\n")


def _check(release: PreviousRelease) -> None:
    """The venv imports its own copy of the package, not this checkout's."""
    imported = release.package.resolve()
    venv = release.venv.resolve()
    if venv not in imported.parents or ROOT in imported.parents:
        pytest.fail(
            f"the previous release's python imports celery_exclusive from {imported}, "
            f"not from its venv {venv}"
        )
