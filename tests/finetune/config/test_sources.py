"""Dataset entries are typed once, at load time (issue 25 item 3): ``data.train`` and every ``eval.sets``
entry is a ``SourceSpec`` after ``load_recipe``, the resolved recipe writes them back as written, and the
errors still name the recipe key before anything slow starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from finetune.config import RecipeError, dump_recipe, load_recipe, parse_sources, recipe_to_dict
from finetune.data.sources import SourceSpec

REPO = Path(__file__).resolve().parents[3]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_entries_are_typed_specs_after_loading(tmp_path):
    recipe = load_recipe(write(tmp_path, "# r\ndata:\n  train: {format: webdataset, urls: 'shards/{0..3}.tar'}\n"
                                         "  num_workers: 0\neval:\n  sets: [docci:goal, {name: synthetic, size: 8}]\n"
                                         "train:\n  max_steps: 4\n"))
    train = recipe.data.train
    assert isinstance(train, SourceSpec) and train.name == "webdataset" and train.is_stream
    assert all(isinstance(s, SourceSpec) for s in recipe.eval.sets)
    assert (recipe.eval.sets[0].name, recipe.eval.sets[0].protocol) == ("docci", "goal")
    assert recipe.eval.sets[1].size == 8 and recipe.eval.sets[1].seed == 0
    # read access by key keeps working for code written when entries were mappings
    assert train["urls"] == "shards/{0..3}.tar" and dict(recipe.eval.sets[0]) == {"name": "docci", "protocol": "goal"}


def test_the_resolved_recipe_writes_entries_as_written_and_loads_back_equal(tmp_path):
    path = write(tmp_path, "# r\ndata:\n  train: {format: webdataset, urls: 'shards/{0..3}.tar'}\n"
                           "eval:\n  sets: [docci:goal, urban1k, {name: synthetic, size: 8, seed: 0}]\n"
                           "train:\n  max_steps: 4\n")
    recipe = load_recipe(path)
    out = dump_recipe(recipe, tmp_path / "run" / "recipe.yaml")
    written = yaml.safe_load(out.read_text())
    assert written["data"]["train"] == {"format": "webdataset", "urls": "shards/{0..3}.tar"}
    assert written["eval"]["sets"] == [{"name": "docci", "protocol": "goal"}, {"name": "urban1k"},
                                       {"name": "synthetic", "size": 8, "seed": 0}]
    again = load_recipe(out)
    assert again == recipe and recipe_to_dict(again) == recipe_to_dict(recipe)


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_recipe_round_trips_through_its_dump(path, tmp_path):
    recipe = load_recipe(path)
    again = load_recipe(dump_recipe(recipe, tmp_path / "recipe.yaml"))
    assert again == recipe
    assert recipe_to_dict(again) == recipe_to_dict(recipe)
    assert isinstance(again.data.train, SourceSpec) and all(isinstance(s, SourceSpec) for s in again.eval.sets)


def test_a_spec_built_in_code_is_checked_and_written_without_defaults(tmp_path):
    from finetune.config import DataConfig

    data = DataConfig(train=SourceSpec(name="synthetic", size=16))
    assert data.train == SourceSpec(name="synthetic", size=16)
    assert dict(data.train) == {"name": "synthetic", "size": 16}
    with pytest.raises(RecipeError, match=r"`data.train.path` is set, but the source 'synthetic' takes no path"):
        DataConfig(train=SourceSpec(name="synthetic", path="x"))


def test_entry_errors_name_the_key_at_load_time(tmp_path):
    with pytest.raises(RecipeError, match=r"line 3: `data.train.sze` is not a recipe key: did you mean "
                                          r"`data.train.size`\?"):
        load_recipe(write(tmp_path, "# r\ndata:\n  train: {name: synthetic, sze: 8}\n"))
    with pytest.raises(RecipeError, match=r"`eval.sets.0` is a stream; only `data.train` can be read as a stream"):
        load_recipe(write(tmp_path, "# r\neval:\n  sets: [{format: webdataset, urls: a.tar}]\n"))
    with pytest.raises(RecipeError, match=r"`--sets.1` is 'nope', not a registered data source"):
        parse_sources(["docci", "nope"], "--sets")
    assert [s.name for s in parse_sources("docci,urban1k".split(","), "--sets")] == ["docci", "urban1k"]
