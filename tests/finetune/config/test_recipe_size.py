"""Recipes and overrides have a size limit (issue 31 item 12): a 50 MB recipe of 3.3M keys took 7.5 minutes and
3.9 GB before its error. Bytes are checked before the file is read, keys and values as PyYAML composes them (the
parse stops at the bound), overrides before any is parsed. The CPU proxy of "before anything slow": the parser is
never called for a file over the byte limit, and stops at the value that passes the value limit."""

from __future__ import annotations

import pytest
import yaml

import finetune.config.schema as schema
from finetune.config import RecipeError, load_recipe
from finetune.config.io import (MAX_OVERRIDES, MAX_RECIPE_BYTES, MAX_RECIPE_VALUES, BoundedSafeLoader,
                                YAMLSizeError, safe_load_yaml)
from finetune.runs.errors import RunFolderError
from finetune.runs.identity import read_run_recipe


def _keys(n: int) -> str:
    return "# many keys\ntrain:\n" + "".join(f"  k{i}: {i}\n" for i in range(n))


def test_a_recipe_over_the_byte_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = tmp_path / "big.yaml"
    text = _keys(80_000)  # about 1.1 MB: the recipe, scaled to just past the bound
    assert len(text.encode()) > MAX_RECIPE_BYTES
    path.write_text(text)

    def never(*args, **kwargs):
        raise AssertionError("the recipe was parsed")

    monkeypatch.setattr(schema, "_compose", never)
    with pytest.raises(RecipeError, match=rf"^{path}: the recipe is {len(text.encode()):,} bytes, more than the "
                                          r"1,048,576 a recipe may hold .*brace patterns") as info:
        load_recipe(path)
    assert info.value.file == str(path)


def test_a_sparse_50_mb_recipe_is_refused_at_once(tmp_path):
    path = tmp_path / "huge.yaml"
    with open(path, "wb") as handle:
        handle.truncate(50 * 2**20)  # 50 MB of nothing on disk: only its size is looked at
    with pytest.raises(RecipeError, match=r"the recipe is 52,428,800 bytes, more than the 1,048,576"):
        load_recipe(path)


def test_a_recipe_with_too_many_keys_is_refused_where_it_passes_the_bound(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(_keys(MAX_RECIPE_VALUES))  # 40,003 values, under the byte limit
    assert path.stat().st_size < MAX_RECIPE_BYTES
    # values: the root mapping, `train`, its mapping, then `k0`, 0, `k1`, 1, ... from line 3: value 20,001 is the
    # key k9998, on line 3 + 9,998; the parse stops there
    line = 3 + (MAX_RECIPE_VALUES + 1 - 4) // 2
    with pytest.raises(RecipeError, match=rf"^{path}, line {line}: the YAML holds more than 20,000 keys and values, "
                                          r"far more than any recipe") as info:
        load_recipe(path)
    assert info.value.line == line


def test_the_loader_stops_composing_at_the_bound():
    loader = BoundedSafeLoader("[" + ", ".join(["1"] * 100) + "]", max_values=10)
    with pytest.raises(YAMLSizeError, match="more than 10 keys and values"):
        loader.get_single_node()
    assert loader.values == 11
    loader.dispose()


def test_shipped_sized_recipes_still_load(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("# fine\n" + yaml.safe_dump({"eval": {"sets": [{"name": "synthetic", "size": 8}] * 200}}))
    assert len(load_recipe(path).eval.sets) == 200


@pytest.mark.slow
def test_overrides_are_bounded_in_number_and_bytes(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("# r\ntrain: {lr: 1.0e-5}\n")
    with pytest.raises(RecipeError, match=rf"^{MAX_OVERRIDES + 1:,} command-line overrides, more than the 1,000"):
        load_recipe(path, ["train.lr=1e-5"] * (MAX_OVERRIDES + 1))
    secret = "x" * (MAX_RECIPE_BYTES + 1)
    total = len("train.lr=1e-5") + len(f"hub.token={secret}")
    with pytest.raises(RecipeError, match=rf"^the command-line overrides hold {total:,} bytes, more than the "
                                          r"1,048,576 .*the longest sets `hub.token`") as info:
        load_recipe(path, ["train.lr=1e-5", f"hub.token={secret}"])
    assert secret not in str(info.value) and info.value.key == "hub.token"
    many = "[" + ",".join(["1"] * (MAX_RECIPE_VALUES + 1)) + "]"
    with pytest.raises(RecipeError, match=r"command-line override `eval.sets=.*`: the YAML holds more than 20,000"):
        load_recipe(path, [f"eval.sets={many}"])


def test_a_run_folders_recipe_is_bounded_too(tmp_path):
    (tmp_path / "recipe.yaml").write_text(_keys(80_000))
    with pytest.raises(RunFolderError, match=r"recipe.yaml is not a readable recipe \(the YAML is [\d,]+ bytes, more "
                                             r"than the 1,048,576"):
        read_run_recipe(tmp_path)
    with pytest.raises(YAMLSizeError, match="more than 20,000 keys and values"):
        safe_load_yaml(_keys(MAX_RECIPE_VALUES))
