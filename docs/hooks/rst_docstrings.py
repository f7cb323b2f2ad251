"""Griffe extension: the package's docstrings are reStructuredText, the site Markdown.

The docstrings use Sphinx roles (``:class:`Settings```, ``:meth:`release```) and
``::`` literal blocks. mkdocstrings renders a docstring's text as Markdown, where
those show up verbatim, so this rewrites each docstring as it is loaded: a role
becomes inline code, a ``::`` paragraph ending introduces a fenced Python block, and
reST's double backquotes become single ones. The package's source is left as it is.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|meth|func|mod|data|attr|exc|obj):`~?\.?([^`]+)`")
DOUBLE_BACKQUOTES = re.compile(r"``([^`]+)``")


def markdown_of(text: str) -> str:
    text = ROLE.sub(lambda found: f"`{found.group(1)}`", text)
    text = DOUBLE_BACKQUOTES.sub(r"`\1`", text)
    lines = text.splitlines()
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.rstrip().endswith("::") and not line.strip().startswith(".."):
            intro = line.rstrip()[:-2].rstrip()
            out.append(intro + ":" if intro else "")
            index += 1
            block: list[str] = []
            while index < len(lines) and (not lines[index].strip() or lines[index][:1] == " "):
                block.append(lines[index])
                index += 1
            while block and not block[-1].strip():
                block.pop()
            while block and not block[0].strip():
                block.pop(0)
            indent = min(len(b) - len(b.lstrip()) for b in block if b.strip()) if block else 0
            out += ["", "```python", *(b[indent:] for b in block), "```", ""]
            continue
        out.append(line)
        index += 1
    return "\n".join(out)


class RstDocstrings(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_of(obj.docstring.value)
