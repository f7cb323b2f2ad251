"""Every Python block of the docs and the README type-checks as a user who checks
strictly sees it: ``mypy --strict`` and pyright, each run once over all the blocks (each
block a module of its own, after its prelude), their errors mapped back to the page and
line they come from."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from tests.docs import preludes
from tests.docs.blocks import Block, blocks_of, every_block
from tests.support.typecheck import CHECKERS

PYTHON = [block for block in every_block() if block.lang == "python"]

#: A page with one mistake, checked with the blocks: each checker must report it at its
#: line of the page, or the checker or the mapping back to pages is broken.
MISTAKE = """\
Settings are typed.

<!-- check: run; prelude=app -->
```python
from celery_exclusive import Settings

ttl: str = Settings(backend_url="memory://").lease_ttl  # a float
```
"""
MISTAKE_LINE = 7


def write_modules(blocks: list[Block], folder: Path) -> dict[Path, tuple[Block, int]]:
    """Each block as ``block_NNN.py`` in ``folder``, after its prelude (and the files
    its prelude needs, beside it); by path, the block and its prelude's line count."""
    modules = {}
    for number, block in enumerate(blocks):
        source, offset = preludes.source_of(block.prelude, block.text)
        for name, text in preludes.FILES.get(block.prelude or "", {}).items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
        path = folder / f"block_{number:03}.py"
        path.write_text(source)
        modules[path.resolve()] = (block, offset)
    return modules


@pytest.fixture(scope="module", params=sorted(CHECKERS))
def errors(request, tmp_path_factory) -> dict[str, list[str]]:
    """One checker's errors over every Python block and the mistake, by block, each as
    ``page:line: message``."""
    folder = tmp_path_factory.mktemp(request.param)
    (folder / "mistake.md").write_text(MISTAKE)
    modules = write_modules([*PYTHON, *blocks_of(folder / "mistake.md")], folder)
    found = collections.defaultdict(list)
    for error in CHECKERS[request.param](folder, sorted(modules)):
        assert error.path in modules, f"{request.param} reports outside the blocks: {error}"
        block, offset = modules[error.path]
        row = error.line - offset  # in the block; 0 or less: in its prelude
        where = block.at(row) if row > 0 else f"{block.where} (its prelude)"
        found[block.where].append(f"{where}: {request.param}: {error.message}")
    return dict(found)


@pytest.mark.parametrize("block", [pytest.param(block, id=block.where) for block in PYTHON])
def test_a_python_example_type_checks(block, errors):
    assert not errors.get(block.where), "\n".join(errors[block.where])


def test_a_mistake_in_an_example_is_reported_at_its_line_of_its_page(errors):
    (block,) = [where for where in errors if where.endswith("/mistake.md:4")]
    reported = [error.split(": ")[0] for error in errors[block]]
    assert reported == [block.removesuffix(":4") + f":{MISTAKE_LINE}"], errors[block]
