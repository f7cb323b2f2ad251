"""Pages written from the code, so that no fact is written twice.

A page asks for generated text with an HTML comment, where the text goes (on a line of
its own for a section, inside a sentence for the version):

- ``<!-- generated: settings -->``: one section per field of
  :class:`celery_exclusive.core.config.Settings`, in the order of the class: its
  default, the values it accepts and the ``#:`` comment above the field, with the
  names it goes by (app setting, Django setting, task attribute, RQ option and
  environment variable, beat override).
- ``<!-- generated: signals -->``: each signal of :mod:`celery_exclusive.signals` with
  the ``#:`` comment above it and the arguments it is sent with.
- ``<!-- generated: version -->``: the package's version.

MkDocs runs :func:`on_page_markdown` for every page before rendering it, so the
generated headings get anchors and links to them are checked like any other.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import re
from typing import Any

MARKER = re.compile(r"<!-- generated: (?P<name>[a-z-]+) -->")


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return MARKER.sub(lambda found: GENERATORS[found.group("name")](), markdown)


def version() -> str:
    import celery_exclusive

    return celery_exclusive.__version__


def comments_above(source: str, body: list[ast.stmt]) -> dict[str, str]:
    """The ``#:`` comment lines right above each assignment in ``body``, joined."""
    lines = source.splitlines()
    comments: dict[str, str] = {}
    for node in body:
        if isinstance(node, ast.AnnAssign):
            target = node.target
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        else:
            continue
        if isinstance(target, ast.Name):
            above: list[str] = []
            row = node.lineno - 2
            while row >= 0 and lines[row].strip().startswith("#:"):
                above.insert(0, lines[row].strip()[2:].strip())
                row -= 1
            comments[target.id] = " ".join(above)
    return comments


def field_comments(cls: type) -> dict[str, str]:
    """The ``#:`` comments above the fields of the class ``cls``."""
    source = inspect.getsource(cls)
    (definition,) = ast.parse(source).body
    assert isinstance(definition, ast.ClassDef)
    return comments_above(source, definition.body)


def signals() -> str:
    from celery.utils.dispatch import Signal

    from celery_exclusive import signals as module

    source = inspect.getsource(module)
    comments = comments_above(source, ast.parse(source).body)
    sections = []
    for name, text in comments.items():
        signal = getattr(module, name)
        assert isinstance(signal, Signal), name
        arguments = ", ".join(f"`{arg}`" for arg in sorted(signal.providing_args))
        sections.append(
            f"### `{name}` {{#{name}}}\n\n{text}\n\nSent with: `sender` (the task or job "
            f"function's name), {arguments}. Import it from `celery_exclusive`.\n"
        )
    return "\n".join(sections)


def choices_of(config: Any, name: str) -> tuple[str, ...]:
    """The values a setting accepts, where ``config`` lists them: ``ON_DUPLICATE`` for
    ``on_duplicate``, ``SCOPES`` for ``scope``."""
    for constant in (name.upper(), name.upper() + "S"):
        found = getattr(config, constant, None)
        if isinstance(found, tuple):
            return found
    return ()


def module_constants(path: str, *names: str) -> dict[str, Any]:
    """Literal constants of a module, read without importing it (``rq`` need not be
    installed to build the site)."""
    with open(path) as source:
        tree = ast.parse(source.read())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in names:
                found[target.id] = ast.literal_eval(node.value)
    return found


#: Where a guide explains each setting (links from the settings page, which is
#: generated in docs/reference/).
GUIDES = {
    "backend_url": ("Stores in production", "../how-to/stores/index.md"),
    "key": ("Choose a key", "../how-to/choosing-a-key.md"),
    "key_prefix": ("Choose a key", "../how-to/choosing-a-key.md"),
    "lease_ttl": ("How a lease works", "../explanation/lease.md"),
    "limit": ("Semaphores", "../how-to/duplicates/semaphores.md"),
    "on_duplicate": ("Duplicates", "../how-to/duplicates/index.md"),
    "wait_timeout": ("wait", "../how-to/duplicates/wait.md"),
    "on_backend_error": (
        "When the store is down",
        "../how-to/stores/index.md#when-the-store-is-down",
    ),
    "on_lease_lost": (
        "When the lease is lost",
        "../how-to/inside-the-body.md#when-the-lease-is-lost",
    ),
    "terminate_grace": (
        "How terminate stops a body",
        "../how-to/inside-the-body.md#how-terminate-stops-a-body",
    ),
    "requeue_lost": (
        "The stopped call runs again",
        "../how-to/inside-the-body.md#the-stopped-call-runs-again",
    ),
    "requeue_delay": ("requeue", "../how-to/duplicates/requeue.md"),
    "requeue_max_delay": ("requeue", "../how-to/duplicates/requeue.md"),
    "requeue_max_retries": ("requeue", "../how-to/duplicates/requeue.md"),
    "rerun_args": ("rerun", "../how-to/duplicates/rerun.md"),
    "priority": ("Priority", "../how-to/duplicates/priority.md"),
    "scope": ("Deduplicate at enqueue", "../how-to/duplicates/enqueue.md"),
    "enqueue_ttl": ("Deduplicate at enqueue", "../how-to/duplicates/enqueue.md"),
    "skip_state": ("skip", "../how-to/duplicates/skip.md"),
    "trace_keys": ("Trace with OpenTelemetry", "../how-to/tracing.md#keys-in-spans"),
    "unique_for": ("A window after the run", "../how-to/duplicates/window.md"),
    "unique_after": ("A window after the run", "../how-to/duplicates/window.md"),
    "rate": ("Rate limits and throttles", "../how-to/duplicates/rate.md"),
    "debounce": ("Debounce", "../how-to/duplicates/debounce.md"),
    "debounce_max_wait": ("Debounce", "../how-to/duplicates/debounce.md"),
}


#: The heading row of each setting's table.
TABLE_HEADER = "| Property | Value |"


def settings() -> str:
    from celery_exclusive.core import config

    rq = module_constants(
        os.path.join(os.path.dirname(config.__file__), "..", "rq", "options.py"),
        "CELERY_ONLY",
        "ENV_PREFIX",
    )

    comments = field_comments(config.Settings)
    sections = []
    for field in dataclasses.fields(config.Settings):
        name = field.name
        if field.default is dataclasses.MISSING:
            default = inspect.getdoc(config.default_backend_url).splitlines()[0]
        elif field.default is None:
            default = "`None`"
        else:
            default = f"`{field.default!r}`"
        allowed = choices_of(config, name)
        rq_option = (
            "—  (Celery only)"
            if name in rq["CELERY_ONLY"]
            else f"`@exclusive({name}=...)`, environment `{rq['ENV_PREFIX']}{name.upper()}`"
            if name != "key"
            else f"`@exclusive({name}=...)` (never read from the environment)"
        )
        rows = [
            ("App setting", f"`{config.setting_name(name)}`"),
            ("Django setting", f"`CELERY_{config.setting_name(name).upper()}`"),
            ("Task attribute", f"`{config.setting_name(name)}`"),
            ("RQ", rq_option),
            (
                "Beat override",
                "`exclusive_beat_key` names the beat's lease instead"
                if name == "key"
                else f"`exclusive_beat_{name}`",
            ),
            ("Type", f"`{field.type}`"),
            ("Default", default),
        ]
        if allowed:
            rows.append(("Allowed", ", ".join(f"`{value!r}`" for value in allowed)))
        if name in GUIDES:
            title, link = GUIDES[name]
            rows.append(("Guide", f"[{title}]({link})"))
        table = "\n".join(f"| {label} | {value} |" for label, value in rows)
        text = comments.get(name) or ""
        sections.append(
            f"### `{name}` {{#{name}}}\n\n{text}\n\n{TABLE_HEADER}\n|---|---|\n{table}\n"
        )
    return "\n".join(sections)


GENERATORS = {"settings": settings, "signals": signals, "version": version}
