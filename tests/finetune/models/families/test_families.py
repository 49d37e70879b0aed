"""Model families (``register_model_family``), optional DualEncoder capabilities and the modules a
model needs at inference (``register_inference_module``), DESIGN 4 "Seams".

A toy two-tower family is registered here: its own folder format (``toy_config.json`` +
``toy_model.safetensors``), no text position table, no states, no patch geometry.
"""

from __future__ import annotations

import json
import math
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

import finetune
import finetune.models as models
from finetune import load_finetuned, load_model
from finetune.models.adapters import apply_adapter
from finetune.models.finetuned import save_finetuned
from finetune.models.core.encoder import (
    DualEncoder,
    ImageFeatures,
    MissingCapabilityError,
    TextFeatures,
    TokenizedText,
)
from finetune.models.families import (
    detect_family,
    model_family_names,
    recipe_family,
    register_model_family,
    unregister_model_family,
)
from finetune.models.inference_modules import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    register_inference_module,
)
from finetune.models.longclip import apply_kps
from finetune.models.registry import save_tiny

TOY_CONFIG = "toy_config.json"
TOY_WEIGHTS = "toy_model.safetensors"


class ToyDualEncoder(DualEncoder):
    """Two linear towers: images averaged to 4x4 pixels, texts as the mean of hashed word embeddings."""

    backend = "toy"

    def __init__(self, *, dim: int = 8, vocab: int = 64, max_text_len: int = 12, name_or_path: str = "toy") -> None:
        towers = nn.Module()
        towers.image_proj = nn.Linear(3 * 4 * 4, dim)
        towers.token_embed = nn.Embedding(vocab, dim)
        towers.text_proj = nn.Linear(dim, dim)
        towers.log_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        super().__init__(towers)
        self.dim, self.vocab = dim, vocab
        self.max_text_len = self.base_text_len = max_text_len
        self.image_size, self.patch_size = 4, 4
        self.name_or_path = name_or_path

    def tokenize(self, texts: list[str], *, max_length: int | None = None) -> TokenizedText:
        length = max_length or self.max_text_len
        rows = [[1 + zlib.crc32(w.encode()) % (self.vocab - 1) for w in t.lower().split()] or [1] for t in texts]
        truncated = torch.tensor([len(r) > length for r in rows])
        rows = [r[:length] for r in rows]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        self._count_truncation(truncated)
        return TokenizedText(ids, mask, truncated)

    def preprocess_images(self, images: list[Any]) -> dict[str, Tensor]:
        arrays = [np.asarray(im.convert("RGB").resize((4, 4)), dtype=np.float32) / 255.0 for im in images]
        return {"pixel_values": torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()}

    def encode_image(self, pixel_values: Tensor, *, states: bool = False, states_rows: int | None = None,
                     **kwargs: Any) -> ImageFeatures:
        if states:
            self.require("states", "encode_image(states=True)")
        x = pixel_values.to(self.model.image_proj.weight.dtype).flatten(1)
        return ImageFeatures(self.model.image_proj(x), None, (1, 1))

    def encode_text(self, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                    states: bool = False) -> TextFeatures:
        if states:
            self.require("states", "encode_text(states=True)")
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        emb = self.model.token_embed(input_ids) * mask.unsqueeze(-1)
        pooled = emb.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return TextFeatures(self.model.text_proj(pooled), None, mask)

    @property
    def logit_scale(self) -> nn.Parameter:
        return self.model.log_scale

    def save_pretrained(self, path: str) -> None:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / TOY_CONFIG).write_text(json.dumps({"dim": self.dim, "vocab": self.vocab,
                                                     "max_text_len": self.max_text_len}))
        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, str(folder / TOY_WEIGHTS))


def load_toy(path: str, *, dtype: torch.dtype | None = None, trust_remote_code: bool = False,
             revision: str | None = None) -> ToyDualEncoder:
    folder = Path(path)
    model = ToyDualEncoder(**json.loads((folder / TOY_CONFIG).read_text()), name_or_path=str(path))
    model.model.load_state_dict(load_file(str(folder / TOY_WEIGHTS)))
    return (model.to(dtype) if dtype is not None else model).eval()


@register_inference_module
class ToyHead(nn.Module):
    """A small head on the joint embeddings (``(B, D) -> (B, 1)``), as a term would train."""

    def __init__(self, dim: int, hidden: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.register_buffer("offset", torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) + self.offset


@pytest.fixture
def toy_family():
    register_model_family("toy", load_toy, lambda model, folder: model.save_pretrained(folder),
                          detect=lambda p: (Path(p) / TOY_CONFIG).is_file(), files=TOY_CONFIG)
    yield "toy"
    unregister_model_family("toy")


@pytest.fixture
def toy_dir(toy_family, tmp_path: Path) -> Path:
    torch.manual_seed(0)
    ToyDualEncoder().save_pretrained(str(tmp_path / "toy"))
    return tmp_path / "toy"


def _images(n: int = 3) -> list[Image.Image]:
    rng = np.random.RandomState(0)
    return [Image.fromarray(rng.randint(0, 255, (20, 24, 3), dtype=np.uint8)) for _ in range(n)]


CAPTIONS = ["a red circle on the left", "two blue squares", "a small green star in the corner"]


@torch.no_grad()
def _outputs(model: DualEncoder) -> dict[str, Tensor]:
    tok = model.tokenize(CAPTIONS)
    image = model.encode_image(**model.preprocess_images(_images())).embeds
    text = model.encode_text(tok.input_ids, tok.attention_mask).embeds
    out = {"image": image, "text": text}
    if "head" in model.inference_modules:
        out["head"] = model.inference_modules["head"](image)
    return out


def _assert_same(a: dict[str, Tensor], b: dict[str, Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


# -- families --------------------------------------------------------------------------------------------
def test_builtin_families_are_registered_and_exported() -> None:
    assert model_family_names()[:2] == ["hf", "open_clip"]
    assert finetune.register_model_family is register_model_family is models.register_model_family
    assert finetune.register_inference_module is register_inference_module is models.register_inference_module


def test_a_registered_family_is_detected_loaded_and_round_trips(toy_dir: Path, tmp_path: Path) -> None:
    assert detect_family(toy_dir) == "toy"
    model = load_model(str(toy_dir))  # family auto: the toy detect recognises the folder
    assert isinstance(model, ToyDualEncoder) and model.backend == "toy" and model.name_or_path == str(toy_dir)
    assert model.capabilities() == frozenset()
    before = _outputs(model)
    assert before["image"].shape == (3, 8) and before["text"].shape == (3, 8)
    named = load_model(str(toy_dir), family="toy")
    _assert_same(before, _outputs(named))

    # full save through save_finetuned: xlipkit.json records the family, load_model and load_finetuned read it
    with torch.no_grad():
        model.model.text_proj.bias.add_(0.5)
    changed = _outputs(model)
    save_finetuned(model, tmp_path / "final", recipe={"model": {"family": "toy"}})
    info = json.loads((tmp_path / "final" / "xlipkit.json").read_text())
    assert info["model_family"] == "toy" and info["backend"] == "toy" and info["kind"] == "full"
    _assert_same(changed, _outputs(load_model(str(tmp_path / "final"))))
    _assert_same(changed, _outputs(load_finetuned(tmp_path / "final")))
    assert not torch.equal(changed["text"], before["text"])


def test_recorded_family_wins_over_detection_and_old_backend_key_is_read(toy_dir: Path, tmp_path: Path) -> None:
    model = load_model(str(toy_dir))
    save_finetuned(model, tmp_path / "final")
    # a family registered later whose detect accepts any folder is asked first among detectors ...
    register_model_family("greedy", load_toy, lambda m, f: m.save_pretrained(f), detect=lambda p: True)
    try:
        assert detect_family(toy_dir) == "greedy"
        # ... but the family recorded in xlipkit.json comes first
        assert detect_family(tmp_path / "final") == "toy"
        assert load_model(str(tmp_path / "final")).backend == "toy"
        # folders written before families existed record only "backend"
        info_file = tmp_path / "final" / "xlipkit.json"
        info = json.loads(info_file.read_text())
        del info["model_family"]
        info_file.write_text(json.dumps(info))
        assert detect_family(tmp_path / "final") == "toy"
        assert load_model(str(tmp_path / "final")).backend == "toy"
    finally:
        unregister_model_family("greedy")


def test_old_hf_folder_with_backend_key_still_loads(tmp_path: Path) -> None:
    model = load_model("tiny-clip")
    save_finetuned(model, tmp_path / "final")
    info_file = tmp_path / "final" / "xlipkit.json"
    info = json.loads(info_file.read_text())
    del info["model_family"]
    info_file.write_text(json.dumps(info))
    assert load_finetuned(tmp_path / "final").backend == "hf"


def test_unregistered_recorded_family_says_to_import_its_module(toy_dir: Path, tmp_path: Path) -> None:
    save_finetuned(load_model(str(toy_dir)), tmp_path / "final")
    info_file = tmp_path / "final" / "xlipkit.json"
    info = json.loads(info_file.read_text())
    info["model_family"] = info["backend"] = "plugin_family"
    info_file.write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"records model family 'plugin_family', which is not registered.*'hf', 'open_clip'"):
        load_model(str(tmp_path / "final"))


def test_registering_a_taken_name_is_an_error(toy_family: str) -> None:
    with pytest.raises(ValueError, match=r"model family 'toy' is already registered"):
        register_model_family("toy", load_toy, lambda m, f: None)
    with pytest.raises(ValueError, match="already registered"):
        register_model_family("hf", load_toy, lambda m, f: None)
    with pytest.raises(ValueError, match="other than 'auto'"):
        register_model_family("auto", load_toy, lambda m, f: None)
    with pytest.raises(TypeError, match="saver must be callable"):
        register_model_family("toy2", load_toy, "save")
    assert model_family_names().count("toy") == 1 and "toy2" not in model_family_names()


def test_unknown_family_lists_the_registered_ones(toy_family: str) -> None:
    with pytest.raises(ValueError, match=r"family 'plugin_family' is not a registered model family; registered: "
                                         r"'hf', 'open_clip', .*'toy'"):
        load_model("tiny-clip", family="plugin_family")
    with pytest.raises(ValueError, match=r"backend 'jax' is not a registered model family"):
        load_model("tiny-clip", backend="jax")
    with pytest.raises(ValueError, match="disagree"):
        load_model("tiny-clip", family="hf", backend="open_clip")


def test_recipe_family_reads_family_and_the_deprecated_backend(toy_family: str) -> None:
    class M:
        family, backend = "auto", "auto"

    m = M()
    assert recipe_family(m) == "auto"
    m.backend = "open_clip"
    with pytest.warns(DeprecationWarning, match="model.backend is deprecated"):
        assert recipe_family(m) == "open_clip"
    m.family, m.backend = "toy", "auto"
    assert recipe_family(m) == "toy"
    m.family = "nope"
    with pytest.raises(ValueError, match=r"recipe key model.family 'nope' is not a registered model family"):
        recipe_family(m)


def test_family_named_for_a_folder_of_another_format_says_what_is_missing(toy_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=rf"not a model folder for family='hf': no config.json"):
        load_model(str(toy_dir), family="hf")
    save_tiny("tiny-clip", tmp_path / "clip")
    with pytest.raises(FileNotFoundError, match=rf"family='toy': no {TOY_CONFIG}"):
        load_model(str(tmp_path / "clip"), family="toy")


# -- capabilities ------------------------------------------------------------------------------------------
def test_missing_capabilities_give_clear_errors(toy_dir: Path) -> None:
    model = load_model(str(toy_dir))
    assert model.position_embedding() is None and model.image_transform_params() is None
    with pytest.raises(MissingCapabilityError, match=r"Long-CLIP KPS .* needs the 'kps' capability.*ToyDualEncoder"
                                                     r".*model family 'toy'"):
        apply_kps(model, length=24)
    with pytest.raises(MissingCapabilityError, match="'kps' capability"):
        load_model(str(toy_dir), max_text_len=24)
    with pytest.raises(MissingCapabilityError, match="'states' capability"):
        model.encode_image(torch.zeros(1, 3, 4, 4), states=True)
    with pytest.raises(MissingCapabilityError, match="'states' capability"):
        model.project_text_states(torch.zeros(1, 8))
    with pytest.raises(MissingCapabilityError, match="'patch_geometry' capability"):
        model.require("patch_geometry", "StructXLIP's region pooling")
    with pytest.raises(MissingCapabilityError, match="'gradient_checkpointing' capability"):
        model.set_gradient_checkpointing(True)
    assert load_model("tiny-clip").capabilities() == {"states", "kps", "patch_geometry", "gradient_checkpointing"}


def test_toy_family_trains_through_finetune_train(toy_dir: Path, tmp_path: Path) -> None:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.state import AcceleratorState, GradientState

    from finetune.config import load_recipe
    from finetune.data.sources import load_source
    from finetune.objectives import ClipTerm, Objective
    from finetune.training import FinetuneRecipe, TrainModule, build_loop

    scenes = load_source({"name": "synthetic", "size": 16, "seed": 0, "options": {"image_size": 32}}).dataset
    model = apply_adapter(load_model(str(toy_dir)), {"type": "full"})
    model.inference_modules["head"] = ToyHead(dim=8)
    objective = Objective(ClipTerm())
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"train": {"lr": 1e-2, "batch_size": 8, "max_steps": 2, "trackers": [],
                                                "log_every": 1, "seed": 0, "warmup_steps": 0}}))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    before = {k: v.clone() for k, v in model.model.state_dict().items()}
    loop = build_loop(acc, TrainModule(model, objective), scenes, load_recipe(recipe).train, tmp_path / "run")
    result = FinetuneRecipe.from_loop(loop).train()
    assert result.steps == 2 and all(math.isfinite(h["loss"]) for h in result.history)
    trained = loop.trained_model()
    assert any(not torch.equal(before[k], v) for k, v in trained.model.state_dict().items())
    save_finetuned(trained, tmp_path / "run" / "final")
    _assert_same(_outputs(trained.eval()), _outputs(load_finetuned(tmp_path / "run" / "final")))


def test_toy_family_lora_needs_targets_and_round_trips(toy_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model family 'toy' .* has no adapter preset: give adapter.targets"):
        apply_adapter(load_model(str(toy_dir)), {"type": "lora", "r": 2})
    model = apply_adapter(load_model(str(toy_dir)), {"type": "lora", "r": 2, "alpha": 4,
                                                     "targets": ["image_proj", "text_proj"]})
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    model.inference_modules["head"] = ToyHead(dim=8, hidden=3)
    want = _outputs(model.eval())
    save_finetuned(model, tmp_path / "adapter")
    info = json.loads((tmp_path / "adapter" / "xlipkit.json").read_text())
    assert info["kind"] == "adapter" and info["model_family"] == "toy" and info["inference_modules"] == ["head"]
    _assert_same(want, _outputs(load_finetuned(tmp_path / "adapter")))
    _assert_same(want, _outputs(load_model(str(tmp_path / "adapter"))))


# -- inference modules ---------------------------------------------------------------------------------------
def _with_head(model: DualEncoder, seed: int = 0) -> DualEncoder:
    torch.manual_seed(seed)
    head = ToyHead(dim=model.encode_text(model.tokenize(["x"]).input_ids).embeds.shape[-1], hidden=5)
    with torch.no_grad():
        head.offset.fill_(0.25)  # a buffer must come back too
    model.inference_modules["head"] = head
    return model


@pytest.fixture
def clip_base(tmp_path: Path) -> Path:
    return save_tiny("tiny-clip", tmp_path / "base")


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_inference_module_survives_save_and_load(clip_base: Path, tmp_path: Path, adapter: str) -> None:
    model = apply_adapter(load_model(str(clip_base), max_text_len=100), {"type": adapter, "r": 4, "alpha": 8})
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    _with_head(model)
    want = _outputs(model.eval())
    assert float(want["head"].std()) > 0
    folder = save_finetuned(model, tmp_path / "final")
    assert (folder / CONFIG_NAME).is_file() and (folder / WEIGHTS_NAME).is_file()
    saved = json.loads((folder / CONFIG_NAME).read_text())["modules"]["head"]
    assert saved["class"] == "ToyHead" and saved["config"] == {"dim": 32, "hidden": 5}
    loaded = load_finetuned(folder)
    assert isinstance(loaded.inference_modules["head"], ToyHead) and not loaded.inference_modules.training
    _assert_same(want, _outputs(loaded))
    merged = load_finetuned(folder, merge=adapter == "lora")
    _assert_same(want, _outputs(merged))


def test_unregistered_inference_modules_are_refused_on_save_and_on_load(clip_base: Path, tmp_path: Path) -> None:
    class Unregistered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

    model = load_model(str(clip_base))
    model.inference_modules["x"] = Unregistered()
    with pytest.raises(ValueError, match=r"Unregistered is not registered.*register_inference_module"):
        save_finetuned(model, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()

    folder = save_finetuned(_with_head(load_model(str(clip_base))), tmp_path / "final")
    spec = json.loads((folder / CONFIG_NAME).read_text())
    spec["modules"]["head"]["class"] = "os.system"  # a class path is looked up by name, never imported
    (folder / CONFIG_NAME).write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"class 'os.system', which is not registered.*import the module"):
        load_finetuned(folder)


def test_registering_another_class_under_a_taken_name_is_an_error() -> None:
    class Other(nn.Module):
        pass

    with pytest.raises(ValueError, match="inference module name 'ToyHead' is already taken"):
        register_inference_module(Other, name="ToyHead")
    with pytest.raises(TypeError, match="nn.Module subclass"):
        register_inference_module(dict)


@pytest.mark.slow
def test_inference_module_is_staged_for_the_hub_and_exported(clip_base: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    from finetune.hub import export, stage_upload

    for adapter in ("full", "lora"):
        model = apply_adapter(load_model(str(clip_base), max_text_len=100), {"type": adapter, "r": 4, "alpha": 8})
        _with_head(model, seed=3)
        want = _outputs(model.eval())
        run = tmp_path / f"run-{adapter}"
        save_finetuned(model, run / "final", recipe={"model": {"name_or_path": str(clip_base)}})
        (run / "recipe.yaml").write_text(yaml.safe_dump({"model": {"name_or_path": str(clip_base)}}))

        staged = stage_upload(run, tmp_path / f"upload-{adapter}", repo_id="me/toy-head",
                              base_model="openai/clip-vit-base-patch16" if adapter == "lora" else None)
        assert (staged / CONFIG_NAME).is_file() and (staged / WEIGHTS_NAME).is_file()
        if adapter == "full":  # an adapter's staged base is the hub id, which is not here offline
            _assert_same(want, _outputs(load_finetuned(staged)))

        merged = stage_upload(run, tmp_path / f"merged-{adapter}", repo_id="me/toy-head", merge=True)
        _assert_same(want, _outputs(load_finetuned(merged)))

        with caplog.at_level("INFO", logger="xlipkit"):
            out = export(run, tmp_path / f"export-{adapter}")
        assert (out / CONFIG_NAME).is_file() and (out / WEIGHTS_NAME).is_file()
        assert "inference modules (head) are written beside it" in caplog.text
        _assert_same(want, _outputs(load_finetuned(out)))
        shutil.rmtree(out)


def test_model_card_offers_no_plain_snippet_for_another_family() -> None:
    from finetune.hub.model_card import plain_snippet

    assert plain_snippet({"kind": "full", "backend": "toy", "family": "clip"}, "me/toy") is None
    assert plain_snippet({"kind": "full", "backend": "hf", "family": "clip"}, "me/clip")[0] == "With plain transformers"


def test_families_are_found_by_the_discovery_rule(tmp_path: Path, monkeypatch) -> None:
    """No hand-kept list: the first lookup imports every module of the registry's packages."""
    from finetune.models import families
    from finetune.plugins import MODEL_FAMILIES

    (tmp_path / "xlip_builtin_family_probe.py").write_text(
        "from finetune.models.families import register_model_family\n"
        "register_model_family('probe_family', lambda p, **kw: None, lambda m, f: None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(MODEL_FAMILIES, "packages", (*MODEL_FAMILIES.packages, "xlip_builtin_family_probe"))
    monkeypatch.setattr(MODEL_FAMILIES, "_discovered", False)
    assert not hasattr(families, "BUILTIN_FAMILY_MODULES")
    try:
        assert families.get_model_family("probe_family").name == "probe_family"
    finally:
        if "probe_family" in families.model_family_names():
            families.unregister_model_family("probe_family")


def test_each_family_module_registers_its_family_and_its_named_configs() -> None:
    """Each module of finetune/models/families holds one family's loader and the named configs it builds."""
    import pkgutil

    from finetune.models import families
    from finetune.plugins import MODEL_FAMILIES, NAMED_CONFIGS

    modules = {info.name for info in pkgutil.iter_modules(families.__path__)}
    assert modules == {"hf", "open_clip", "vision_text", "flair", "fcast"}
    where = {name: family.loader.__module__ for name, family in MODEL_FAMILIES.items()}
    assert {n: m for n, m in where.items() if m.startswith("finetune.")} == {
        "hf": "finetune.models.families.hf", "open_clip": "finetune.models.families.open_clip",
        "vision_text": "finetune.models.families.vision_text", "flair": "finetune.models.families.flair",
        "fcast": "finetune.models.families.fcast"}
    configs = dict(NAMED_CONFIGS.items())
    assert {n for n, e in configs.items() if e.backend == "fcast"} == {"fcast-b", "fcast-s", "fcast-tiny"}
    assert {n for n, e in configs.items() if e.backend == "flair"} == {"tiny-flair", "small-flair", "flair-vit-b-16"}
    for name, entry in configs.items():
        assert entry.build is None or entry.build.__module__ == where[entry.backend], name
    # the generic families are listed first (and tried last by detect_family)
    assert model_family_names()[:2] == ["hf", "open_clip"]
