"""The operator's commands: ``celery -A proj exclusive ...`` and ``celery-exclusive``."""

from .commands import exclusive, main
from .web import web

exclusive.add_command(web)

__all__ = ["exclusive", "main"]
