"""``celery exclusive ...`` and the standalone ``celery-exclusive`` command.

Both show who holds which key and let an operator free a key by hand. Under Celery
the store comes from the app's settings (``celery -A proj exclusive ls``); RQ users
and scripts name it: ``celery-exclusive --backend redis://... ls``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Optional

import click

from . import config, marks
from .backends import Backend, LeaseInfo, backend_for_url
from .errors import ExclusiveError


class Target:
    """The store the command talks to, and the key prefix it lists under."""

    def __init__(self, backend_url: str, key_prefix: str):
        self.backend_url = backend_url
        self.key_prefix = key_prefix

    @property
    def backend(self) -> Backend:
        return backend_for_url(self.backend_url)

    def full_key(self, key: str) -> str:
        return key if key.startswith(self.key_prefix) else self.key_prefix + key


def _target(app: Any, backend_url: Optional[str], key_prefix: Optional[str]) -> Target:
    conf = app.conf if app is not None else {}
    settings = config.resolve(
        "celery exclusive",
        {"backend_url": backend_url, "key_prefix": key_prefix}.get,
        lambda name: conf.get(config.setting_name(name)),
        broker_url=conf.get("broker_url"),
    )
    if backend_url is None and app is None:
        raise click.UsageError("name the lease store: --backend URL (or EXCLUSIVE_BACKEND_URL)")
    return Target(settings.backend_url, settings.key_prefix)


@click.group(name="exclusive")
@click.option(
    "--backend",
    "backend_url",
    envvar="EXCLUSIVE_BACKEND_URL",
    help="Lease store URL. Default: the app's exclusive_backend_url.",
)
@click.option(
    "--prefix",
    "key_prefix",
    default=None,
    help="Key prefix to list under. Default: the app's exclusive_key_prefix.",
)
@click.pass_context
def exclusive(ctx: click.Context, backend_url: Optional[str], key_prefix: Optional[str]) -> None:
    """Who holds which key, and freeing a key by hand."""
    app = getattr(ctx.obj, "app", None)
    try:
        ctx.obj = _target(app, backend_url, key_prefix)
    except ExclusiveError as exc:
        raise click.ClickException(str(exc)) from None


def _holders(target: Target, prefix: str) -> list[LeaseInfo]:
    try:
        return target.backend.holders(prefix)
    except ExclusiveError as exc:
        raise click.ClickException(str(exc)) from None


def _marks(backend: Backend, key: str) -> str:
    """Pending rerun, line of waiters and enqueue mark of ``key``, as one short cell."""
    if not backend.stores_marks:
        return ""
    found = {
        "rerun": marks.pending_rerun(backend, key),
        "line": ",".join(marks.line_of(backend, key)),
        "queued": backend.read_mark(key + marks.QUEUED),
    }
    return " ".join(f"{name}:{value}" for name, value in found.items() if value)


def _describe(backend: Backend, infos: list[LeaseInfo]) -> list[dict]:
    marks_of = {key: _marks(backend, key) for key in {info.key for info in infos}}
    return [{**_as_dict(info), "marks": marks_of[info.key]} for info in infos]


def _as_dict(info: LeaseInfo) -> dict:
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


COLUMNS = ("key", "task_id", "hostname", "pid", "age", "expires_in", "fencing_token", "marks")


def _table(rows: list[dict]) -> str:
    if not rows:
        return "no leases held"

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        return f"{value:.1f}s" if isinstance(value, float) else str(value)

    cells = [[cell(row[c]) for c in COLUMNS] for row in rows]
    header = [c.replace("_", " ") for c in COLUMNS]
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(COLUMNS))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


@exclusive.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="One JSON document instead of a table.")
@click.pass_obj
def ls(target: Target, as_json: bool) -> None:
    """List every held lease: key, holder, age, time left, fencing token, and the key's
    pending rerun, line of waiters and enqueue mark."""
    rows = _describe(target.backend, _holders(target, target.key_prefix))
    click.echo(json.dumps(rows, indent=2) if as_json else _table(rows))


@exclusive.command()
@click.argument("key")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def inspect(target: Target, key: str, as_json: bool) -> None:
    """Show who holds KEY (with or without the key prefix), and its marks."""
    full = target.full_key(key)
    try:
        infos = target.backend.holders_of(full)
        key_marks = _marks(target.backend, full)
    except ExclusiveError as exc:
        raise click.ClickException(str(exc)) from None
    rows = [{**_as_dict(info), "holder": dict(info.holder)} for info in infos]
    if as_json:
        click.echo(json.dumps({"key": full, "holders": rows, "marks": key_marks}, indent=2))
        return
    click.echo(f"{full}: held by {len(rows)}" if rows else f"{full}: free")
    for row in rows:
        for name, value in row["holder"].items():
            click.echo(f"  {name}: {value}")
        click.echo(f"  expires in: {row['expires_in']}s  fencing token: {row['fencing_token']}")
    if key_marks:
        click.echo(f"  marks: {key_marks}")


@exclusive.command()
@click.argument("key")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_obj
def release(target: Target, key: str, yes: bool) -> None:
    """Free KEY whoever holds it. Its running holder is not stopped: it will find its
    lease lost at the next renewal."""
    full = target.full_key(key)
    try:
        infos = target.backend.holders_of(full)
        if not infos:
            click.echo(f"{full}: not held, nothing released")
            return
        who = ", ".join(f"task {i.task_id} on {i.holder.get('hostname')}" for i in infos)
        if not yes:
            click.confirm(f"Release {full}, held by {who}?", abort=True)
        count = target.backend.force_release(full)
    except ExclusiveError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"released {full}: {count} lease(s), held by {who}")


@exclusive.command()
@click.option("--interval", default=1.0, show_default=True, help="Seconds between refreshes.")
@click.option("--count", default=0, help="Stop after this many refreshes (0: until Ctrl-C).")
@click.pass_obj
def watch(target: Target, interval: float, count: int) -> None:
    """Refresh the lease table until interrupted."""
    shown = 0
    try:
        while count == 0 or shown < count:
            rows = _describe(target.backend, _holders(target, target.key_prefix))
            click.clear()
            click.echo(
                f"{target.backend.safe_url}  {time.strftime('%H:%M:%S')}  {len(rows)} held\n"
            )
            click.echo(_table(rows))
            shown += 1
            if count == 0 or shown < count:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


def main() -> None:
    """Entry point of the standalone ``celery-exclusive`` command."""
    exclusive(prog_name="celery-exclusive")
