"""Reading the spans a traced worker wrote (``tests/support/apps/traced.py``) as trees."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional


@dataclass
class Span:
    name: str
    span_id: str
    parent_id: Optional[str]
    trace_id: str
    attributes: dict[str, Any]
    events: list[dict[str, Any]]
    status: str
    start: int
    end: int
    children: list[Span] = field(default_factory=list)

    def event(self, name: str) -> dict[str, Any]:
        """The attributes of the one event called ``name``."""
        found = [event["attributes"] for event in self.events if event["name"] == name]
        assert len(found) == 1, (name, self.events)
        return found[0]

    @property
    def event_names(self) -> list[str]:
        """The library's events, in order (an instrumentation's ``exception`` left out)."""
        return [event["name"] for event in self.events if event["name"].startswith("exclusive.")]

    def child(self, name: str) -> Span:
        found = [child for child in self.children if child.name == name]
        assert len(found) == 1, (name, self.shape())
        return found[0]

    def shape(self) -> tuple:
        """The tree's names, ``(name, (child shapes...))``, store round trips left out
        (how many a step takes is the store's business)."""
        return (
            self.name,
            tuple(
                child.shape()
                for child in sorted(self.children, key=lambda c: c.start)
                if child.name != "exclusive.store" and not child.name.startswith("exclusive.store ")
            ),
        )


def read(path: Path) -> list[Span]:
    """Every span written so far, each with its children."""
    if not path.exists():
        return []
    spans = [
        Span(
            record["name"],
            record["span_id"],
            record["parent_id"],
            record["trace_id"],
            record["attributes"],
            record["events"],
            record["status"],
            record["start"],
            record["end"],
        )
        for record in map(json.loads, path.read_text().splitlines())
    ]
    by_id = {span.span_id: span for span in spans}
    for span in spans:
        parent = by_id.get(span.parent_id or "")
        if parent is not None:
            parent.children.append(span)
    return spans


def root_of(spans: list[Span], span: Span) -> Span:
    by_id = {s.span_id: s for s in spans}
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
    return span


def wait_for_span(
    path: Path, matches: Callable[[Span], bool], timeout: float = 30, ended: bool = True
) -> tuple[Span, list[Span]]:
    """The first span that ``matches`` (and all spans), once it has been written."""
    deadline = time.monotonic() + timeout
    while True:
        spans = read(path)
        found = [span for span in spans if matches(span)]
        if found:
            return found[0], spans
        assert time.monotonic() < deadline, [s.name for s in spans]
        time.sleep(0.1)


def acquire_of(task_id: str, outcome: Optional[str] = None) -> Callable[[Span], bool]:
    """Matches the ``exclusive.acquire`` span of the call ``task_id`` (that ended so)."""
    return lambda span: (
        span.name == "exclusive.acquire"
        and span.attributes.get("exclusive.task_id") == task_id
        and (outcome is None or span.attributes.get("exclusive.outcome") == outcome)
    )


def call_tree(path: Path, task_id: str, timeout: float = 30) -> Span:
    """The span the call ``task_id`` ran in (Celery's ``run/<task>``, or the library's
    own ``exclusive.call``), with everything beneath it, once it has ended."""
    acquire, _ = wait_for_span(path, acquire_of(task_id), timeout)
    parent, _ = wait_for_span(path, lambda span: span.span_id == acquire.parent_id, timeout)
    return parent
