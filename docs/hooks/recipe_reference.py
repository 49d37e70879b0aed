"""MkDocs hook: the recipe reference pages, generated at build time from the recipe schema.

``reference/recipe-keys.md`` renders what ``finetune/run.py --schema`` prints (every section, key, type,
default and description, every registered objective term's options, the keys of a dataset entry), and
``reference/recipes.md`` what ``finetune/run.py --list`` prints (the shipped recipes). Both call the
command line's own ``main`` in-process, so the pages can never drift from the schema: a key added to
``finetune/config/`` or a registered term appears on the next build.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

KEYS_PAGE = "reference/recipe-keys.md"
RECIPES_PAGE = "reference/recipes.md"

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj):`~?([^`]+)`")
_ATTRIBUTE = re.compile(r"^    (\w[\w, ]*?):\s*(.*)$")


def _cli_output(argv: list[str]) -> str:
    """What ``finetune/run.py ARGV`` prints to stdout (its exit status must be 0)."""
    from finetune.cli.train import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    if status != 0:
        raise RuntimeError(f"finetune/run.py {' '.join(argv)} exited {status}")
    return out.getvalue()


def _md(text: str) -> str:
    """A schema description as Markdown: Sphinx roles as code spans, ``::`` as ``:``."""
    return re.sub(r"(?<=\S)::$", ":", _ROLE.sub(r"`\1`", text), flags=re.MULTILINE)


def _cell(text: str) -> str:
    """One table cell: a single line, pipes escaped."""
    return " ".join(_md(text).split()).replace("|", "\\|")


def _split_docstring(description: str) -> tuple[str, dict[str, str]]:
    """A class docstring as ``(prose before 'Attributes:', {field: its text})``."""
    head, _, attrs = textwrap.dedent(description).partition("\nAttributes:\n")
    fields: dict[str, str] = {}
    current: list[str] = []
    for line in attrs.splitlines():
        m = _ATTRIBUTE.match(line)
        if m:
            current = [m.group(2)]
            for name in m.group(1).split(","):
                fields[name.strip()] = current  # type: ignore[assignment]
        elif line.startswith("        ") and current:
            current.append(line.strip())
        elif line.strip():
            current = []
    return head.strip(), {k: " ".join(v) for k, v in fields.items()}  # type: ignore[arg-type]


class _Schema:
    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        self.defs = schema.get("$defs", {})

    def resolve(self, node: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in node:
            node = {**self.defs[node["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
        return node

    def objects(self, node: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        """The object schemas with properties a value may be: ``(suffix, object)``; the suffix is ``[]`` for
        list items."""
        node = self.resolve(node)
        if node.get("properties"):
            yield "", node
        for alt in node.get("anyOf", []) + node.get("oneOf", []):
            yield from self.objects(alt)
        if isinstance(node.get("items"), dict):
            for suffix, obj in self.objects(node["items"]):
                yield "[]" + suffix, obj

    def type_of(self, node: dict[str, Any]) -> str:
        node = self.resolve(node)
        alts = node.get("anyOf") or node.get("oneOf")
        if alts:
            return " or ".join(dict.fromkeys(self.type_of(a) for a in alts))
        if "enum" in node:
            return " or ".join(f"`{json.dumps(v)}`" for v in node["enum"])
        if "const" in node:
            return f"`{json.dumps(node['const'])}`"
        kind = node.get("type", "any")
        if kind == "array":
            items = node.get("items")
            return f"list of {self.type_of(items)}" if isinstance(items, dict) else "list"
        if kind == "object":
            if node.get("properties"):
                return "mapping (below)"
            extra = node.get("additionalProperties")
            return f"mapping of {self.type_of(extra)}" if isinstance(extra, dict) else "mapping"
        bounds = [f"{op} {node[key]}" for key, op in (("minimum", "≥"), ("exclusiveMinimum", ">"),
                                                      ("maximum", "≤"), ("exclusiveMaximum", "<"))
                  if key in node]
        return kind + (f" ({', '.join(bounds)})" if bounds else "")


def _anchor(path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def render_recipe_keys(schema: dict[str, Any]) -> str:
    """The Markdown of the recipe key reference for a recipe JSON schema (``finetune/run.py --schema``)."""
    s = _Schema(schema)
    sections: dict[str, dict[str, Any]] = {}  # first path -> {"node", "paths"}
    by_identity: dict[str, str] = {}

    def add(path: str, node: dict[str, Any]) -> str:
        identity = json.dumps(node, sort_keys=True)
        if identity in by_identity:
            first = by_identity[identity]
            sections[first]["paths"].append(path)
            return first
        by_identity[identity] = path
        sections[path] = {"node": node, "paths": [path]}
        for key, prop in node["properties"].items():
            for suffix, obj in s.objects(prop):
                add(f"{path}.{key}{suffix}", obj)
        return path

    for key, prop in schema["properties"].items():
        for suffix, obj in s.objects(prop):
            add(key + suffix, obj)

    lines = [
        "# Recipe keys",
        "",
        "Generated at build time from `xlipkit schema` (the same as `python finetune/run.py --schema`): "
        "every key a recipe may set, its type, default and meaning. Any key can be overridden on the command "
        "line as `key.sub=value`. Unknown keys, wrong types and out-of-range values are recipe errors "
        "(exit 2) that name the key. Save the schema for your editor with "
        "`xlipkit schema > recipe.schema.json`.",
        "",
        "Sections: " + ", ".join(f"[`{k}`](#{_anchor(k)})" for k in schema["properties"]) + ".",
        "",
    ]
    for path, section in sections.items():
        node = section["node"]
        prose, fields = _split_docstring(node.get("description", ""))
        depth = min(2 + path.count("."), 4)
        lines += [f"{'#' * depth} `{path}` {{#{_anchor(path)}}}", ""]
        if len(section["paths"]) > 1:
            lines += ["The same keys at " + ", ".join(f"`{p}`" for p in section["paths"][1:]) + ".", ""]
        if prose:
            lines += [_md(prose), ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for key, prop in node["properties"].items():
            resolved = s.resolve(prop)
            kind = s.type_of(prop)
            nested = [f"{path}.{key}{suffix}" for suffix, _ in s.objects(prop)]
            own = prop.get("description") or (None if nested else resolved.get("description"))
            text = own or fields.get(key, "")
            if not text and nested:  # a term's options: the first line of its class's docstring
                nested_prose = _split_docstring(next(s.objects(prop))[1].get("description", ""))[0]
                text = nested_prose.split("\n\n")[0]
            if nested:
                target = next(first for first, sec in sections.items() if any(p in sec["paths"] for p in nested))
                kind = kind.replace("mapping (below)", f"[mapping](#{_anchor(target)})")
            if "default" in prop:
                default = f"`{json.dumps(prop['default'])}`"
            elif key in node.get("required", []):
                default = "required"
            else:
                default = "(below)" if nested else ""
            lines.append(f"| `{key}` | {_cell(kind)} | {_cell(default)} | {_cell(text)} |")
        lines.append("")
    return "\n".join(lines)


def render_recipe_list(listing: str) -> str:
    """The Markdown of the shipped-recipe page for the output of ``finetune/run.py --list``."""
    rows = []
    for line in listing.splitlines():
        if line.strip():
            name, _, description = line.strip().partition(" ")
            rows.append(f"| `recipes/{name}.yaml` | {_cell(description.strip())} |")
    return "\n".join([
        "# Shipped recipes",
        "",
        "Generated at build time from `xlipkit recipes` (the same as `python finetune/run.py --list`): each "
        "recipe in `recipes/` with the first line of its header comment. The header of each file states the "
        "paper settings it follows and where it departs from them. Run one with "
        "`xlipkit train recipes/NAME.yaml` or `accelerate launch finetune/run.py recipes/NAME.yaml`; every "
        "key is described in [Recipe keys](recipe-keys.md).",
        "",
        "| recipe | what it runs |",
        "|---|---|",
        *rows,
        "",
    ])


def on_files(files: Any, config: Any) -> Any:
    """Add the two generated pages to the site."""
    from mkdocs.structure.files import File

    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    schema = json.loads(_cli_output(["--schema"]))
    files.append(File.generated(config, KEYS_PAGE, content=render_recipe_keys(schema)))
    files.append(File.generated(config, RECIPES_PAGE, content=render_recipe_list(_cli_output(["--list"]))))
    return files
