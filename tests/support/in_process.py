"""Signal handlers of a test app, connected only in the process that runs it.

A test imports an app to send its tasks; the app's workers (or beats) import it to run
them. Handlers the app connects at import would run in the test's process too, in every
later test of it, and one that fails there is taken for a failure of those tests. So an
app connects its handlers when its worker or beat starts, never at import.
"""

from __future__ import annotations

from typing import Any, Callable

from celery import signals as celery_signals


def in_worker(*connections: tuple[Any, Callable[..., Any]]) -> None:
    """Connect each ``(signal, handler)`` when a Celery worker starts (its pool's
    processes inherit them)."""
    _when(celery_signals.worker_init, connections)


def in_beat(*connections: tuple[Any, Callable[..., Any]]) -> None:
    """Connect each ``(signal, handler)`` when ``celery beat`` starts."""
    _when(celery_signals.beat_init, connections)


def _when(start: Any, connections: tuple[tuple[Any, Callable[..., Any]], ...]) -> None:
    def connect(**kwargs: Any) -> None:
        for signal, handler in connections:
            signal.connect(handler, weak=False)

    start.connect(connect, weak=False)
