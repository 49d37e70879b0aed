"""F-CAST's two-level sigmoid losses (F-CAST, section 3.3, eqs. 6-8).

- Part level (eqs. 6-7): FLAIR's text-conditioned attention pool over the 64 stage-2 segment tokens
  ``v_fine`` of image i, queried by sub-caption k of caption j, compared with that sub-caption;
  ``y = +1`` for the image's own K sub-captions (the first N of them its long caption's chunks),
  -1 otherwise. This is FLAIR's L_tcs (:func:`losses.flair.flair_loss` with ``add_mps=False``) on
  ``v_fine`` in place of the patch tokens, with the part level's own scale and bias: each image
  sees its K sub-captions and one random sub-caption of every other image (FLAIR 3.3's
  ``B x (K + B - 1)`` pairs), summed over images, averaged over each image's texts.
- Whole level (eq. 8): a SigLIP loss between ``v_coarse`` (the final [CLS] token) and ``t_long`` (the
  stage-2 [CLS] of the caption), with its own scale and bias: ``-sum_ij log sigmoid(y_ij (s cos + b)) / B``
  (a sum over images of the mean over the B captions, FLAIR's normalisation of its sigmoid terms).
- ``L = L_part + L_whole``.

Eqs. 7-8 give the loss of one pair; how pairs are summed is not in the paper. The part level is reduced
as FLAIR's public code reduces L_tcs (a sum over images of a mean over each image's ``K + B - 1`` texts),
the whole level as a SigLIP loss (a sum over all ``B x B`` pairs divided by B). Both are this
implementation's choices, and they set the balance of ``L = L_part + L_whole``: at initialisation (bias
-10, every positive costing about 10, negatives about 0) ``L_part ~ B K 10 / (K + B - 1)`` and
``L_whole ~ 10``, about ``K : 1`` = 8 : 1 for ``B >> K``.

Both temperatures and biases are initialised as the paper says ("0.07 and -10 following SigLIP"), read
as FLAIR's code reads 0.07: the scale is ``1 / 0.07`` (log scale ``log(1/0.07) = 2.659``), not SigLIP's
``log 10``; the bias is -10. (The clamp of the log scales to ``[0, ln 100]`` after each step is FLAIR's
public code, not F-CAST's text: ``finetune.objectives.fcast``.)

Distributed as FLAIR's loss: ``distributed="global"`` all-gathers the sub-captions (part) and the long
captions (whole) with autograd, each process draws only its own images' negatives (keyed by ``seed``),
and the mean of the per-process losses equals one process on the concatenated batch with the same draw.
"""

from __future__ import annotations

from torch import Tensor

from .contrastive import siglip_loss
from .flair import Distributed, TextConditionedAttentionPool, flair_loss


def fcast_part_loss(
    sub_embeds: Tensor,
    fine: Tensor,
    pool: TextConditionedAttentionPool,
    logit_scale: Tensor | float,
    logit_bias: Tensor | float,
    *,
    fine_mask: Tensor | None = None,
    text_indices: Tensor | None = None,
    seed: int | None = None,
    distributed: Distributed = "global",
    gather: bool | None = None,
) -> Tensor:
    """Part-level text-grounded sigmoid loss (F-CAST eqs. 6-7).

    ``L_part = sum_i mean_c -log sigmoid(y_ic (s <n(AttnPool(t_c, v_fine_i)), n(t_c)> + b))`` over the
    ``K + B - 1`` sub-captions ``c`` of image i (its own K, one of every other image).

    Args:
        sub_embeds: ``(B, K, D)`` raw stage-1 sub-caption embeddings ``t_sub`` (the first N the chunks).
        fine: ``(B, M, D)`` raw projected stage-2 segment tokens ``v_fine`` (M = 64).
        pool: the attention pool (FLAIR's :class:`TextConditionedAttentionPool`).
        logit_scale: ``tau_part`` as a multiplier (already exponentiated).
        logit_bias: ``b_part``.
        fine_mask: ``(B, M)`` bool, True for real segment tokens; None: all real.
        text_indices: a fixed draw of each image's texts (:func:`losses.flair.sample_flair_text_indices`),
            for tests; None draws one.
        seed: the draw's key (as :func:`losses.flair_loss`: a training loop passes one per step); None: a
            seed from torch's default CPU generator.
        distributed: ``"global"`` (the paper's global batch) or ``"ring"`` (FLAIR's public code).
        gather: None works across processes when a process group of size > 1 is initialised.
    Returns:
        Scalar loss; 0 with the graph intact for an empty batch (B = 0).
    Raises:
        ValueError: naming the argument (see :func:`losses.flair_loss`; ``logit_scale`` finite and >= 0,
            ``logit_bias`` finite).
    """
    if not isinstance(fine, Tensor) or fine.dim() != 3 or not fine.is_floating_point():
        got = (fine.dtype, tuple(fine.shape)) if isinstance(fine, Tensor) else type(fine).__name__
        raise ValueError(f"fcast_part_loss: fine must be (B, M, D) floating-point segment tokens, got {got}")
    if fine.shape[1] == 0:
        raise ValueError("fcast_part_loss: fine has M = 0 segment tokens; the part level needs at least one")
    # flair_loss takes a global image for its L_mps; with add_mps=False it is not read
    return flair_loss(sub_embeds, fine, fine[:, 0], pool, logit_scale, logit_bias, add_mps=False,
                      text_indices=text_indices, seed=seed, distributed=distributed, gather=gather,
                      local_mask=fine_mask)


def fcast_whole_loss(
    coarse: Tensor,
    long_embeds: Tensor,
    logit_scale: Tensor | float,
    logit_bias: Tensor | float,
    *,
    gather: bool | None = None,
) -> Tensor:
    """Whole-level sigmoid loss (F-CAST eq. 8): ``-sum_ij log sigmoid(y_ij (s cos(v_coarse_i, t_long_j) + b))
    / B`` with ``y_ij = +1`` iff ``i == j``.

    Args:
        coarse: ``(B, D)`` raw ``v_coarse``.
        long_embeds: ``(B, D)`` raw ``t_long``.
        logit_scale: ``tau_whole`` as a multiplier; logit_bias: ``b_whole``.
        gather: as :func:`losses.siglip_loss` (local images against all processes' captions).
    Returns:
        Scalar loss; 0 with the graph intact for an empty batch (B = 0).
    Raises:
        ValueError: naming the argument (see :func:`losses.siglip_loss`).
    """
    return siglip_loss(coarse, long_embeds, logit_scale, logit_bias, gather=gather)


def fcast_loss(
    sub_embeds: Tensor,
    fine: Tensor,
    coarse: Tensor,
    long_embeds: Tensor,
    pool: TextConditionedAttentionPool,
    part_scale: Tensor | float,
    part_bias: Tensor | float,
    whole_scale: Tensor | float,
    whole_bias: Tensor | float,
    *,
    fine_mask: Tensor | None = None,
    text_indices: Tensor | None = None,
    seed: int | None = None,
    distributed: Distributed = "global",
    gather: bool | None = None,
) -> dict[str, Tensor]:
    """``L = L_part + L_whole`` (F-CAST 3.3, "Optimization"), unweighted as the paper writes it; the
    reductions of the two levels are the implementation's (module docstring: about 8 : 1 at
    initialisation).

    Args: as :func:`fcast_part_loss` and :func:`fcast_whole_loss`; each level has its own scale and bias.
    Returns:
        ``{"part": L_part, "whole": L_whole, "loss": L_part + L_whole}``.
    """
    part = fcast_part_loss(sub_embeds, fine, pool, part_scale, part_bias, fine_mask=fine_mask,
                           text_indices=text_indices, seed=seed, distributed=distributed, gather=gather)
    whole = fcast_whole_loss(coarse, long_embeds, whole_scale, whole_bias, gather=gather)
    return {"part": part, "whole": whole, "loss": part + whole}


__all__ = ["fcast_part_loss", "fcast_whole_loss", "fcast_loss"]
