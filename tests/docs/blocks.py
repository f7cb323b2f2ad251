"""The code blocks of the documentation, and how each says it is checked.

Every fenced block in ``docs/`` and in the repository's top-level Markdown files is
preceded (blank lines and other HTML comments aside) by one annotation::

    <!-- check: KIND[; file=NAME][; prelude=NAME][; run by PATH] -->

KIND says what the spec does with the block:

========== ======== ===============================================================
kind       language what is checked
========== ======== ===============================================================
run        python   runs (after its prelude, if any), then type-checks; every
                    Celery app it leaves has its exclusive tasks' settings
                    resolved, so a misspelt or bad setting fails
typecheck  python   type-checks: it needs a server or a worker to run (``run by
                    PATH`` names the test that runs it, if one does)
pytest     python   runs as a test module with pytest, then type-checks
shell      sh       each command names something that exists: an extra of this
                    package, a subcommand and options of ``celery``,
                    ``celery-exclusive`` or ``rq``, a module for ``python -m``, a
                    script, a docker-compose service, a test file
output     text     what a program prints; ``run by PATH`` names the test that
                    compares it with what it prints
example    text     an example whose values differ from run to run: the paragraph
                    above it says it is an example
diagram    mermaid  a diagram type Mermaid knows, and (sequence diagrams) no
                    message to or from an undeclared participant
acl        text     the Redis ACL rule grants exactly the commands the Redis store
                    says it needs
hcl        hcl      the Consul rules are the ones the Consul store asks for
toml       toml     parses
tree       text     every file and folder of a layout exists (indented names are
                    inside the last unindented folder)
========== ======== ===============================================================

Every Python block is type-checked by ``mypy --strict`` and by pyright, as a user who
checks strictly sees it (tests/docs/test_typing.py).

``file=NAME`` says the reader saves the block as a file of that name (the paragraph
above says so): the test named by ``run by`` writes it under that name, and another
block's prelude may put it beside that block. ``prelude=NAME`` puts what the example
assumes without showing it before the block (tests/docs/preludes.py).

A block without an annotation, or with an unknown kind, fails the spec.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]

#: Each kind and the languages its block may be written in.
KINDS: dict[str, tuple[str, ...]] = {
    "run": ("python",),
    "typecheck": ("python",),
    "pytest": ("python",),
    "shell": ("sh", "bash", "console"),
    "output": ("text",),
    "example": ("text",),
    "diagram": ("mermaid",),
    "acl": ("text",),
    "hcl": ("hcl",),
    "toml": ("toml",),
    "tree": ("text",),
}

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)\s*$")
ANNOTATION = re.compile(r"^\s*<!-- check: (?P<body>.*?) -->\s*$")
COMMENT = re.compile(r"^\s*<!--.*-->\s*$")


@dataclasses.dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    kind: Optional[str]
    file: Optional[str] = None
    prelude: Optional[str] = None
    run_by: Optional[str] = None
    before: str = ""  # the prose paragraph above the annotation

    @property
    def where(self) -> str:
        return self.at(0)

    def at(self, row: int) -> str:
        """``page:line`` of the block's line ``row`` (1-based; 0 is the opening fence)."""
        shown = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{shown}:{self.line + row}"


def documents() -> list[Path]:
    """Every Markdown file the spec covers: the site's pages and the top-level files."""
    pages = sorted((ROOT / "docs").rglob("*.md"))
    top = [ROOT / name for name in ("README.md", "CONTRIBUTING.md", "CHANGELOG.md")]
    return [*top, *pages]


def blocks_of(path: Path, text: Optional[str] = None) -> list[Block]:
    lines = (path.read_text() if text is None else text).splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        fence, indent = opening.group("fence"), opening.group("indent")
        end = index + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(fence[0] * len(fence))
            and lines[end].strip().strip(fence[0]) == ""
        ):
            end += 1
        body = "\n".join(line[len(indent) :] for line in lines[index + 1 : end]) + "\n"
        block = Block(path, index + 1, opening.group("lang"), body, None)
        annotate(block, lines[:index])
        found.append(block)
        index = end + 1
    return found


def annotate(block: Block, above: list[str]) -> None:
    """Read the annotation above the block, if any, into ``block``."""
    row = len(above) - 1
    while row >= 0 and (not above[row].strip() or COMMENT.match(above[row])):
        annotation = ANNOTATION.match(above[row])
        if annotation:
            parse(block, annotation.group("body"))
            paragraph: list[str] = []
            row -= 1
            while row >= 0 and not above[row].strip():
                row -= 1
            while row >= 0 and above[row].strip():
                paragraph.insert(0, above[row])
                row -= 1
            block.before = " ".join(paragraph)
            return
        row -= 1


def parse(block: Block, body: str) -> None:
    kind, *options = [part.strip() for part in body.split(";")]
    block.kind = kind
    for option in options:
        if option.startswith("file="):
            block.file = option.split("=", 1)[1]
        elif option.startswith("prelude="):
            block.prelude = option.split("=", 1)[1]
        elif option.startswith("run by "):
            block.run_by = option[len("run by ") :]
        else:
            raise ValueError(f"unknown option {option!r} in <!-- check: {body} -->")


def every_block() -> list[Block]:
    return [block for path in documents() for block in blocks_of(path)]


def run_by(test: str) -> list[Block]:
    """The blocks whose annotation says ``run by <test>``, in the order of the pages."""
    return [block for block in every_block() if block.run_by == test]


def saved_as(name: str) -> Block:
    """The one block the reader saves as ``name`` (``file=<name>``)."""
    (block,) = [block for block in every_block() if block.file == name]
    return block


def problems_of(block: Block) -> list[str]:
    """What is wrong with a block's annotation itself (nothing, for a good one)."""
    if block.kind is None:
        return [f"{block.where}: a ```{block.lang} block says nothing of how it is checked"]
    if block.kind not in KINDS:
        return [f"{block.where}: unknown kind {block.kind!r}; use one of {', '.join(KINDS)}"]
    if block.lang not in KINDS[block.kind]:
        return [f"{block.where}: a {block.kind!r} block is written in {KINDS[block.kind]}"]
    if block.kind == "output" and not block.run_by:
        return [f"{block.where}: shown output needs 'run by PATH', the test that compares it"]
    if block.run_by and not (ROOT / block.run_by.split("::")[0]).exists():
        return [f"{block.where}: run by {block.run_by}, which does not exist"]
    if block.file and f"`{block.file}`" not in block.before:
        return [f"{block.where}: saved as {block.file}, which the paragraph above never names"]
    return []
