"""StructXLIP's structure-centric losses (StructXLIP, section 3.2, eqs. 1-4).

L* = lambda1 L_{I',T'} + lambda2 L_{I,I'} + lambda3 L^local_{I',T'} (eq. 4) is added to the
caller's base loss L_{I,T}: ``total = L_IT + StructXLIPLoss(...)(...)["loss"]``. I' are edge maps
of the images, T' the captions with appearance terms filtered out, chunks the sentences of T',
regions the edge map inside segments of the image.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .checks import check_index_range, check_number, check_scalar, zero_with_graph
from .contrastive import _check_embeds, _check_mask, clip_loss
from .distributed import gather_variable_with_grad, should_gather, sum_over_ranks, world_info

Compat = Literal["paper", "official"]

# Paper: lambda1 = 0.25, lambda2 = 0.1, lambda3 = 0.1 (section 4, implementation details).
PAPER_WEIGHTS = (0.25, 0.1, 0.1)
# Public code (scripts/finetune.sh): 0.25 / 0.001 / 0.001, decayed per epoch by the trainer.
OFFICIAL_WEIGHTS = (0.25, 0.001, 0.001)
# Public code: per-epoch floors of the weight decay for the structure, consistency, local terms.
OFFICIAL_WEIGHT_FLOORS = (0.7, 0.5, 0.4)
# Public code: the local logits use min(s / 0.07, 100) with s the main (CLIP) scale.
OFFICIAL_LOCAL_SCALE_MAX = 100.0


_zero_with_graph = zero_with_graph


def consistency_loss(
    image_embeds: Tensor,
    edge_embeds: Tensor,
    *,
    valid: Tensor | None = None,
    gather: bool | None = None,
) -> Tensor:
    """Consistency regularisation L_{I,I'} (StructXLIP 3.2, eq. 3): mean over rows of
    ``1 - cos(f_img(I_i), f_img(I'_i))``.

    Args:
        image_embeds: ``(B, D)`` raw embeddings of the colour images.
        edge_embeds: ``(B, D)`` raw embeddings of their edge maps.
        valid: optional ``(B,)`` bool, rows with an edge map; the mean runs over valid rows.
        gather: ``None`` normalises by the valid count over all ranks when a process group of
            size > 1 is initialised: the value is ``world * sum_local / N_valid_global``, so that
            the mean over ranks is the mean over the global batch even when ranks hold different
            numbers of valid rows (the loss is per row: nothing else crosses ranks).

    Returns:
        Scalar loss; 0 (graph intact) when no row is valid.
    """
    _check_embeds("image_embeds", image_embeds)
    _check_embeds("edge_embeds", edge_embeds)
    if image_embeds.shape != edge_embeds.shape:
        raise ValueError(
            f"image_embeds {tuple(image_embeds.shape)} and edge_embeds {tuple(edge_embeds.shape)} "
            "must have the same shape (row i is the edge map of image i)"
        )
    if valid is not None:
        _check_mask("valid", valid, (image_embeds.shape[0],))
    cos = (F.normalize(image_embeds, dim=-1) * F.normalize(edge_embeds, dim=-1)).sum(dim=-1)
    per_row = 1 - cos
    if valid is None:
        count = torch.full((), float(per_row.shape[0]), dtype=per_row.dtype, device=per_row.device)  # no copy
        total = per_row.sum()
    else:
        count = valid.sum().to(per_row.dtype)
        total = per_row[valid].sum() + _zero_with_graph(per_row)
    world = world_info()[1] if should_gather(gather) else 1
    if world > 1:
        count = sum_over_ranks(count)
    return total * world / count.clamp(min=1)


def _check_owner(name: str, owner: Tensor, n: int, num_samples: int | None) -> None:
    if (
        not isinstance(owner, Tensor)
        or owner.dtype not in (torch.int32, torch.int64)
        or tuple(owner.shape) != (n,)
    ):
        got = (owner.dtype, tuple(owner.shape)) if isinstance(owner, Tensor) else type(owner).__name__
        raise ValueError(f"{name} must be an integer (long) tensor of shape ({n},), got {got}")
    check_index_range(name, owner, num_samples, where="local_structure_loss")


def local_structure_loss(
    chunk_embeds: Tensor,
    chunk_owner: Tensor,
    region_embeds: Tensor,
    region_owner: Tensor,
    *,
    temperature: float | Tensor = 0.07,
    positives: Tensor | None = None,
    region_valid: Tensor | None = None,
    num_samples: int | None = None,
    gather: bool | None = None,
) -> Tensor:
    """Local structure-centric alignment L^local_{I',T'} (StructXLIP 3.2, eqs. 1-2).

    For chunk c (eq. 1): ``l_c = -log( sum_{k in P_c} exp(cos(c, k) / T) / sum_{j in R^B}
    exp(cos(c, j) / T) )`` with R^B all valid regions of the batch ("gamma is the temperature":
    logits are cosines divided by it, 0.07 in D.2). Eq. 2: mean of l_c over the chunks of each
    sample, then mean over samples. Chunks without any positive are skipped, and samples are
    counted only if at least one of their chunks has a positive.

    Args:
        chunk_embeds: ``(Nc, D)`` raw embeddings of the text chunks of the batch.
        chunk_owner: ``(Nc,)`` long, the batch index of each chunk's sample, in ``[0, num_samples)``.
        region_embeds: ``(Nr, D)`` raw embeddings of the image regions of the batch.
        region_owner: ``(Nr,)`` long, the batch index of each region's sample, in ``[0, num_samples)``.
        temperature: T, finite and > 0; a float or a scalar tensor (the ``compat="official"`` scale is one).
        positives: ``(Nc, Nr)`` bool, P_c (e.g. the K regions most similar to each chunk under
            the frozen encoders). Default: every valid region of the chunk's own sample.
            Distributed, it indexes this rank's regions ``(Nc, Nr_local)``; regions of other
            ranks are negatives only. Invalid regions are never positives.
        region_valid: ``(Nr,)`` bool; invalid regions (e.g. padding, missing crops) take no
            part at all. Default: all valid.
        num_samples: B, the number of samples of this process's batch: the owners must lie in ``[0, B)``.
            None: the owners must be >= 0. Checked on the device (:mod:`losses.checks`: no host read; on the CPU a
            ``ValueError`` at once). An owner outside the batch would leave its chunk without positives and
            silently drop it from the loss.
        gather: ``None`` gathers when a process group of size > 1 is initialised. Distributed,
            the regions of every rank (different counts per rank) are gathered with autograd
            and are the denominator's R^B; chunks stay local; the value is scaled by
            ``world / N_samples_global`` so that the mean over ranks equals the single-process
            loss on the concatenated batch.

    Returns:
        Scalar loss; 0 (graph intact) when no chunk has a positive anywhere (an empty batch included).

    Raises:
        ValueError: naming the argument: shapes, dtypes, a ``temperature`` that is not finite and > 0, a
            ``num_samples`` that is not an integer >= 0, owners outside ``[0, num_samples)`` (on the CPU).
    """
    _check_embeds("chunk_embeds", chunk_embeds)
    _check_embeds("region_embeds", region_embeds)
    n_chunks, n_regions = chunk_embeds.shape[0], region_embeds.shape[0]
    if chunk_embeds.shape[1] != region_embeds.shape[1]:
        raise ValueError(
            f"chunk_embeds and region_embeds must share the embedding dim D, got "
            f"{chunk_embeds.shape[1]} and {region_embeds.shape[1]}"
        )
    if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)
                                    or num_samples < 0):
        raise ValueError(f"local_structure_loss: num_samples must be an integer >= 0 (B), got {num_samples!r}")
    _check_owner("chunk_owner", chunk_owner, n_chunks, num_samples)
    _check_owner("region_owner", region_owner, n_regions, num_samples)
    if region_valid is None:
        region_valid = torch.ones(n_regions, dtype=torch.bool, device=region_embeds.device)
    _check_mask("region_valid", region_valid, (n_regions,))
    if positives is not None:
        _check_mask("positives", positives, (n_chunks, n_regions))
    check_scalar("temperature", temperature, low=0.0, above=True, where="local_structure_loss")

    chunks = F.normalize(chunk_embeds, dim=-1)
    regions = F.normalize(region_embeds, dim=-1)
    rank, world = world_info() if should_gather(gather) else (0, 1)
    if world > 1:
        gathered = gather_variable_with_grad(regions)
        regions_all = gathered.tensor
        # Owners and validity travel together in one integer gather.
        meta = torch.stack([region_owner.long(), region_valid.long()], dim=1)
        meta_all = gather_variable_with_grad(meta, counts=gathered.counts).tensor
        owner_all, valid_all = meta_all[:, 0], meta_all[:, 1].bool()
        region_rank = torch.repeat_interleave(
            torch.arange(world, device=regions.device),
            torch.tensor(gathered.counts, device=regions.device),
        )
        own_rank = region_rank == rank
        start = gathered.offsets[rank]
    else:
        regions_all, owner_all, valid_all = regions, region_owner.long(), region_valid
        own_rank = torch.ones(n_regions, dtype=torch.bool, device=regions.device)
        start = 0

    if positives is None:
        positives_all = (chunk_owner.long()[:, None] == owner_all[None, :]) & own_rank[None, :]
    else:
        positives_all = torch.zeros(
            n_chunks, regions_all.shape[0], dtype=torch.bool, device=positives.device
        )
        positives_all[:, start : start + n_regions] = positives
    positives_all = positives_all & valid_all[None, :]

    logits = chunks @ regions_all.T / temperature
    has_positive = positives_all.any(dim=1)
    # every chunk row is computed and the rows without a positive weigh 0, instead of selecting rows by a
    # boolean mask: no value decides a shape, so nothing waits for the device. Those rows take every region as
    # "positive" so that their two log-sum-exps are finite (a masked row of -inf would give NaN gradients).
    keep = has_positive[:, None]
    pos_logits = logits.masked_fill(~torch.where(keep, positives_all, True), float("-inf"))
    all_logits = logits.masked_fill(~torch.where(keep, valid_all[None, :], True), float("-inf"))
    per_chunk = torch.logsumexp(all_logits, dim=1) - torch.logsumexp(pos_logits, dim=1)

    # mean over each sample's chunks with a positive, summed over those samples: chunk c weighs
    # 1 / (chunks with a positive of its sample); the weights of one sample sum to 1, so their total counts them
    owner = chunk_owner.long()
    same = (owner[:, None] == owner[None, :]) & has_positive[None, :]
    weight = torch.where(has_positive, same.sum(dim=1).clamp(min=1).to(per_chunk.dtype).reciprocal(), 0.0)
    total = (torch.where(has_positive, per_chunk, 0.0) * weight).sum() + _zero_with_graph(logits)
    n_samples = weight.sum().detach()
    if world > 1:
        n_samples = sum_over_ranks(n_samples)
    return total * world / n_samples.clamp(min=1)


def official_weight_decay(
    epoch: int, floor: float, *, warm: int = 1, decay_start: int = 1, decay_end: int = 8
) -> float:
    """Per-epoch multiplier of the StructXLIP public code's loss weights
    (``cosine_anneal_warm_decay``; ``compat="official"``), not part of the paper.

    Linear warm-up ``(epoch + 1) / warm`` for ``epoch < warm``, 1 until ``decay_start``, then a
    cosine from 1 at ``decay_start`` to ``floor`` at ``decay_end``, and ``floor`` afterwards.
    The public code's defaults are ``warm=1, decay_start=1, decay_end=8`` with floors 0.7 / 0.5 /
    0.4 for the structure / consistency / local weights (:data:`OFFICIAL_WEIGHT_FLOORS`).

    Args:
        epoch: 0-based epoch index.
        floor: final multiplier.

    Returns:
        The multiplier for that epoch (the trainer multiplies the term's base weight by it).
    """
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
    check_number("floor", floor, low=0.0, where="official_weight_decay")
    for name, value in (("warm", warm), ("decay_start", decay_start), ("decay_end", decay_end)):
        check_number(name, value, low=0.0, where="official_weight_decay")
    if epoch < warm:
        return (epoch + 1) / max(1, warm)
    if epoch < decay_start:
        return 1.0
    span = max(decay_end - decay_start, 1e-6)
    progress = min(max(epoch - decay_start, 0), span) / span
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class StructXLIPLoss(nn.Module):
    """StructXLIP's auxiliary objective L* (StructXLIP 3.2, eq. 4): weighted sum of the
    structure-centric alignment L_{I',T'}, the consistency L_{I,I'} (eq. 3) and the local
    alignment L^local_{I',T'} (eqs. 1-2). The caller adds its base loss: ``total = L_IT +
    out["loss"]``.

    ``compat="paper"`` (default): weights 0.25 / 0.1 / 0.1 (section 4); L_{I',T'} is a symmetric
    InfoNCE with its own learnable temperature tau' (a log-scale parameter initialised like
    CLIP's, ``log(1/0.07)``; call :meth:`clamp_structure_logit_scale_` after each optimiser step
    to keep it <= ``structure_logit_scale_max``, 3.5 as the paper's clamp of the main scale, D.2);
    the local temperature is fixed at 0.07 (D.2).

    ``compat="official"`` reproduces the public code: weights 0.25 / 0.001 / 0.001 (the trainer
    decays them per epoch with :func:`official_weight_decay`), L_{I',T'} uses the main CLIP
    scale detached (``forward`` then needs ``logit_scale``), and the local logits use the scale
    ``min(s / local_temperature, 100)`` of the main scale s (in practice 100, i.e. a
    temperature of 0.01). The public code makes every region of the chunk's image a positive:
    leave ``chunk_positives`` at None. No structure scale parameter exists in this mode (DDP
    would flag it unused).

    Args:
        compat: ``"paper"`` or ``"official"``.
        structure_weight, consistency_weight, local_weight: lambda1-3, finite and >= 0; ``None`` takes the
            ``compat`` default.
        structure_logit_scale_init: initial log scale of L_{I',T'} (paper mode), finite.
        structure_logit_scale_max: upper clamp of that log scale, finite.
        local_temperature: gamma of eq. 1 (official mode: the main scale is divided by it), finite and > 0.
        gather: passed to every term (see :func:`clip_loss`); every rank must pass the same set
            of inputs to ``forward``.

    Raises:
        ValueError: naming the argument: an unknown ``compat``, a NaN, infinite or negative weight, a
            ``local_temperature`` that is not finite and > 0, a log scale init or max that is not finite.
    """

    def __init__(
        self,
        *,
        compat: Compat = "paper",
        structure_weight: float | None = None,
        consistency_weight: float | None = None,
        local_weight: float | None = None,
        structure_logit_scale_init: float = math.log(1 / 0.07),
        structure_logit_scale_max: float = 3.5,
        local_temperature: float = 0.07,
        gather: bool | None = None,
    ) -> None:
        super().__init__()
        if compat not in ("paper", "official"):
            raise ValueError(f"compat must be 'paper' or 'official', got {compat!r}")
        where = "StructXLIPLoss"
        local_temperature = check_number("local_temperature", local_temperature, low=0.0, above=True, where=where)
        defaults = PAPER_WEIGHTS if compat == "paper" else OFFICIAL_WEIGHTS
        names = ("structure_weight", "consistency_weight", "local_weight")
        given = (structure_weight, consistency_weight, local_weight)
        self.compat = compat
        self.structure_weight, self.consistency_weight, self.local_weight = (
            d if w is None else check_number(name, w, low=0.0, where=where)
            for name, w, d in zip(names, given, defaults)
        )
        structure_logit_scale_init = check_number("structure_logit_scale_init", structure_logit_scale_init,
                                                  where=where)
        structure_logit_scale_max = check_number("structure_logit_scale_max", structure_logit_scale_max, where=where)
        self.local_temperature = local_temperature
        self.structure_logit_scale_max = structure_logit_scale_max
        self.gather = gather
        if compat == "paper":
            self.structure_logit_scale: nn.Parameter | None = nn.Parameter(torch.tensor(structure_logit_scale_init))
        else:
            self.structure_logit_scale = None

    @torch.no_grad()
    def clamp_structure_logit_scale_(self) -> None:
        """Clamp the structure log scale to ``<= structure_logit_scale_max`` in place (call it
        after each optimiser step, like the main scale's clamp). No-op in official mode."""
        if self.structure_logit_scale is not None:
            self.structure_logit_scale.clamp_(max=self.structure_logit_scale_max)

    def forward(
        self,
        *,
        image_embeds: Tensor,
        edge_embeds: Tensor,
        filtered_text_embeds: Tensor,
        chunk_embeds: Tensor | None = None,
        chunk_owner: Tensor | None = None,
        region_embeds: Tensor | None = None,
        region_owner: Tensor | None = None,
        edge_valid: Tensor | None = None,
        chunk_positives: Tensor | None = None,
        region_valid: Tensor | None = None,
        logit_scale: Tensor | float | None = None,
    ) -> dict[str, Tensor]:
        """Compute the three terms and their weighted sum.

        Args:
            image_embeds: ``(B, D)`` colour images I.
            edge_embeds: ``(B, D)`` their edge maps I'.
            filtered_text_embeds: ``(B, D)`` the appearance-filtered captions T'.
            chunk_embeds, chunk_owner, region_embeds, region_owner: the local term's inputs (see
                :func:`local_structure_loss`); all four or none (then ``local`` is 0).
            edge_valid: ``(B,)`` bool, rows with an edge map; L_{I',T'} and L_{I,I'} use only
                these rows.
            chunk_positives: ``(Nc, Nr)`` bool positives of the local term.
            region_valid: ``(Nr,)`` bool valid regions.
            logit_scale: the main CLIP multiplier s; required with ``compat="official"``,
                unused otherwise.

        Returns:
            ``{"structure": L_{I',T'}, "consistency": L_{I,I'}, "local": L^local, "loss": L*}``; each 0 with the
            graph intact for an empty batch (B = 0).

        Raises:
            ValueError: naming the argument (see :func:`clip_loss`, :func:`consistency_loss` and
                :func:`local_structure_loss`; the owners must lie in ``[0, B)``).
        """
        local_inputs = {
            "chunk_embeds": chunk_embeds,
            "chunk_owner": chunk_owner,
            "region_embeds": region_embeds,
            "region_owner": region_owner,
        }
        missing = [k for k, v in local_inputs.items() if v is None]
        if missing and len(missing) < len(local_inputs):
            raise ValueError(
                f"StructXLIPLoss: the local term needs chunk_embeds, chunk_owner, region_embeds and "
                f"region_owner together; missing {missing}"
            )
        if self.compat == "official":
            if logit_scale is None:
                raise ValueError(
                    "StructXLIPLoss(compat='official') needs logit_scale (the main CLIP multiplier, "
                    "model.logit_scale.exp()) in forward"
                )
            check_scalar("logit_scale", logit_scale, low=0.0, where="StructXLIPLoss")
            logit_scale = torch.as_tensor(logit_scale, dtype=edge_embeds.dtype, device=edge_embeds.device)
            structure_scale = logit_scale.detach()
            local_scale = (logit_scale / self.local_temperature).clamp(max=OFFICIAL_LOCAL_SCALE_MAX)
            local_temperature: float | Tensor = 1 / local_scale
        else:
            structure_scale = self.structure_logit_scale.exp()
            local_temperature = self.local_temperature

        structure = clip_loss(
            edge_embeds, filtered_text_embeds, structure_scale, valid=edge_valid, gather=self.gather
        )
        consistency = consistency_loss(image_embeds, edge_embeds, valid=edge_valid, gather=self.gather)
        if missing:
            local = structure.new_zeros(())
        else:
            local = local_structure_loss(
                chunk_embeds,
                chunk_owner,
                region_embeds,
                region_owner,
                temperature=local_temperature,
                positives=chunk_positives,
                region_valid=region_valid,
                num_samples=image_embeds.shape[0],
                gather=self.gather,
            )
        loss = (
            self.structure_weight * structure
            + self.consistency_weight * consistency
            + self.local_weight * local
        )
        return {"structure": structure, "consistency": consistency, "local": local, "loss": loss}

    def extra_repr(self) -> str:
        return (
            f"compat={self.compat!r}, weights=({self.structure_weight}, {self.consistency_weight}, "
            f"{self.local_weight}), local_temperature={self.local_temperature}"
        )
