"""Objective term ``grm``: GRM's adapters, region prompts, Gaussian uncertainty and token-wise
multi-level hinge loss (GRM eqs. 1-13, :mod:`losses.grm`) on any model family with token states.

The token states of both towers go through the model's own final norm and projection
(``DualEncoder.project_image_states`` / ``project_text_states``: CLIP's ``post_layernorm`` +
``visual_projection``, SigLIP's head, the ``vision_text`` family's linear projections to d = 512), then
through one :class:`losses.GRMHead` (the significance- and granularity-aware adapters, K region
prompts, the log-variance network). The head is part of the fine-tuned model: it lives in
``model.inference_modules["grm"]`` (installed when the training set is preprocessed, on the model's
device), so that it is trained with the model, saved in ``final/`` and in adapter folders, pushed, and
restored by ``load_finetuned``; the ``grm`` scorer (:mod:`finetune.evaluation.scorers.grm`) reads it at retrieval.

``objective.base: none`` makes the hinge loss the only contrastive objective (the paper); beside
``clip`` both train. The term's values are logged as ``grm/ori``, ``grm/key``, ``grm/unc`` (eq. 8 on
each level), ``grm/con`` (eq. 9), ``grm/recon`` (eq. 10), ``grm/kl``, ``grm/ent`` (eqs. 11-12),
``grm/reg`` (eq. 13); the total is ``con + recon_weight * recon + reg_weight * reg``. With weight 0
(logged, not trained on): ``grm/keep_image`` and ``grm/keep_text``, the fraction of real tokens the
significance- and granularity-aware gates keep, so that a run shows its gates.

Eq. 8 as printed sums the hinge over every negative; the text cites VSE++'s hard negative mining
(the hardest negative of each row and column): ``max_violation: true`` is that reading, from the
first step when ``warmup_sum_epochs`` is 0 (the default). LAPS sums over all negatives for its first
epoch and takes the hardest negative afterwards: ``warmup_sum_epochs: 1``.

Multi-caption data (COCO, Flickr30k: ``captions`` holds five per image): with ``expand_captions``
(default) every caption is a training example, as LAPS trains. Captions of one image in a batch are
never negatives of each other; as LAPS's ``ContrastiveLoss``, each example's own image-caption pair is
its anchor (``anchors: own``; ``anchors: positives`` makes every same-image pair an anchor), from the
image id of each example.

What LAPS does and the toolkit does not: image augmentation (RandomResizedCrop 0.6-1, horizontal
flip) and BERT token masking / deletion; GRM's paper mentions none. Retrieval (the ``grm`` scorer)
ranks with the key level alone (LAPS ranks with its one similarity; the paper does not say which of
its three levels it ranks with).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from finetune.models.inference_modules import register_inference_module
from losses.grm import (
    DEFAULT_MIN_KEEP,
    PAPER_LEVEL_WEIGHTS,
    PAPER_MARGIN,
    PAPER_NUM_REGIONS,
    GRMHead,
    grm_loss,
)

from .base import Batch, Features, ImageRequest, Term, TextRequest
from .registry import Citation, register_term

#: the key of the GRM head in ``model.inference_modules``
HEAD_KEY = "grm"
#: the name ``xlipkit_inference.json`` records for :class:`losses.GRMHead`
HEAD_CLASS = "grm.GRMHead"

register_inference_module(GRMHead, name=HEAD_CLASS)

__all__ = ["GRMOptions", "GRMTerm", "HEAD_KEY", "install_head", "image_key"]


def _positive(value: Any) -> str | None:
    return None if value > 0 else f"must be > 0, got {value!r}"


def _at_least_one(value: Any) -> str | None:
    return None if value is None or value >= 1 else f"must be >= 1, got {value!r}"


def _non_negative(value: Any) -> str | None:
    return None if value >= 0 else f"must be >= 0, got {value!r}"


def _level_weights(value: Any) -> str | None:
    if len(value) != 3 or any(w < 0 for w in value):
        return f"must be three non-negative numbers [a, b, c] (eq. 9), got {list(value)!r}"
    return None


def _slope(value: Any) -> str | None:
    return None if value is None or value >= 0 else f"must be >= 0 or null, got {value!r}"


def _fraction(value: Any) -> str | None:
    return None if 0 <= value <= 1 else f"must be a fraction in [0, 1], got {value!r}"


@dataclass
class GRMOptions:
    """``grm``: the paper's settings (GRM, "Implementation Details", eqs. 1-13) unless noted.

    Attributes:
        num_regions: K region prompts (5 for ViT backbones, 50 for Swin).
        tau: Gumbel-softmax temperature of eq. 1 (not in the paper: 1.0).
        hard: straight-through hard gate (ours: a soft gate cancels under LAPS's normalisation of eq. 7).
        hidden_dim: width of each adapter's W1 (not in the paper: null = d).
        keep_bias: initial keep-minus-drop bias of both adapters' W2 (not in the paper: 0 =
            PyTorch's initialisation; > 0 starts with the tokens kept, see :class:`losses.TokenAdapter`).
        min_keep: the gates' floor (ours; the paper has none): every sample keeps at least
            ``max(1, ceil(min_keep * n))`` of its n real tokens, in training and at retrieval
            (:func:`losses.grm.keep_floor`). Recorded with the head.
        level_weights: a, b, c of eq. 9 (0.4, 0.4, 0.2).
        margin: alpha of eq. 8 (0.2).
        max_violation: hardest negative per row and column (VSE++'s hard negative mining, which
            the paper's text cites) after the warm-up epochs; false: the sum over negatives of eq. 8
            as printed.
        warmup_sum_epochs: epochs that sum over all negatives first (LAPS: 1; the paper mentions no warm-up: 0).
        anchors: ``own`` (LAPS's ContrastiveLoss: each example's own pair is its anchor, other
            captions of its image only leave the negatives) or ``positives`` (every same-image pair
            an anchor).
        recon_weight: weight of L_recon (eq. 10; not in the paper: 1).
        reg_weight: weight of L_reg = L_KL + L_ent (eq. 13; not in the paper: 1).
        leaky_slope: LAPS's leaky ReLU of the token cosines in eq. 7 (null: eq. 7 as written).
            Recorded with the head: the ``grm`` scorer ranks with the slope the head was trained with.
        entropy_of: A of eq. 12: ``normalised`` (A_hat_r) or ``sigmoid`` (A_r).
        expand_captions: train on every caption of multi-caption rows (``captions``), as LAPS.
    """

    num_regions: int = field(default=PAPER_NUM_REGIONS, metadata={"check": _at_least_one})
    tau: float = field(default=1.0, metadata={"check": _positive})
    hard: bool = True
    hidden_dim: int | None = field(default=None, metadata={"check": _at_least_one})
    keep_bias: float = 0.0
    min_keep: float = field(default=DEFAULT_MIN_KEEP, metadata={"check": _fraction})
    level_weights: list[float] = field(default_factory=lambda: list(PAPER_LEVEL_WEIGHTS),
                                       metadata={"check": _level_weights})
    margin: float = field(default=PAPER_MARGIN, metadata={"check": _non_negative})
    max_violation: bool = True
    warmup_sum_epochs: int = field(default=0, metadata={"check": _non_negative})
    anchors: Literal["own", "positives"] = "own"
    recon_weight: float = field(default=1.0, metadata={"check": _non_negative})
    reg_weight: float = field(default=1.0, metadata={"check": _non_negative})
    leaky_slope: float | None = field(default=None, metadata={"check": _slope})
    entropy_of: Literal["normalised", "sigmoid"] = "normalised"
    expand_captions: bool = True


def image_key(image_id: Any) -> int:
    """A stable 63-bit integer of an image id (the same on every process and run), so that examples of one
    image are recognised as positives across micro-batches and ranks."""
    digest = hashlib.blake2b(str(image_id).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def _joint_dim(model: Any) -> int:
    with torch.no_grad():
        tok = model.tokenize(["a"])
        return int(model.encode_text(tok.input_ids.to(model.device), tok.attention_mask.to(model.device)).embeds.shape[-1])


def install_head(model: Any, options: GRMOptions) -> GRMHead:
    """Put a new :class:`losses.GRMHead` of the model's joint width d into ``model.inference_modules["grm"]``
    (on the model's device and dtype), or keep the one there (a GRM model fine-tuned further; its floor
    ``min_keep`` and ``leaky_slope`` become this run's, so that retrieval scores as this training does).

    Raises:
        MissingCapabilityError: the model has no token states (``states`` capability).
        ValueError: an installed head of another width or K than ``options`` asks for.
    """
    model.require("states", "objective term grm (token-wise similarity of projected token states)")
    dim = _joint_dim(model)
    head = model.inference_modules[HEAD_KEY] if HEAD_KEY in model.inference_modules else None
    if head is not None:
        if not isinstance(head, GRMHead) or head.dim != dim or head.num_regions != options.num_regions:
            raise ValueError(f"model {model.name_or_path!r} already holds a GRM head (dim "
                             f"{getattr(head, 'dim', '?')}, K {getattr(head, 'num_regions', '?')}) that does not fit "
                             f"objective.terms.grm (dim {dim}, num_regions {options.num_regions}): set num_regions to "
                             f"the head's K")
        head.min_keep, head.leaky_slope = float(options.min_keep), options.leaky_slope
        head.train()
        return head
    head = GRMHead(dim, num_regions=options.num_regions, tau=options.tau, hard=options.hard,
                   hidden_dim=options.hidden_dim, keep_bias=options.keep_bias, min_keep=options.min_keep,
                   leaky_slope=options.leaky_slope)
    head.to(device=model.device, dtype=model.dtype)
    model.inference_modules[HEAD_KEY] = head
    return head


def _caption_counts(dataset: Any) -> list[int] | None:
    """The training examples each row of a multi-caption dataset becomes (its non-empty ``captions``, at least
    one); None when the dataset has no ``captions`` column (or cannot be expanded)."""
    names = getattr(dataset, "column_names", None) or []
    if "captions" not in names or not hasattr(dataset, "select"):
        return None
    return [max(1, len([c for c in (caps or []) if isinstance(c, str) and c.strip()])) for caps in dataset["captions"]]


def _expand(dataset: Any) -> Any:
    """One row per caption of each multi-caption row: ``caption`` = that caption, ``grm_image`` = the row's
    id (rows are selected by index: images are not decoded)."""
    counts = _caption_counts(dataset)
    if counts is None or all(n == 1 for n in counts):
        return dataset
    index = [i for i, n in enumerate(counts) for _ in range(n)]
    expanded = dataset.select(index)

    def pick(captions: list, caption: str, row_id: Any, position: int) -> dict[str, Any]:
        kept = [c for c in (captions or []) if isinstance(c, str) and c.strip()] or [caption]
        k = position - first[index[position]]
        return {"caption": kept[k], "grm_image": str(row_id), "id": f"{row_id}#{k}"}

    first: dict[int, int] = {}
    for position, row in enumerate(index):
        first.setdefault(row, position)
    return expanded.map(pick, input_columns=["captions", "caption", "id"], with_indices=True,
                        desc="grm: one example per caption")


class GRMTerm(Term):
    """GRM's loss (eqs. 1-13) on the projected token states, with the head in ``model.inference_modules``.

    Args:
        options: :class:`GRMOptions`.
    """

    needs = frozenset({"grm_image_key"})
    produces = frozenset({"grm_image_key"})
    requests = frozenset({"image", "text"})
    contrastive = True
    features = frozenset({"grm_image_key"})

    def __init__(self, options: GRMOptions | None = None) -> None:
        super().__init__()
        self.options = options or GRMOptions()
        self.epoch = 0
        self.expanded: tuple[int, int] | None = None

    # -- data ---------------------------------------------------------------------------------------
    def prepare_model(self, model: Any) -> None:
        """Install the GRM head in the model (:func:`install_head`), or keep the one a GRM model holds."""
        install_head(model, self.options)

    def preprocess(self, dataset: Any, model: Any, *, cache_dir: str | None = None, log: Any = None) -> Any:
        """With ``expand_captions``, turn multi-caption rows into one example per caption."""
        if not self.options.expand_captions:
            return dataset
        before = len(dataset)
        out = _expand(dataset)
        if out is not dataset:
            self.expanded = (before, len(out))
            if log is not None:
                log.info("grm: %d images -> %d training examples (one per caption)", before, len(out))
        return out

    def training_examples(self, dataset: Any, count: int) -> int:
        """With ``expand_captions``, one example per caption of each multi-caption row."""
        counts = _caption_counts(dataset) if self.options.expand_captions else None
        return sum(counts) if counts is not None else count

    def stream_map(self, example: dict[str, Any], model: Any) -> dict[str, Any]:
        """Streams: nothing to add; each streamed example is one image with one caption (its id keys the
        image for the positives)."""
        return {}

    def check_stream(self) -> None:
        """``expand_captions`` turns one row into several, which a stream cannot do."""
        if self.options.expand_captions:
            raise ValueError("objective.terms.grm.expand_captions: true makes one training example per caption "
                             "of each row, which a streamed data.train cannot do; set expand_captions: false to "
                             "train on a stream (one caption per example)")

    def prepare(self, example: dict[str, Any]) -> dict[str, Any]:
        return {"grm_image_key": image_key(example.get("grm_image") or example.get("id", ""))}

    def collate(self, examples: list[dict[str, Any]], model: Any) -> dict[str, Any]:
        return {"grm_image_key": torch.tensor([e["grm_image_key"] for e in examples], dtype=torch.long)}

    # -- model --------------------------------------------------------------------------------------
    def image_inputs(self, batch: Batch) -> dict[str, ImageRequest]:
        return {"image": ImageRequest(batch["image_inputs"], states=True)}

    def text_inputs(self, batch: Batch) -> dict[str, TextRequest]:
        return {"text": TextRequest(batch["input_ids"], batch["attention_mask"], states=True)}

    def extra_features(self, model: Any, batch: Batch, feats: Features) -> None:
        feats["grm_image_key"] = batch["grm_image_key"].to(feats["image"].device)

    def set_epoch(self, epoch: int) -> None:
        """LAPS's schedule: the sum over negatives while ``epoch < warmup_sum_epochs``."""
        self.epoch = int(epoch)

    @property
    def max_violation(self) -> bool:
        """Whether this epoch's hinge takes the hardest negative (else the sum over negatives)."""
        return self.options.max_violation and self.epoch >= self.options.warmup_sum_epochs

    def loss(self, model: Any, feats: Features, *, detach_params: bool = False) -> dict[str, Tensor]:
        """GRM's values (:func:`losses.grm_loss`) on the batch's projected token states."""
        if HEAD_KEY not in model.inference_modules:
            raise RuntimeError("objective term 'grm': the model has no GRM head; the term installs it in "
                               "preprocess(dataset, model) before training (call it, or finetune.objectives.grm."
                               "install_head(model, options))")
        head = model.inference_modules[HEAD_KEY]
        image_tokens = model.project_image_states(feats["image_states"])
        text_tokens = model.project_text_states(feats["text_states"])
        image = head.encode_image(image_tokens)
        # the Gumbel noise of the text gates drawn for max_text_len positions: the bucket a batch is padded to does
        # not decide which noise lands on its tokens
        text = head.encode_text(text_tokens, feats["text_mask"], noise_length=int(model.max_text_len))
        keys = feats["grm_image_key"]
        all_keys = _all_keys(keys)
        positives = keys[:, None] == all_keys[None, :]
        o = self.options
        values = grm_loss(image, text, level_weights=tuple(o.level_weights), margin=o.margin,
                          max_violation=self.max_violation, positives=positives, anchors=o.anchors,
                          recon_weight=o.recon_weight, reg_weight=o.reg_weight, leaky_slope=o.leaky_slope,
                          entropy_of=o.entropy_of)
        values.pop("loss")
        return values

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"options": {k: getattr(self.options, k) for k in self.options.__dataclass_fields__}}
        if self.expanded:
            out["images"], out["examples"] = self.expanded
        return out


def _all_keys(keys: Tensor) -> Tensor:
    """The image keys of every rank's texts (rank 0 first), as :func:`losses.grm_loss` orders the gathered
    texts; ``keys`` itself in one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return keys
    parts = [torch.empty_like(keys) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, keys.contiguous())
    return torch.cat(parts)


def _weights(options: GRMOptions) -> dict[str, float]:
    """The objective sums ``con``, ``recon`` and ``reg`` (eq. 13); the parts and the gates' keep ratios are
    logged with weight 0."""
    return {"ori": 0.0, "key": 0.0, "unc": 0.0, "kl": 0.0, "ent": 0.0, "keep_image": 0.0, "keep_text": 0.0,
            "con": 1.0, "recon": float(options.recon_weight), "reg": float(options.reg_weight)}


@register_term("grm", GRMOptions, citation=Citation(
    "Liu et al., Cross Modal Fine-grained Alignment via Granularity-aware and Region-uncertain Modeling",
    "https://arxiv.org/abs/2511.07710"))
def build_grm(options: GRMOptions) -> tuple[GRMTerm, dict[str, float]]:
    """The ``grm`` term and its weights (:func:`_weights`)."""
    return GRMTerm(options), _weights(options)
