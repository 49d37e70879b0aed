"""The architecture page (docs/architecture.md) stays true to the code: its layout names every module and package of
``finetune/`` under its own package, and no module that is not there.

The layout block is read as it is written: ``finetune/`` and its packages are entries (``data/``, ``models/`` and,
indented below it, ``core/``), each followed by its description; a package inside a description is named with its
modules in parentheses (``streams/ (urls, tar, ...)``). A package's own text is its entry and description without
the text of the packages inside it, so a module named only under another package does not count.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "architecture.md"
#: files that are not modules a reader looks for: a package's own namespace and its ``python -m`` entry
NOT_NAMED = {"__init__.py", "__main__.py"}


def layout_block(page: str) -> list[str]:
    """The lines of the code block under ``## Layout``."""
    section = page.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1].strip("\n").splitlines()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _entry_section(lines: list[str], name: str, deeper_than: int = -1) -> list[str] | None:
    """The lines of entry ``name/`` (the first token of a line indented more than ``deeper_than``, not followed by
    parentheses, which name a package inline) and of every following line indented more than it, or None."""
    for i, line in enumerate(lines):
        words = line.split()
        inline = line.lstrip()[len(name) + 1:].lstrip().startswith("(")
        if words and _indent(line) > deeper_than and words[0] == f"{name}/" and not inline:
            end = i + 1
            while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > _indent(line)):
                end += 1
            return lines[i:end]
    return None


def _inline(text: str, name: str) -> re.Match | None:
    """``name/ (...)`` inside a description: the package's modules in parentheses (no nesting)."""
    return re.search(rf"(?<![\w/.-]){re.escape(name)}/\s*\(([^()]*)\)", text)


def package_texts(lines: list[str], root: Path) -> dict[Path, str]:
    """``{package folder: its own text on the page}`` for ``root`` (``finetune/``) and every package below it that
    the page names; a package it does not name is left out."""
    texts: dict[Path, str] = {}

    def visit(folder: Path, own: list[str] | None, text: str | None) -> None:
        """``own``: the package's lines (an entry and what is indented below it); ``text``: inline parentheses."""
        body = " ".join(own) if own is not None else text or ""
        for child in sorted(p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file()):
            nested = _entry_section(own[1:], child.name, _indent(own[0])) if own is not None else None
            if nested is not None:
                body = body.replace(" ".join(nested), " ")
                visit(child, nested, None)
                continue
            match = _inline(body, child.name)
            if match is not None:
                body = body[:match.start()] + " " + body[match.end():]
                visit(child, None, match.group(1))
        texts[folder] = body

    visit(root, _entry_section(lines, root.name), None)
    return texts


def _named(text: str, stem: str, with_suffix: bool) -> bool:
    suffix = r"\.py" if with_suffix else r"(\.py)?"
    return re.search(rf"(?<![\w/.-]){re.escape(stem)}{suffix}(?![\w])", text) is not None


def unnamed_modules(page: str, root: Path = REPO / "finetune") -> list[str]:
    """Every package of ``root`` the layout does not name, and every module it does not name under its own package
    (``finetune/``'s own modules by their file name, ``run.py``; a package's by its name, ``loader``)."""
    texts = package_texts(layout_block(page), root)
    missing = []
    for folder in sorted({root, *(p.parent for p in root.rglob("__init__.py"))}):
        rel = folder.relative_to(root.parent).as_posix()
        if folder not in texts:
            missing.append(f"{rel}/ (the package)")
            continue
        for module in sorted(folder.glob("*.py")):
            if module.name not in NOT_NAMED and not _named(texts[folder], module.stem, with_suffix=folder == root):
                missing.append(f"{rel}/{module.name}")
    return missing


def stale_modules(page: str, root: Path = REPO / "finetune") -> list[str]:
    """The ``name.py`` files the layout names under a package of ``root`` where no such file is."""
    texts = package_texts(layout_block(page), root)
    return sorted(f"{folder.relative_to(root.parent).as_posix()}/{name}" for folder, text in texts.items()
                  for name in set(re.findall(r"(?<![\w/.-])(\w+\.py)\b", text)) if not (folder / name).is_file())


def test_the_architecture_page_names_every_module_of_finetune():
    missing = unnamed_modules(PAGE.read_text(encoding="utf-8"))
    assert not missing, "name these in the layout of docs/architecture.md, under their package:\n" + "\n".join(missing)


def test_the_architecture_page_names_no_module_that_is_not_there():
    stale = stale_modules(PAGE.read_text(encoding="utf-8"))
    assert not stale, "docs/architecture.md names modules that are not there:\n" + "\n".join(stale)


def test_the_check_finds_a_module_left_out_and_one_named_under_another_package():
    page = PAGE.read_text(encoding="utf-8")
    without = page.replace("prefetch.py (batches to the device on a side stream, pixels\n", "(\n", 1)
    assert without != page and unnamed_modules(without) == ["finetune/data/prefetch.py"]
    moved = page.replace("streams/ (urls, remote,", "streams/ (urls,", 1).replace("bad_rows.py", "bad_rows.py, remote", 1)
    assert "finetune/data/streams/remote.py" in unnamed_modules(moved)  # named under data/, not under streams/
    renamed = page.replace("step.py (TrainStep", "stepper.py (TrainStep", 1)
    assert stale_modules(renamed) == ["finetune/training/stepper.py"]
