"""Griffe extension for the API reference: the docstrings' Sphinx roles, read as Markdown.

xlipkit's docstrings are Google style with Sphinx cross-reference roles (``:func:`load_model```,
``:class:`~finetune.config.Recipe```). mkdocstrings renders docstrings as Markdown, where a role would show
as ``:func:`` text. This extension rewrites each role into an optional cross-reference: a link when the
target is on one of the site's API pages, else the name in code (a role may name a private helper or
another library). RST's ``text::`` before a literal block becomes ``text:``.

The docstrings also give parameters that share a meaning on one line (``image_width, text_width: ...``),
which Google style has no form for: each name gets its own entry with the shared text.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj):`(~?)([^`<>]+?)`")
LITERAL_BLOCK_MARKER = re.compile(r"(?<=\S)::$", re.MULTILINE)


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1) == "~", match.group(2).strip()
    shown = target.rsplit(".", 1)[-1] if short else target
    return f'<autoref identifier="{target}" optional><code>{shown}</code></autoref>'


SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Attributes|Keyword Args|Other Parameters):\s*$")
SHARED_ENTRY = re.compile(r"^(\s+)(\w+(?:\s*,\s*\w+)+)\s*(\([^)]*\))?:\s*(.*)$")


def split_shared_entries(text: str) -> str:
    """One entry per name for ``a, b: text`` lines (with their continuation lines) in parameter sections."""
    lines, out, i, section_indent = text.splitlines(), [], 0, None
    while i < len(lines):
        line = lines[i]
        header = SECTION.match(line)
        if header:
            section_indent = len(header.group(1))
            out.append(line)
            i += 1
            continue
        indent = len(line) - len(line.lstrip())
        if line.strip() and section_indent is not None and indent <= section_indent:
            section_indent = None
        entry = SHARED_ENTRY.match(line) if section_indent is not None else None
        if entry is None:
            out.append(line)
            i += 1
            continue
        body, i = [entry.group(4)], i + 1
        while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > len(entry.group(1)):
            body.append(lines[i].strip())
            i += 1
        shared = " ".join(part for part in body if part)
        for name in entry.group(2).split(","):
            out.append(f"{entry.group(1)}{name.strip()}{entry.group(3) or ''}: {shared}")
    return "\n".join(out)


def convert(text: str) -> str:
    """``text`` with every Sphinx role replaced by an optional autorefs link, ``::`` by ``:`` and shared
    parameter entries split."""
    return split_shared_entries(LITERAL_BLOCK_MARKER.sub(":", ROLE.sub(_role, text)))


class SphinxRoles(griffe.Extension):
    """Rewrite the roles of every docstring as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:  # noqa: D102
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)
