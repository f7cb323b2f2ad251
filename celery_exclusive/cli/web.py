"""``celery exclusive web``: the web view, served by uvicorn (the ``web`` extra)."""

from __future__ import annotations

import logging
from typing import Any, Optional

import click

from .commands import Target, one_line_errors, with_target

#: Where the page is served unless told otherwise: this host only.
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8555


@click.command(name="web")
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="Address to listen on.")
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=int)
@click.option(
    "--release-token",
    envvar="EXCLUSIVE_WEB_RELEASE_TOKEN",
    default=None,
    help="Turn releasing from the page on, for whoever gives this secret (16 characters or "
    "more). Prefer the environment variable EXCLUSIVE_WEB_RELEASE_TOKEN: a command line is "
    "visible to every user of the host. Without it the page is read-only.",
)
@click.option("--refresh", default=1.0, show_default=True, help="Seconds between store reads.")
@click.option("--page-size", default=100, show_default=True, help="Held keys per page.")
@with_target
@one_line_errors
def web(
    target: Target,
    host: str,
    port: int,
    release_token: Optional[str],
    refresh: float,
    page_size: int,
) -> None:
    """Serve a live page of held leases, lines of waiters, pending reruns, the beat
    leader and a feed of duplicates and lost leases."""
    try:
        import uvicorn

        from ..web import create_app
    except ImportError as exc:
        raise click.ClickException(
            f"the web view needs its extra ({exc}): pip install 'celery-exclusive[web]'"
        ) from None
    app = create_app(
        target.backend_url,
        target.key_prefix,
        release_token=release_token or None,
        refresh=refresh,
        page_size=page_size,
        beat_entries=_beat_entries(
            getattr(click.get_current_context().find_root().obj, "app", None)
        ),
    )
    logging.getLogger("celery_exclusive").setLevel(logging.INFO)
    mode = "releasing on (token needed)" if release_token else "read-only"
    click.echo(f"celery-exclusive web: {target.backend.safe_url} on http://{host}:{port}/ ({mode})")
    uvicorn.run(app, host=host, port=port, log_level="info")


def _beat_entries(app: Any) -> list[str]:
    """The schedule entries of the Celery app, if any, whose last sends the page shows."""
    schedule = getattr(getattr(app, "conf", None), "beat_schedule", None) or {}
    return sorted(name for name in schedule if isinstance(name, str))
