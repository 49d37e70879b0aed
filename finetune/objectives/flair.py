"""The ``flair`` objective term: FLAIR pretraining (FLAIR section 3; public ``train.py`` / ``loss.py``).

A recipe uses it with ``objective.base: none`` on a FLAIR model (``model.family: flair``)::

    objective:
      base: none
      terms:
        flair: {k: 8, caption_fields: null, distributed: global}

Per example the data workers draw K sub-captions of 1-3 sentences (:func:`finetune.data.text.sample_subcaptions`:
consecutive windows over every start, or sentences at random positions kept in caption order) from

- ``caption_fields`` (DreamLIP re-captioned shards: the fields holding PRE-SPLIT sentence lists, concatenated
  in the order given, as the public code does); a field holding a string is an error naming it
  (:func:`finetune.data.text.as_sentence_list`; the public code silently samples characters);
- else the example's ``sentences`` (the synthetic scenes; pre-split benchmark rows);
- else the ``caption`` split into sentences (PixelProse: split on the fly), by ``splitter``.

A sub-caption's sentences are joined as the public code joins them (``join: public_code``: each loses a
final period, then ``". "`` between them) and tokenised to the model's 77 positions (image-major, ``B*K``
rows). The loss is :func:`losses.flair_loss` (``(L_tcs + L_mps) / 2``) on the class token, the projected
patch tokens and the sub-caption embeddings, with the model's attention pool, scale and bias; its two parts
are logged as ``flair/tcs`` and ``flair/mps`` (weight 0). L_mps takes the paper's negatives by default
(``mps_negatives: paper``, section 3.4), the public code's all-captions form with ``public_code``.

The negatives of a step are keyed by (``seed``, step) (:func:`losses.flair_draw_seed`): each process draws
only its own rows on the device (:func:`losses.sample_flair_text_indices`), gradient-accumulation
micro-batches share the step's draw, and the step count is a persistent buffer (:class:`DrawCounter`), so
``accelerator.save_state`` checkpoints it and a resumed run draws what the uninterrupted one would. After
every optimiser step the log scale is clamped to ``[0, ln 100]`` (the public ``train.py``).
"""

from __future__ import annotations

import logging
import math
import random
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from losses import FLAIRLoss, flair_draw_seed
from losses.flair import MPS_NEGATIVES

from .base import Batch, Features, ImageRequest, Term, TextRequest, scale_of
from .registry import Citation, register_term

FIELD_SUBCAPTIONS = "flair_subcaptions"
FIELD_IDS = "flair_input_ids"
FIELD_MASK = "flair_attention_mask"
FEATURE = "flair_text"
#: the clamp of the log logit scale after every step (public ``train.py``: [0, ln 100])
LOG_SCALE_RANGE = (0.0, math.log(100.0))
#: how a sub-caption's sentences are joined: the public code's ``". "`` or a space
JOINS = ("public_code", "space")

log = logging.getLogger("xlipkit")


def join_public_code(sentences: list[str]) -> str:
    """A sub-caption's text as the FLAIR code writes it: its sentences split at periods (``re.split``
    drops them) joined by ``". "``, without a final period. Sentences that kept their period (the
    toolkit's splitter, the synthetic scenes) lose it first, so both give ``"A dog runs. It is brown"``;
    a sentence ending in ``!`` or ``?`` is followed by a space only."""
    pieces = [s[:-1].rstrip() if s.endswith(".") else s for s in sentences]
    text = pieces[0] if pieces else ""
    for piece in pieces[1:]:
        text += (" " if text.endswith(("!", "?")) else ". ") + piece
    return text


class DrawCounter(nn.Module):
    """The optimiser steps a term has drawn negatives for, which key its draws (FLAIR, F-CAST).

    A persistent int64 buffer ``steps`` holds the count in the module's state dict, so the trainer's
    ``accelerator.save_state`` (the model and the objective in one module) saves it and ``load_state``
    restores it; the Python copy :attr:`value` keys the draws without reading the device in the step.
    A checkpoint saved before the counter existed loads with a warning and the count restarts at 0.
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.value = 0

    def advance(self) -> None:
        """One more step (after each optimiser step); the buffer follows without a host read."""
        self.value += 1
        self.steps.fill_(self.value)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        key = prefix + "steps"
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if key in state_dict:
            self.value = int(state_dict[key])  # once, when a checkpoint loads
        elif key in missing_keys:
            missing_keys.remove(key)
            log.warning("%s: the checkpoint has no negative-draw count (saved before it was checkpointed); "
                        "draws restart at step 0", key)


def _positive_int(value: Any) -> str | None:
    return None if isinstance(value, int) and value >= 1 else f"must be an integer >= 1, got {value!r}"


def _probability(value: Any) -> str | None:
    return None if 0.0 <= value <= 1.0 else f"must be in [0, 1], got {value!r}"


def _distributed(value: Any) -> str | None:
    return None if value in ("global", "ring") else f"must be 'global' (the paper's batch) or 'ring' (the public code), got {value!r}"


def _mps_negatives(value: Any) -> str | None:
    return None if value in MPS_NEGATIVES else (f"must be 'paper' (one sub-caption of every other image, FLAIR 3.4) "
                                                f"or 'public_code' (all B*K sub-captions), got {value!r}")


def _join(value: Any) -> str | None:
    return None if value in JOINS else f"must be 'public_code' (\". \") or 'space', got {value!r}"


def _splitter(value: Any) -> str | None:
    return None if value in ("sentences", "flair") else f"must be 'sentences' or 'flair', got {value!r}"


def _fields(value: Any) -> str | None:
    if value is None or (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
        return None
    return f"must be null or a non-empty list of field names, got {value!r}"


@dataclass
class FlairOptions:
    """``objective.terms.flair`` (FLAIR section 3, implementation details; Table 12).

    Attributes:
        k: sub-captions per image (8; 10 for YFCC15M and Merged-30M in the public scripts).
        min_sentences, max_sentences: sentences per sub-caption, s ~ U{min, max} (1 and 3).
        consecutive: probability that a sub-caption is a consecutive window (the public code's 0.5).
        caption_fields: fields of pre-split sentence lists (DreamLIP: ``raw_caption``, ``short_IB_captions``,
            ...), concatenated in this order; null: ``sentences``, else the split ``caption``.
        splitter: how a ``caption`` string is split: ``sentences`` (:func:`finetune.data.text.split_sentences`)
            or ``flair`` (the public code's ``re.split(r'\\n|</s>|[.]')``, PixelProse).
        join: how a sub-caption's sentences are joined: ``public_code`` (:func:`join_public_code`, ``". "``)
            or ``space`` (as they are, joined by a space); the paper does not say.
        add_mps: add L_mps (the paper's final loss; false: L_tcs only).
        mps_negatives: L_mps's negatives: ``paper`` (one sub-caption of every other image, section 3.4,
            L_tcs's draw) or ``public_code`` (all ``B*K`` sub-captions, the public ``loss.py``).
        distributed: ``global`` (the paper's batch over all processes) or ``ring`` (the public code's per-process
            blocks, to reproduce its runs).
        seed: seeds the sub-caption draws (with the epoch and the example id) and the negatives of L_tcs
            (with the step), the same on every process.
    """

    k: int = field(default=8, metadata={"check": _positive_int})
    min_sentences: int = field(default=1, metadata={"check": _positive_int})
    max_sentences: int = field(default=3, metadata={"check": _positive_int})
    consecutive: float = field(default=0.5, metadata={"check": _probability})
    caption_fields: list[str] | None = field(default=None, metadata={"check": _fields})
    splitter: str = field(default="sentences", metadata={"check": _splitter})
    join: str = field(default="public_code", metadata={"check": _join})
    add_mps: bool = True
    mps_negatives: str = field(default="paper", metadata={"check": _mps_negatives})
    distributed: str = field(default="global", metadata={"check": _distributed})
    seed: int = 0


def _split(caption: str, splitter: str) -> list[str]:
    from finetune.data.text import split_sentences

    if splitter == "flair":
        import re

        return [p.strip() for p in re.split(r"\n|</s>|[.]", caption) if p.strip()]
    return split_sentences(caption)


class FlairTerm(Term):
    """FLAIR's loss as an objective term (see the module docstring).

    Args:
        options: :class:`FlairOptions`.
    """

    name = "flair"
    contrastive = True
    needs = frozenset({FIELD_SUBCAPTIONS})
    produces = frozenset({FIELD_SUBCAPTIONS, FIELD_IDS, FIELD_MASK})
    requests = frozenset({"image", FEATURE})
    uses_logit_bias = True

    def __init__(self, options: FlairOptions | None = None) -> None:
        super().__init__()
        self.options = options or FlairOptions()
        if self.options.max_sentences < self.options.min_sentences:
            raise ValueError(f"objective.terms.flair: max_sentences ({self.options.max_sentences}) must be >= "
                             f"min_sentences ({self.options.min_sentences})")
        self.loss_fn = FLAIRLoss(add_mps=self.options.add_mps, mps_negatives=self.options.mps_negatives,
                                 distributed=self.options.distributed)
        self.epoch = 0
        self.draws = DrawCounter()
        self._scale: list[Tensor] = []  # the model's log scale, clamped after each step (not a parameter here)

    # -- data ---------------------------------------------------------------------------------------
    def sentences(self, example: dict[str, Any]) -> list[str]:
        """The example's sentences, from ``caption_fields``, ``sentences`` or the split ``caption``.

        Raises:
            TypeError: a caption field holding a string instead of a list (naming the field).
            ValueError: a missing field, or no sentence at all (naming the example).
        """
        from finetune.data.text import as_sentence_list

        ident = example.get("id", "?")
        fields = self.options.caption_fields
        if fields:
            sentences: list[str] = []
            for name in fields:
                if name not in example:
                    raise ValueError(f"objective.terms.flair.caption_fields: example {ident!r} has no field {name!r} "
                                     f"(fields: {sorted(k for k in example if k != 'image')}); for a stream, list it "
                                     f"in data.train.options.fields")
                sentences += as_sentence_list(example[name], field=name)
        elif example.get("sentences") is not None:
            sentences = as_sentence_list(example["sentences"], field="sentences")
        else:
            sentences = _split(str(example.get("caption") or ""), self.options.splitter)
        if not sentences:
            raise ValueError(f"objective.terms.flair: example {ident!r} has no sentence to sample sub-captions from")
        return sentences

    def prepare(self, example: dict[str, Any]) -> dict[str, Any]:
        """``{"flair_subcaptions": [K str]}``, drawn from a generator seeded by (seed, epoch, id)."""
        from finetune.data.text import sample_subcaptions

        o = self.options
        key = f"{o.seed}/{self.epoch}/{example.get('id', '')}".encode()
        rng = random.Random(zlib.crc32(key) ^ (o.seed << 32))
        subs = sample_subcaptions(self.sentences(example), o.k, o.min_sentences, o.max_sentences, rng,
                                  consecutive=o.consecutive, join=join_public_code if o.join == "public_code" else None)
        return {FIELD_SUBCAPTIONS: subs}

    def example_fields(self) -> dict[str, str]:
        """``caption_fields``: what a stream must pass through (``data.train.options.fields``)."""
        return {name: "objective.terms.flair.caption_fields" for name in self.options.caption_fields or ()}

    def stream_map(self, example: dict[str, Any], model: Any) -> dict[str, Any]:
        """Nothing is cached: sub-captions are drawn in :meth:`prepare` (also for streamed examples)."""
        return {}

    def collate(self, examples: list[dict[str, Any]], model: Any) -> dict[str, Any]:
        """The ``B*K`` sub-captions, image-major, tokenised to the model's text length (77)."""
        texts = [s for e in examples for s in e[FIELD_SUBCAPTIONS]]
        tok = model.tokenize(texts)
        return {FIELD_IDS: tok.input_ids, FIELD_MASK: tok.attention_mask}

    def image_inputs(self, batch: Batch) -> dict[str, ImageRequest]:
        return {"image": ImageRequest(batch["image_inputs"], states=True)}

    def text_inputs(self, batch: Batch) -> dict[str, TextRequest]:
        return {FEATURE: TextRequest(batch[FIELD_IDS], batch[FIELD_MASK])}

    def shape_scan(self, dataset: Any, model: Any) -> Any:
        """The sub-captions are drawn every epoch (:meth:`prepare`), so their lengths cannot be listed before
        training: the caption kind plans every bucket length."""
        from .shapes import TEXT, ShapeScan

        return ShapeScan(open_kinds=frozenset({TEXT}))

    # -- loss ---------------------------------------------------------------------------------------
    def draw_seed(self) -> int:
        """The key of this step's negatives, (``seed``, steps so far), the same on every process
        (:func:`losses.flair_draw_seed`; ``ring`` mixes in the rank inside the loss)."""
        return flair_draw_seed(self.options.seed, self.draws.value)

    def loss(self, model: Any, feats: Features, *, detach_params: bool = False) -> dict[str, Tensor]:
        if not callable(getattr(model, "local_tokens", None)) or getattr(model, "logit_bias", None) is None:
            raise ValueError(f"objective.terms.flair needs a FLAIR model (model.family: flair, e.g. tiny-flair or "
                             f"flair-vit-b-16); {getattr(model, 'name_or_path', '?')!r} is a "
                             f"{getattr(model, 'backend', '?')!r} model without the attention pool")
        if not self._scale or self._scale[0] is not model.logit_scale:
            self._scale = [model.logit_scale]
        glob = feats["image"]
        b, k = glob.shape[0], self.options.k
        text = feats[FEATURE]
        if text.shape[0] != b * k:
            raise ValueError(f"objective.terms.flair: {text.shape[0]} sub-captions for {b} images, expected K={k} each")
        local = model.local_tokens(feats["image_states"])
        s = scale_of(model.logit_scale, detach_params)
        bias = model.logit_bias.detach() if detach_params else model.logit_bias
        out = self.loss_fn(text.view(b, k, -1), local, glob, model.pool, s, bias, seed=self.draw_seed())
        values = {"flair": out["loss"], "tcs": out["tcs"].detach()}
        if "mps" in out:
            values["mps"] = out["mps"].detach()
        return values

    def after_optimizer_step(self) -> None:
        """Clamp the model's log logit scale to ``[0, ln 100]`` (public ``train.py``); the next step draws new
        negatives."""
        self.draws.advance()
        if self._scale:
            with torch.no_grad():
                self._scale[0].clamp_(*LOG_SCALE_RANGE)

    def set_epoch(self, epoch: int) -> None:
        """New sub-captions every epoch."""
        self.epoch = int(epoch)

    def summary(self) -> dict[str, Any]:
        o = self.options
        return {"k": o.k, "sentences": [o.min_sentences, o.max_sentences], "consecutive": o.consecutive,
                "caption_fields": o.caption_fields, "splitter": o.splitter, "join": o.join, "add_mps": o.add_mps,
                "mps_negatives": o.mps_negatives, "distributed": o.distributed,
                "log_scale_range": list(LOG_SCALE_RANGE)}


@register_term("flair", FlairOptions, citation=Citation(
    "Xiao et al., FLAIR: VLM with Fine-grained Language-informed Image Representations (CVPR 2025)",
    "https://arxiv.org/abs/2412.03561"))
def build_flair(options: FlairOptions) -> tuple[FlairTerm, dict[str, float]]:
    """``flair``: :class:`FlairTerm`; ``flair/tcs`` and ``flair/mps`` are logged with weight 0 (the loss is
    ``flair``, their mean)."""
    return FlairTerm(options), {"flair": 1.0, "tcs": 0.0, "mps": 0.0}
