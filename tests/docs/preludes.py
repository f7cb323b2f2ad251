"""What a documentation example assumes without showing it (``prelude=NAME``).

Most examples are fragments: ``app.conf.x = ...`` assumes an app. A prelude is put
before the block, both to run it and to type-check it; it holds only what a reader
would have anyway (an app, a stand-in for their own storage), never what the example
is about. ``FILES`` are written beside the block (a package it imports).
"""

from __future__ import annotations

from tests.docs.blocks import saved_as

APP = """\
from celery import Celery

app = Celery("proj")
"""

PRELUDES: dict[str, str] = {
    "app": APP,
    # Tasks run in the calling process, with a private in-process store, as in tests.
    "eager": """\
from celery import Celery

from celery_exclusive.testing import ExclusiveStore

app = Celery("proj")
app.conf.task_always_eager = True
active = ExclusiveStore().active()  # kept: closing it would end the store
store = active.__enter__()
""",
    # Calls are sent to a broker in this process that no worker reads, so what they
    # sent stays queued; leases and marks go to a store in this process.
    "queued": """\
from celery import Celery

app = Celery("proj", broker="memory://")
app.conf.exclusive_backend_url = "memory://"
""",
    # A Django view beside the tasks: Django ships no type hints (a strict checker's
    # user has django-stubs), so its import is told apart once; the rest is "queued".
    "view": """\
import django.http  # type: ignore[import-untyped]
from celery import Celery

app = Celery("proj", broker="memory://")
app.conf.exclusive_backend_url = "memory://"
""",
    # The reader's own storage, which the example writes to, checking fencing tokens.
    "ledger": APP
    + """\
from typing import Optional


class Ledger:
    def write(self, invoice_id: int, fence: Optional[int]) -> None: ...


ledger = Ledger()
""",
    # The reader's own audit function and exception.
    "audit": APP
    + """\
from typing import Any


def audit(task_id: str, exc_info: Any) -> None: ...


class PaymentDeclined(Exception): ...
""",
    # The fenced write of the worked SQL example, on the same page.
    "fenced": APP
    + """\
from typing import Optional


def write(invoice_id: int, status: str, token: Optional[int]) -> bool:
    raise NotImplementedError
""",
    # A Django settings module: run, then checked (see EPILOGUES).
    "django": "",
    # A project whose tasks the example's tests import (see FILES).
    "proj": "",
    # The quick start's call.py, beside the quick start's tasks.py (see FILES).
    "quickstart": "",
}


#: Files written beside the block for a prelude.
FILES: dict[str, dict[str, str]] = {
    "quickstart": {"tasks.py": saved_as("tasks.py").text},
    "proj": {
        "proj/__init__.py": "",
        "proj/tasks.py": """\
from celery import Celery

from celery_exclusive import ExclusiveTask

app = Celery("proj")
app.conf.task_always_eager = True


@app.task(base=ExclusiveTask, exclusive_key="invoice:{invoice_id}")
def settle(invoice_id: int) -> str:
    return f"invoice {invoice_id} settled"
""",
    },
}

#: Run after every ``run`` block: every Celery app the example leaves behind has its
#: settings and each exclusive task's settings and key resolved and checked, so an
#: example with a misspelt or bad setting fails.
CHECK_APPS = """

def _check_the_examples_apps() -> None:
    from celery import Celery

    from celery_exclusive import ExclusiveTask
    from celery_exclusive.celery import settings as app_settings

    for value in list(globals().values()):
        if isinstance(value, Celery):
            app_settings.for_app(value, "the example")
            for task in value.tasks.values():
                if isinstance(task, ExclusiveTask):
                    task.exclusive_settings  # noqa: B018 - resolving is the check


_check_the_examples_apps()
"""

#: Run after a ``django`` block: every CELERY_EXCLUSIVE_* name is a setting.
CHECK_DJANGO = """

def _check_the_django_settings() -> None:
    from celery_exclusive.core import config

    for name in [n for n in globals() if n.startswith("CELERY_EXCLUSIVE_")]:
        setting = name[len("CELERY_EXCLUSIVE_") :].lower()
        setting = setting[len("beat_") :] if setting.startswith("beat_") else setting
        assert setting in config.NAMES or setting == "scheduler", name


_check_the_django_settings()
"""

EPILOGUES: dict[str, str] = {"django": CHECK_DJANGO}


def source_of(prelude: str | None, block: str) -> tuple[str, int]:
    """The module to check: the prelude, then the block; and the prelude's line count."""
    head = PRELUDES[prelude] if prelude else ""
    if head and not head.endswith("\n\n"):
        head += "\n"
    return head + block, head.count("\n")
