"""Reading and writing recipe YAML: ``yaml.safe_load`` semantics with the size of a document bounded (bytes,
keys and values as written, and what YAML aliases expand to) before the document is built
(:func:`safe_load_yaml`), duplicate keys refused with their lines, and the resolved
recipe written back as plain YAML that loads to the same recipe (:func:`dump_recipe`, ``recipe.yaml`` in a
run folder; ``hub.token`` never written, storage credentials and those inside URLs masked)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from finetune.config.errors import SECTION_TYPES, KeyPath, RecipeError, _alias, _dotted
from finetune.config.secrets import clean_recipe, mask_secrets, secret_values, without_secrets
from finetune.files import process_tag


#: the most values a YAML document may hold once its aliases are expanded (a recipe holds hundreds)
MAX_YAML_VALUES = 100_000
#: the largest recipe file, and the most text all command-line overrides may hold together, in bytes: 200 times the
#: largest shipped recipe (5.3 kB). A 50 MB recipe of 3.3 million keys took 7.5 minutes and 3.9 GB before its
#: error and is now refused from its size before it is read; the slowest documents under the bound (1 MB of blank
#: lines or of one comment) take PyYAML 1.5 to 3 s on a shared 2-core CPU, 2 to 5 times the load of the largest
#: shipped recipe measured in the same run (bench/recipe_size.py)
MAX_RECIPE_BYTES = 1 << 20
#: the most keys and values a YAML document may hold as written (the shipped recipes hold a few hundred; 20,000
#: take PyYAML about a second to read)
MAX_RECIPE_VALUES = 20_000
#: the most command-line overrides one run may take
MAX_OVERRIDES = 1_000
#: how to keep a recipe small, for the messages
_SMALLER = ("list long things in files the recipe names (a captions file, an ids file), or write shard URLs as "
            "brace patterns (shards-{000000..000999}.tar)")


class YAMLLimitError(yaml.YAMLError):
    """A YAML document past one of the bounds of this module (:class:`YAMLAliasError`, :class:`YAMLSizeError`).

    Attributes:
        problem: what is wrong and what to do.
        problem_mark: where (the line), or None.
    """

    def __init__(self, problem: str, line: int | None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.problem_mark = yaml.Mark("", 0, line - 1, 0, None, None) if line else None


class YAMLAliasError(YAMLLimitError):
    """YAML aliases that expand past :data:`MAX_YAML_VALUES` values (a "billion laughs" document) or
    refer to themselves."""


class YAMLSizeError(YAMLLimitError):
    """A YAML document larger than :data:`MAX_RECIPE_BYTES` bytes or with more than :data:`MAX_RECIPE_VALUES` keys
    and values as written, refused before it is read (bytes) or as soon as the bound is passed (values)."""


def check_yaml_size(text: str) -> None:
    """Refuse a YAML text of more than :data:`MAX_RECIPE_BYTES` bytes before it is parsed.

    Raises:
        YAMLSizeError: naming the size and the bound.
    """
    if len(text) > MAX_RECIPE_BYTES // 4 and len(text.encode("utf-8")) > MAX_RECIPE_BYTES:
        raise YAMLSizeError(f"the YAML is {len(text.encode('utf-8')):,} bytes, more than the {MAX_RECIPE_BYTES:,} a "
                            f"recipe may hold (the shipped ones hold about 5 kB); {_SMALLER}", None)


class BoundedSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that counts the keys and values it composes (at most ``max_values``: the parse stops
    there, :class:`YAMLSizeError`) and notes where aliases are used, so that :func:`check_aliases` can bound
    what they expand to before anything walks or copies the document."""

    def __init__(self, stream: Any, max_values: int = MAX_RECIPE_VALUES) -> None:
        super().__init__(stream)
        self.alias_lines: list[int] = []
        self.max_values = max_values
        self.values = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.alias_lines.append(self.peek_event().start_mark.line + 1)
        else:
            self.values += 1
            if self.values > self.max_values:
                line = self.peek_event().start_mark.line + 1
                raise YAMLSizeError(f"the YAML holds more than {self.max_values:,} keys and values, far more than any "
                                    f"recipe (the shipped ones hold a few hundred); {_SMALLER}", line)
        return super().compose_node(parent, index)


def check_aliases(node: yaml.Node, alias_lines: Sequence[int], limit: int = MAX_YAML_VALUES) -> None:
    """Count the values of the composed document ``node`` as its aliases expand them, in time linear in
    the distinct nodes (each node's expanded size is computed once).

    Raises:
        YAMLAliasError: more than ``limit`` values, or an alias inside the node it refers to.
    """
    if not alias_lines:
        return
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    open_: set[int] = set()
    while stack:
        current, done = stack.pop()
        key = id(current)
        children = ([n for pair in current.value for n in pair] if isinstance(current, yaml.MappingNode)
                    else list(current.value) if isinstance(current, yaml.SequenceNode) else [])
        if done:
            open_.discard(key)
            sizes[key] = min(limit + 1, 1 + sum(sizes[id(c)] for c in children))
            continue
        if key in sizes:
            continue
        if key in open_:
            raise YAMLAliasError("a YAML alias refers to the value that contains it (a recursive document); "
                                 "write the value out", alias_lines[0])
        open_.add(key)
        stack.append((current, True))
        for child in children:
            if id(child) in open_:
                raise YAMLAliasError("a YAML alias refers to the value that contains it (a recursive document); "
                                     "write the value out", alias_lines[0])
            if id(child) not in sizes:
                stack.append((child, False))
    if sizes[id(node)] > limit:
        raise YAMLAliasError(f"YAML aliases (`*name`, first on line {alias_lines[0]}) expand to more than "
                             f"{limit:,} values, far more than any recipe holds (an alias bomb?); write the values "
                             "out or use fewer aliases", alias_lines[0])


def safe_load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)`` with aliases bounded (:func:`check_aliases`) before the data is built.

    Raises:
        yaml.YAMLError: invalid YAML, or a :class:`YAMLLimitError` (too large, or an alias bomb).
    """
    check_yaml_size(text)
    loader = BoundedSafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check_aliases(node, loader.alias_lines)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _compose(text: str, file: str) -> tuple[Any, yaml.Node | None]:
    """Parse YAML once, keeping both the node tree (for line numbers) and the safe-loaded data; the size
    (:func:`check_yaml_size`, :class:`BoundedSafeLoader`) and the aliases (:func:`check_aliases`) are bounded
    before anything walks or builds the document."""
    try:
        check_yaml_size(text)
    except YAMLSizeError as exc:
        raise RecipeError(f"{file}: {exc.problem}", file=file) from None
    loader = BoundedSafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        check_aliases(node, loader.alias_lines)
        _reject_duplicates(node, file)
        data = loader.construct_document(node)
    except RecursionError:
        raise RecipeError(f"{file}: the YAML is nested too deeply to read; a recipe has a few levels of sections",
                          file=file) from None
    except YAMLLimitError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark is not None else None
        raise RecipeError(f"{file}{f', line {line}' if line else ''}: {exc.problem}", file=file, line=line) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        where = f"{file}, line {line}" if line else file
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError(f"{where}: invalid YAML ({problem}); fix the syntax there "
                          f"(indentation, `key: value`, quotes)", file=file, line=line) from None
    finally:
        loader.dispose()
    return data, node


def _reject_duplicates(node: yaml.Node, file: str, path: KeyPath = ()) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = getattr(key_node, "value", None)
            line = key_node.start_mark.line + 1
            if key in seen:
                dotted = _dotted(path + (key,))
                raise RecipeError(f"{file}, line {line}: `{dotted}` is given twice (first on line {seen[key]}); "
                                  f"keep one", file=file, line=line, key=dotted)
            seen[key] = line
            _reject_duplicates(value_node, file, path + (key,))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _reject_duplicates(item, file, path + (i,))



def _first_comment(text: str) -> str:
    """The recipe's description: its first comment line, skipping an editor modeline
    (``# yaml-language-server: $schema=...``)."""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment = stripped.lstrip("#").strip()
            if not comment.startswith("yaml-language-server:"):
                return comment
    return ""


# -- writing --------------------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """Plain YAML-able data: sections and options classes become mappings (under their YAML
    keys), tuples lists."""
    entry = getattr(value, "recipe_entry", None)
    if callable(entry):  # a typed dataset entry (finetune.data.sources.SourceSpec): the keys it was given
        return _plain(entry())
    if isinstance(value, BaseModel):
        return _plain(value.model_dump(by_alias=True))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        hints = typing.get_type_hints(type(value), include_extras=True)
        return {(_alias(hints.get(f.name)) or f.name): _plain(getattr(value, f.name))
                for f in dataclasses.fields(value) if not f.metadata.get("meta")}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def recipe_to_dict(recipe: Any, *, keep_secrets: bool = False) -> dict[str, Any]:
    """The recipe as plain YAML-able data (sections only, under their YAML keys; tuples become
    lists).

    Unless ``keep_secrets`` is true, ``hub.token`` is dropped and every storage credential
    (``data.*.options.storage_options``: ``key``, ``secret``, ``token``, headers, ...) and every credential
    inside a URL is masked as ``***`` (:func:`finetune.config.secrets.clean_recipe`): this is what
    ``recipe.yaml``, ``metrics.json``, ``final/xlipkit.json`` and the checkpoints hold.
    """
    out = _plain(recipe)
    return out if keep_secrets else clean_recipe(out)


def dump_recipe(recipe: Any, path: str | os.PathLike[str]) -> Path:
    """Write the resolved recipe as YAML, atomically (temp file + ``os.replace``).

    The first line is the recipe's description comment, so the file lists and loads like any
    recipe; ``hub.token`` is never written: overrides that set it are left out of the header, and section
    overrides are written without it (``hub={repo_id: me/x}`` for ``'hub={token: X, repo_id: me/x}'``); so are
    storage credentials, which the body shows as ``***`` (:func:`recipe_to_dict`), as it does the credentials
    inside URLs. Returns the path written.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    header = [f"# {recipe.description or 'resolved recipe'}"]
    if recipe.source:
        header.append(f"# resolved from {recipe.source}")
    shown = [o for o in map(without_secrets, recipe.overrides) if o is not None]
    if shown:
        header.append("# overrides: " + " ".join(shown))
    secrets = secret_values(recipe_to_dict(recipe, keep_secrets=True))
    header = [mask_secrets(line, secrets) for line in header]
    body = yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, allow_unicode=True, default_flow_style=None)
    # the writer's PID@HOST in the name: another run's cleanup leaves it alone while this process lives
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.{process_tag()}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("\n".join(header) + "\n" + body)
            fh.flush()
            os.fsync(fh.fileno())
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600: give the file the user's usual permissions
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def is_dumped_recipe(text: str) -> bool:
    """Whether ``text`` is a ``recipe.yaml`` as :func:`dump_recipe` writes it (the header it writes, then every
    section dumped as it dumps them), not a recipe a person wrote: a run may replace the one, never the other."""
    lines = text.splitlines(keepends=True)
    header = 0
    while header < len(lines) and lines[header].startswith("#"):
        if header and not lines[header].startswith(("# resolved from ", "# overrides: ")):
            return False
        header += 1
    body = "".join(lines[header:])
    try:
        data = safe_load_yaml(body)
    except (yaml.YAMLError, ValueError):
        return False
    if not header or not isinstance(data, dict) or not SECTION_TYPES:
        return False
    sections = [f.name for f in dataclasses.fields(SECTION_TYPES[0]) if not f.metadata.get("meta")]
    return list(data) == sections and body == yaml.safe_dump(data, sort_keys=False, allow_unicode=True,
                                                             default_flow_style=None)


def list_recipes(folder: str | os.PathLike[str] = "recipes") -> list[tuple[str, str]]:
    """The recipes in ``folder`` as ``(name, description)`` pairs, sorted by name; the name is the
    file name without ``.yaml`` / ``.yml`` and the description its first comment line."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"recipe folder not found: {root}; run from the repository root "
                                f"or give the folder that holds the YAML recipes")
    out = []
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix in (".yaml", ".yml"):
            out.append((p.stem, _first_comment(p.read_text(encoding="utf-8"))))
    return out
