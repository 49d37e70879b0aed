"""The objective seams (DESIGN 4): one registry for bases and added terms, ``objective.base: none``, term
discovery and ``objective.import``, shared feature keys encoded once, ``term/name`` loss names, and
collisions between terms."""

from __future__ import annotations

import dataclasses
import math
import sys
import textwrap
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

import finetune.config as config_module
import finetune.objectives as objectives
from finetune.config import load_recipe
from finetune.data.collate import Collator
from finetune.data.sources import load_source
from finetune.models.registry import build_model
from finetune.objectives import (
    ClipOptions,
    ClipTerm,
    ImageRequest,
    LongClipTerm,
    Objective,
    SiglipTerm,
    Term,
    TermCollisionError,
    TextRequest,
    build_objective,
    build_term,
    discover_terms,
    loss_name,
    register_term,
)
from finetune.objectives.contrastive import image_request
from finetune import plugins
from finetune.objectives.registry import TERM_BUILDERS, TERM_OPTIONS
from losses import clip_loss


@pytest.fixture(autouse=True)
def _restore_registry():
    """Terms registered by a test are forgotten after it (the registries are process-wide)."""
    for registry in (plugins.TERMS, plugins.TERM_OPTIONS):
        registry.discover()  # the built-in terms stay registered: their modules are imported only once
    saved = {registry: registry.snapshot() for registry in (plugins.TERMS, plugins.TERM_OPTIONS)}
    modules = set(sys.modules)
    yield
    for registry, entries in saved.items():
        registry.restore(entries)
    for name in set(sys.modules) - modules:
        if name.startswith(("user_terms_", "finetune.objectives.dropped_")):
            del sys.modules[name]


@pytest.fixture(scope="module")
def model():
    return build_model("tiny-clip")


@pytest.fixture(scope="module")
def batch(model):
    scenes = load_source({"name": "synthetic", "size": 4, "seed": 0, "options": {"image_size": 32}}).dataset
    return Collator(model)([scenes[i] for i in range(4)])


class _Toy(Term):
    """InfoNCE of the batch, returned twice: under the term's own name and as ``half`` (half of it)."""

    requests = frozenset({"image", "text"})

    def __init__(self, name: str = "toy", *, states: bool = False, text_states: bool = False) -> None:
        super().__init__()
        self.name = name
        self.states = states
        self.text_states = text_states

    def image_inputs(self, batch):
        return {"image": ImageRequest(batch["image_inputs"], states=self.states)}

    def text_inputs(self, batch):
        return {"text": TextRequest(batch["input_ids"], batch["attention_mask"], states=self.text_states)}

    def loss(self, model, feats, *, detach_params=False):
        value = clip_loss(feats["image"], feats["text"], model.logit_scale.exp())
        return {self.name: value, "half": value / 2}


# -- the registry -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, cls", [("clip", ClipTerm), ("siglip", SiglipTerm), ("longclip", LongClipTerm)])
def test_the_three_bases_come_from_the_registry(name, cls):
    assert name in TERM_BUILDERS and dataclasses.is_dataclass(TERM_OPTIONS[name])
    assert config_module.registered_term_configs()[name] is TERM_OPTIONS[name]
    objective = build_objective(types.SimpleNamespace(base=name, terms={}, label_smoothing=None, imports=[]))
    assert type(objective.base) is cls and objective.base.name == name
    assert objective.all_terms == [objective.base] and objective.base_weights == 1.0


def test_label_smoothing_reaches_the_base_and_options_build_a_term(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"objective": {"base": "clip", "label_smoothing": 0.2}}))
    assert build_objective(load_recipe(path).objective).base.label_smoothing == 0.2
    path.write_text(yaml.safe_dump({"objective": {"base": "longclip"}}))
    assert build_objective(load_recipe(path).objective).base.label_smoothing == 0.1  # Long-CLIP's own
    term, weight = build_term("clip", ClipOptions(label_smoothing=0.3))
    assert isinstance(term, ClipTerm) and term.label_smoothing == 0.3 and weight == 1.0
    with pytest.raises(ValueError, match="objective.label_smoothing: the base term 'siglip' has no label smoothing"):
        build_objective(types.SimpleNamespace(base="siglip", terms={}, label_smoothing=0.1, imports=[]))
    with pytest.raises(ValueError, match="objective.base: 'nope' is not a registered objective term"):
        build_objective(types.SimpleNamespace(base="nope", terms={}, label_smoothing=None, imports=[]))


def test_siglip_exchange_option_reaches_the_loss(monkeypatch):
    """``objective.terms.siglip.exchange: ring`` is passed to ``siglip_loss`` (one process: the same value)."""
    from finetune.config import ObjectiveConfig
    from finetune.objectives import contrastive

    seen = []
    real = contrastive.siglip_loss
    monkeypatch.setattr(contrastive, "siglip_loss", lambda *a, **k: seen.append(k["exchange"]) or real(*a, **k))
    model = types.SimpleNamespace(logit_scale=torch.tensor(2.0), logit_bias=torch.tensor(-3.0))
    feats = {"image": torch.randn(4, 8), "text": torch.randn(4, 8)}
    values = [build_objective(ObjectiveConfig(base="none", terms={"siglip": {"exchange": e}})).all_terms[0]
              .loss(model, feats)["siglip"] for e in ("gather", "ring")]
    assert seen == ["gather", "ring"] and torch.equal(values[0], values[1])
    with pytest.raises(ValueError, match="objective.terms.siglip.exchange.*'gather' or 'ring'"):
        ObjectiveConfig(base="none", terms={"siglip": {"exchange": "all"}})


def test_reserved_and_repeated_names_are_refused():
    with pytest.raises(ValueError, match="cannot name a term"):
        register_term("loss", ClipOptions)
    with pytest.raises(ValueError, match="cannot name a term"):
        register_term("a/b", ClipOptions)
    with pytest.raises(ValueError, match="'clip' appears twice"):
        Objective(ClipTerm(), [(ClipTerm(), 1.0)])
    with pytest.raises(ValueError, match="already objective.base"):
        build_objective(types.SimpleNamespace(base="clip", terms={"clip": None}, label_smoothing=None, imports=[]))


# -- base: none -----------------------------------------------------------------------------------------
def test_base_none_is_the_weighted_sum_of_the_terms(tmp_path, model, batch):
    @dataclass
    class ToyOptions:
        weight: float = 1.0

    @register_term("toy_sum", ToyOptions)
    def build(options):
        return _Toy("toy_sum"), {"toy_sum": options.weight, "half": 0.0}

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"objective": {"base": "none", "terms": {"toy_sum": {"weight": 3.0}}}}))
    objective = build_objective(load_recipe(path).objective)
    assert objective.base is None and [t.name for t in objective.all_terms] == ["toy_sum"]
    values = objective.loss(model, objective.encode(model, batch))
    assert set(values) == {"toy_sum", "toy_sum/half", "loss"}
    torch.testing.assert_close(values["loss"], 3.0 * values["toy_sum"])  # "half" weighs 0: logged only
    values["loss"].backward()
    assert model.logit_scale.grad is not None
    model.zero_grad(set_to_none=True)


def test_an_objective_with_nothing_is_a_clear_error(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"objective": {"base": "none"}}))
    with pytest.raises(ValueError, match="nothing to optimise: objective.base is `none` and objective.terms is empty"):
        build_objective(load_recipe(path).objective)
    with pytest.raises(ValueError, match="nothing to optimise"):
        Objective(None, [])


# -- finding term modules -------------------------------------------------------------------------------
_MODULE = '''
from dataclasses import dataclass

from finetune.objectives import ImageRequest, Term, TextRequest, register_term
from losses import clip_loss


@dataclass
class {cls}Options:
    scale: float = 1.0


class {cls}(Term):
    requests = frozenset({{"image", "text"}})

    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def image_inputs(self, batch):
        return {{"image": ImageRequest(batch["image_inputs"])}}

    def text_inputs(self, batch):
        return {{"text": TextRequest(batch["input_ids"], batch["attention_mask"])}}

    def loss(self, model, feats, *, detach_params=False):
        return {{"nce": self.scale * clip_loss(feats["image"], feats["text"], model.logit_scale.exp())}}


@register_term("{name}", {cls}Options)
def build(options):
    return {cls}(options.scale), 1.0
'''


def _write_module(folder: Path, module: str, name: str) -> None:
    cls = "".join(part.title() for part in name.split("_"))
    (folder / f"{module}.py").write_text(textwrap.dedent(_MODULE.format(cls=cls, name=name)))


def test_a_module_dropped_into_the_package_registers(tmp_path, monkeypatch):
    # the package's folder, extended by tmp_path: a module there is found like one in finetune/objectives/
    _write_module(tmp_path, "dropped_term", "dropped")
    monkeypatch.setattr(objectives, "__path__", [*objectives.__path__, str(tmp_path)])
    assert "dropped" not in TERM_BUILDERS
    assert "dropped_term" in discover_terms()
    assert "dropped" in TERM_BUILDERS and "dropped" in config_module.registered_term_configs()
    sys.modules.pop("finetune.objectives.dropped_term", None)


def test_objective_import_loads_a_users_term_and_runs_it(tmp_path, monkeypatch, model, batch):
    _write_module(tmp_path, "user_terms_a", "user_nce")
    _write_module(tmp_path, "user_terms_b", "user_nce_b")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"objective": {"base": "none", "import": ["user_terms_a"],
                                                  "terms": {"user_nce": {"scale": 2.0}}}}))
    recipe = load_recipe(path, trust_imports=True)
    assert recipe.objective.imports == ["user_terms_a"]
    objective = build_objective(recipe.objective)
    values = objective.loss(model, objective.encode(model, batch))
    assert set(values) == {"user_nce/nce", "loss"}
    expected = 2.0 * clip_loss(*_embeds(model, batch), model.logit_scale.exp())
    torch.testing.assert_close(values["loss"], expected)
    # a config object built in code: build_objective imports the module itself
    assert "user_terms_b" not in sys.modules
    cfg = types.SimpleNamespace(base="clip", imports=["user_terms_b"], terms={"user_nce_b": None},
                                label_smoothing=None)
    objective = build_objective(cfg)
    assert [t.name for t in objective.all_terms] == ["clip", "user_nce_b"]
    assert math.isfinite(float(objective.loss(model, objective.encode(model, batch))["loss"].detach()))
    bad = types.SimpleNamespace(base="clip", imports=["user_terms_missing"], terms={}, label_smoothing=None)
    with pytest.raises(ImportError, match=r"objective.import\[0\]: cannot import module 'user_terms_missing'"):
        build_objective(bad)


def _embeds(model, batch):
    with torch.no_grad():
        image = model.encode_image(**batch["image_inputs"]).embeds
        text = model.encode_text(batch["input_ids"], batch["attention_mask"]).embeds
    return image, text


# -- shared feature keys --------------------------------------------------------------------------------
def test_one_key_asked_by_two_terms_is_encoded_once_with_states(model, batch, monkeypatch):
    calls = {"image": [], "text": []}
    encode_image, encode_text = model.encode_image, model.encode_text

    def counting_image(*args, **kwargs):
        calls["image"].append(kwargs)
        return encode_image(*args, **kwargs)

    def counting_text(*args, **kwargs):
        calls["text"].append(kwargs)
        return encode_text(*args, **kwargs)

    monkeypatch.setattr(model, "encode_image", counting_image)
    monkeypatch.setattr(model, "encode_text", counting_text)
    objective = Objective(ClipTerm(), [(_Toy(states=True, text_states=True), 1.0)])
    feats = objective.encode(model, batch)
    assert len(calls["image"]) == 1 and calls["image"][0]["states"] is True
    assert len(calls["text"]) == 1 and calls["text"][0]["states"] is True
    n = len(batch["input_ids"])
    assert feats["image"].shape[0] == n and feats["text"].shape[0] == n  # not 2n: one copy per key
    assert feats["image_states"].shape[:2] == (n, int(torch.tensor(model.encode_image(
        **batch["image_inputs"], states=True).grid).prod()))
    assert feats["text_states"].shape[:2] == batch["input_ids"].shape
    expected = _embeds(model, batch)
    torch.testing.assert_close(feats["image"], expected[0])
    torch.testing.assert_close(feats["text"], expected[1])
    # the states go with the key whichever term asked first
    feats = Objective(_Toy(states=True), [(ClipTerm(), 1.0)]).encode(model, batch)
    assert "image_states" in feats


def test_one_key_with_different_inputs_names_both_terms(model, batch):
    class Flipped(_Toy):
        def image_inputs(self, batch):
            return {"image": ImageRequest({"pixel_values": batch["image_inputs"]["pixel_values"].flip(-1)})}

    objective = Objective(ClipTerm(), [(Flipped("flipped"), 1.0)])
    with pytest.raises(TermCollisionError, match="terms 'clip' and 'flipped' both write the feature key 'image'"):
        objective.encode(model, batch)
    # equal values in another tensor are the same input
    class Copied(_Toy):
        def image_inputs(self, batch):
            return {"image": ImageRequest({k: v.clone() for k, v in batch["image_inputs"].items()})}

    assert Objective(ClipTerm(), [(Copied("copied"), 1.0)]).encode(model, batch)["image"].shape[0] == 4


# -- loss names -----------------------------------------------------------------------------------------
def test_losses_are_named_term_slash_value(model, batch):
    assert loss_name("structxlip", "local") == "structxlip/local" and loss_name("clip", "clip") == "clip"
    objective = Objective(ClipTerm(), [(_Toy("goal"), {"half": 0.5})])
    values = objective.loss(model, objective.encode(model, batch))
    assert list(values) == ["clip", "goal", "goal/half", "loss"]
    torch.testing.assert_close(values["goal/half"], values["goal"] / 2)
    torch.testing.assert_close(values["loss"], values["clip"] + values["goal"] + 0.5 * values["goal/half"])


def test_two_terms_with_a_value_of_one_name_log_apart(model, batch):
    """FAST-GOAL's ``local`` and StructXLIP's ``local`` must not overwrite each other."""

    class Local(_Toy):
        def loss(self, model, feats, *, detach_params=False):
            return {"local": clip_loss(feats["image"], feats["text"], model.logit_scale.exp()) * len(self.name)}

    objective = Objective(None, [(Local("fastgoal"), 1.0), (Local("sx"), 1.0)])
    values = objective.loss(model, objective.encode(model, batch))
    assert set(values) == {"fastgoal/local", "sx/local", "loss"}
    torch.testing.assert_close(values["fastgoal/local"], values["sx/local"] * 4)


# -- collisions -----------------------------------------------------------------------------------------
class _Fields(Term):
    def __init__(self, name, *, prepared=(), collated=(), extra=(), produces=(), features=()):
        super().__init__()
        self.name = name
        self.prepared, self.collated, self.extra = prepared, collated, extra
        self.produces, self.features = frozenset(produces), frozenset(features)

    def prepare(self, example):
        return {k: 1 for k in self.prepared}

    def collate(self, examples, model):
        return {k: torch.zeros(len(examples)) for k in self.collated}

    def image_inputs(self, batch):
        return {"image": image_request(batch)}

    def extra_features(self, model, batch, feats):
        for k in self.extra:
            feats[k] = torch.zeros(1)

    def loss(self, model, feats, *, detach_params=False):
        return {self.name: feats["image"].sum() * 0}


def test_declared_collisions_fail_when_the_objective_is_built():
    with pytest.raises(TermCollisionError, match="terms 'a' and 'b' both write the batch field 'mask'"):
        Objective(_Fields("a", produces={"mask"}), [(_Fields("b", produces={"mask"}), 1.0)])
    with pytest.raises(TermCollisionError, match="term 'a' writes the batch field 'input_ids'.*the collator"):
        Objective(_Fields("a", produces={"input_ids"}))
    with pytest.raises(TermCollisionError, match="terms 'a' and 'b' both write the feature key 'owner'"):
        Objective(_Fields("a", features={"owner"}), [(_Fields("b", features={"owner"}), 1.0)])
    with pytest.raises(TermCollisionError, match="terms 'clip' and 'b' both write the feature key 'text'"):
        Objective(ClipTerm(), [(_Fields("b", features={"text"}), 1.0)])


def test_undeclared_collisions_fail_while_running(model, batch):
    objective = Objective(_Fields("a", prepared=["f"]), [(_Fields("b", prepared=["f"]), 1.0)])
    with pytest.raises(TermCollisionError, match="terms 'a' and 'b' both write the example field 'f' \\(in prepare\\)"):
        objective.prepare({"caption": "x"})
    objective = Objective(_Fields("a", collated=["g"]), [(_Fields("b", collated=["g"]), 1.0)])
    with pytest.raises(TermCollisionError, match="terms 'a' and 'b' both write the batch field 'g' \\(in collate\\)"):
        objective.collate([{}, {}], model)
    with pytest.raises(TermCollisionError, match="term 'a' writes the batch field 'input_ids'"):
        Objective(_Fields("a", collated=["input_ids"])).collate([{}], model)
    objective = Objective(_Fields("a", extra=["h"]), [(_Fields("b", extra=["h"]), 1.0)])
    with pytest.raises(TermCollisionError, match="terms 'a' and 'b' both write the feature key 'h' \\(in extra_f"):
        objective.encode(model, batch)
    objective = Objective(ClipTerm(), [(_Fields("b", extra=["text"]), 1.0)])
    with pytest.raises(TermCollisionError, match="terms 'clip' and 'b' both write the feature key 'text'"):
        objective.encode(model, batch)
    # a term may write its own keys, and distinct keys pass
    Objective(_Fields("a", extra=["h"]), [(_Fields("b", extra=["i"]), 1.0)]).encode(model, batch)


def test_a_run_without_base_names_only_its_terms_on_the_model_card():
    from finetune.hub.model_card import method_keys

    recipe = {"objective": {"base": "none", "terms": {"structxlip": {}}}}
    assert method_keys({}, recipe) == ["structxlip"]
    assert method_keys({}, {"objective": {"base": "clip", "terms": {}}}) == ["clip"]


# ------------------------------------------------------------------ a batch a contrastive term cannot learn from (#40)


@pytest.mark.parametrize("base", ["clip", "siglip", "longclip"])
def test_a_batch_of_one_is_refused_for_contrastive_terms(base):
    """Issue 40: ``train.batch_size=1`` with the clip loss trained on a loss of exactly 0 at every step, exit 0."""
    objective = build_objective(types.SimpleNamespace(base=base, terms={}, label_smoothing=None, imports=[]))
    with pytest.raises(ValueError, match=rf"train\.batch_size=1 gives each loss 1 example\(s\): the contrastive "
                                         rf"term\(s\) {base} .*loss of exactly 0"):
        objective.check_batch(1)
    with pytest.raises(ValueError, match=r"train\.batch_size=4 / train\.accumulation_steps=4 .*at least 8"):
        objective.check_batch(4, 4)
    objective.check_batch(2)
    objective.check_batch(8, 4)


def test_the_clip_loss_of_a_batch_of_one_is_exactly_zero():
    """Why: InfoNCE of one pair is log softmax over a single logit."""
    from losses import clip_loss

    image, text = torch.randn(1, 8, requires_grad=True), torch.randn(1, 8)
    assert clip_loss(image, text, torch.tensor(10.0)).item() == 0.0


def test_xlipkit_train_and_validate_refuse_it_before_anything_slow(tmp_path):
    from finetune.training.preflight import preflight

    path = tmp_path / "r.yaml"
    path.write_text("# r\ntrain: {batch_size: 1, max_steps: 2}\neval: {sets: []}\n", encoding="utf-8")
    problems = preflight(load_recipe(path), str(path), output=False).message()
    assert problems is not None and "train.batch_size=1 gives each loss 1 example(s)" in problems
