"""FLAIR's text-conditioned attention pooling and sigmoid losses (FLAIR, sections 3.2-3.4).

The global text embedding queries the image's local (patch) embeddings through one multi-head
attention layer, giving a text-conditioned image embedding ``v_tc``. The keys and values get an
"empty" slot, a zero key and a zero value appended *after* the in-projection (PyTorch's
``add_zero_attn``, as the authors' ``PureAttentionPoolingBlock``), so that a text with nothing to
attend to can put its weight there: that slot has logit exactly 0 and adds nothing to the output.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checks import check_number, check_scalar, zero_with_graph
from .distributed import gather_with_grad, ring_exchange_with_grad, should_gather, world_info

Distributed = Literal["global", "ring"]
MpsNegatives = Literal["paper", "public_code"]
#: the negatives of L_mps: the paper's (section 3.4) or the public code's (``loss.py``)
MPS_NEGATIVES = ("paper", "public_code")


class TextConditionedAttentionPool(nn.Module):
    """Multi-head attention with text queries over an image's local tokens (FLAIR, section 3.2).

    ``v_tc = out_proj(concat_h softmax(Q_h [K_h; 0]^T / sqrt(d_h)) [V_h; 0])`` with
    ``Q = W_q LN_q(t)``, ``K = W_k LN_k(v_loc)``, ``V = W_v LN_v(v_loc)``; no output norm and no MLP.
    Submodule names (``attn``, ``ln_q``, ``ln_k``, ``ln_v``) are those of the authors' checkpoints,
    so their pool weights load as they are.

    Args:
        dim: embedding width D of texts and local image tokens (512 for FLAIR ViT-B/16).
        heads: attention heads (8 in FLAIR).
        eps: LayerNorm epsilon (PyTorch's default, as the authors').
    """

    def __init__(self, dim: int, heads: int = 8, *, eps: float = 1e-5) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("heads", heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TextConditionedAttentionPool: {name} must be an integer >= 1, got {value!r}")
        check_number("eps", eps, low=0.0, above=True, where="TextConditionedAttentionPool")
        if dim % heads:
            raise ValueError(f"TextConditionedAttentionPool: dim {dim} is not divisible by heads {heads}")
        self.dim, self.heads = dim, heads
        self.ln_q = nn.LayerNorm(dim, eps=eps)
        self.ln_k = nn.LayerNorm(dim, eps=eps)
        self.ln_v = nn.LayerNorm(dim, eps=eps)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True, add_zero_attn=True)

    def forward(
        self,
        queries: Tensor,
        local: Tensor,
        local_mask: Tensor | None = None,
        *,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Pool each image's local tokens once per text query.

        Args:
            queries: ``(B, Q, D)`` text embeddings (raw, not normalised), Q queries per image;
                ``(B, D)`` is one query per image.
            local: ``(B, N, D)`` projected local image tokens (patches; no class token).
            local_mask: ``(B, N)`` bool, True for real tokens (padded segments False); None: all real.
                The empty slot is never masked, so an image with no real token pools to zero.
            return_weights: also return the attention weights averaged over heads.

        Returns:
            ``(B, Q, D)`` text-conditioned image embeddings (``(B, D)`` for 2-d ``queries``), and with
            ``return_weights`` the weights ``(B, Q, N + 1)``, the empty slot last.
        """
        single = queries.dim() == 2
        if single:
            queries = queries.unsqueeze(1)
        if queries.dim() != 3 or local.dim() != 3 or queries.shape[0] != local.shape[0]:
            raise ValueError(f"TextConditionedAttentionPool: queries (B, Q, D) and local (B, N, D) must share "
                             f"B, got {tuple(queries.shape)} and {tuple(local.shape)}")
        if queries.shape[-1] != self.dim or local.shape[-1] != self.dim:
            raise ValueError(f"TextConditionedAttentionPool: width must be {self.dim}, got queries "
                             f"{queries.shape[-1]} and local {local.shape[-1]}")
        padding = None
        if local_mask is not None:
            if local_mask.shape != local.shape[:2]:
                raise ValueError(f"TextConditionedAttentionPool: local_mask must be (B, N) = "
                                 f"{tuple(local.shape[:2])}, got {tuple(local_mask.shape)}")
            padding = ~local_mask.bool()
        out, weights = self.attn(self.ln_q(queries), self.ln_k(local), self.ln_v(local),
                                 key_padding_mask=padding, need_weights=return_weights,
                                 average_attn_weights=True)
        if single:
            out = out.squeeze(1)
            weights = weights.squeeze(1) if weights is not None else None
        return (out, weights) if return_weights else out


_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


def _splitmix64(x: int) -> int:
    """SplitMix64's output function on a Python int (Steele et al. 2014): neighbouring seeds give
    unrelated 64-bit keys."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2**32`` for int64 tensors holding 32-bit values, in two 16-bit halves of ``c`` so
    that no int64 product overflows (every device computes the same bits)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _fmix32(x: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser, a bijection of 32-bit values with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _negative_offsets(seed: int, images: Tensor, others: Tensor, k: int) -> Tensor:
    """Which of image ``others``' K sub-captions image ``images`` gets as its negative: a hash of
    (seed, image, other image) mod K, a pure function of its three arguments (a counter-based
    draw), so any block of rows is computed alone and equals those rows of the whole matrix.
    ``images`` ``(R, 1)`` and ``others`` ``(R, C)`` or ``(1, C)`` int64; returns ``(R, C)`` in [0, K)."""
    key = _splitmix64(seed)
    row = _fmix32(_fmix32(images ^ (key & _MASK32)) ^ (key >> 32))
    return _fmix32(row ^ _mul32(others, 0x9E3779B9)) % k


def flair_draw_seed(*parts: int) -> int:
    """One 64-bit draw seed from integers (a run's seed, the training step, ...): SplitMix64 chained
    over ``parts``. :class:`finetune.objectives.flair.FlairTerm` keys each step's draw this way."""
    h = 0
    for part in parts:
        h = _splitmix64(h ^ (int(part) & _MASK64))
    return h


def sample_flair_text_indices(
    num_images: int,
    k: int,
    *,
    rows: slice | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Draw the texts of L_tcs: each image's K positives and one random sub-caption of every other
    image (FLAIR, section 3.3: ``B x (K + B - 1)`` pairs instead of ``B x BK``).

    As the public code (``downsample_text_features``), the sub-caption taken from each other image
    is drawn independently for every (image, other image) pair, and each row is ordered by image,
    so image i's own sub-captions sit at columns ``i .. i + K - 1``. Unlike the public code's
    ``torch.randint`` over the whole batch, the draw is counter-based: the pick of image i from image
    j is a hash of (``seed``, i, j) (MurmurHash3's finaliser on the device), so a process computes
    only its own ``rows`` (``R x (K + B - 1)`` integers, nothing of size ``B x B``), on the texts'
    device, without a host read, and gets exactly those rows of the whole draw.

    Args:
        num_images: B, images in the batch (the global batch for ``flair_loss(distributed="global")``).
        k: K, sub-captions per image.
        rows: the images whose rows to return (a step-1 slice); None: all.
        seed: the draw's key (any int; :func:`flair_draw_seed` makes one from a run's seed and step);
            None: drawn from ``generator``.
        generator: a CPU ``torch.Generator`` to draw ``seed`` from (one CPU draw, no device read);
            None uses torch's default CPU generator, so processes seeded alike share one draw.
        device: where the indices are made (the texts' device).

    Returns:
        ``(R, K + B - 1)`` int64 indices into the image-major ``B * K`` sub-captions
        (sub-caption k of image j is ``j * K + k``), R = B or the length of ``rows``.
    """
    if num_images < 1 or k < 1:
        raise ValueError(f"sample_flair_text_indices needs num_images >= 1 and k >= 1, got {num_images} and {k}")
    first, stop, step = (rows or slice(None)).indices(num_images)
    if step != 1 or stop <= first:
        raise ValueError(f"sample_flair_text_indices: rows must be a non-empty step-1 slice of "
                         f"range({num_images}), got {rows}")
    if seed is None:
        seed = int(torch.randint(0, 2 ** 62, (), generator=generator))
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"sample_flair_text_indices: seed must be an int, got {seed!r}")
    image = torch.arange(first, stop, device=device).unsqueeze(1)
    column = torch.arange(k + num_images - 1, device=device).unsqueeze(0)
    own = (column >= image) & (column < image + k)
    other = torch.where(column < image, column, column - k + 1).clamp(0, num_images - 1)
    negatives = other * k + _negative_offsets(seed, image, other, k)
    return torch.where(own, image * k + column - image, negatives)


def _check_text_indices(indices: Tensor, num_images: int, k: int, what: str) -> None:
    """Type and shape of ``text_indices``: ``(num_images, K + num_images - 1)`` integers."""
    shape = (num_images, k + num_images - 1)
    if not isinstance(indices, Tensor) or indices.is_floating_point() or indices.dtype == torch.bool \
            or tuple(indices.shape) != shape:
        got = (indices.dtype, tuple(indices.shape)) if isinstance(indices, Tensor) else type(indices).__name__
        raise ValueError(f"flair_loss: text_indices must be an integer tensor of shape {shape} "
                         f"(K + B - 1 columns, {what}), got {got}")


def _check_rows(rows: Tensor, first_image: int, num_images: int, k: int) -> None:
    """FLAIR's structure of rows ``first_image ..`` of ``text_indices``: in range, each row
    holding its image's K sub-captions (once each) and one sub-caption of every other image.

    It reads the rows on the host, so it runs on ``text_indices`` where the caller made them (a fixed draw, given
    on the CPU: no device sync), before they move to the texts' device. A training step gives no
    ``text_indices``: its rows are drawn on the device by construction (:func:`sample_flair_text_indices`) and
    not checked."""
    if rows.min() < 0 or rows.max() >= num_images * k:
        raise ValueError(f"flair_loss: text_indices must index the {num_images} x {k} image-major "
                         f"sub-captions, i.e. lie in [0, {num_images * k})")
    owner = rows // k
    counts = torch.zeros(rows.shape[0], num_images, dtype=torch.long, device=rows.device)
    counts.scatter_add_(1, owner, torch.ones_like(owner))
    expected = torch.ones_like(counts)
    expected[torch.arange(rows.shape[0], device=rows.device), first_image + torch.arange(
        rows.shape[0], device=rows.device)] = k
    distinct = (rows.sort(dim=1).values.diff(dim=1) > 0).all()
    if not (torch.equal(counts, expected) and distinct):
        raise ValueError("flair_loss: each row i of text_indices must hold image i's K sub-captions "
                         "(once each) and one sub-caption of every other image; draw it with "
                         "sample_flair_text_indices")


def _check_inputs(text_embeds: Tensor, local_image: Tensor, global_image: Tensor,
                  local_mask: Tensor | None) -> None:
    if not isinstance(text_embeds, Tensor) or text_embeds.dim() != 3 or not text_embeds.is_floating_point():
        got = (text_embeds.dtype, tuple(text_embeds.shape)) if isinstance(text_embeds, Tensor) \
            else type(text_embeds).__name__
        raise ValueError(f"flair_loss: text_embeds must be a (B, K, D) floating-point tensor, got {got}")
    if not isinstance(local_image, Tensor) or local_image.dim() != 3 or not local_image.is_floating_point():
        raise ValueError("flair_loss: local_image must be (B, N, D) floating-point patch embeddings")
    if not isinstance(global_image, Tensor) or global_image.dim() != 2 or not global_image.is_floating_point():
        raise ValueError("flair_loss: global_image must be a (B, D) floating-point tensor")
    if text_embeds.shape[1] == 0:
        raise ValueError("flair_loss: text_embeds has K = 0 sub-captions per image; FLAIR needs at least one "
                         "(K >= 1) per image")
    b, _, d = text_embeds.shape
    if local_image.shape[0] != b or global_image.shape[0] != b:
        raise ValueError(f"flair_loss: text_embeds, local_image and global_image must share B, got "
                         f"{b}, {local_image.shape[0]} and {global_image.shape[0]}")
    if local_image.shape[2] != d or global_image.shape[1] != d:
        raise ValueError(f"flair_loss: text_embeds, local_image and global_image must share D, got "
                         f"{d}, {local_image.shape[2]} and {global_image.shape[1]}")
    if local_mask is not None and (local_mask.dtype != torch.bool or local_mask.shape != local_image.shape[:2]):
        raise ValueError(f"flair_loss: local_mask must be a bool (B, N) = {tuple(local_image.shape[:2])} "
                         f"tensor, got {local_mask.dtype} {tuple(local_mask.shape)}")


def _at_least_float32(x: Tensor) -> Tensor:
    """The logits and log-sigmoids in float32 under bf16/fp16 autocast (float64 stays)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _sigmoid_sum(image: Tensor, text: Tensor, positive: Tensor | None, logit_scale: Tensor | float,
                 logit_bias: Tensor | float) -> Tensor:
    """``-sum log sigmoid(y (s cos + b))`` over paired rows of ``image`` and ``text`` (``(..., D)``,
    raw); ``y = +1`` where ``positive``, -1 elsewhere (all -1 when ``positive`` is None)."""
    cos = (F.normalize(image, dim=-1) * F.normalize(text, dim=-1)).sum(-1)
    logits = logit_scale * _at_least_float32(cos) + logit_bias
    signs = -torch.ones_like(logits) if positive is None else positive.to(logits.dtype) * 2 - 1
    return -F.logsigmoid(signs * logits).sum()


def _pair_sums(texts: Tensor, rows: Tensor, positive: Tensor | None, local_image: Tensor,
               local_mask: Tensor | None, global_image: Tensor | None, pool: TextConditionedAttentionPool,
               logit_scale: Tensor | float, logit_bias: Tensor | float) -> tuple[Tensor, Tensor | None]:
    """Over the pairs (image i, text ``texts[rows[i, c]]``), ``texts`` ``(T, D)``, ``rows`` ``(B, C)``:
    L_tcs summed (image i conditioned on the text and compared with that same text, FLAIR eq. 2) and,
    with ``global_image``, the paper's L_mps summed (the global image against the same texts, eq. 3
    with "1 caption from every K negative sub-captions")."""
    chosen = texts[rows]
    conditioned = pool(chosen, local_image, local_mask)
    tcs = _sigmoid_sum(conditioned, chosen, positive, logit_scale, logit_bias)
    if global_image is None:
        return tcs, None
    return tcs, _sigmoid_sum(global_image.unsqueeze(1), chosen, positive, logit_scale, logit_bias)


def _mps_sum(global_image: Tensor, texts: Tensor, positive: Tensor | None,
             logit_scale: Tensor | float, logit_bias: Tensor | float) -> Tensor:
    """L_mps summed over all (image, text) pairs, the public code's form: ``(B, D)`` x ``(T, D)``."""
    cos = F.normalize(global_image, dim=-1) @ F.normalize(texts, dim=-1).T
    logits = logit_scale * _at_least_float32(cos) + logit_bias
    signs = -torch.ones_like(logits) if positive is None else positive.to(logits.dtype) * 2 - 1
    return -F.logsigmoid(signs * logits).sum()


def _global_parts(text_embeds: Tensor, local_image: Tensor, global_image: Tensor,
                  pool: TextConditionedAttentionPool, logit_scale: Tensor | float,
                  logit_bias: Tensor | float, add_mps: bool, mps_negatives: str, text_indices: Tensor | None,
                  seed: int | None, gather: bool | None, local_mask: Tensor | None) -> dict[str, Tensor]:
    b, k, d = text_embeds.shape
    rank, world = world_info() if should_gather(gather) else (0, 1)
    total = b * world
    texts = gather_with_grad(text_embeds.reshape(b * k, d)) if world > 1 else text_embeds.reshape(b * k, d)
    mine = slice(rank * b, (rank + 1) * b)
    if text_indices is None:  # this process's rows only, on the device
        rows = sample_flair_text_indices(total, k, rows=mine, seed=seed, device=text_embeds.device)
    else:  # each process checks its own rows
        _check_text_indices(text_indices, total, k, "the global batch, the same on every process")
        _check_rows(text_indices[mine].long(), rank * b, total, k)  # where they were given (the CPU: no sync)
        rows = text_indices[mine].to(text_embeds.device).long()
    owner = torch.arange(rank * b, (rank + 1) * b, device=text_embeds.device).unsqueeze(1)
    paper_mps = add_mps and mps_negatives == "paper"
    tcs, mps = _pair_sums(texts, rows, rows // k == owner, local_image, local_mask,
                          global_image if paper_mps else None, pool, logit_scale, logit_bias)
    # Each process holds B of the W*B images: W x its share makes the mean over processes (and
    # DDP's averaged gradients) equal the loss of one process on the global batch.
    parts = {"tcs": tcs * (world / (k + total - 1))}
    if paper_mps:
        parts["mps"] = mps * (world / (k + total - 1))
    elif add_mps:
        text_owner = torch.arange(total * k, device=text_embeds.device).unsqueeze(0) // k
        parts["mps"] = _mps_sum(global_image, texts, text_owner == owner, logit_scale,
                                logit_bias) * (world / (total * k))
    return parts


def _ring_parts(text_embeds: Tensor, local_image: Tensor, global_image: Tensor,
                pool: TextConditionedAttentionPool, logit_scale: Tensor | float,
                logit_bias: Tensor | float, add_mps: bool, mps_negatives: str, text_indices: Tensor | None,
                seed: int | None, gather: bool | None, local_mask: Tensor | None) -> dict[str, Tensor]:
    b, k, d = text_embeds.shape
    texts = text_embeds.reshape(b * k, d)
    distributed = should_gather(gather) and world_info()[1] > 1
    if text_indices is None:  # each process its own draw (the public code seeds each rank apart)
        if seed is not None and distributed:
            seed = flair_draw_seed(seed, world_info()[0])
        rows = sample_flair_text_indices(b, k, seed=seed, device=text_embeds.device)
    else:
        _check_text_indices(text_indices, b, k, "this process's batch")
        _check_rows(text_indices.long(), 0, b, k)  # where they were given (the CPU: no sync)
        rows = text_indices.to(text_embeds.device).long()
    owner = torch.arange(b, device=text_embeds.device).unsqueeze(1)
    paper_mps = add_mps and mps_negatives == "paper"
    tcs, mps = _pair_sums(texts, rows, rows // k == owner, local_image, local_mask,
                          global_image if paper_mps else None, pool, logit_scale, logit_bias)
    if add_mps and not paper_mps:
        mps = _mps_sum(global_image, texts, (torch.arange(b * k, device=owner.device) // k) == owner,
                       logit_scale, logit_bias)
    if distributed:
        # Only the (B*K, D) texts travel; each process's sampled rows are small integers.
        all_rows = gather_with_grad(rows)
        for source, foreign in ring_exchange_with_grad(texts):
            foreign_rows = all_rows[source * b : (source + 1) * b]
            tcs_q, mps_q = _pair_sums(foreign, foreign_rows, None, local_image, local_mask,
                                      global_image if paper_mps else None, pool, logit_scale, logit_bias)
            tcs = tcs + tcs_q
            if paper_mps:
                mps = mps + mps_q
            elif add_mps:
                mps = mps + _mps_sum(global_image, foreign, None, logit_scale, logit_bias)
    parts = {"tcs": tcs / (k + b - 1)}
    if add_mps:
        parts["mps"] = mps / ((k + b - 1) if paper_mps else (b * k))
    return parts


def _flair_parts(text_embeds: Tensor, local_image: Tensor, global_image: Tensor,
                 pool: TextConditionedAttentionPool, logit_scale: Tensor | float,
                 logit_bias: Tensor | float, *, add_mps: bool, mps_negatives: str, text_indices: Tensor | None,
                 seed: int | None, distributed: str, gather: bool | None,
                 local_mask: Tensor | None) -> dict[str, Tensor]:
    if distributed not in ("global", "ring"):
        raise ValueError(f"flair_loss: distributed must be 'global' or 'ring', got {distributed!r}")
    _check_mps_negatives(mps_negatives, "flair_loss")
    if text_indices is not None and seed is not None:
        raise ValueError("flair_loss: give text_indices (a fixed draw) or seed (the draw's key), not both")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"flair_loss: seed must be an int, got {seed!r}")
    _check_inputs(text_embeds, local_image, global_image, local_mask)
    check_scalar("logit_scale", logit_scale, low=0.0, where="flair_loss")
    check_scalar("logit_bias", logit_bias, where="flair_loss")
    if gather is not None and not isinstance(gather, bool):
        raise ValueError(f"flair_loss: gather must be None, True or False, got {gather!r}")
    if text_embeds.shape[0] == 0:  # every process passes the same B: all return here, no collective is skipped
        zero = zero_with_graph(text_embeds, local_image, global_image, logit_scale, logit_bias, pool.parameters())
        parts = {"tcs": zero, "loss": zero}
        if add_mps:
            parts["mps"] = zero
        return parts
    compute = _global_parts if distributed == "global" else _ring_parts
    parts = compute(text_embeds, local_image, global_image, pool, logit_scale, logit_bias, add_mps,
                    mps_negatives, text_indices, seed, gather, local_mask)
    parts["loss"] = (parts["tcs"] + parts["mps"]) / 2 if add_mps else parts["tcs"]
    return parts


def _check_mps_negatives(value: str, where: str) -> None:
    if value not in MPS_NEGATIVES:
        raise ValueError(f"{where}: mps_negatives must be 'paper' (one sub-caption of every other image, FLAIR "
                         f"3.4) or 'public_code' (all B*K sub-captions, the public loss.py), got {value!r}")


def flair_loss(
    text_embeds: Tensor,
    local_image: Tensor,
    global_image: Tensor,
    pool: TextConditionedAttentionPool,
    logit_scale: Tensor | float,
    logit_bias: Tensor | float,
    *,
    add_mps: bool = True,
    mps_negatives: MpsNegatives = "paper",
    text_indices: Tensor | None = None,
    seed: int | None = None,
    distributed: Distributed = "global",
    gather: bool | None = None,
    local_mask: Tensor | None = None,
) -> Tensor:
    """FLAIR's loss ``L = (L_tcs + L_mps) / 2`` (FLAIR, sections 3.3-3.4, eqs. 2-4).

    With ``s`` = ``logit_scale``, ``b`` = ``logit_bias``, ``n`` the L2 normalisation and
    ``y = +1`` for an image's own sub-captions, -1 otherwise, and row i of the draw holding image
    i's K sub-captions and one random sub-caption of every other image (``K + B - 1`` texts c):

    * ``L_tcs = sum_i mean_c -log sigmoid(y_ic (s <n(pool(t_c, v_loc_i)), n(t_c)> + b))`` over
      row i: the image is conditioned on each text and compared with that same text (eq. 2, the
      negatives ``<v_{i,j_k}^tc, t_{j_k}>``; section 3.3's ``B x (K + B - 1)`` pairs);
    * ``L_mps = sum_i mean_c -log sigmoid(y_ic (s <n(v_g_i), n(t_c)> + b))`` (eq. 3) over, with
      ``mps_negatives="paper"``, the same row i ("all K positive pairs per image and 1 caption from
      every K negative sub-captions", section 3.4; the paper does not say whether L_mps draws its
      own negatives: here it shares L_tcs's draw), or with ``"public_code"`` all ``B * K``
      sub-captions (the public ``loss.py``);
    * ``L = (L_tcs + L_mps) / 2`` with ``add_mps`` (eq. 4), else ``L_tcs``.

    The normalisation is the public code's: a sum over images of a mean over each image's texts
    (so the loss grows with B; open_clip's SigLIP loss divides by B instead). One scale and one
    bias serve both terms.

    Image tokens never leave their process. Across processes (``gather``):

    * ``distributed="global"`` (default, the paper's batch of W*B images): texts are all-gathered
      with autograd; each process draws and scores only its own images' rows of the global draw
      and returns ``W x`` its images' share, so the mean over processes and DDP's averaged
      gradients equal one process on the concatenated batch with the same draw, whatever W.
    * ``distributed="ring"`` (the public code, to reproduce its runs): per process the sum over the
      W process blocks of ``(L_tcs + L_mps) / 2``, each normalised by the local ``K + B - 1`` (and
      ``B * K`` for the public L_mps): its own block as above, and for a foreign block local image
      i conditioned on row i of that process's drawn ``(B, K + B - 1)`` rows, all negatives, plus
      the global image against that process's texts (the same row, or all its ``B * K``), all
      negatives. The ``(B*K, D)`` texts travel by bidirectional neighbour exchange with autograd
      (:func:`losses.distributed.ring_exchange_with_grad`), so a process's text gradients include
      the other processes' losses.

    Args:
        text_embeds: ``(B, K, D)`` raw global text embeddings, K sub-captions per image.
        local_image: ``(B, N, D)`` raw projected local (patch) image tokens.
        global_image: ``(B, D)`` raw global image embedding (class token).
        pool: the :class:`TextConditionedAttentionPool` (a model module; its gradient flows).
        logit_scale: ``s``, the multiplier (already exponentiated), finite and >= 0.
        logit_bias: ``b`` (FLAIR initialises it to -10), finite.
        add_mps: add L_mps (the paper's and the public code's final loss).
        mps_negatives: ``"paper"`` or ``"public_code"`` (above).
        text_indices: a fixed draw, for tests: integer indices into the image-major sub-captions,
            row i for image i (see :func:`sample_flair_text_indices`). ``"global"``:
            ``(W*B, K + W*B - 1)`` over the global batch, the same on every process; ``"ring"``:
            ``(B, K + B - 1)``, this process's own draw. Checked (a host read): leave it None in
            a training step.
        seed: the draw's key (:func:`sample_flair_text_indices`; a training loop passes one per
            step, :func:`flair_draw_seed`): ``"global"`` draws this process's rows of the global
            draw keyed by ``seed``, the same rows a single process would draw on the concatenated
            batch; ``"ring"`` draws this process's own matrix keyed by (``seed``, rank). None:
            a seed from torch's default CPU generator, so processes seeded alike share one draw.
        distributed: ``"global"`` or ``"ring"`` (above).
        gather: ``None`` works across processes when a process group of size > 1 is
            initialised; ``False`` keeps each process's loss on its own batch.
        local_mask: ``(B, N)`` bool, True for real local tokens (see the pool).

    Returns:
        Scalar loss. Every process must pass the same B, K and D (N may differ). An empty batch (B = 0)
        gives 0 with the graph intact.

    Raises:
        ValueError: naming the argument: shapes (K = 0 included), a ``logit_scale`` that is not finite and >= 0,
            a ``logit_bias`` that is not finite, a bad ``text_indices``, ``seed``, ``distributed`` or
            ``mps_negatives``.
    """
    return _flair_parts(text_embeds, local_image, global_image, pool, logit_scale, logit_bias,
                        add_mps=add_mps, mps_negatives=mps_negatives, text_indices=text_indices, seed=seed,
                        distributed=distributed, gather=gather, local_mask=local_mask)["loss"]


class FLAIRLoss(nn.Module):
    """FLAIR's loss as a module, in open_clip's ``loss.py`` style: options fixed at construction,
    the model's outputs at call time (see :func:`flair_loss`).

    Args:
        add_mps: add the multi-positive sigmoid loss L_mps (FLAIR 3.4; the paper's final loss).
        mps_negatives: ``"paper"`` (one sub-caption of every other image, FLAIR 3.4) or
            ``"public_code"`` (all ``B * K`` sub-captions, the public ``loss.py``).
        distributed: ``"global"`` (the paper's batch) or ``"ring"`` (the public code).
        gather: see :func:`flair_loss`.
    """

    def __init__(self, *, add_mps: bool = True, mps_negatives: MpsNegatives = "paper",
                 distributed: Distributed = "global", gather: bool | None = None) -> None:
        super().__init__()
        if distributed not in ("global", "ring"):
            raise ValueError(f"FLAIRLoss: distributed must be 'global' or 'ring', got {distributed!r}")
        _check_mps_negatives(mps_negatives, "FLAIRLoss")
        self.add_mps, self.mps_negatives = add_mps, mps_negatives
        self.distributed, self.gather = distributed, gather

    def forward(
        self,
        text_embeds: Tensor,
        local_image: Tensor,
        global_image: Tensor,
        pool: TextConditionedAttentionPool,
        logit_scale: Tensor | float,
        logit_bias: Tensor | float,
        *,
        text_indices: Tensor | None = None,
        seed: int | None = None,
        local_mask: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """The loss and its terms.

        Args: as :func:`flair_loss`.

        Returns:
            ``{"loss", "tcs"}`` and, with ``add_mps``, ``"mps"``: scalars, ``loss`` the one to
            backpropagate, the terms (normalised as in the loss) for logging.
        """
        return _flair_parts(text_embeds, local_image, global_image, pool, logit_scale, logit_bias,
                            add_mps=self.add_mps, mps_negatives=self.mps_negatives, text_indices=text_indices,
                            seed=seed, distributed=self.distributed, gather=self.gather, local_mask=local_mask)

    def extra_repr(self) -> str:  # noqa: D102
        return f"add_mps={self.add_mps}, mps_negatives={self.mps_negatives!r}, distributed={self.distributed!r}"


__all__ = ["TextConditionedAttentionPool", "flair_loss", "FLAIRLoss", "sample_flair_text_indices", "flair_draw_seed",
           "MPS_NEGATIVES"]
