"""MkDocs hook: nested lists written with 2-space indentation, as in the README, render nested.

GitHub (CommonMark) nests a list item indented by 2 spaces under the item above it; Python-Markdown, which
MkDocs uses, needs 4 and otherwise flattens the nested list into its parent. The method pages are seeded
from the README, so this hook doubles the indentation of list markers indented by 2, 6, 10, ... spaces
(outside fenced code) before the page is rendered. Indentation that is a multiple of 4 is left alone.
"""

from __future__ import annotations

import re
from typing import Any

_MARKER = re.compile(r"^( +)([-*+]|\d+\.) ")
_FENCE = re.compile(r"^\s*(```|~~~)")


def nest_two_space_lists(markdown: str) -> str:
    """``markdown`` with 2-space-style nested list markers re-indented for Python-Markdown."""
    out, fenced = [], False
    for line in markdown.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
        m = None if fenced else _MARKER.match(line)
        if m and len(m.group(1)) % 4 == 2:
            line = " " * (2 * len(m.group(1))) + line[len(m.group(1)):]
        out.append(line)
    return "\n".join(out)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Re-indent each page's nested lists before it is rendered."""
    return nest_two_space_lists(markdown)
