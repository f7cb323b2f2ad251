"""``celery exclusive ...`` and the standalone ``celery-exclusive`` command.

Both show who holds which key and let an operator free a key by hand. Under Celery
the store comes from the app's settings (``celery -A proj exclusive ls``); RQ users
and scripts name it: ``celery-exclusive --backend redis://... ls``, or
``celery-exclusive ls --backend redis://...`` (every command takes the store options).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import click
from click.core import ParameterSource

from ..backends import Backend, LeaseInfo, backend_for_url, versions
from ..core import config, holders, marks
from ..errors import ExclusiveError
from . import display

F = TypeVar("F", bound=Callable[..., Any])


def one_line_errors(command: F) -> F:
    """Show an :class:`ExclusiveError` (a store that does not answer, a client library
    that is not installed, a bad setting) as one line, never a traceback."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except ExclusiveError as exc:
            raise click.ClickException(str(exc)) from None

    return run  # type: ignore[return-value]


class Target:
    """The store the command talks to, and the key prefix it lists under."""

    def __init__(self, backend_url: str, key_prefix: str):
        self.backend_url = backend_url
        self.key_prefix = key_prefix

    @functools.cached_property
    def backend(self) -> Backend:
        """The store, once it is known to hold a layout this version shares."""
        backend = backend_for_url(self.backend_url)
        versions.check(backend, self.key_prefix, record=False)
        return backend

    def full_key(self, key: str) -> str:
        return key if key.startswith(self.key_prefix) else self.key_prefix + key


def _target(app: Any, backend_url: Optional[str], key_prefix: Optional[str]) -> Target:
    conf = app.conf if app is not None else {}
    settings = config.resolve(
        "celery exclusive",
        {"backend_url": backend_url, "key_prefix": key_prefix}.get,
        lambda name: conf.get(config.setting_name(name)),
        broker_url=conf.get("broker_url"),
        app_name=getattr(app, "main", None),
    )
    if backend_url is None and app is None:
        raise click.UsageError("name the lease store: --backend URL (or EXCLUSIVE_BACKEND_URL)")
    return Target(settings.backend_url, settings.key_prefix)


#: The options naming the store, accepted by the group and by each command alike:
#: ``celery-exclusive --backend URL ls`` and ``celery-exclusive ls --backend URL``.
STORE_OPTIONS = (
    click.option(
        "--backend",
        "backend_url",
        envvar="EXCLUSIVE_BACKEND_URL",
        show_envvar=True,
        help="Lease store URL. Default: the app's exclusive_backend_url.",
    ),
    click.option(
        "--prefix",
        "key_prefix",
        default=None,
        help="Key prefix to list under. Default: the app's exclusive_key_prefix.",
    ),
)


def store_options(command: F) -> F:
    """Add ``--backend`` and ``--prefix`` to a command (or the group)."""
    for option in reversed(STORE_OPTIONS):
        command = option(command)
    return command


def _chosen(ctx: click.Context, name: str) -> Optional[str]:
    """The store option ``name`` as the operator gave it: on the command's own command
    line, else on the group's, else in the environment; None when not given at all."""
    given: list[click.Context] = []
    context: Optional[click.Context] = ctx
    while context is not None:
        if context.params.get(name) is not None:
            given.append(context)
        context = context.parent
    typed = [c for c in given if c.get_parameter_source(name) is ParameterSource.COMMANDLINE]
    return (typed or given)[0].params[name] if given else None


def with_target(command: F) -> F:
    """Hand the command the store it talks to, as its first argument, in place of the
    store options: resolved when the command runs, never for ``--help``, so that help
    needs neither a store nor an app."""

    @functools.wraps(command)
    def run(
        *args: Any, backend_url: Optional[str], key_prefix: Optional[str], **kwargs: Any
    ) -> Any:
        ctx = click.get_current_context()
        app = getattr(ctx.find_root().obj, "app", None)
        try:
            target = _target(app, _chosen(ctx, "backend_url"), _chosen(ctx, "key_prefix"))
        except ExclusiveError as exc:
            raise click.ClickException(str(exc)) from None
        return command(target, *args, **kwargs)

    return store_options(run)  # type: ignore[return-value]


@click.group(name="exclusive")
@store_options
def exclusive(backend_url: Optional[str], key_prefix: Optional[str]) -> None:
    """Who holds which key, and freeing a key by hand.

    The store options may come before the command or after it; after it, they win.
    """


def _marks(backend: Backend, key: str) -> str:
    """Pending rerun, line of waiters and enqueue mark of ``key``, as one short cell."""
    if not backend.capabilities.marks:
        return ""
    found = {
        "rerun": marks.pending_rerun(backend, key),
        "line": ",".join(marks.line_of(backend, key)),
        "queued": backend.read_mark(key, marks.QUEUED),
    }
    return " ".join(f"{name}:{value}" for name, value in found.items() if value)


def _describe(backend: Backend, infos: list[LeaseInfo]) -> list[dict[str, Any]]:
    marks_of = {key: _marks(backend, key) for key in {info.key for info in infos}}
    return [{**_as_dict(info), "marks": marks_of[info.key]} for info in infos]


def _as_dict(info: LeaseInfo) -> dict[str, Any]:
    holder = dict(info.holder)
    return {
        "key": info.key,
        "task": holder.get("task"),
        "task_id": info.task_id,
        "hostname": holder.get("hostname"),
        "pid": holder.get("pid"),
        "age": None if info.age is None else round(info.age, 3),
        "expires_in": None if info.expires_in is None else round(info.expires_in, 3),
        "fencing_token": info.fencing_token,
    }


#: The table's columns: heading, and how a row's value is shown.
COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("KEY", lambda row: display.one_line(row["key"])),
    ("TASK", lambda row: _cell(row["task"])),
    ("TASK ID", lambda row: _cell(row["task_id"])),
    ("HOST", lambda row: _cell(row["hostname"])),
    ("PID", lambda row: _cell(row["pid"])),
    ("ACQUIRED", lambda row: display.ago(row["age"])),
    ("EXPIRES", lambda row: display.within(row["expires_in"])),
    ("TOKEN", lambda row: _cell(row["fencing_token"])),
    ("MARKS", lambda row: display.one_line(row["marks"], limit=None)),
)


def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else display.one_line(value)


def _table(rows: list[dict[str, Any]]) -> str:
    """One line per lease, whatever its key holds (newlines and control characters are
    escaped, long keys cut): a table for people; ``--json`` has the exact values."""
    if not rows:
        return "no leases held"
    header = [heading for heading, _ in COLUMNS]
    cells = [[show(row) for _, show in COLUMNS] for row in rows]
    widths = [max(display.width(line[i]) for line in [header, *cells]) for i in range(len(header))]
    return "\n".join(
        "  ".join(display.pad(value, w) for value, w in zip(line, widths)).rstrip()
        for line in [header, *cells]
    )


@exclusive.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON document instead of a table.")
@with_target
@one_line_errors
def ls(target: Target, as_json: bool) -> None:
    """List every held lease: key, task, holder, when it was taken, when it expires,
    fencing token, and the key's pending rerun, line of waiters and enqueue mark."""
    backend = target.backend
    rows = _describe(backend, backend.holders(target.key_prefix))
    click.echo(json.dumps(rows, indent=2) if as_json else _table(rows))


@exclusive.command()
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="The exact values, as JSON.")
@with_target
@one_line_errors
def inspect(target: Target, key: str, as_json: bool) -> None:
    """Show who holds KEY (with or without the key prefix), and its marks."""
    full = target.full_key(key)
    backend = target.backend
    infos = backend.holders_of(full)
    key_marks = _marks(backend, full)
    rows = [{**_as_dict(info), "holder": dict(info.holder)} for info in infos]
    if as_json:
        click.echo(json.dumps({"key": full, "holders": rows, "marks": key_marks}, indent=2))
        return
    shown = display.one_line(full, limit=None)
    click.echo(f"{shown}: held by {len(rows)}" if rows else f"{shown}: free")
    for row in rows:
        for name, value in row["holder"].items():
            click.echo(f"  {name}: {_holder_field(name, value)}")
        click.echo(
            f"  expires: {display.within(row['expires_in'])}  "
            f"fencing token: {_cell(row['fencing_token'])}"
        )
    if key_marks:
        click.echo(f"  marks: {display.one_line(key_marks, limit=None)}")


def _holder_field(name: str, value: Any) -> str:
    """A holder record's field for people: ``*_at`` epoch times as local time and age."""
    if name.endswith("_at") and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{display.local_time(value)} ({display.ago(max(0.0, time.time() - value))})"
    return display.one_line(value, limit=None)


@exclusive.command()
@click.argument("key")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@with_target
@one_line_errors
def release(target: Target, key: str, yes: bool) -> None:
    """Free KEY of this library's holders (tasks, jobs, locks), after asking. It stops
    nobody: a running holder finds its lease lost at its next renewal (and, under
    on_lease_lost="terminate", is stopped then). A foreign client's lock on KEY (a
    ?recipe= store) is never freed: it is named and left alone."""
    full = target.full_key(key)
    shown = display.one_line(full, limit=None)

    def confirm(infos: list[LeaseInfo]) -> bool:
        return yes or click.confirm(f"Release {shown}, held by {held_by(infos)}?", abort=True)

    released = release_key(target.backend, full, confirm)
    if released is None:
        click.echo(f"{shown}: not held, nothing released")
        return
    if released.holders:
        leases = display.counted(released.count, "lease", "leases")
        click.echo(f"released {shown}: {leases}, held by {held_by(released.holders)}")
    else:
        click.echo(f"{shown}: nothing released")
    if released.left:
        click.echo(f"{shown}: {left_alone(released.left)}")


@dataclass(frozen=True)
class Released:
    """What a release did to a key: ``count`` leases freed, whose they were
    (``holders``), and the foreign holders it ``left`` alone."""

    count: int
    holders: list[LeaseInfo]
    left: list[LeaseInfo]


def release_key(
    backend: Backend, key: str, confirm: Callable[[list[LeaseInfo]], bool]
) -> Optional[Released]:
    """Free ``key`` of this library's holders, once ``confirm`` approved them as read
    now; None if nobody held it, or ``confirm`` said no. Foreign holders (clients of the
    store's own lock recipe) are never freed, nor asked about: they are only named, in
    ``Released.left``. The CLI's ``release`` and the web view's share it."""
    infos = backend.holders_of(key)
    ours = [info for info in infos if not holders.foreign(info)]
    left = [info for info in infos if holders.foreign(info)]
    if not infos or (ours and not confirm(ours)):
        return None
    if not ours:
        return Released(0, [], left)
    # Remembered first, so that the holders say "released by an operator" when they find out.
    marks.mark_released(backend, key, [i.fencing_token for i in ours if i.fencing_token])
    return Released(backend.force_release(key), ours, left)


def held_by(infos: list[LeaseInfo]) -> str:
    """The holders of a key, for people, on one line: ``task <id> on <host>, ...``."""
    return display.one_line(holders.all_described(infos), limit=None)


def left_alone(infos: list[LeaseInfo]) -> str:
    """What a release says of the foreign holders it left alone."""
    return f"left alone: {held_by(infos)}; free it with its own client"


@exclusive.command()
@click.option("--interval", default=1.0, show_default=True, help="Seconds between refreshes.")
@click.option("--count", default=0, help="Stop after this many refreshes (0: until Ctrl-C).")
@with_target
@one_line_errors
def watch(target: Target, interval: float, count: int) -> None:
    """Refresh the lease table until interrupted."""
    shown = 0
    backend = target.backend
    try:
        while count == 0 or shown < count:
            rows = _describe(backend, backend.holders(target.key_prefix))
            click.clear()
            click.echo(f"{backend.safe_url}  {time.strftime('%H:%M:%S')}  {len(rows)} held\n")
            click.echo(_table(rows))
            shown += 1
            if count == 0 or shown < count:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


@exclusive.command()
@with_target
@one_line_errors
def migrate(target: Target) -> None:
    """Create what the store needs before workers use it (PostgreSQL's tables), as the
    URL's user, and record this version's layout under the key prefix: run once by an
    owner where the workers' role may not create tables, and once at the end of an
    upgrade that changes the layout, when no process of the older version is left."""
    backend = backend_for_url(target.backend_url)
    done = backend.connection.migrate()
    click.echo(f"{backend.safe_url}: {done or 'this store needs nothing created'}")
    click.echo(f"{backend.safe_url}: {versions.migrate(backend, target.key_prefix)}")


def main() -> None:
    """Entry point of the standalone ``celery-exclusive`` command."""
    exclusive(prog_name="celery-exclusive")
