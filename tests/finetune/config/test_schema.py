"""Recipes: schema defaults, typed overrides, every error message, dump/list round trips."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Literal

import pydantic
import pytest
import yaml

from finetune import config
from finetune.config import errors, schema
from finetune.config import (
    Recipe,
    RecipeError,
    dump_recipe,
    list_recipes,
    load_recipe,
    recipe_to_dict,
    register_term_config,
)

REPO = Path(__file__).resolve().parents[3]
#: a recipe of all defaults (an empty file is an error)
DEFAULTS = "# defaults\nmodel: {}\n"


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@dataclasses.dataclass
class Weights:
    edge: float = 0.1
    local: float = 0.1


@dataclasses.dataclass
class ToyTerm:
    weight: float = 1.0
    temperature: float = 0.07
    weights: Weights = dataclasses.field(default_factory=Weights)
    mode: str = "pool"


@dataclasses.dataclass
class OtherTerm:
    x: int = 1


@pytest.fixture
def term_registry(monkeypatch):
    """An isolated term registry holding one test term with a nested options dataclass."""
    from finetune import plugins

    # a registry of its own with nothing to discover (config reads finetune.plugins.TERM_OPTIONS at call time)
    monkeypatch.setattr(plugins, "TERM_OPTIONS", plugins.Registry("objective term", recipe_key="objective.terms"))
    register_term_config("toy", ToyTerm)
    return ToyTerm, Weights


# -- loading and defaults -------------------------------------------------------------------------
def test_minimal_recipe_gets_schema_defaults_and_description(tmp_path):
    path = write(tmp_path, "# A tiny run on synthetic scenes\n# second comment\nmodel:\n  name_or_path: tiny-clip\n")
    recipe = load_recipe(path)
    assert recipe.description == "A tiny run on synthetic scenes"
    assert recipe.source == str(path)
    assert recipe.model.name_or_path == "tiny-clip"
    assert recipe.model.max_text_len == 248
    assert recipe.model.kps == config.KPSConfig(keep=20, ratio=None, freeze_kept=True)
    assert recipe.train.lr == 5.0e-6 and recipe.train.betas == (0.9, 0.98)
    assert recipe.train.mixed_precision == "no"
    assert dict(recipe.data.train) == {"name": "synthetic", "size": 2000, "seed": 0}
    assert [dict(s) for s in recipe.eval.sets] == [{"name": "synthetic", "split": "test", "size": 256, "seed": 1}]
    assert recipe.eval.ks == [1, 5, 10, 25, 50]
    assert recipe.objective.terms == {}


def test_empty_sections_are_all_defaults(tmp_path):
    assert load_recipe(write(tmp_path, "model: {}\n")) == Recipe()
    assert load_recipe(write(tmp_path, "model:\ntrain:\n")) == Recipe()


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\n\n"])
def test_empty_file_is_an_error_naming_the_file(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(RecipeError, match=rf"{path}: the recipe is empty; write at least one section") as info:
        load_recipe(path, ["train.lr=1e-5"])
    assert info.value.file == str(path)


def test_yaml_numbers_without_dot_and_unquoted_no(tmp_path):
    # YAML 1.1 reads `1e-5` as a string and `no` as false; the schema fixes both for typed fields
    text = "train:\n  lr: 1e-5\n  eps: 1e-8\n  mixed_precision: no\n  max_steps: 1e3\nadapter:\n  dropout: 0\n"
    recipe = load_recipe(write(tmp_path, text))
    assert recipe.train.lr == pytest.approx(1e-5) and isinstance(recipe.train.lr, float)
    assert recipe.train.eps == pytest.approx(1e-8)
    assert recipe.train.mixed_precision == "no"
    assert recipe.train.max_steps == 1000 and isinstance(recipe.train.max_steps, int)
    assert recipe.adapter.dropout == 0.0 and isinstance(recipe.adapter.dropout, float)


def test_source_entries_accept_names_shorthand_and_mappings(tmp_path):
    text = (
        "data:\n  train: sharegpt4v\n"
        "eval:\n  sets: [docci, 'docci:goal', {name: urban1k, limit: 100}]\n"
    )
    recipe = load_recipe(write(tmp_path, text))
    assert dict(recipe.data.train) == {"name": "sharegpt4v"}
    assert [dict(s) for s in recipe.eval.sets] == [
        {"name": "docci"}, {"name": "docci", "protocol": "goal"}, {"name": "urban1k", "limit": 100},
    ]


def test_term_options_are_built_as_the_registered_dataclass(tmp_path, term_registry):
    toy, weights = term_registry
    text = "objective:\n  terms:\n    toy: {weight: 0.5, weights: {edge: 1e-3}}\n"
    recipe = load_recipe(write(tmp_path, text))
    assert recipe.objective.terms == {"toy": toy(weight=0.5, weights=weights(edge=1e-3))}
    # a term with no options gets its defaults
    recipe = load_recipe(write(tmp_path, "objective:\n  terms:\n    toy:\n"))
    assert recipe.objective.terms == {"toy": toy()}


# -- overrides ------------------------------------------------------------------------------------
def test_overrides_are_typed_and_applied_after_the_file(tmp_path):
    path = write(tmp_path, "# r\ntrain:\n  lr: 1.0e-4\n  max_steps: 100\n")
    recipe = load_recipe(path, [
        "train.lr=1e-5", "eval.sets=[docci,urban1k]", "adapter.type=lora", "train.max_steps=null",
        "model.kps.keep=10", "train.betas=[0.9, 0.99]", "train.mixed_precision=no", "data.train.size=64",
        "train.trackers=[]", "adapter.targets=[q_proj, v_proj]", "train.fused_optimizer=false",
    ])
    assert recipe.train.lr == pytest.approx(1e-5) and isinstance(recipe.train.lr, float)
    assert [dict(s) for s in recipe.eval.sets] == [{"name": "docci"}, {"name": "urban1k"}]
    assert recipe.adapter.type == "lora"
    assert recipe.train.max_steps is None
    assert recipe.model.kps.keep == 10
    assert recipe.train.betas == (0.9, 0.99)
    assert recipe.train.mixed_precision == "no"
    assert dict(recipe.data.train) == {"name": "synthetic", "size": 64, "seed": 0}  # merged into the default entry
    assert recipe.train.trackers == []
    assert recipe.adapter.targets == ["q_proj", "v_proj"]
    assert recipe.train.fused_optimizer is False
    assert recipe.overrides[0] == "train.lr=1e-5"


def test_override_into_a_list_entry_by_index(tmp_path):
    recipe = load_recipe(write(tmp_path, DEFAULTS), ["eval.sets.0.size=32"])
    assert [dict(s) for s in recipe.eval.sets] == [{"name": "synthetic", "split": "test", "size": 32, "seed": 1}]


def test_override_repairs_a_bad_file_value_and_extends_shorthand(tmp_path):
    path = write(tmp_path, "train:\n  trackers: tensorboard\ndata:\n  train: docci:goal\neval:\n  sets: [urban1k]\n")
    with pytest.raises(RecipeError, match="line 2: `train.trackers` expected a list of strings"):
        load_recipe(path)
    recipe = load_recipe(path, ["train.trackers=[tensorboard]", "data.train.split=test", "eval.sets.0.limit=10"])
    assert recipe.train.trackers == ["tensorboard"]
    assert dict(recipe.data.train) == {"name": "docci", "protocol": "goal", "split": "test"}
    assert [dict(s) for s in recipe.eval.sets] == [{"name": "urban1k", "limit": 10}]


def test_override_into_term_options(tmp_path, term_registry):
    toy, weights = term_registry
    recipe = load_recipe(write(tmp_path, "objective:\n  terms: {toy: {}}\n"), ["objective.terms.toy.weights.local=0.5"])
    assert recipe.objective.terms["toy"] == toy(weights=weights(local=0.5))


# -- errors ---------------------------------------------------------------------------------------
def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(RecipeError, match="not found: .*nope.yaml") as info:
        load_recipe(missing)
    assert info.value.file == str(missing)


def test_unknown_key_names_line_and_closest_key(tmp_path):
    path = write(tmp_path, "# r\nmodel:\n  name_or_path: tiny-clip\ntrain:\n  batch_size: 8\n  lrr: 1.0e-5\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    msg = str(info.value)
    assert f"{path}, line 6" in msg and "`train.lrr`" in msg and "did you mean `train.lr`?" in msg
    assert (info.value.file, info.value.line, info.value.key) == (str(path), 6, "train.lrr")


def test_unknown_section_and_key_of_another_section(tmp_path):
    with pytest.raises(RecipeError, match="did you mean `train`"):
        load_recipe(write(tmp_path, "trian:\n  lr: 1.0\n"))
    with pytest.raises(RecipeError, match=r"did you mean `model.max_text_len`\?"):
        load_recipe(write(tmp_path, "train:\n  max_text_len: 248\n"))


def test_unknown_override_key_names_the_override_and_closest_key(tmp_path):
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, DEFAULTS), ["train.batchsize=4"])
    msg = str(info.value)
    assert "override `train.batchsize=4`" in msg and "did you mean `train.batch_size`?" in msg


@pytest.mark.parametrize(("key", "suggested"), [
    ("train.learning_rate=1e-5", "train.lr"), ("train.per_device_train_batch_size=8", "train.batch_size"),
    ("train.num_train_epochs=3", "train.epochs"), ("train.warmup_ratio=0.1", "train.warmup_steps"),
    ("train.gradient_accumulation_steps=2", "train.accumulation_steps"), ("train.max_grad_norm=1", "train.grad_clip"),
    ("train.output_dir=x", "output.dir"), ("learning_rate=1e-5", "train.lr"), ("model.lora_r=8", "adapter.r"),
])
def test_other_tools_names_suggest_the_recipe_key(tmp_path, key, suggested):
    with pytest.raises(RecipeError, match=rf"is not a recipe key: did you mean `{suggested}`\? \(`[a-z_0-9]+` is "):
        load_recipe(write(tmp_path, DEFAULTS), [key])


def test_every_foreign_name_points_at_a_recipe_key():
    assert {target for target, _ in errors._FOREIGN_KEYS.values()} <= set(errors._schema_paths())
    assert not set(errors._FOREIGN_KEYS) & {p.rsplit(".", 1)[-1] for p in errors._schema_paths()}


@pytest.mark.slow
def test_wrong_type_names_the_expected_type_and_line(tmp_path):
    path = write(tmp_path, "train:\n  lr: fast\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    msg = str(info.value)
    assert f"{path}, line 2" in msg and "`train.lr`" in msg and "expected a number" in msg and "'fast'" in msg
    with pytest.raises(RecipeError, match=r"`train.batch_size` expected an integer, got 8.5"):
        load_recipe(write(tmp_path, "train:\n  batch_size: 8.5\n"))
    with pytest.raises(RecipeError, match=r"`eval.before` expected true or false"):
        load_recipe(write(tmp_path, "eval:\n  before: maybe\n"))
    with pytest.raises(RecipeError, match=r"`train.trackers` expected a list of strings"):
        load_recipe(write(tmp_path, "train:\n  trackers: 3\n"))
    with pytest.raises(RecipeError, match=r"expected a list of 2 values"):
        load_recipe(write(tmp_path, "train:\n  betas: [0.9]\n"))


def test_wrong_type_in_override(tmp_path):
    with pytest.raises(RecipeError, match=r"override `train.epochs=many`: `train.epochs` expected an integer or null"):
        load_recipe(write(tmp_path, DEFAULTS), ["train.epochs=many"])


def test_choice_fields_list_the_allowed_values(tmp_path):
    with pytest.raises(RecipeError, match=r"one of 'full', 'lora', 'dora', got 'lroa' \(did you mean 'lora'\?\)"):
        load_recipe(write(tmp_path, "adapter:\n  type: lroa\n"))
    with pytest.raises(RecipeError, match=r"override `objective.base=infonce`.*not a registered objective term.*`clip`, (?:`\w+`, )*`longclip`, (?:`\w+`, )*`none`, (?:`\w+`, )*`siglip`"):
        load_recipe(write(tmp_path, DEFAULTS), ["objective.base=infonce"])


def test_invalid_yaml_and_duplicate_keys_name_the_line(tmp_path):
    path = write(tmp_path, "train:\n  lr: [1, 2\nmodel: {}\n")
    with pytest.raises(RecipeError, match=rf"{path}, line \d+: invalid YAML"):
        load_recipe(path)
    path = write(tmp_path, "train:\n  lr: 1.0e-5\n  lr: 2.0e-5\n")
    with pytest.raises(RecipeError, match=rf"{path}, line 3: `train.lr` is given twice \(first on line 2\)"):
        load_recipe(path)


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(RecipeError, match="a recipe is a mapping of sections"):
        load_recipe(write(tmp_path, "- model\n- train\n"))


def test_malformed_overrides(tmp_path):
    path = write(tmp_path, DEFAULTS)
    with pytest.raises(RecipeError, match=r"`train.lr` is not `key.sub=value`"):
        load_recipe(path, ["train.lr"])
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(path, ["eval.sets=[docci"])
    with pytest.raises(RecipeError, match="there is no index 3"):
        load_recipe(path, ["eval.sets.3.size=1"])


def test_range_and_cross_field_checks(tmp_path):
    path = write(tmp_path, "train:\n  batch_size: 10\n  accumulation_steps: 4\n")
    with pytest.raises(RecipeError, match=r"line 2: .*must be divisible by `train.accumulation_steps` \(4\)"):
        load_recipe(path)
    with pytest.raises(RecipeError, match=r"override `train.accumulation_steps=3`"):
        load_recipe(write(tmp_path, DEFAULTS), ["train.accumulation_steps=3"])
    with pytest.raises(RecipeError, match=r"`hub.push: true` needs `hub.repo_id`"):
        load_recipe(write(tmp_path, "hub:\n  push: true\n"))
    with pytest.raises(RecipeError, match=r"`train.lr` must be > 0, got 0.0"):
        load_recipe(write(tmp_path, "train:\n  lr: 0\n"))
    with pytest.raises(RecipeError, match=r"`train.epochs` and `train.max_steps` are both null"):
        load_recipe(write(tmp_path, "train:\n  epochs: null\n"))
    with pytest.raises(RecipeError, match=r"`model.max_text_len` must be >= 1, got 0"):
        load_recipe(write(tmp_path, "model:\n  max_text_len: 0\n"))
    with pytest.raises(RecipeError, match=r"`eval.ks` every K must be >= 1"):
        load_recipe(write(tmp_path, "eval:\n  ks: [1, 0]\n"))
    # null max_text_len keeps the model's own length
    assert load_recipe(write(tmp_path, "model:\n  max_text_len: null\n")).model.max_text_len is None


def test_dataset_entry_errors(tmp_path):
    path = write(tmp_path, "eval:\n  sets:\n    - name: docci\n      protcol: goal\n")
    with pytest.raises(RecipeError, match=rf"{path}, line 4: `eval.sets.0.protcol`.*did you mean `eval.sets.0.protocol`"):
        load_recipe(path)
    with pytest.raises(RecipeError, match=r"`data.train` is missing the required key `name`"):
        load_recipe(write(tmp_path, "data:\n  train: {size: 10}\n"))
    with pytest.raises(RecipeError, match=r"`data.train.size` expected an integer or null"):
        load_recipe(write(tmp_path, "data:\n  train: {name: synthetic, size: lots}\n"))
    with pytest.raises(RecipeError, match=r"`data.train` expected a dataset name"):
        load_recipe(write(tmp_path, "data:\n  train: 12\n"))
    with pytest.raises(RecipeError, match=r"line 2: `eval.sets.1` is 'synthtic', not a registered data source: "
                                          r"did you mean `synthetic`\? registered sources: .*docci"):
        load_recipe(write(tmp_path, "eval:\n  sets: [docci, synthtic]\n"))
    with pytest.raises(RecipeError, match=r"`data.train.name` is 'jsnl', not a registered data source: did you mean `jsonl`"):
        load_recipe(write(tmp_path, "data:\n  train: {name: jsnl, path: x.jsonl}\n"))


def test_unknown_term_lists_registered_terms(tmp_path, term_registry):
    path = write(tmp_path, "objective:\n  terms:\n    tyo: {}\n")
    with pytest.raises(RecipeError, match=r"line 3: `objective.terms.tyo` is not a registered objective term: "
                                          r"did you mean `toy`\? registered terms: `toy`"):
        load_recipe(path)
    with pytest.raises(RecipeError, match=r"`objective.terms.toy.weights.edge` expected a number"):
        load_recipe(write(tmp_path, "objective:\n  terms:\n    toy: {weights: {edge: high}}\n"))
    with pytest.raises(RecipeError, match=r"`objective.terms.toy.temprature`.*did you mean `objective.terms.toy.temperature`"):
        load_recipe(write(tmp_path, "objective:\n  terms:\n    toy: {temprature: 0.1}\n"))


def test_register_term_config_rejects_non_dataclasses_and_name_clashes(term_registry):
    toy, _ = term_registry
    register_term_config("toy", toy)  # same class again: fine
    with pytest.raises(TypeError, match="expected a dataclass"):
        register_term_config("other", dict)
    with pytest.raises(ValueError, match="already registered"):
        register_term_config("toy", OtherTerm)


# -- dump / list ----------------------------------------------------------------------------------
def test_dump_round_trips_and_drops_the_token(tmp_path, term_registry):
    toy, _ = term_registry
    path = write(tmp_path, "# my run\nobjective:\n  terms: {toy: {weight: 2.0}}\nhub:\n  token: hf_SECRET\n")
    recipe = load_recipe(path, ["train.lr=1e-5", "hub.token=hf_OTHER", "eval.sets=[docci:goal]"])
    assert recipe.hub.token == "hf_OTHER"
    out = dump_recipe(recipe, tmp_path / "run" / "recipe.yaml")
    text = out.read_text()
    assert "SECRET" not in text and "OTHER" not in text and "token" not in text
    assert text.startswith("# my run\n")
    assert "train.lr=1e-5" in text
    assert list(out.parent.iterdir()) == [out]  # no temp file left behind
    again = load_recipe(out)
    assert again == dataclasses.replace(recipe, hub=dataclasses.replace(recipe.hub, token=None))
    assert yaml.safe_load(text)["objective"]["terms"] == {
        "toy": {"weight": 2.0, "temperature": 0.07, "weights": {"edge": 0.1, "local": 0.1}, "mode": "pool"}}


def test_recipe_to_dict_is_plain_yaml_data():
    data = recipe_to_dict(Recipe())
    assert list(data) == ["model", "adapter", "data", "objective", "train", "eval", "output", "hub"]
    assert data["train"]["betas"] == [0.9, 0.98]
    assert "token" not in data["hub"]
    assert "token" in recipe_to_dict(Recipe(), keep_secrets=True)["hub"]
    yaml.safe_dump(data)  # raises on anything that is not plain data


def test_list_recipes(tmp_path):
    write(tmp_path, "# yaml-language-server: $schema=../recipe.schema.json\n# Quick start on synthetic scenes\n"
                    "train: {}\n", "quickstart.yaml")
    write(tmp_path, "model: {}\n# late comment\n", "b_other.yml")
    write(tmp_path, "not a recipe", "notes.txt")
    assert list_recipes(tmp_path) == [("b_other", "late comment"), ("quickstart", "Quick start on synthetic scenes")]
    with pytest.raises(FileNotFoundError, match="recipe folder not found"):
        list_recipes(tmp_path / "missing")


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.description, f"{path.name}: the first line should be a one-line description comment"


# -- pydantic schema: sections built in code, registered options, JSON schema --------------------
def test_sections_built_in_code_raise_recipe_errors_naming_the_key():
    with pytest.raises(RecipeError, match=r"`train.lr` must be > 0, got 0.0"):
        config.TrainConfig(lr=0)
    with pytest.raises(RecipeError, match=r"`model.kps.keep` must be >= 0, got -1"):
        config.KPSConfig(keep=-1)
    with pytest.raises(RecipeError, match=r"`adapter.lora_rank` is not a recipe key"):
        config.AdapterConfig(lora_rank=4)
    recipe = Recipe()
    assert dataclasses.replace(recipe, train=config.TrainConfig(lr=1e-4)).train.lr == 1e-4
    assert vars(recipe.model.kps) == {"keep": 20, "ratio": None, "freeze_kept": True}


def test_one_adapter_config_class_for_recipes_and_adapters():
    adapters = pytest.importorskip("finetune.models.adapters")
    assert adapters.AdapterConfig is config.AdapterConfig
    assert config.AdapterConfig().train_extra == list(adapters.EXTRA_SYMBOLS)
    assert isinstance(Recipe().adapter, adapters.AdapterConfig)


def test_adapter_train_extra_is_a_recipe_key(tmp_path):
    recipe = load_recipe(write(tmp_path, "adapter:\n  type: lora\n  train_extra: [logit_scale]\n"))
    assert recipe.adapter.train_extra == ["logit_scale"]


class PydanticTerm(pydantic.BaseModel):
    weight: float = 1.0
    k: int = pydantic.Field(default=3, ge=1)
    mode: Literal["a", "b"] = "a"


def test_a_pydantic_model_registered_as_term_options_is_validated(tmp_path, term_registry):
    register_term_config("pyd", PydanticTerm)
    recipe = load_recipe(write(tmp_path, "objective:\n  terms:\n    pyd: {weight: 1e-2, k: 5}\n"))
    assert recipe.objective.terms["pyd"] == PydanticTerm(weight=0.01, k=5)
    path = write(tmp_path, "objective:\n  terms:\n    pyd:\n      k: 0\n")
    with pytest.raises(RecipeError, match=rf"{path}, line 4: `objective.terms.pyd.k` must be >= 1, got 0"):
        load_recipe(path)
    with pytest.raises(RecipeError, match=r"`objective.terms.pyd.mdoe` is not a recipe key: "
                                          r"did you mean `objective.terms.pyd.mode`\?"):
        load_recipe(write(tmp_path, "objective:\n  terms:\n    pyd: {mdoe: b}\n"))
    with pytest.raises(RecipeError, match=r"override `objective.terms.pyd.mode=c`: `objective.terms.pyd.mode` "
                                          r"must be one of 'a', 'b', got 'c'"):
        load_recipe(write(tmp_path, "objective:\n  terms: {pyd: {}}\n"), ["objective.terms.pyd.mode=c"])
    assert recipe_to_dict(recipe)["objective"]["terms"]["pyd"] == {"weight": 0.01, "k": 5, "mode": "a"}


def test_dataclass_field_checks_of_term_options_are_run(tmp_path, term_registry):
    @dataclasses.dataclass
    class Checked:
        k: int = dataclasses.field(default=3,
                                   metadata={"check": lambda v: None if v >= 1 else f"must be >= 1, got {v}"})

    register_term_config("checked", Checked)
    with pytest.raises(RecipeError, match=r"line 3: `objective.terms.checked.k` must be >= 1, got 0"):
        load_recipe(write(tmp_path, "objective:\n  terms:\n    checked: {k: 0}\n"))


def test_yaml_quirks_in_term_options(tmp_path, term_registry):
    @dataclasses.dataclass
    class Quirky:
        steps: int = 1
        rate: float | None = None
        mode: Literal["no", "fp16"] = "fp16"
        flag: bool = True

    register_term_config("quirky", Quirky)
    recipe = load_recipe(write(tmp_path, "objective:\n  terms:\n    quirky: {steps: 1e3, rate: 1e-5, mode: no}\n"))
    assert recipe.objective.terms["quirky"] == Quirky(steps=1000, rate=1e-5, mode="no")
    assert isinstance(recipe.objective.terms["quirky"].steps, int)
    with pytest.raises(RecipeError, match=r"`objective.terms.quirky.steps` expected an integer, got 2.5"):
        load_recipe(write(tmp_path, "objective:\n  terms:\n    quirky: {steps: 2.5}\n"))


@pytest.mark.slow
def test_schema_flag_prints_the_json_schema_with_terms_and_types():
    out = subprocess.run([sys.executable, str(REPO / "finetune" / "run.py"), "--schema"], capture_output=True,
                         text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr
    schema = json.loads(out.stdout)
    defs = schema["$defs"]

    def resolve(node):
        return defs[node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node

    sections = schema["properties"]
    assert list(sections) == ["model", "adapter", "data", "objective", "train", "eval", "output", "hub"]
    train = resolve(sections["train"])
    assert train["properties"]["lr"]["type"] == "number"
    assert train["properties"]["lr"]["exclusiveMinimum"] == 0
    assert train["additionalProperties"] is False
    objective = resolve(sections["objective"])
    assert "import" in objective["properties"] and "imports" not in objective["properties"]
    structxlip = objective["properties"]["terms"]["properties"]["structxlip"]["anyOf"][0]
    structxlip = resolve(structxlip)
    assert {"compat", "weights", "edges", "lexicon", "regions"} <= set(structxlip["properties"])
    assert structxlip["additionalProperties"] is False
    regions = resolve(structxlip["properties"]["regions"])
    assert regions["properties"]["encode"]["enum"] == ["crop", "pool"]
    entry = resolve(sections["data"])["properties"]["train"]["anyOf"]
    mapping = resolve(next(a for a in entry if a.get("type") != "string"))
    assert set(mapping["properties"]) == set(config.source_spec_keys())
    assert mapping["required"] == ["name"]
    assert "description" not in sections and "source" not in sections


def test_schema_lists_a_term_registered_in_code(term_registry):
    schema = config.recipe_json_schema()
    terms = schema["$defs"]["ObjectiveConfig"]["properties"]["terms"]["properties"]
    assert list(terms) == ["toy"]
    toy = terms["toy"]["anyOf"][0]
    toy = schema["$defs"][toy["$ref"].rsplit("/", 1)[-1]] if "$ref" in toy else toy
    assert toy["properties"]["temperature"] == {"default": 0.07, "title": "Temperature", "type": "number"}


def test_run_exits_2_on_a_recipe_error(tmp_path, capsys):
    from finetune.cli.train import main

    path = write(tmp_path, "# r\ntrain:\n  lrr: 1.0e-5\n")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert f"recipe error: {path}, line 3: `train.lrr` is not a recipe key: did you mean `train.lr`?" in err
    assert main([str(write(tmp_path, "", "empty.yaml"))]) == 2
    assert "the recipe is empty" in capsys.readouterr().err


# -- dataset entries ------------------------------------------------------------------------------
def test_source_spec_keys_come_from_the_dataclass():
    from finetune.data.sources import SourceSpec

    assert config.source_spec_keys() == tuple(f.name for f in dataclasses.fields(SourceSpec))


def test_a_path_on_a_source_that_takes_none_is_an_error(tmp_path):
    path = write(tmp_path, "data:\n  train:\n    name: synthetic\n    path: data/scenes\n")
    with pytest.raises(RecipeError, match=rf"{path}, line 4: `data.train.path` is set, but the source 'synthetic' "
                                          r"takes no path") as info:
        load_recipe(path)
    assert info.value.key == "data.train.path"
    with pytest.raises(RecipeError, match=r"override `eval.sets.0.path=x`: `eval.sets.0.path` is set"):
        load_recipe(write(tmp_path, DEFAULTS), ["eval.sets.0.path=x"])
    recipe = load_recipe(write(tmp_path, "data:\n  train: {name: jsonl, path: x.jsonl}\n"))
    assert dict(recipe.data.train) == {"name": "jsonl", "path": "x.jsonl"}


def test_dataset_entries_get_the_source_modules_own_checks(tmp_path):
    recipe = load_recipe(write(tmp_path, "data:\n  train: {format: webdataset, urls: 'shards/{0..3}.tar'}\n"
                                         "train:\n  max_steps: 10\n"))
    assert dict(recipe.data.train) == {"format": "webdataset", "urls": "shards/{0..3}.tar"}  # `format` names the source
    path = write(tmp_path, "data:\n  train: {name: docci, streaming: true}\n")
    with pytest.raises(RecipeError, match=rf"{path}, line 2: `data.train` is not a valid dataset entry: "
                                          r"data source 'docci' cannot be streamed"):
        load_recipe(path)
    with pytest.raises(RecipeError, match=r"`data.train` is not a valid dataset entry: .*'size' must be positive"):
        load_recipe(write(tmp_path, "data:\n  train: {name: synthetic, size: 0}\n"))
    path = write(tmp_path, "eval:\n  sets:\n    - docci\n    - {name: webdataset, urls: x.tar}\n")
    with pytest.raises(RecipeError, match=rf"{path}, line 4: `eval.sets.1` is a stream; only `data.train`"):
        load_recipe(path)


# -- objective.import, base, scorer and model family ----------------------------------------------
def test_objective_import_registers_a_term_from_a_module(tmp_path, monkeypatch, term_registry):
    (tmp_path / "my_terms_xyz.py").write_text(
        "import dataclasses\n"
        "from finetune.config import register_term_config\n\n"
        "@dataclasses.dataclass\n"
        "class MineOptions:\n"
        "    weight: float = 0.5\n\n"
        "register_term_config('mine', MineOptions)\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_terms_xyz", raising=False)
    text = "# mine\nobjective:\n  import: [my_terms_xyz]\n  base: mine\n  terms:\n    mine: {weight: 2}\n"
    recipe = load_recipe(write(tmp_path, text), trust_imports=True)
    assert recipe.objective.imports == ["my_terms_xyz"]
    assert recipe.objective.base == "mine"
    assert dataclasses.asdict(recipe.objective.terms["mine"]) == {"weight": 2.0}
    assert recipe_to_dict(recipe)["objective"]["import"] == ["my_terms_xyz"]
    assert load_recipe(dump_recipe(recipe, tmp_path / "out" / "recipe.yaml")) == recipe
    path = write(tmp_path, "objective:\n  import:\n    - my_terms_xyz\n    - no_such_module_xyz\n")
    with pytest.raises(RecipeError, match=rf"{path}, line 4: `objective.import.1` cannot import module "
                                          r"'no_such_module_xyz'"):
        load_recipe(path, trust_imports=True)
    with pytest.raises(RecipeError, match=r"`objective.import` expected a list of module names"):
        load_recipe(write(tmp_path, "objective:\n  import: {a: 1}\n"))
    with pytest.raises(RecipeError, match=r"`objective.base` is not a registered objective term: "
                                          r"did you mean `mine`\?"):
        load_recipe(write(tmp_path, "objective:\n  import: [my_terms_xyz]\n  base: mien\n"))


def test_scorer_and_model_family_are_checked_against_their_registries(tmp_path, monkeypatch):
    """The recipe reads the names from the registries of the ground floor (finetune.plugins), not from the
    modules above it."""
    from finetune import plugins

    scorers, families = plugins.Registry("scorer"), plugins.Registry("model family")
    for name in ("cosine", "token_max"):
        scorers.add(name, types.SimpleNamespace(name=name))
    for name in ("hf", "open_clip"):
        families.add(name, types.SimpleNamespace(name=name))
    monkeypatch.setattr(plugins, "SCORERS", scorers)
    monkeypatch.setattr(plugins, "MODEL_FAMILIES", families)
    recipe = load_recipe(write(tmp_path, "eval:\n  scorer: token_max\nmodel:\n  family: open_clip\n"))
    assert (recipe.eval.scorer, recipe.model.family) == ("token_max", "open_clip")
    with pytest.raises(RecipeError, match=r"line 2: `eval.scorer` is 'token_mx', not a registered scorer: "
                                          r"did you mean `token_max`\? choose one of `cosine`, `token_max`"):
        load_recipe(write(tmp_path, "eval:\n  scorer: token_mx\n"))
    with pytest.raises(RecipeError, match=r"override `model.family=openclip`: `model.family` is 'openclip', not a "
                                          r"registered model family: did you mean `open_clip`\?"):
        load_recipe(write(tmp_path, DEFAULTS), ["model.family=openclip"])


def test_model_family_is_checked_against_the_registered_families(tmp_path):
    families = pytest.importorskip("finetune.models.families")
    assert "hf" in families.model_family_names()
    with pytest.raises(RecipeError, match=r"line 2: `model.family` is 'hff', not a registered model family: "
                                          r"did you mean `hf`\? choose one of `auto`, (`\w+`, )*`hf`"):
        load_recipe(write(tmp_path, "model:\n  family: hff\n"))
    with pytest.raises(RecipeError, match=r"`model.backend` is 'jax', not a registered model family"):
        load_recipe(write(tmp_path, "model:\n  backend: jax\n"))


def test_eval_scorer_is_checked_against_the_registered_scorers(tmp_path):
    scorers = pytest.importorskip("finetune.evaluation.scorers")
    assert "cosine" in scorers.available_scorers()
    with pytest.raises(RecipeError, match=r"`eval.scorer` is 'cosin', not a registered scorer: did you mean `cosine`\?"):
        load_recipe(write(tmp_path, DEFAULTS), ["eval.scorer=cosin"])


def test_model_backend_is_a_deprecated_alias_of_family(tmp_path):
    recipe = load_recipe(write(tmp_path, "model:\n  backend: open_clip\n"))
    assert recipe.model.family == "open_clip"
    assert load_recipe(write(tmp_path, "model:\n  family: hf\n")).model.family == "hf"
    with pytest.raises(RecipeError, match=r"`model.backend` \(hf\) and `model.family` \(open_clip\) disagree"):
        load_recipe(write(tmp_path, "model:\n  backend: hf\n  family: open_clip\n"))


# -- hostile input: non-finite numbers, alias bombs, tokens in messages, untrusted imports ----------
@pytest.mark.parametrize(("text", "overrides", "key", "shown"), [
    ("# r\ntrain: {lr: .inf}\n", [], "train.lr", "inf"),
    ("# r\ntrain: {logit_scale_max: .nan}\n", [], "train.logit_scale_max", "nan"),
    (DEFAULTS, ["train.lr=-.inf"], "train.lr", "-inf"),
    (DEFAULTS, ["train.lr=1e999"], "train.lr", "'1e999'"),  # YAML 1.1 reads it as a string: then inf
    ("# r\nobjective:\n  terms:\n    toy: {weight: .inf}\n", [], "objective.terms.toy.weight", "inf"),
    ("# r\nobjective:\n  terms:\n    toy: {weights: {edge: .nan}}\n", [], "objective.terms.toy.weights.edge", "nan"),
    (DEFAULTS, ["objective.terms.toy.temperature=1e999"], "objective.terms.toy.temperature", "inf"),
    ("# r\ndata:\n  train: {name: synthetic, options: {image_size: .inf}}\n", [], "data.train.options.image_size",
     "inf"),
])
def test_non_finite_numbers_are_refused_anywhere_naming_the_key(tmp_path, term_registry, text, overrides, key, shown):
    with pytest.raises(RecipeError, match=rf"`{key}` must be a finite number \(no \.inf, -\.inf or \.nan anywhere "
                                          rf"in a recipe\), got {shown}$") as info:
        load_recipe(write(tmp_path, text), overrides)
    assert info.value.key == key


def test_non_finite_numbers_built_in_code_are_refused():
    from finetune.config import TrainConfig

    with pytest.raises(RecipeError, match=r"`train.logit_scale_max` must be a finite number .* got nan"):
        TrainConfig(logit_scale_max=float("nan"))


def _alias_bomb(levels: int) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "# a billion laughs\n" + "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    # 9**7 = 4.8 million values once expanded (the 16 lines: 9**16); refused before anything walks it
    path = write(tmp_path, _alias_bomb(7))
    with pytest.raises(RecipeError, match=rf"^{path}, line 3: YAML aliases \(`\*name`, first on line 3\) expand to "
                                          r"more than 100,000 values, .*an alias bomb"):
        load_recipe(path)
    with pytest.raises(RecipeError, match=r"command-line override `train.lr=.*`: YAML aliases .* expand to more than"):
        load_recipe(write(tmp_path, DEFAULTS), ["train.lr=[&a [1,1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,"
                                                "*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], &d [*c,*c,*c,*c,*c,*c,*c,*c,"
                                                "*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d], &f [*e,*e,*e,*e,*e,*e,"
                                                "*e,*e,*e,*e]]"])
    with pytest.raises(RecipeError, match=r"a YAML alias refers to the value that contains it"):
        load_recipe(write(tmp_path, "# r\neval: &e {sets: [*e]}\n"))
    # aliases in moderation are fine
    recipe = load_recipe(write(tmp_path, "# r\neval:\n  sets: [&s {name: synthetic, size: 8}]\n"
                                         "data:\n  train: *s\n"))
    assert dict(recipe.data.train) == {"name": "synthetic", "size": 8}


def test_a_token_in_a_malformed_override_is_not_echoed(tmp_path):
    token = "hf_" + "aBcD1234" * 4
    for override in (f"hub.tokn={token}", f"hub.tocken={token}", f"hub.token=[{token}]", f"hub.secret_key={token}",
                     f"train.lr={token}"):
        with pytest.raises(RecipeError) as info:
            load_recipe(write(tmp_path, DEFAULTS), [override])
        assert token not in str(info.value) and "***" in str(info.value), str(info.value)
    with pytest.raises(RecipeError, match=r"command-line override `hub.tokn=\*\*\*`: `hub.tokn` is not a recipe key: "
                                          r"did you mean `hub.token`\?"):
        load_recipe(write(tmp_path, DEFAULTS), ["hub.tokn=my-own-secret-1"])
    with pytest.raises(RecipeError) as info:
        load_recipe(write(tmp_path, f"# r\nhub:\n  token: [{token}]\n"))
    assert token not in str(info.value)


def test_untrusted_recipes_import_nothing(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "side_effect_xyz.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "side_effect_xyz", raising=False)
    path = write(tmp_path, "# r\nobjective:\n  import: [finetune.evaluation.scorers, side_effect_xyz]\n")
    for untrusted in ({}, {"trust_imports": False}):  # the default: a recipe may come from anyone
        with pytest.raises(RecipeError, match=rf"{path}, line 3: `objective.import.1` would import the module "
                                              r"'side_effect_xyz', which runs its code; .* pass --trust-recipe-code"):
            load_recipe(path, **untrusted)
    assert not marker.exists()
    recipe = load_recipe(path, trust_imports=True)
    assert recipe.objective.imports == ["finetune.evaluation.scorers", "side_effect_xyz"] and recipe.trust_code
    assert marker.exists()


def test_group_by_length_is_off_by_default_and_refused_on_a_stream(tmp_path):
    """train.group_by_length: opt-in; its megabatch key needs it; a stream (no lengths before training) refuses it
    when the recipe is read, naming the key."""
    assert load_recipe(write(tmp_path, DEFAULTS)).train.group_by_length is False
    on = load_recipe(write(tmp_path, DEFAULTS), ["train.group_by_length=true", "train.length_group_batches=20"])
    assert on.train.group_by_length is True and on.train.length_group_batches == 20
    with pytest.raises(RecipeError, match=r"`train.length_group_batches` \(20\) only applies with "
                                          r"`train.group_by_length: true`"):
        load_recipe(write(tmp_path, DEFAULTS), ["train.length_group_batches=20"])
    with pytest.raises(RecipeError, match="train.length_group_batches.*>= 1"):
        load_recipe(write(tmp_path, DEFAULTS), ["train.group_by_length=true", "train.length_group_batches=0"])
    stream = write(tmp_path, "data:\n  train: {name: webdataset, urls: 'shards/{0..3}.tar'}\n"
                             "train:\n  max_steps: 10\n  group_by_length: true\n")
    with pytest.raises(RecipeError, match="train.group_by_length: true needs a map-style data.train: a stream "
                                          r"\(webdataset.*set train.group_by_length: false") as info:
        load_recipe(stream)
    assert "r.yaml" in str(info.value)
