"""The model card: front matter keys and values per kind of upload, the prose sections, and that
the copy-paste snippets it shows really load the model (run here against local folders)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from finetune import load_finetuned
from finetune.hub import export, stage_upload
from finetune.hub.model_card import (
    hub_model_id,
    is_local_path,
    peft_snippet,
    read_front_matter,
    render_model_card,
    transformers_snippet,
)
from finetune.models.registry import save_tiny
from tests.finetune.hub.hub_runs import AFTER, BEFORE, CAPTIONS, embeddings, images, make_run, recipe_dict


def _info(kind: str = "adapter", *, base: str = "openai/clip-vit-base-patch16", backend: str = "hf",
          family: str = "clip", adapter: str = "lora") -> dict[str, Any]:
    return {"format": "xlipkit", "version": 1, "kind": kind, "base_model": base, "backend": backend,
            "family": family, "base_text_len": 77, "max_text_len": 248,
            "kps": {"length": 248, "keep": 20, "ratio": 4, "freeze_kept": True},
            "adapter": {"type": adapter, "r": 16, "alpha": 32, "dropout": 0.05, "targets": "preset",
                        "train_extra": ["positions", "logit_scale"]},
            "extra_tensors": ["text_model.embeddings.position_embedding.weight", "logit_scale"]}


METRICS = {"objective": "clip, structxlip", "train_set": "docci", "train_examples": 9647, "steps": 6030,
           "before": BEFORE, "after": AFTER}


def test_front_matter_of_a_transformers_adapter() -> None:
    card = render_model_card(_info(), repo_id="me/clip-structxlip-docci", recipe=recipe_dict("x", "lora"),
                             metrics=METRICS)
    meta = read_front_matter(card)
    assert meta["base_model"] == "openai/clip-vit-base-patch16"
    assert meta["library_name"] == "peft"
    assert meta["pipeline_tag"] == "zero-shot-image-classification"
    assert meta["tags"] == ["xlipkit", "clip", "long-captions", "structxlip", "long-clip", "lora", "peft"]
    assert meta["datasets"] == ["google/docci"]
    [entry] = meta["model-index"]
    assert entry["name"] == "clip-structxlip-docci"
    t2i = next(r for r in entry["results"] if r["task"]["type"] == "text-to-image-retrieval")
    assert t2i["dataset"] == {"name": "synthetic", "type": "synthetic", "split": "default"}
    assert t2i["metrics"] == [{"type": "recall", "value": 25.0, "name": "t2i R@1"},
                              {"type": "recall", "value": 75.0, "name": "t2i R@5"}]


def test_card_prose_has_loading_training_results_and_papers() -> None:
    card = render_model_card(_info(adapter="dora"), repo_id="me/m", recipe=recipe_dict("x", "dora"),
                             recipe_text="# my recipe\nmodel: {name_or_path: x}\n", metrics=METRICS)
    body = card.split("\n---\n", 1)[1]
    assert 'model = load_finetuned("me/m")' in body
    assert "### With plain transformers + peft" in body
    assert "text positions: 77 -> 248 with Long-CLIP knowledge-preserving stretching (keep 20, ratio 4" in body
    assert "dora r=16 alpha=32" in body and "`logit_scale`" in body
    assert "6030 steps at batch 8" in body
    assert "```yaml\n# my recipe\nmodel: {name_or_path: x}\n```" in body
    assert "| synthetic | 8 / 8 | text→image | 12.5 → 25.0 | 50.0 → 75.0 |" in body
    assert "StructXLIP" in body
    assert "https://arxiv.org/abs/2403.15378" in body and "https://arxiv.org/abs/2402.09353" in body


def test_the_card_names_the_model_family_and_architecture_as_the_readme_does() -> None:
    body = render_model_card(_info(), repo_id="me/m").split("\n---\n", 1)[1]
    assert "(clip architecture, model family `hf`)" in body
    assert "clip family" not in body and "hf backend" not in body
    info = {**_info(family="siglip2", backend="hf"), "model_family": "hf"}
    assert "(siglip2 architecture, model family `hf`)" in render_model_card(info, repo_id="me/m")


def test_front_matter_without_hub_base_or_evaluation() -> None:
    meta = read_front_matter(render_model_card(_info(base="tiny-clip"), repo_id="me/m"))
    assert "base_model" not in meta and "model-index" not in meta and "datasets" not in meta
    card = render_model_card(_info(base="tiny-clip"), repo_id="me/m")
    assert "not a hub repository" in card and "No evaluation was recorded" in card
    full = read_front_matter(render_model_card(_info("full", backend="open_clip", base="hf-hub:org/long"),
                                               repo_id="me/m"))
    assert full["library_name"] == "open_clip" and full["base_model"] == "org/long" and "peft" not in full["tags"]


def test_hub_ids_and_local_paths(tmp_path: Path) -> None:
    assert hub_model_id("openai/clip-vit-base-patch16") == "openai/clip-vit-base-patch16"
    assert hub_model_id("hf-hub:timm/ViT-B-16-SigLIP") == "timm/ViT-B-16-SigLIP"
    for name in ("tiny-clip", "ViT-B-16:openai", "/models/clip", "runs/a/final", None):
        assert hub_model_id(name) is None
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert is_local_path(str(tmp_path / "org" / "name")) and is_local_path("longclip-B.pt")
    assert not is_local_path("openai/clip-vit-base-patch16") and not is_local_path("tiny-clip")
    with pytest.raises(ValueError, match="no YAML front matter"):
        read_front_matter("# a card")


_WITHOUT_XLIPKIT = """
import sys

class _NoXlipkit:  # the card's reader has no xlipkit: importing it must fail
    def find_spec(self, name, path=None, target=None):
        if name == "finetune" or name.startswith("finetune."):
            raise ImportError(f"xlipkit is not installed here ({name})")
        return None

sys.meta_path.insert(0, _NoXlipkit())
import torch
import huggingface_hub

folder_on_disk, inputs_file, out_file, snippet = sys.argv[1:5]
huggingface_hub.snapshot_download = lambda repo_id, **kw: folder_on_disk
scope = {}
exec(snippet, scope)
inputs = torch.load(inputs_file, weights_only=True)
model, tokenizer = scope["model"], scope["tokenizer"]
tok = tokenizer(inputs["captions"], padding="max_length", truncation=True, return_tensors="pt")
with torch.no_grad():
    out = (model.get_text_features(input_ids=tok.input_ids), model.get_image_features(pixel_values=inputs["pixels"]))
out = [x if isinstance(x, torch.Tensor) else x.pooler_output for x in out]
assert not [m for m in sys.modules if m == "finetune" or m.startswith("finetune.")]
torch.save({"text": out[0], "image": out[1], "max_length": tokenizer.model_max_length}, out_file)
"""


@pytest.mark.slow
def test_peft_snippet_rebuilds_the_adapter_without_xlipkit(tmp_path: Path) -> None:
    import subprocess
    import sys

    from transformers import AutoImageProcessor

    base = save_tiny("tiny-siglip", tmp_path / "base")
    run = make_run(tmp_path / "run", str(base), "lora")
    folder = stage_upload(run, tmp_path / "upload", repo_id="me/m", base_model="google/siglip-base-patch16-224")
    pixels = AutoImageProcessor.from_pretrained(folder)(images=images(), return_tensors="pt").pixel_values
    torch.save({"captions": CAPTIONS, "pixels": pixels}, tmp_path / "inputs.pt")
    script = tmp_path / "reader.py"
    script.write_text(_WITHOUT_XLIPKIT)
    # a fresh interpreter, outside the repository: the snippet runs with no xlipkit imported or importable
    proc = subprocess.run([sys.executable, str(script), str(folder), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt"),
                           peft_snippet("me/m", str(base), 248)], capture_output=True, text=True, cwd=tmp_path,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert got["max_length"] == 248
    for name, want in zip(("text", "image"), embeddings(load_finetuned(run / "final"))):
        torch.testing.assert_close(got[name], want, atol=1e-5, rtol=0)


def test_transformers_snippet_loads_an_export(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", "tiny-clip", "dora")
    out = export(run, tmp_path / "export")
    scope: dict[str, Any] = {}
    exec(transformers_snippet(str(out), "clip").replace('["a long, detailed caption ..."]', repr(CAPTIONS)), scope)
    text = scope["text"] if isinstance(scope["text"], torch.Tensor) else scope["text"].pooler_output
    torch.testing.assert_close(text, embeddings(load_finetuned(run / "final"))[0], atol=1e-5, rtol=0)


def test_a_terms_registered_citation_reaches_the_card() -> None:
    # the card reads a term's paper from its registration (finetune.plugins.TERMS), not from a table of its own
    import dataclasses

    from finetune import plugins
    from finetune.objectives import Citation, register_term

    @dataclasses.dataclass
    class CitedOptions:
        weight: float = 1.0

    for registry in (plugins.TERMS, plugins.TERM_OPTIONS):
        registry.discover()
    saved = {registry: registry.snapshot() for registry in (plugins.TERMS, plugins.TERM_OPTIONS)}
    try:
        register_term("cited_term", CitedOptions, citation=Citation(
            "Doe et al., A Cited Term (NeurIPS 2031)", "https://arxiv.org/abs/3101.00001", tag="cited"))(
            lambda options: None)
        register_term("uncited_term", CitedOptions)(lambda options: None)
        recipe = {"objective": {"base": "clip", "terms": {"cited_term": {}, "uncited_term": {}}}}
        card = render_model_card(_info(kind="full"), repo_id="me/m", recipe=recipe, metrics=METRICS)
        meta = read_front_matter(card)
        assert meta["tags"] == ["xlipkit", "clip", "long-captions", "cited", "uncited_term", "long-clip", "lora"]
        methods = card.split("## Methods\n\n", 1)[1].strip().splitlines()
        assert methods == [
            "- Radford et al., Learning Transferable Visual Models From Natural Language Supervision (ICML 2021), "
            "https://arxiv.org/abs/2103.00020",
            "- Doe et al., A Cited Term (NeurIPS 2031), https://arxiv.org/abs/3101.00001",
            "- Zhang et al., Long-CLIP: Unlocking the Long-Text Capability of CLIP (ECCV 2024), "
            "https://arxiv.org/abs/2403.15378",
            "- Hu et al., LoRA: Low-Rank Adaptation of Large Language Models (ICLR 2022), "
            "https://arxiv.org/abs/2106.09685",
        ]
    finally:
        for registry, entries in saved.items():
            registry.restore(entries)


@pytest.mark.parametrize("name", ["clip", "siglip", "longclip", "structxlip", "fastgoal", "grm", "flair", "fcast"])
def test_every_shipped_term_registers_its_paper(name: str) -> None:
    from finetune import plugins

    citation = plugins.citation_of(plugins.TERMS, name)
    assert citation is not None and len(citation.text) > 20
