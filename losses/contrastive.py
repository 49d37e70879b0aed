"""Image-text contrastive losses: CLIP's InfoNCE, SigLIP's sigmoid loss and Long-CLIP's loss.

Conventions (DESIGN 4): embeddings are raw and L2-normalised here; ``logit_scale`` is the
multiplier (already exponentiated); ``logit_bias`` is raw. With ``gather`` each rank scores its
local rows against the rows of every rank (gathered with autograd) and returns a value whose mean
over ranks equals the single-process loss on the concatenated batch, with exact gradients under
DDP's gradient averaging.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_embeds, check_mask, check_number, check_scalar, zero_with_graph
from .distributed import gather_with_grad, ring_exchange_with_grad, should_gather, world_info

logger = logging.getLogger(__name__)


def _check_embeds(name: str, x: Tensor) -> None:
    check_embeds(name, x)


def _check_pair(image_embeds: Tensor, text_embeds: Tensor, *, same_batch: bool = True) -> None:
    _check_embeds("image_embeds", image_embeds)
    _check_embeds("text_embeds", text_embeds)
    if image_embeds.shape[1] != text_embeds.shape[1]:
        raise ValueError(
            f"image_embeds and text_embeds must share the embedding dim D, got "
            f"{image_embeds.shape[1]} and {text_embeds.shape[1]}"
        )
    if same_batch and image_embeds.shape[0] != text_embeds.shape[0]:
        raise ValueError(
            f"image_embeds ({image_embeds.shape[0]} rows) and text_embeds ({text_embeds.shape[0]} "
            "rows) must be paired row by row"
        )


def _check_mask(name: str, mask: Tensor, shape: tuple[int, ...]) -> None:
    check_mask(name, mask, shape)


def _check_label_smoothing(value: float) -> float:
    return check_number("label_smoothing", value, low=0.0, high=1.0)


def _check_gather(gather: bool | None) -> None:
    if gather is not None and not isinstance(gather, bool):
        raise ValueError(f"gather must be None, True or False, got {gather!r}")


def _masked_cross_entropy(
    logits: Tensor, labels: Tensor, valid_rows: Tensor, valid_cols: Tensor, n_classes: Tensor, label_smoothing: float
) -> Tensor:
    """``F.cross_entropy(logits[valid_rows][:, valid_cols], remapped labels, label_smoothing, reduction="sum")``
    without boolean indexing (whose output size is a read of the mask on the host): invalid columns get the
    dtype's lowest logit, so that their softmax weight is exactly 0 (a finite fill, not -inf: a row with no valid
    column stays finite, also in backward), invalid rows are dropped with ``where``, and the smoothing term sums
    ``-log p`` over the ``n_classes`` valid columns only, in the order ``F.cross_entropy`` computes it:
    ``(1 - eps) * nll + eps / C * sum_j -log p_j``.

    ``logits`` ``(B, N)``; ``labels`` ``(B,)`` column of each row's pair (valid where the row is valid)."""
    masked = logits.masked_fill(~valid_cols[None, :], torch.finfo(logits.dtype).min)
    logp = F.log_softmax(masked, dim=1)
    nll = -logp.gather(1, labels[:, None])[:, 0]
    loss = torch.where(valid_rows, nll, 0.0).sum()
    if label_smoothing:
        smooth = -torch.where(valid_cols[None, :], logp, 0.0).sum(dim=1)
        smooth = torch.where(valid_rows, smooth, 0.0).sum()
        loss = (1 - label_smoothing) * loss + smooth * (label_smoothing / n_classes)
    return loss


def _symmetric_infonce(
    image_rows: Tensor,
    text_rows: Tensor,
    image_cols: Tensor,
    text_cols: Tensor,
    logit_scale: Tensor | float,
    *,
    row_offset: int,
    world: int,
    label_smoothing: float,
    valid_rows: Tensor | None,
    valid_cols: Tensor | None,
) -> Tensor:
    """Local-loss symmetric InfoNCE on normalised embeddings.

    Rows ``(B, D)`` are this rank's pairs, columns ``(world * B, D)`` all ranks' pairs (the rows
    included, starting at ``row_offset``). Returns ``world / N * sum over local valid rows`` of
    ``(CE_i->t + CE_t->i) / 2``, N the number of valid pairs over all ranks, so that the mean over
    ranks is the mean over the global batch. Invalid pairs leave the batch (neither queries nor
    candidates) through masks, not boolean indexing: nothing is read back to the host.
    """
    labels = torch.arange(image_rows.shape[0], device=image_rows.device) + row_offset
    logits_per_image = logit_scale * image_rows @ text_cols.T
    logits_per_text = logit_scale * text_rows @ image_cols.T
    if valid_cols is None:
        ce = F.cross_entropy(
            logits_per_image, labels, label_smoothing=label_smoothing, reduction="sum"
        ) + F.cross_entropy(logits_per_text, labels, label_smoothing=label_smoothing, reduction="sum")
        return ce / 2 * (world / image_cols.shape[0])
    n_pairs = valid_cols.sum().clamp(min=1)
    ce = _masked_cross_entropy(
        logits_per_image, labels, valid_rows, valid_cols, n_pairs, label_smoothing
    ) + _masked_cross_entropy(logits_per_text, labels, valid_rows, valid_cols, n_pairs, label_smoothing)
    return ce / 2 * (world / n_pairs)


def clip_loss(
    image_embeds: Tensor,
    text_embeds: Tensor,
    logit_scale: Tensor | float,
    *,
    label_smoothing: float = 0.0,
    valid: Tensor | None = None,
    gather: bool | None = None,
) -> Tensor:
    """Symmetric InfoNCE of CLIP (Radford et al. 2021, Fig. 3): mean of image->text and
    text->image cross-entropy over the batch, cosine similarities times ``logit_scale``.

    Also StructXLIP's L_{I,T} and L_{I',T'} (StructXLIP 3.2) and Long-CLIP's long/short losses
    (``label_smoothing=0.1``).

    Args:
        image_embeds: ``(B, D)`` raw image embeddings (normalised here).
        text_embeds: ``(B, D)`` raw text embeddings, row i paired with image row i.
        logit_scale: scalar multiplier of the cosine logits (``exp`` of the model's parameter): a number or a
            ``()`` / ``(1,)`` tensor, finite and >= 0 (a tensor's value is checked on the device, see
            :mod:`losses.checks`).
        label_smoothing: cross-entropy label smoothing over the candidates (``F.cross_entropy``), in [0, 1].
        valid: optional ``(B,)`` bool; pairs marked False are dropped from the batch (neither
            queries nor negatives), e.g. StructXLIP rows without an edge map. The mean runs over
            valid pairs; 0 (with the graph intact) when there are none.
        gather: ``None`` gathers across ranks when a process group of size > 1 is initialised.
            Distributed, this rank's rows are scored against all ranks' columns (gathered with
            autograd, labels offset by rank), and the value is scaled by ``world / N_valid`` so
            that the mean over ranks equals the single-process loss on the concatenated batch;
            every rank must pass the same B.

    Returns:
        Scalar loss (mean reduction); 0 with the graph intact for an empty batch (B = 0).

    Raises:
        ValueError: naming the argument: shapes that do not pair, a ``valid`` that is not a ``(B,)`` bool
            tensor, a ``logit_scale`` that is not a finite scalar >= 0, ``label_smoothing`` outside [0, 1].
    """
    _check_pair(image_embeds, text_embeds)
    if valid is not None:
        _check_mask("valid", valid, (image_embeds.shape[0],))
    check_scalar("logit_scale", logit_scale, low=0.0, where="clip_loss")
    label_smoothing = _check_label_smoothing(label_smoothing)
    _check_gather(gather)
    if image_embeds.shape[0] == 0:  # every rank passes the same B: all return here, no collective is skipped
        return zero_with_graph(image_embeds, text_embeds, logit_scale)
    image = F.normalize(image_embeds, dim=-1)
    text = F.normalize(text_embeds, dim=-1)
    rank, world = world_info() if should_gather(gather) else (0, 1)
    image_all, text_all = (gather_with_grad(image), gather_with_grad(text)) if world > 1 else (image, text)
    valid_all = gather_with_grad(valid) if valid is not None and world > 1 else valid
    return _symmetric_infonce(
        image,
        text,
        image_all,
        text_all,
        logit_scale,
        row_offset=rank * image.shape[0],
        world=world,
        label_smoothing=label_smoothing,
        valid_rows=valid,
        valid_cols=valid_all,
    )


def siglip_loss(
    image_embeds: Tensor,
    text_embeds: Tensor,
    logit_scale: Tensor | float,
    logit_bias: Tensor | float,
    *,
    positives: Tensor | None = None,
    gather: bool | None = None,
    exchange: str = "gather",
) -> Tensor:
    """Pairwise sigmoid loss of SigLIP (Zhai et al. 2023, section 3.2 and Algorithm 1).

    ``-sum_ij log sigmoid(y_ij (s cos(i, j) + b)) / B_image`` with ``y_ij = 1`` for positive
    pairs and -1 otherwise: the sum over all pairs divided by the number of images, like
    open_clip's ``SigLipLoss``.

    Args:
        image_embeds: ``(B_image, D)`` raw image embeddings.
        text_embeds: ``(B_text, D)`` raw text embeddings.
        logit_scale: scalar multiplier ``s`` (``exp`` of the model's parameter), finite and >= 0.
        logit_bias: scalar bias ``b`` (raw), finite.
        positives: ``(B_image, B_text)`` bool, True where text j describes image i (several
            captions per image); default the identity (then ``B_image == B_text``). With a gather
            it indexes this rank's texts; other ranks' texts are negatives.
        gather: ``None`` goes distributed when a process group of size > 1 is initialised. The
            mean over ranks equals the single-process loss on the concatenated batch; every rank must
            pass the same shapes.
        exchange: how texts reach the other ranks when distributed: ``"gather"`` all-gathers them
            with autograd and scores one ``(B_image, W * B_text)`` matrix; ``"ring"`` passes each
            rank's text block around the ring by neighbour exchange
            (:func:`losses.distributed.ring_exchange_with_grad`; SigLIP section 3.3's chunked
            implementation, as open_clip's ``SigLipLoss``) and scores one ``(B_image, B_text)`` block
            at a time, all negatives. Same value and gradients.

    Returns:
        Scalar loss; 0 with the graph intact when there is no image or no text (B = 0).

    Raises:
        ValueError: naming the argument (shapes, ``positives``, ``exchange``, a ``logit_scale`` that is not
            finite and >= 0, a ``logit_bias`` that is not finite).
    """
    _check_pair(image_embeds, text_embeds, same_batch=False)
    check_scalar("logit_scale", logit_scale, low=0.0, where="siglip_loss")
    check_scalar("logit_bias", logit_bias, where="siglip_loss")
    _check_gather(gather)
    n_image, n_text = image_embeds.shape[0], text_embeds.shape[0]
    if positives is None:
        if n_image != n_text:
            raise ValueError(
                f"siglip_loss: image_embeds has {n_image} rows and text_embeds {n_text}; pass "
                "positives (B_image, B_text) bool to say which texts describe which image"
            )
        positives = torch.eye(n_image, dtype=torch.bool, device=image_embeds.device)
    _check_mask("positives", positives, (n_image, n_text))
    if exchange not in ("gather", "ring"):
        raise ValueError(f"siglip_loss: exchange must be 'gather' or 'ring', got {exchange!r}")
    if n_image == 0 or n_text == 0:  # every rank passes the same shapes: all return here
        return zero_with_graph(image_embeds, text_embeds, logit_scale, logit_bias)
    image = F.normalize(image_embeds, dim=-1)
    text = F.normalize(text_embeds, dim=-1)
    rank, world = world_info() if should_gather(gather) else (0, 1)
    if world > 1 and exchange == "ring":
        own = logit_scale * image @ text.T + logit_bias
        loss = -F.logsigmoid((positives.to(own.dtype) * 2 - 1) * own).sum()
        for _, block in ring_exchange_with_grad(text):  # other ranks' texts: negatives only
            loss = loss - F.logsigmoid(-(logit_scale * image @ block.T + logit_bias)).sum()
        return loss / n_image
    if world > 1:
        text = gather_with_grad(text)
        block = positives
        positives = torch.zeros(n_image, world * n_text, dtype=torch.bool, device=block.device)
        positives[:, rank * n_text : (rank + 1) * n_text] = block
    logits = logit_scale * image @ text.T + logit_bias
    signs = positives.to(logits.dtype) * 2 - 1
    return -F.logsigmoid(signs * logits).sum() / n_image


def pca_reconstruct(x: Tensor, k: int = 32) -> Tensor:
    """Long-CLIP's coarse image features for the short caption (Zhang et al. 2024, section 3.2,
    "primary component matching").

    Rows are L2-normalised, centred, projected on the top-``k`` principal components of the
    batch, and the mean is added back; the result is *not* re-normalised (as in the public
    training code; a loss normalises it when it consumes it).

    Args:
        x: ``(B, D)`` raw image embeddings of the batch.
        k: number of principal components kept (Long-CLIP: 32).

    Returns:
        ``(B, D)`` reconstruction, differentiable through the decomposition. When
        ``B <= k + 1`` the centred rows span at most ``k`` dimensions and the reconstruction is
        exactly the normalised input, which is returned without a decomposition. If the SVD fails
        (e.g. non-finite features, Long-CLIP issue #52) a warning is logged and the normalised
        input is returned unreduced.
    """
    _check_embeds("x", x)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (number of principal components) must be an integer >= 1, got {k!r}")
    x = F.normalize(x, dim=-1)
    if x.shape[0] <= k + 1:
        return x
    work = x if x.dtype in (torch.float32, torch.float64) else x.float()
    mean = work.mean(dim=0, keepdim=True)
    centred = work - mean
    try:
        u, s, vh = torch.linalg.svd(centred, full_matrices=False)
    except torch.linalg.LinAlgError as err:
        logger.warning("pca_reconstruct: SVD failed (%s); using the unreduced features", err)
        return x
    reconstructed = (u[:, :k] * s[:k]) @ vh[:k] + mean
    return reconstructed.to(x.dtype)


def longclip_loss(
    image_embeds: Tensor,
    long_text_embeds: Tensor,
    short_text_embeds: Tensor,
    logit_scale: Tensor | float,
    *,
    pca_dim: int = 32,
    label_smoothing: float = 0.1,
    gather: bool | None = None,
) -> Tensor:
    """Long-CLIP's fine-tuning loss (Zhang et al. 2024, section 3.2): long loss + short loss.

    ``clip_loss(image, long caption)`` plus the same symmetric InfoNCE between
    ``pca_reconstruct(image)`` and the short caption, both with label smoothing 0.1 and equal
    weights, as in Long-CLIP's public training code. The short caption is the long caption's
    first sentence (the caller encodes it). As in that code, the short loss's image side is the
    PCA reconstruction itself, not re-normalised (the paper does not say); the text side and
    the long loss use cosine similarities.

    Args:
        image_embeds: ``(B, D)`` raw image embeddings.
        long_text_embeds: ``(B, D)`` raw embeddings of the long captions.
        short_text_embeds: ``(B, D)`` raw embeddings of the short captions (first sentences).
        logit_scale: scalar multiplier (``exp`` of the model's parameter), finite and >= 0.
        pca_dim: principal components kept for the short loss's image features (32), an integer >= 1.
        label_smoothing: for both cross-entropies (0.1), in [0, 1].
        gather: as in :func:`clip_loss`. Distributed, the PCA runs on the *gathered* image batch
            (every rank decomposes the same ``(world * B, D)`` matrix): the loss then equals the
            single-process loss on the concatenated batch whatever the number of ranks. The
            public code decomposes each GPU's own batch, which makes the objective depend on the
            sharding and turns PCA into a no-op for per-GPU batches of 33 or fewer (issue #68).

    Returns:
        Scalar loss, the sum of the long and the short loss; 0 with the graph intact for an empty batch.

    Raises:
        ValueError: naming the argument, as :func:`clip_loss`, and a ``pca_dim`` that is not an integer >= 1.
    """
    _check_pair(image_embeds, long_text_embeds)
    _check_pair(image_embeds, short_text_embeds)
    check_scalar("logit_scale", logit_scale, low=0.0, where="longclip_loss")
    label_smoothing = _check_label_smoothing(label_smoothing)
    if isinstance(pca_dim, bool) or not isinstance(pca_dim, int) or pca_dim < 1:
        raise ValueError(f"longclip_loss: pca_dim must be an integer >= 1, got {pca_dim!r}")
    _check_gather(gather)
    if image_embeds.shape[0] == 0:
        return zero_with_graph(image_embeds, long_text_embeds, short_text_embeds, logit_scale)
    image = F.normalize(image_embeds, dim=-1)
    long_text = F.normalize(long_text_embeds, dim=-1)
    short_text = F.normalize(short_text_embeds, dim=-1)
    rank, world = world_info() if should_gather(gather) else (0, 1)
    n = image.shape[0]
    image_all = gather_with_grad(image) if world > 1 else image
    long_all = gather_with_grad(long_text) if world > 1 else long_text
    short_all = gather_with_grad(short_text) if world > 1 else short_text
    options = dict(row_offset=rank * n, world=world, label_smoothing=label_smoothing)
    long_loss = _symmetric_infonce(
        image, long_text, image_all, long_all, logit_scale, valid_rows=None, valid_cols=None, **options
    )
    # Used as it is, like Long-CLIP's code: the short logits are dot products with the
    # reconstruction, which is not re-normalised.
    pca_all = pca_reconstruct(image_all, pca_dim)
    pca_rows = pca_all[rank * n : (rank + 1) * n]
    short_loss = _symmetric_infonce(
        pca_rows, short_text, pca_all, short_all, logit_scale, valid_rows=None, valid_cols=None, **options
    )
    return long_loss + short_loss


__all__ = ["clip_loss", "siglip_loss", "pca_reconstruct", "longclip_loss"]
