"""The model card (``README.md``) that ``finetune.hub.push`` uploads with a run.

A card is YAML front matter built with ``huggingface_hub.ModelCardData`` (``base_model``,
``library_name``, ``pipeline_tag: zero-shot-image-classification``, tags naming the methods,
``datasets`` and a ``model-index`` with the run's Recall@K per evaluation set) followed by prose:
what was trained and with which recipe, how to load it (``finetune.load_finetuned``, and plain
peft / transformers / open_clip where that works without xlipkit), the recall table and the papers
of the methods.

Inputs are the plain dictionaries a run folder holds: ``xlipkit.json`` (written by
``finetune.models.finetuned.save_finetuned``), the resolved recipe and ``metrics.json``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

import finetune.plugins as plugins
from finetune.evaluation.retrieval import format_table

PIPELINE_TAG = "zero-shot-image-classification"
#: hub task types of the two retrieval directions in the ``model-index``
RETRIEVAL_TASKS = {"t2i": ("text-to-image-retrieval", "Text-to-image retrieval"),
                   "i2t": ("image-to-text-retrieval", "Image-to-text retrieval")}

#: the papers behind the adapters (peft's LoRA / DoRA; not registered terms): (tag, citation, link or None).
#: A term's paper is part of its registration (``register_term(..., citation=...)``, read from
#: ``finetune.plugins.TERMS``), so a method of your own is cited on the cards of the runs that use it.
ADAPTER_PAPERS: dict[str, tuple[str, str, str | None]] = {
    "lora": ("lora", "Hu et al., LoRA: Low-Rank Adaptation of Large Language Models (ICLR 2022)",
             "https://arxiv.org/abs/2106.09685"),
    "dora": ("dora", "Liu et al., DoRA: Weight-Decomposed Low-Rank Adaptation (ICML 2024)",
             "https://arxiv.org/abs/2402.09353"),
}

#: training sources registered in ``finetune.data`` whose data is a hub dataset
HUB_DATASETS = {"docci": "google/docci", "docci_fg": "google/docci", "urban1k": "BeichenZhang/Urban1k",
                "sharegpt4v": "Lin-Chen/ShareGPT4V", "flickr30k": "nlphuji/flickr30k",
                "iiw": "google/imageinwords"}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_LOCAL_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def hub_model_id(name: str | None) -> str | None:
    """The hub repository id ``name`` refers to (``org/name`` or ``hf-hub:org/name``), or None for
    registry names, open_clip architecture names and local paths."""
    if not name:
        return None
    text = str(name)
    text = text[len("hf-hub:"):] if text.startswith("hf-hub:") else text
    if not _HUB_ID.match(text) or Path(text).expanduser().exists():
        return None
    return text


def is_local_path(name: str) -> bool:
    """Whether a ``base_model`` names a file or folder on this machine (so that an adapter over it
    cannot be loaded anywhere else)."""
    text = str(name)
    if text.startswith("hf-hub:"):
        return False
    return (text.startswith(("/", "./", "../", "~", ".\\")) or text.count("/") > 1
            or text.endswith(_LOCAL_SUFFIXES) or Path(text).expanduser().exists())


def _term_key(name: str) -> str:
    return name.strip()


def method_paper(key: str) -> tuple[str, str | None] | None:
    """``(tag, "citation, link")`` of a method key of :func:`method_keys`: an adapter's paper, or the
    :class:`~finetune.plugins.Citation` the objective term registered (``None``: a term without one, or
    one not registered in this process)."""
    if key in ADAPTER_PAPERS:
        tag, text, url = ADAPTER_PAPERS[key]
        return tag, text + (f", {url}" if url else "")
    try:
        citation = plugins.citation_of(plugins.TERMS, key)
    except ImportError:  # the term modules' dependencies are missing here: no citations, the card still renders
        return None
    if citation is None:
        return None
    return citation.tag or key, citation.markdown()


def method_keys(info: dict[str, Any], recipe: dict[str, Any] | None) -> list[str]:
    """The methods a run used, in order: the objective base, its added terms, ``longclip`` when KPS
    stretched the text positions, and the adapter type (``lora`` / ``dora``)."""
    objective = (recipe or {}).get("objective") or {}
    keys: list[str] = []
    if objective.get("base") and objective["base"] != "none":  # `none`: the terms alone
        keys.append(_term_key(str(objective["base"])))
    keys += [_term_key(str(t)) for t in (objective.get("terms") or {})]
    if info.get("kps"):
        keys.append("longclip")
    adapter = info.get("adapter") or {}
    if adapter.get("type") in ("lora", "dora"):
        keys.append(adapter["type"])
    return list(dict.fromkeys(keys))


def card_tags(info: dict[str, Any], recipe: dict[str, Any] | None) -> list[str]:
    """Hub tags: ``xlipkit``, the model family, ``long-captions`` and one tag per method."""
    tags = ["xlipkit", str(info.get("family") or "clip"), "long-captions"]
    for key in method_keys(info, recipe):
        paper = method_paper(key)
        tags.append(paper[0] if paper else key)
    if info.get("kind") == "adapter":
        tags.append("peft")
    return list(dict.fromkeys(tags))


def train_datasets(recipe: dict[str, Any] | None) -> list[str]:
    """Hub dataset ids of the recipe's training data (none for synthetic or local data)."""
    train = ((recipe or {}).get("data") or {}).get("train") or {}
    name = train.get("name") if isinstance(train, dict) else str(train).partition(":")[0]
    return [HUB_DATASETS[name]] if name in HUB_DATASETS else []


def library_name(info: dict[str, Any]) -> str:
    """``peft`` for adapter folders, else the backend's library (``transformers`` / ``open_clip``)."""
    if info.get("kind") == "adapter":
        return "peft"
    return "open_clip" if info.get("backend") == "open_clip" else "transformers"


def eval_results(metrics: dict[str, Any] | None) -> list[Any]:
    """``huggingface_hub.EvalResult`` rows for the ``model-index``: one per evaluation set, direction
    (text-to-image, image-to-text) and K of the run's Recall@K after training, in percent."""
    from huggingface_hub import EvalResult

    after = (metrics or {}).get("after") or {}
    rows = []
    for label, res in after.items():
        name = label.split(":")[0].split("#")[0]
        for direction, (task_type, task_name) in RETRIEVAL_TASKS.items():
            for k, value in (res.get(direction) or {}).items():
                rows.append(EvalResult(
                    task_type=task_type, task_name=task_name, dataset_type=HUB_DATASETS.get(name, name),
                    dataset_name=label, dataset_split=str(res.get("protocol") or "default"),
                    metric_type="recall", metric_name=f"{direction} {k}", metric_value=round(float(value), 2)))
    return rows


def card_metadata(info: dict[str, Any], *, repo_id: str, recipe: dict[str, Any] | None,
                  metrics: dict[str, Any] | None) -> Any:
    """The card's front matter as a ``huggingface_hub.ModelCardData``: ``base_model`` (only when
    the base is a hub repository), ``library_name``, ``pipeline_tag``, ``tags``, ``datasets`` and
    the ``model-index`` (see :func:`eval_results`)."""
    from huggingface_hub import ModelCardData

    results = eval_results(metrics)
    return ModelCardData(
        base_model=hub_model_id(info.get("base_model")),
        library_name=library_name(info),
        pipeline_tag=PIPELINE_TAG,
        tags=card_tags(info, recipe),
        datasets=train_datasets(recipe) or None,
        model_name=repo_id.split("/")[-1] if results else None,
        eval_results=results or None,
    )


# -- load snippets ----------------------------------------------------------------------------------
def xlipkit_snippet(repo_id: str) -> str:
    """Python that loads the pushed model with xlipkit and encodes a caption and an image."""
    return (
        "from PIL import Image\n"
        "from finetune import load_finetuned\n\n"
        f'model = load_finetuned("{repo_id}")          # base + KPS + adapter, eval mode\n'
        'tokens = model.tokenize(["a long, detailed caption ..."])\n'
        "text = model.encode_text(tokens.input_ids, tokens.attention_mask).embeds   # (B, D)\n"
        'image = model.encode_image(**model.preprocess_images([Image.open("photo.jpg")])).embeds  # (B, D)'
    )


def peft_snippet(repo_id: str, base_model: str, max_text_len: int) -> str:
    """Python that rebuilds a transformers LoRA/DoRA adapter with plain transformers + peft (no
    xlipkit): the base config gets ``max_text_len`` positions, the trained tensors outside the
    adapter (stretched positions, logit scale/bias in ``xlipkit_extra.safetensors``) are copied in,
    then peft loads the adapter and merges it."""
    return (
        "import torch\n"
        "from huggingface_hub import snapshot_download\n"
        "from peft import PeftModel\n"
        "from safetensors.torch import load_file\n"
        "from transformers import AutoConfig, AutoImageProcessor, AutoModel, AutoTokenizer\n\n"
        f'folder = snapshot_download("{repo_id}")\n'
        f'config = AutoConfig.from_pretrained("{base_model}")\n'
        f"config.text_config.max_position_embeddings = {max_text_len}   # the stretched table is loaded below\n"
        f'model = AutoModel.from_pretrained("{base_model}", config=config, ignore_mismatched_sizes=True)\n'
        "with torch.no_grad():\n"
        '    for name, tensor in load_file(f"{folder}/xlipkit_extra.safetensors").items():\n'
        "        model.get_parameter(name).copy_(tensor)\n"
        "model = PeftModel.from_pretrained(model, folder).merge_and_unload().eval()\n"
        "tokenizer = AutoTokenizer.from_pretrained(folder)            # model_max_length "
        f"{max_text_len}\n"
        "image_processor = AutoImageProcessor.from_pretrained(folder)"
    )


def transformers_snippet(repo_id: str, family: str) -> str:
    """Python that loads a full (or merged) transformers model with plain transformers."""
    cls = "CLIPModel" if family == "clip" else ("Siglip2Model" if family == "siglip2" else "SiglipModel")
    padding = "True" if family == "clip" else '"max_length"'
    return (
        f"from transformers import AutoImageProcessor, AutoTokenizer, {cls}\n\n"
        f'model = {cls}.from_pretrained("{repo_id}").eval()\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
        f'image_processor = AutoImageProcessor.from_pretrained("{repo_id}")\n'
        f'inputs = tokenizer(["a long, detailed caption ..."], padding={padding}, truncation=True, '
        'return_tensors="pt")\n'
        "text = model.get_text_features(**inputs)"
    )


def open_clip_snippet(repo_id: str) -> str:
    """Python that loads a full (or merged) open_clip model with plain open_clip."""
    return (
        "import open_clip\n\n"
        f'model, _, preprocess = open_clip.create_model_and_transforms("hf-hub:{repo_id}")\n'
        f'tokenizer = open_clip.get_tokenizer("hf-hub:{repo_id}")\n'
        'text = model.encode_text(tokenizer(["a long, detailed caption ..."]))'
    )


def plain_snippet(info: dict[str, Any], repo_id: str) -> tuple[str, str] | None:
    """``(title, code)`` of the no-xlipkit way to load what ``info`` describes, or None where there
    is none (an open_clip adapter, an adapter whose base is not a hub repository, or a model family
    other than ``hf`` / ``open_clip``)."""
    family = str(info.get("family") or "clip")
    if info.get("backend") not in ("hf", "open_clip"):  # a registered model family that only xlipkit loads
        return None
    if info.get("kind") != "adapter":
        if info.get("backend") == "open_clip":
            return "With plain open_clip", open_clip_snippet(repo_id)
        return "With plain transformers", transformers_snippet(repo_id, family)
    base = hub_model_id(info.get("base_model"))
    if info.get("backend") != "hf" or base is None:
        return None
    return "With plain transformers + peft", peft_snippet(repo_id, base, int(info.get("max_text_len") or 77))


# -- the card ---------------------------------------------------------------------------------------
def _what(info: dict[str, Any], source_info: dict[str, Any]) -> str:
    adapter = source_info.get("adapter") or {}
    kind = adapter.get("type")
    base = f"`{source_info.get('base_model')}`"
    if kind in ("lora", "dora"):
        label = "LoRA" if kind == "lora" else "DoRA"
        what = f"A {label} adapter (rank {adapter.get('r')}, alpha {adapter.get('alpha')})"
        if info.get("kind") != "adapter":
            what += " merged into its base model"
        what += f" for {base}"
    else:
        what = f"{base}, fully fine-tuned"
    # the README's names: the model family that loads it (hf, open_clip, flair, ...; xlipkit.json's "model_family",
    # "backend" in folders from before model families) and the architecture (clip, siglip, siglip2: its "family")
    family = source_info.get("model_family") or source_info.get("backend")
    architecture = source_info.get("architecture") or source_info.get("family")
    return (f"{what} ({architecture} architecture, model family `{family}`), fine-tuned with xlipkit to read long, "
            f"detail-rich captions.")


def _training_lines(info: dict[str, Any], recipe: dict[str, Any] | None, metrics: dict[str, Any] | None) -> list[str]:
    recipe = recipe or {}
    metrics = metrics or {}
    lines = []
    kps = info.get("kps")
    if kps:
        lines.append(f"- text positions: {info.get('base_text_len')} -> {info.get('max_text_len')} with Long-CLIP "
                     f"knowledge-preserving stretching (keep {kps.get('keep')}, ratio {kps.get('ratio')}, "
                     f"kept rows {'frozen' if kps.get('freeze_kept') else 'trained'})")
    else:
        lines.append(f"- text positions: {info.get('max_text_len')}")
    adapter = info.get("adapter") or recipe.get("adapter") or {}
    if adapter.get("type") in ("lora", "dora"):
        targets = adapter.get("targets")
        where = "the preset attention + MLP linears" if targets == "preset" else ", ".join(map(str, targets or []))
        extra = info.get("extra_tensors") or []
        lines.append(f"- adapter: {adapter['type']} r={adapter.get('r')} alpha={adapter.get('alpha')} "
                     f"dropout={adapter.get('dropout')} on {where}; trained next to it: "
                     f"{', '.join(f'`{n}`' for n in extra) or 'nothing else'}")
    elif adapter.get("type"):
        lines.append(f"- adapter: {adapter['type']} (every parameter trained)")
    objective = recipe.get("objective") or {}
    if objective or metrics.get("objective"):
        terms = [str(objective.get("base"))] + list(objective.get("terms") or {}) if objective else []
        lines.append(f"- objective: {metrics.get('objective') or ' + '.join(terms)}")
    if metrics.get("train_set") or (recipe.get("data") or {}).get("train"):
        train = metrics.get("train_set") or (recipe.get("data") or {}).get("train")
        count = f" ({metrics['train_examples']} examples)" if metrics.get("train_examples") is not None else ""
        lines.append(f"- training data: {train}{count}")
    tr = recipe.get("train") or {}
    if tr:
        steps = f"{metrics['steps']} steps" if metrics.get("steps") is not None else f"{tr.get('epochs')} epochs"
        lines.append(f"- optimisation: {steps} at batch {tr.get('batch_size')}, AdamW lr {tr.get('lr')}, weight "
                     f"decay {tr.get('weight_decay')}, {tr.get('schedule')} schedule")
    return lines


def render_model_card(
    info: dict[str, Any],
    *,
    repo_id: str,
    recipe: dict[str, Any] | None = None,
    recipe_text: str | None = None,
    metrics: dict[str, Any] | None = None,
    source_info: dict[str, Any] | None = None,
) -> str:
    """The full ``README.md`` of a pushed run.

    Args:
        info: the uploaded folder's ``xlipkit.json`` (kind ``adapter`` or ``full``).
        repo_id: the hub repository, used in the snippets and as the ``model-index`` name.
        recipe: the resolved recipe as a dict (tags, datasets, training lines).
        recipe_text: the resolved recipe's YAML, shown verbatim (already free of secrets).
        metrics: the run's ``metrics.json`` (``before`` / ``after`` Recall@K, ``steps``, ...).
        source_info: the run's own ``xlipkit.json`` when ``info`` describes a merged export of it.

    Returns:
        the card text: YAML front matter between ``---`` lines, then markdown.
    """
    source_info = source_info or info
    # what was trained comes from the run; what is loaded (kind, so library_name) from the uploaded folder
    described = {**source_info, "kind": info.get("kind")}
    data = card_metadata(described, repo_id=repo_id, recipe=recipe, metrics=metrics)
    name = repo_id.split("/")[-1]
    parts = [f"---\n{data.to_yaml()}\n---", f"# {name}", _what(info, source_info)]
    parts += ["## How to load it", "### With xlipkit", "```python\n" + xlipkit_snippet(repo_id) + "\n```"]
    plain = plain_snippet(info, repo_id)
    if plain is not None:
        parts += [f"### {plain[0]}", "```python\n" + plain[1] + "\n```"]
    else:
        reason = (f"its base `{info.get('base_model')}` is not a hub repository"
                  if hub_model_id(info.get("base_model")) is None
                  else "peft alone cannot rebuild the stretched open_clip text tower")
        parts.append(f"Loading this adapter without xlipkit is not possible as it stands ({reason}). A merged copy "
                     f"that plain `transformers` / `open_clip` loads comes from `python -m finetune.hub export "
                     f"RUN_DIR OUT_DIR` (or push it with `--merge`).")
    parts += ["## Training", "\n".join(_training_lines(source_info, recipe, metrics))]
    if recipe_text:
        parts += ["The resolved recipe (`recipe.yaml` in this repository):",
                  "```yaml\n" + recipe_text.strip() + "\n```"]
    parts.append("## Retrieval results (Recall@K, %)")
    after = (metrics or {}).get("after") or {}
    if after:
        parts.append("Before -> after fine-tuning, as measured at the end of the run:")
        parts.append(format_table((metrics or {}).get("before"), after))
    else:
        parts.append("No evaluation was recorded for this run.")
    keys = method_keys(source_info, recipe)
    papers = [method_paper(k) for k in keys]
    refs = [f"- {paper[1]}" for paper in papers if paper is not None]
    if refs:
        parts += ["## Methods", "\n".join(refs)]
    return "\n\n".join(parts) + "\n"


def read_front_matter(card: str) -> dict[str, Any]:
    """Parse a card's YAML front matter (with ``yaml.safe_load``).

    Raises:
        ValueError: the text does not start with a ``---`` block.
    """
    if not card.startswith("---\n"):
        raise ValueError("model card has no YAML front matter (it must start with a '---' line)")
    end = card.find("\n---", 4)
    if end < 0:
        raise ValueError("model card front matter is not closed by a '---' line")
    return yaml.safe_load(card[4:end]) or {}
