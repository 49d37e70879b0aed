"""The documentation site (mkdocs.yml, docs/): it builds in strict mode, its recipe reference covers every
key of the recipe schema and every shipped recipe, and a broken link or a stale API name fails the build."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, REPO / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, env=env, cwd=config.parent, timeout=600)


def _nav_pages(nav: Any) -> Iterator[str]:
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            yield from _nav_pages(value)
        else:
            yield value


def _directive(page: Path, name: str) -> str:
    """The identifier of the first ``::: identifier`` of ``page`` that ends in ``name``."""
    found = re.search(rf"^::: ([\w.]+\.{name})$", page.read_text(encoding="utf-8"), re.MULTILINE)
    assert found, f"{page} documents no {name}"
    return found.group(1)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = _build(REPO / "mkdocs.yml", out)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


@pytest.mark.slow
def test_the_site_builds_in_strict_mode_with_every_nav_page(site):
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    pages = list(_nav_pages(nav))
    assert len(pages) >= 30
    for page in pages:
        html = site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert html.is_file(), f"nav page {page} was not built"
    assert (site / "images" / "quickstart_loss.png").is_file() and (site / "images" / "fcast_hierarchy.png").is_file()
    assert not (site / "hooks").exists(), "the build hooks must not be published"


def test_the_api_reference_is_generated_from_the_docstrings_without_raw_sphinx_roles(site):
    models = (site / "reference/api/models/index.html").read_text(encoding="utf-8")
    load_model = _directive(REPO / "docs/reference/api/models.md", "load_model")
    assert f'id="{load_model}"' in models
    assert "name_or_path" in models and "max_text_len" in models  # the signature and its parameters
    losses = (site / "reference/api/losses/index.html").read_text(encoding="utf-8")
    for name in ("clip_loss", "siglip_loss", "StructXLIPLoss", "tsl_loss", "GRMHead", "flair_loss", "fcast_loss"):
        assert re.search(rf'id="losses\.\w+\.{name}"', losses), name
    for page in (site / "reference/api").rglob("index.html"):
        text = page.read_text(encoding="utf-8")
        assert not re.search(r":(func|class|meth|mod|attr|data|exc):", text), f"a raw Sphinx role in {page}"
    # DualEncoder.sentence_spans's :func:`finetune.data.text.split_sentences` became a link to that function
    assert re.search(r'<a class="autorefs autorefs-internal"[^>]*href="#finetune\.data\.text\.split_sentences"', models)


def test_the_readme_style_nested_lists_of_the_method_pages_render_nested(site):
    fastgoal = (site / "methods/fastgoal/index.html").read_text(encoding="utf-8")
    flism_item = fastgoal[fastgoal.index("<li><strong>FLISM</strong>"):]
    assert flism_item.index("<ul>") < flism_item.index("</li>"), "FLISM's sub-list was flattened into its parent"
    hook = _module("nested_lists")
    text = "- a\n  - b\n    continued\n      - c\n\n```\n  - code\n```\n    - already four\n"
    assert hook.nest_two_space_lists(text) == (
        "- a\n    - b\n    continued\n            - c\n\n```\n  - code\n```\n    - already four\n")


def test_the_generated_recipe_pages_are_in_the_site(site):
    keys = (site / "reference/recipe-keys/index.html").read_text(encoding="utf-8")
    assert 'id="objective-terms-structxlip-regions"' in keys and "name_or_path" in keys
    recipes = (site / "reference/recipes/index.html").read_text(encoding="utf-8")
    assert "recipes/quickstart.yaml" in recipes


def _schema_keys(schema: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """Every ``(section path, key)`` of the recipe JSON schema, walked independently of the renderer."""
    defs = schema["$defs"]

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[-1]]
        return node

    def objects(node: dict[str, Any], suffix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
        node = resolve(node)
        if node.get("properties"):
            yield suffix, node
        for alt in node.get("anyOf", []):
            yield from objects(alt, suffix)
        if isinstance(node.get("items"), dict):
            yield from objects(node["items"], suffix + "[]")

    def walk(path: str, node: dict[str, Any]) -> Iterator[tuple[str, str]]:
        for key, prop in node["properties"].items():
            yield path, key
            for suffix, obj in objects(prop):
                yield from walk(f"{path}.{key}{suffix}", obj)

    for section, prop in schema["properties"].items():
        for suffix, obj in objects(prop):
            yield from walk(section + suffix, obj)


def _section_text(page: str, path: str) -> str:
    """The part of the generated page that documents the keys at ``path`` (its own section, or the one
    that says it holds "the same keys at" it)."""
    blocks = re.split(r"\n(?=#{2,4} `)", page)
    for block in blocks:
        heading = block.splitlines()[0]
        if heading.split("`")[1:2] == [path] or f"`{path}`" in block.split("\n\n")[1]:
            return block
    raise AssertionError(f"no section for {path!r} in the recipe reference")


def test_the_recipe_reference_documents_every_key_of_finetune_run_schema():
    hook = _module("recipe_reference")
    schema = json.loads(hook._cli_output(["--schema"]))
    page = hook.render_recipe_keys(schema)
    keys = list(_schema_keys(schema))
    assert len(keys) > 150
    for path, key in keys:
        assert f"| `{key}` |" in _section_text(page, path), f"recipe key {path}.{key} is not in the reference"
    for term in schema["$defs"]["ObjectiveConfig"]["properties"]["terms"]["properties"]:
        assert f"#### `objective.terms.{term}`" in page  # every registered term has its own section
    train = _section_text(page, "train")
    assert re.search(r"\| `lr` \| number \(> 0\.0\) \| `5e-06` \| peak learning rate \(AdamW\) \|", train)


def test_the_shipped_recipes_page_lists_every_recipe_with_its_description():
    from finetune.config import list_recipes
    from finetune.cli.train import RECIPES_DIR

    hook = _module("recipe_reference")
    page = hook.render_recipe_list(hook._cli_output(["--list"]))
    shipped = list_recipes(RECIPES_DIR)
    assert len(shipped) >= 25
    for name, description in shipped:
        assert f"| `recipes/{name}.yaml` | {description} |" in page


def test_sphinx_roles_and_shared_parameters_become_markdown():
    roles = _module("sphinx_roles")
    text = roles.convert("See :func:`~finetune.models.finetuned.load_model` and :class:`Recipe`::\n\n"
                         "Args:\n    a, b: the two widths\n        of the towers.\n    c: own.\n")
    assert ('<autoref identifier="finetune.models.finetuned.load_model" optional><code>load_model</code></autoref>'
            in text)
    assert '<autoref identifier="Recipe" optional><code>Recipe</code></autoref>:\n' in text
    assert "    a: the two widths of the towers.\n    b: the two widths of the towers.\n    c: own." in text


@pytest.mark.slow
@pytest.mark.parametrize("breakage", ["missing_page_and_anchor", "stale_api_name"])
def test_a_broken_link_or_a_stale_api_name_fails_the_strict_build(breakage, tmp_path):
    """A link to a missing page and one to a missing API anchor are both named by one strict build (both are
    warnings); a stale ``:::`` name stops mkdocstrings at once, so it gets a build of its own."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(REPO / "docs", root / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    for package in ("finetune", "losses", "recipes"):
        (root / package).symlink_to(REPO / package)
    if breakage == "missing_page_and_anchor":
        kps = root / "docs" / "methods" / "kps.md"
        anchor = re.search(r"\(\.\./reference/api/\w+\.md(#[\w.]+)\)", kps.read_text()).group(1)
        # a link into the API reference whose object is not there, and a link to a page that does not exist
        edits = [("guides/cli.md", "(scaling.md)", "(scalling.md)"), ("methods/kps.md", anchor, anchor + "_renamed")]
    else:  # `::: finetune...load_model` naming a function that no longer exists
        old = _directive(root / "docs" / "reference/api/models.md", "load_model")
        edits = [("reference/api/models.md", old, old + "_renamed")]
    for page, old, new in edits:
        text = (root / "docs" / page).read_text(encoding="utf-8")
        assert old in text
        (root / "docs" / page).write_text(text.replace(old, new, 1), encoding="utf-8")
    proc = _build(root / "mkdocs.yml", tmp_path / "site")
    assert proc.returncode != 0
    for _, _, new in edits:
        assert new.lstrip("(#").rstrip(")") in proc.stdout + proc.stderr
