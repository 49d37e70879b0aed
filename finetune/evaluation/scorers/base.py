"""The scorer interface (DESIGN 4, Seams: Scorers): payloads, :class:`Scorer` and the scorer registry.

Evaluation (``finetune.evaluation``) asks the recipe's scorer (``eval.scorer``) for three things:

- ``encode_images(model, inputs)`` / ``encode_texts(model, input_ids, attention_mask)``: a *payload*
  per batch, a ``dict[str, Tensor]`` whose tensors all have the items on dim 0 (the cosine scorer
  keeps the ``(B, D)`` ``embeds``; a token-wise scorer such as GRM's eq. 7 keeps ``(B, L, W)``
  states and ``(B, L)`` masks);
- ``score(texts, images) -> (Tt, Ti)`` for a block of texts x images;
- optionally ``score_pairs`` (the score of text ``j`` with image ``j``), ``score_candidates`` (each
  query against its own candidates) and ``tie_tolerance`` when the scorer has faster or more
  precise forms than the generic ones.

Scorers register by name (``@register_scorer("name")``, over :data:`finetune.plugins.SCORERS`) and are
built with :func:`get_scorer`; the first lookup imports every module of the ``finetune.evaluation.scorers`` package
(cosine, GRM's, FLAIR's), and a recipe names one in ``eval.scorer`` (a user's module that registers one is
imported through ``objective.import``).
"""

from __future__ import annotations

import abc
import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import finetune.plugins as plugins

Payload = dict[str, Tensor]
"""What a scorer keeps per item: tensors that all hold the items on dim 0."""

__all__ = ["Payload", "Scorer", "available_scorers", "concat_payloads", "get_scorer", "pad_trailing",
           "payload_len", "register_scorer", "take"]


# -- payloads -------------------------------------------------------------------------------------
def payload_len(payload: Mapping[str, Tensor]) -> int:
    """The number of items in ``payload`` (the common size of dim 0 of its tensors).

    Raises:
        ValueError: when the payload is empty, holds a non-tensor or its tensors disagree on dim 0.
    """
    if not payload:
        raise ValueError("a scorer payload must hold at least one tensor")
    sizes = {}
    for key, value in payload.items():
        if not isinstance(value, Tensor) or value.ndim == 0:
            raise ValueError(f"scorer payload entry {key!r} must be a tensor with the items on dim 0, "
                             f"got {type(value).__name__}{'' if not isinstance(value, Tensor) else ' (a scalar)'}")
        sizes[key] = value.shape[0]
    if len(set(sizes.values())) != 1:
        raise ValueError(f"scorer payload entries disagree on the number of items (dim 0): {sizes}")
    return next(iter(sizes.values()))


def take(payload: Mapping[str, Tensor], index: slice | Tensor) -> Payload:
    """The items ``index`` (a slice: views, no copy; or a ``(n,)`` long tensor) of every tensor."""
    if isinstance(index, Tensor):
        return {key: value[index.to(value.device)] for key, value in payload.items()}
    return {key: value[index] for key, value in payload.items()}


def pad_trailing(x: Tensor, shape: Sequence[int]) -> Tensor:
    """Zero-pad the trailing dims of ``x`` (not dim 0) up to ``shape``."""
    pad: list[int] = []
    for have, want in zip(reversed(x.shape[1:]), reversed(shape)):
        pad.extend((0, want - have))
    return F.pad(x, pad) if any(pad) else x


def concat_payloads(payloads: Sequence[Mapping[str, Tensor]]) -> Payload:
    """Concatenate per-batch payloads along dim 0. Trailing dims that differ between batches (token
    states padded to each batch's longest caption) are zero-padded to the largest, so masks pad as 0.

    Raises:
        ValueError: when the batches do not hold the same keys or the same number of dims per key.
    """
    if not payloads:
        raise ValueError("concat_payloads: no payloads")
    keys = list(payloads[0])
    out: Payload = {}
    for p in payloads:
        if list(p) != keys:
            raise ValueError(f"scorer payloads of different batches hold different keys: {keys} vs {list(p)}")
    for key in keys:
        parts = [p[key] for p in payloads]
        if len({x.ndim for x in parts}) != 1:
            raise ValueError(f"scorer payload entry {key!r} changes its number of dims between batches")
        shape = [max(sizes) for sizes in zip(*(x.shape[1:] for x in parts))]
        out[key] = torch.cat([pad_trailing(x, shape) for x in parts]) if len(parts) > 1 else parts[0]
    return out


# -- the interface --------------------------------------------------------------------------------
class Scorer(abc.ABC):
    """How evaluation scores texts against images (DESIGN 4, Seams: Scorers).

    Subclasses implement :meth:`score`; the encoders default to the model's global embeddings
    (``{"embeds": (B, D) float32}``), which is also what the ``rerank_top_k`` prefilter reads, so a
    scorer that wants the prefilter keeps ``embeds`` in its payloads next to its own tensors.
    Options given to :func:`get_scorer` are passed to the constructor.
    """

    #: the registered name (set by :func:`register_scorer`)
    name: str = ""

    def encode_images(self, model: Any, inputs: Mapping[str, Any]) -> Payload:
        """Payload of a batch of images. ``inputs``: ``model.preprocess_images(...)`` on the device
        (``pixel_values (B, 3, H, W)`` and any other ``encode_image`` keyword). Default:
        ``{"embeds": (B, D) float32}``."""
        return {"embeds": model.encode_image(**inputs).embeds.float()}

    def encode_texts(self, model: Any, input_ids: Tensor, attention_mask: Tensor) -> Payload:
        """Payload of a batch of captions, ``input_ids`` and ``attention_mask`` ``(B, L)``. Default:
        ``{"embeds": (B, D) float32}``."""
        return {"embeds": model.encode_text(input_ids, attention_mask).embeds.float()}

    def prepare(self, texts: Payload, images: Payload) -> tuple[Payload, Payload]:
        """Called once on the whole (gathered) payloads before ranking, e.g. to normalise. Default:
        unchanged."""
        return texts, images

    @abc.abstractmethod
    def score(self, texts: Payload, images: Payload) -> Tensor:
        """``(Tt, Ti)`` scores of a block of ``Tt`` texts against a block of ``Ti`` images (higher =
        better match)."""

    def score_pairs(self, texts: Payload, images: Payload) -> Tensor:
        """``(n,)`` score of text ``j`` with image ``j`` for ``n`` texts and ``n`` images.

        The default takes the diagonal of :meth:`score` on chunks of 16 pairs (16x the work of the
        pairs alone); override it where a direct pairwise form exists.
        """
        n = payload_len(texts)
        out = []
        for j0 in range(0, n, 16):
            j1 = min(j0 + 16, n)
            out.append(self.score(take(texts, slice(j0, j1)), take(images, slice(j0, j1))).diagonal())
        return torch.cat(out)

    def score_candidates(self, queries: Payload, items: Payload, candidates: Tensor, *,
                         query_side: str) -> Tensor:
        """``(Q, K)`` scores of each of ``Q`` queries with its own ``K`` candidate items.

        Args:
            queries: payload of ``Q`` queries (texts when ``query_side == "text"``, else images).
            items: payload of all items of the other side.
            candidates: ``(Q, K)`` long, indices into ``items``.
            query_side: ``"text"`` (text -> image) or ``"image"`` (image -> text).

        The default calls :meth:`score` once per query; override it to batch.
        """
        if query_side not in ("text", "image"):
            raise ValueError(f"score_candidates: query_side must be 'text' or 'image', got {query_side!r}")
        rows = []
        for q in range(candidates.shape[0]):
            query, cands = take(queries, slice(q, q + 1)), take(items, candidates[q])
            if query_side == "text":
                rows.append(self.score(query, cands)[0])
            else:
                rows.append(self.score(cands, query)[:, 0])
        return torch.stack(rows)

    def tie_tolerance(self, texts: Payload, images: Payload) -> float:
        """Scores within this of a query's correct score count as ties (against the model): the
        rounding bound between :meth:`score` and :meth:`score_pairs`. Default 0 (exact ties only)."""
        return 0.0



# -- the registry (finetune.plugins.SCORERS) ------------------------------------------------------
def register_scorer(name: str, *, replace: bool = False) -> Callable[[Any], Any]:
    """Class decorator (or decorator of a factory returning a :class:`Scorer`) that registers a scorer
    under ``name`` for ``eval.scorer`` / ``--scorer`` (in :data:`finetune.plugins.SCORERS`).

    Raises:
        ValueError: when ``name`` is empty or already registered to something else (``replace=True``
            overrides).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register_scorer: the name must be a non-empty string, got {name!r}")

    def deco(factory: Any) -> Any:
        old = plugins.SCORERS.peek(name)
        if old is not None and old is not factory and not replace:
            raise ValueError(f"register_scorer: {name!r} is already registered ({old!r}); pick another "
                             f"name or pass replace=True")
        if isinstance(factory, type) and not issubclass(factory, Scorer):
            raise TypeError(f"register_scorer({name!r}): {factory.__name__} must subclass finetune.evaluation.scorers.Scorer")
        if isinstance(factory, type):
            factory.name = name
        plugins.SCORERS.add(name, factory, replace=True)
        return factory

    return deco


def available_scorers() -> list[str]:
    """Registered scorer names, sorted (the modules of ``finetune.evaluation.scorers`` discovered first)."""
    return plugins.SCORERS.names()


def get_scorer(name: str | Scorer, **options: Any) -> Scorer:
    """Build the scorer registered as ``name`` with ``options`` (a :class:`Scorer` is returned as is).

    Raises:
        ValueError: for an unknown name (listing the registered ones) or options the scorer does not take.
    """
    if isinstance(name, Scorer):
        if options:
            raise ValueError(f"get_scorer: options {sorted(options)} cannot apply to an already built scorer")
        return name
    if not isinstance(name, str) or name not in plugins.SCORERS:
        close = difflib.get_close_matches(str(name), available_scorers(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown scorer {name!r} (eval.scorer / --scorer): {hint}registered scorers are "
                         f"{', '.join(available_scorers())}; a scorer from your own module registers when "
                         f"the module is imported (recipe key objective.import)")
    factory = plugins.SCORERS.get(name)
    try:
        scorer = factory(**options)
    except TypeError as exc:
        raise ValueError(f"scorer {name!r} does not take the options {sorted(options)}: {exc}") from None
    if not isinstance(scorer, Scorer):
        raise TypeError(f"scorer {name!r}: its factory returned {type(scorer).__name__}, not a Scorer")
    if not scorer.name:
        scorer.name = name
    return scorer
