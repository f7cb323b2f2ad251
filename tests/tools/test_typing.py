"""The public API type-checks as users check it: ``mypy --strict`` and pyright report
each typical mistake of a user's file where it is made, and nothing else
(``tests/support/typing/mistakes.py``); the typed options are the settings. The docs'
and README's examples are type-checked by tests/docs/test_typing.py.

Celery's own types come from celery-types, as in a user's strictly typed project."""

from __future__ import annotations

import typing
from typing import Optional

import pytest

from tests.support.typecheck import CHECKERS, ROOT

MISTAKES = ROOT / "tests/support/typing/mistakes.py"


@pytest.mark.parametrize("checker", sorted(CHECKERS))
def test_each_typical_mistake_is_reported_where_it_is_made(tmp_path, checker):
    user = tmp_path / "user.py"
    user.write_text(MISTAKES.read_text())
    expected = {
        number
        for number, line in enumerate(MISTAKES.read_text().splitlines(), start=1)
        if "# E:" in line
    }
    errors = CHECKERS[checker](tmp_path, [user])
    reported = {error.line for error in errors if error.path == user.resolve()}
    assert reported == expected, "\n".join(f"{line}: {message}" for _, line, message in errors)


def test_the_decorators_typed_options_are_the_settings_rq_takes():
    from celery_exclusive.rq import calls, options

    (_, with_options) = typing.get_overloads(calls.exclusive)
    hints = typing.get_type_hints(with_options)
    hints.pop("return")
    assert hints == {
        name: kind if name == "key" else Optional[kind]
        for name, kind in options.OPTION_TYPES.items()
    }


def test_exclusive_tasks_typed_attributes_are_the_settings():
    from celery_exclusive import ExclusiveTask, Settings

    hints = typing.get_type_hints(ExclusiveTask)
    attributes = {name: kind for name, kind in hints.items() if name.startswith("exclusive_")}
    assert attributes == {
        f"exclusive_{name}": kind if name == "key" else Optional[kind]
        for name, kind in typing.get_type_hints(Settings).items()
    }
