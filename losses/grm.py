"""GRM: significance / granularity adapters, region prompts with Gaussian uncertainty, token-wise
multi-level hinge loss (Liu et al., "Cross Modal Fine-grained Alignment via Granularity-aware and
Region-uncertain Modeling", eqs. 1-13).

* :class:`GRMHead` holds the learnable parts: two instances of the eq. 1 adapter (one per
  modality), the region prompts P (eq. 2) and the log-variance network phi (eq. 4).
  ``encode_image`` / ``encode_text`` return every intermediate (:class:`GRMImageOutput`,
  :class:`GRMTextOutput`), so that images and texts can be encoded apart (retrieval).
* :func:`token_wise_similarity` is eq. 7, computed in blocks (bounded memory).
* :func:`vse_hinge_loss` is eq. 8 (VSE++ hinge, summed over the batch).
* :func:`grm_loss` / :class:`GRMLoss` combine eqs. 7-13.

The gates and the L2 normalisation. Eq. 7 runs on L2-normalised tokens, and
``normalize(a * v) == normalize(v)`` for any ``a > 0``: a soft gate of eq. 1 cancels. The head
therefore uses a straight-through hard Gumbel gate (``hard=True``, exact 0/1 forward, the soft
sample's gradient). The key-level similarity gates the *normalised* tokens,
``A * normalize(X)``, which in the forward is exactly ``normalize(A * X)`` for 0/1 gates (a dropped
token is the zero vector), and whose gradient with respect to the gate is the token's cosine
(``normalize(A * X)`` has zero gradient with respect to ``A`` at ``A = 1`` and an unbounded one at
``A = 0``). With ``hard=False`` the same formula scales each cosine by the soft gate.

Distributed (``gather``): images stay local, texts are gathered. A rank scores its local images
against the texts of every rank (rank 0's texts first), ``sim`` is ``(Bi_local, Bt_global)``;
:func:`vse_hinge_loss` gathers these rows with autograd to rank the columns of its own texts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .distributed import gather_counts, gather_with_grad, should_gather, world_info

# Eq. 9 weights a, b, c (paper, "Parameter Analysis" and implementation details).
PAPER_LEVEL_WEIGHTS = (0.4, 0.4, 0.2)
# Eq. 8 margin alpha (implementation details).
PAPER_MARGIN = 0.2
# K for ViT backbones (K = 50 for Swin; implementation details).
PAPER_NUM_REGIONS = 5
# LAPS (lib/xttn.py) applies leaky_relu(cos, 0.1) before the max; eq. 7 has none.
LAPS_LEAKY_SLOPE = 0.1
# Elements of one (images x texts x Lv x Lt) block of token cosines (16 MiB in float32).
DEFAULT_BLOCK_ELEMENTS = 2**22

EntropyOf = Literal["normalised", "sigmoid"]
Level = Literal["ori", "key", "unc"]


# --- checks --------------------------------------------------------------------------------


def _check_tokens(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor) or x.dim() != 3 or not x.is_floating_point():
        got = (x.dtype, tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a floating (B, L, d) tensor of token states, got {got}")


def _token_mask(name: str, mask: Tensor | None, tokens: Tensor, *, need_one: bool = True) -> Tensor:
    """``mask`` as a (B, L) bool tensor (all True when None); True marks a real token."""
    shape = tuple(tokens.shape[:2])
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=tokens.device)
    if not isinstance(mask, Tensor) or tuple(mask.shape) != shape:
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"{name} must be a (B, L) = {shape} tensor (True = real token), got {got}")
    if mask.dtype != torch.bool:
        if mask.is_floating_point() or mask.is_complex():
            raise ValueError(f"{name} must be bool or integer (an attention mask), got {mask.dtype}")
        mask = mask != 0
    if need_one and shape[0] and not bool(mask.any(dim=1).all()):
        empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
        raise ValueError(f"{name}: rows {empty} have no real token; every sample needs at least one")
    return mask


def _token_weights(name: str, weights: Tensor | None, tokens: Tensor) -> Tensor | None:
    if weights is None:
        return None
    if not isinstance(weights, Tensor) or tuple(weights.shape) != tuple(tokens.shape[:2]):
        got = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"{name} must be a (B, L) = {tuple(tokens.shape[:2])} tensor of gates, got {got}")
    return weights


# --- eq. 1: adapters and the Gumbel gate ---------------------------------------------------


def gumbel_gate(
    logits: Tensor,
    *,
    tau: float = 1.0,
    hard: bool = True,
    stochastic: bool = True,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Column 1 of the Gumbel-softmax of 2-way logits: ``A = f_g(D, tau)[:, 1]`` (GRM eq. 1).

    Args:
        logits: ``(..., 2)`` D of eq. 1; column 1 is "keep".
        tau: Gumbel-softmax temperature.
        hard: straight-through: the forward value is the one-hot argmax of the sample (exactly 0
            or 1), the gradient the soft sample's.
        stochastic: add Gumbel noise (training). ``False`` is evaluation: no noise, the gate is the
            argmax of the logits (always hard), with the straight-through gradient of
            ``softmax(D / tau)``.
        generator: RNG of the Gumbel noise.

    Returns:
        ``(...)`` the gate A in [0, 1].
    """
    if logits.shape[-1] != 2:
        raise ValueError(
            f"gumbel_gate: logits must end with 2 columns (drop, keep), got {tuple(logits.shape)}"
        )
    if tau <= 0:
        raise ValueError(f"gumbel_gate: tau must be > 0, got {tau}")
    if stochastic:
        exponential = torch.empty_like(logits).exponential_(generator=generator)
        gumbel = -exponential.clamp_min(torch.finfo(logits.dtype).tiny).log()
        soft = ((logits + gumbel) / tau).softmax(dim=-1)
    else:
        soft = (logits / tau).softmax(dim=-1)
    if hard or not stochastic:
        one_hot = torch.zeros_like(soft).scatter_(-1, soft.argmax(dim=-1, keepdim=True), 1.0)
        # one_hot + (soft - soft.detach()): exactly 0/1 in the forward, the soft gradient.
        return (one_hot + (soft - soft.detach()))[..., 1]
    return soft[..., 1]


class TokenAdapter(nn.Module):
    """The adapter of GRM eq. 1 without its gate: ``D = W2 GELU(W1 X)``, 2 logits per token.

    GRM instantiates it twice (same structure, separate weights): the significance-aware adapter
    on image tokens and the granularity-aware adapter on text tokens.

    Args:
        dim: token width d.
        hidden_dim: width of ``W1`` (the paper does not give it); default ``dim``.
        keep_bias: initial bias of the keep logit minus the drop logit (``W2``'s bias is set to
            ``(0, keep_bias)``; the paper does not give the initialisation). 0: PyTorch's default
            initialisation; > 0 starts with the tokens kept (the gate is ``sigmoid(keep_bias)`` in
            expectation at a zero ``W2`` row difference), so that the regularisers, which are
            smallest when every token is dropped, do not close the gates before the hinge uses them.
    """

    def __init__(self, dim: int, hidden_dim: int | None = None, *, keep_bias: float = 0.0) -> None:
        super().__init__()
        hidden_dim = dim if hidden_dim is None else hidden_dim
        if dim < 1 or hidden_dim < 1:
            raise ValueError(f"TokenAdapter: dim and hidden_dim must be >= 1, got {dim}, {hidden_dim}")
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, 2)
        if keep_bias:
            with torch.no_grad():
                self.fc2.bias.copy_(torch.tensor([0.0, float(keep_bias)]))

    def forward(self, tokens: Tensor) -> Tensor:
        """``(B, L, d)`` tokens -> ``(B, L, 2)`` logits D (column 1: keep)."""
        return self.fc2(self.act(self.fc1(tokens)))


# --- eqs. 2-6: outputs ---------------------------------------------------------------------


@dataclass
class GatedTokens:
    """One side of :class:`GRMHead` after its adapter (eq. 1): the tokens, their gate and the kept tokens.

    Attributes:
        tokens: ``(B, L, d)`` the input token states (T or V).
        mask: ``(B, L)`` bool, True for real tokens (padding never counts).
        logits: ``(B, L, 2)`` D of eq. 1.
        gate: ``(B, L)`` A (0 on padding); 0/1 with a hard gate and at evaluation.
        key_tokens: ``(B, L, d)`` the key tokens A * T (eq. 1).
    """

    tokens: Tensor
    mask: Tensor
    logits: Tensor
    gate: Tensor
    key_tokens: Tensor

    def keep_ratio(self) -> Tensor:
        """Fraction of real tokens the gate keeps, per sample ``(B,)`` (for reports)."""
        return _keep_ratio(self.gate, self.mask)


@dataclass
class GRMTextOutput(GatedTokens):
    """Text side of :class:`GRMHead` (granularity-aware adapter, eq. 1): T, D_t, A_T and T_hat = A_T * T
    (``(B, Lt, ...)``; the fields of :class:`GatedTokens`)."""


@dataclass
class GRMImageOutput(GatedTokens):
    """Image side of :class:`GRMHead` (significance-aware adapter eq. 1, regions eqs. 2-6): V, D_v, A_V and
    V_hat = A_V * V (``(B, Lv, ...)``; the fields of :class:`GatedTokens`), then

    Attributes:
        region_scores: ``(B, Lv, K)`` A_r = sigmoid(V_hat P_hat^T) (eq. 2), 0 on padding.
        region_weights: ``(B, Lv, K)`` A_hat_r, A_r normalised over the real tokens (eq. 2).
        mu: ``(B, K, d)`` region means (eq. 3).
        log_var: ``(B, K, d)`` log sigma^2 = phi(mu) (eq. 4).
        regions: ``(B, K, d)`` U, the uncertainty-aware regions (eqs. 5-6); ``mu`` at evaluation.
    """

    region_scores: Tensor
    region_weights: Tensor
    mu: Tensor
    log_var: Tensor
    regions: Tensor


@dataclass
class GRMOutput:
    """Both sides of :class:`GRMHead` for a batch of image-text pairs."""

    image: GRMImageOutput
    text: GRMTextOutput


def _keep_ratio(gate: Tensor, mask: Tensor) -> Tensor:
    return (gate.detach() * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def sample_regions(
    mu: Tensor,
    log_var: Tensor,
    weights: Tensor,
    *,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Uncertainty-aware regions U (GRM eqs. 5-6).

    ``z_lk = mu_k + eps_lk * exp(log_var_k / 2)``, ``u_k = sum_l A_hat_lk z_lk``. Since the
    weights of region k sum to 1 over the tokens, ``u_k = mu_k + exp(log_var_k / 2) * sum_l
    A_hat_lk eps_lk``, and ``sum_l A_hat_lk eps_lk`` is ``N(0, sum_l A_hat_lk^2)`` per dimension.
    Without ``noise`` that one ``(B, K, d)`` normal is drawn: the distribution of eqs. 5-6
    without their ``(B, Lv, K, d)`` noise tensor (another reparameterisation of the same
    distribution, so its gradients are unbiased too).

    Args:
        mu: ``(B, K, d)`` region means (eq. 3).
        log_var: ``(B, K, d)`` log-variances (eq. 4).
        weights: ``(B, Lv, K)`` normalised region attention A_hat_r (eq. 2), 0 on padding.
        noise: optional ``(B, Lv, K, d)`` eps of eq. 5, used as given (eqs. 5-6 literally).
        generator: RNG when ``noise`` is None.

    Returns:
        ``(B, K, d)`` U.
    """
    std = torch.exp(0.5 * log_var)
    if noise is not None:
        expected = (*weights.shape, mu.shape[-1])
        if tuple(noise.shape) != expected:
            raise ValueError(
                f"sample_regions: noise must have shape (B, Lv, K, d) = {expected}, got {tuple(noise.shape)}"
            )
        z = mu[:, None] + noise * std[:, None]
        return torch.einsum("blk,blkd->bkd", weights, z)
    eps = torch.randn(mu.shape, generator=generator, dtype=mu.dtype, device=mu.device)
    spread = weights.square().sum(dim=1).sqrt()  # (B, K)
    return mu + std * spread[..., None] * eps


class GRMHead(nn.Module):
    """GRM's learnable head (eqs. 1-6): two eq. 1 adapters, region prompts, uncertainty network.

    * ``vision_adapter``: the significance-aware adapter (image tokens), a :class:`TokenAdapter`.
    * ``text_adapter``: the granularity-aware adapter (text tokens), a second instance.
    * ``prompts``: P ``(K, d)``, L2-normalised when used (eq. 2).
    * ``phi``: ``Linear(d, d)``, ``log sigma^2_k = phi(mu_k)`` (eq. 4).

    ``encode_image`` and ``encode_text`` run one side each (retrieval encodes them apart);
    ``forward`` runs both. In training mode the gates sample Gumbel noise and the regions the
    Gaussian noise of eqs. 5-6; in eval mode (or ``stochastic=False``) both are deterministic: the
    gate is the argmax of the logits, U = mu.

    Args:
        dim: token width d (512 in the paper).
        num_regions: K (5 for ViT, 50 for Swin in the paper).
        tau: Gumbel-softmax temperature (the paper does not give it: 1.0).
        hard: straight-through hard gate (default; a soft gate cancels under the normalisation of
            eq. 7, see the module docstring).
        hidden_dim: width of each adapter's ``W1`` (not given: ``dim``).
        keep_bias: initial keep-minus-drop bias of both adapters (not given: 0, PyTorch's
            initialisation), see :class:`TokenAdapter`.
    """

    def __init__(
        self,
        dim: int,
        *,
        num_regions: int = PAPER_NUM_REGIONS,
        tau: float = 1.0,
        hard: bool = True,
        hidden_dim: int | None = None,
        keep_bias: float = 0.0,
    ) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"GRMHead: dim must be >= 1, got {dim}")
        if num_regions < 1:
            raise ValueError(f"GRMHead: num_regions (K) must be >= 1, got {num_regions}")
        if tau <= 0:
            raise ValueError(f"GRMHead: tau must be > 0, got {tau}")
        self.dim, self.num_regions, self.tau, self.hard = dim, num_regions, float(tau), bool(hard)
        self.vision_adapter = TokenAdapter(dim, hidden_dim, keep_bias=keep_bias)
        self.text_adapter = TokenAdapter(dim, hidden_dim, keep_bias=keep_bias)
        # Directions uniform on the sphere (only the normalised prompts are used).
        self.prompts = nn.Parameter(torch.randn(num_regions, dim))
        self.phi = nn.Linear(dim, dim)

    def _stochastic(self, stochastic: bool | None) -> bool:
        return self.training if stochastic is None else bool(stochastic)

    def _check_dim(self, name: str, tokens: Tensor) -> None:
        _check_tokens(name, tokens)
        if tokens.shape[-1] != self.dim:
            raise ValueError(f"GRMHead(dim={self.dim}): {name} has width {tokens.shape[-1]}")

    def _gated(self, side: str, adapter: nn.Module, tokens: Tensor, mask: Tensor | None, stochastic: bool,
               generator: torch.Generator | None, check: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """Eq. 1 on one side: the checked mask, the adapter's logits D and the gate A (0 on padding)."""
        self._check_dim(f"{side} tokens", tokens)
        mask = _token_mask(f"{side} mask", mask, tokens, need_one=check)
        logits = adapter(tokens)
        gate = gumbel_gate(logits, tau=self.tau, hard=self.hard, stochastic=stochastic, generator=generator) * mask
        return mask, logits, gate

    def encode_text(
        self,
        tokens: Tensor,
        mask: Tensor | None = None,
        *,
        stochastic: bool | None = None,
        generator: torch.Generator | None = None,
        check: bool = True,
    ) -> GRMTextOutput:
        """Granularity-aware adapter on text tokens (eq. 1).

        Args:
            tokens: ``(B, Lt, d)`` T (projected token states).
            mask: ``(B, Lt)`` bool or 0/1 attention mask; None: no padding.
            stochastic: Gumbel noise on/off; None follows ``self.training``.
            generator: RNG of the Gumbel noise.
            check: raise when a row of ``mask`` has no real token. The check reads the mask back to the host
                (a device sync); a training loop whose tokenizer always emits BOS/EOS passes False.

        Returns:
            :class:`GRMTextOutput` (gate 0 on padding).
        """
        mask, logits, gate = self._gated("text", self.text_adapter, tokens, mask, self._stochastic(stochastic),
                                         generator, check)
        return GRMTextOutput(tokens, mask, logits, gate, tokens * gate[..., None])

    def encode_image(
        self,
        tokens: Tensor,
        mask: Tensor | None = None,
        *,
        stochastic: bool | None = None,
        generator: torch.Generator | None = None,
        noise: Tensor | None = None,
    ) -> GRMImageOutput:
        """Significance-aware adapter (eq. 1), region prompts (eqs. 2-3), uncertainty (eqs. 4-6).

        Args:
            tokens: ``(B, Lv, d)`` V (projected patch states).
            mask: ``(B, Lv)`` bool or 0/1 mask; None: no padding.
            stochastic: Gumbel and Gaussian noise on/off; None follows ``self.training``.
            generator: RNG of both noises.
            noise: optional ``(B, Lv, K, d)`` eps of eq. 5 (see :func:`sample_regions`); only
                used when stochastic.

        Returns:
            :class:`GRMImageOutput`; padding has gate 0 and region weight 0, and each region's
            weights sum to 1 over the real tokens (also when K exceeds their number).
        """
        stochastic = self._stochastic(stochastic)
        mask, logits, gate = self._gated("image", self.vision_adapter, tokens, mask, stochastic, generator)
        key_tokens = tokens * gate[..., None]
        prompts = F.normalize(self.prompts, dim=-1).to(key_tokens.dtype)
        region_scores = torch.sigmoid(key_tokens @ prompts.T) * mask[..., None]
        region_weights = region_scores / region_scores.sum(dim=1, keepdim=True)
        mu = region_weights.transpose(1, 2) @ key_tokens
        log_var = self.phi(mu)
        if stochastic:
            regions = sample_regions(mu, log_var, region_weights, noise=noise, generator=generator)
        else:
            regions = mu
        return GRMImageOutput(
            tokens, mask, logits, gate, key_tokens, region_scores, region_weights, mu, log_var, regions
        )

    def forward(
        self,
        image_tokens: Tensor,
        text_tokens: Tensor,
        image_mask: Tensor | None = None,
        text_mask: Tensor | None = None,
        *,
        stochastic: bool | None = None,
        generator: torch.Generator | None = None,
    ) -> GRMOutput:
        """Both sides: ``GRMOutput(image=encode_image(...), text=encode_text(...))``."""
        return GRMOutput(
            self.encode_image(image_tokens, image_mask, stochastic=stochastic, generator=generator),
            self.encode_text(text_tokens, text_mask, stochastic=stochastic, generator=generator),
        )

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_regions={self.num_regions}, tau={self.tau}, hard={self.hard}"


# --- eq. 7: token-wise similarity ----------------------------------------------------------


def _unit_tokens(tokens: Tensor, weights: Tensor | None) -> Tensor:
    unit = F.normalize(tokens, dim=-1)
    return unit if weights is None else unit * weights[..., None].to(unit.dtype)


def _block_similarity(
    text: Tensor, text_mask: Tensor, image: Tensor, image_mask: Tensor, leaky_slope: float | None
) -> Tensor:
    """Eq. 7 for one block: ``(ci, Lv, d)`` unit images x ``(ct, Lt, d)`` unit texts -> (ci, ct)."""
    ci, lv, d = image.shape
    ct, lt, _ = text.shape
    # (ci, Lv, ct, Lt) token cosines, without a permuted copy.
    s = (image.reshape(ci * lv, d) @ text.reshape(ct * lt, d).T).reshape(ci, lv, ct, lt)
    low = torch.finfo(s.dtype).min
    # Text2Image: each real text token takes its best real image token.
    t2i = s.masked_fill(~image_mask[:, :, None, None], low).max(dim=1).values  # (ci, ct, Lt)
    # Image2Text: each real image token takes its best real text token (without autograd the
    # mask is written in place: one block copy fewer).
    no_text = ~text_mask[None, None]
    masked = s.masked_fill(no_text, low) if s.requires_grad else s.masked_fill_(no_text, low)
    i2t = masked.max(dim=3).values  # (ci, Lv, ct)
    if leaky_slope is not None:
        # leaky_relu is increasing, so max(leaky(s)) = leaky(max(s)): applied after the max, the
        # block of cosines is not kept for the backward.
        t2i, i2t = F.leaky_relu(t2i, leaky_slope), F.leaky_relu(i2t, leaky_slope)
    t2i = (t2i * text_mask[None]).sum(dim=-1) / text_mask.sum(dim=-1)[None]
    i2t = (i2t * image_mask[..., None]).sum(dim=1) / image_mask.sum(dim=-1)[:, None]
    return t2i + i2t


def token_wise_similarity(
    text: Tensor,
    text_mask: Tensor | None,
    image: Tensor,
    image_mask: Tensor | None,
    *,
    text_weights: Tensor | None = None,
    image_weights: Tensor | None = None,
    leaky_slope: float | None = None,
    block_elements: int = DEFAULT_BLOCK_ELEMENTS,
    check: bool = True,
) -> Tensor:
    """Bidirectional token-wise similarity (GRM eq. 7) of every image with every text.

    ``S = 1/Lt sum_t max_v s_tv + 1/Lv sum_v max_t s_tv`` (a sum of the two directions, as
    LAPS), with ``s_tv`` the cosine of L2-normalised tokens; padding tokens take part neither in
    the max nor in the mean. Blocks of images x texts are scored one at a time so that at most
    ``block_elements`` token cosines exist at once (peak memory about two to three times that,
    plus the inputs and the (Bi, Bt) result); under autograd each block keeps only the arg-max
    indices, so training memory is linear in Bi x Bt x (Lv + Lt), not in Bi x Bt x Lv x Lt.

    Args:
        text: ``(Bt, Lt, d)`` text token states (raw; normalised here).
        text_mask: ``(Bt, Lt)`` bool or 0/1, True for real tokens; None: no padding.
        image: ``(Bi, Lv, d)`` image token states (or regions U).
        image_mask: ``(Bi, Lv)``; None: no padding.
        text_weights: optional ``(Bt, Lt)`` gates multiplied onto the *normalised* text tokens
            (GRM's key level): with 0/1 gates this is eq. 7 on ``normalize(A * T)`` (a dropped
            token is the zero vector, cosine 0) with a gradient to the gates.
        image_weights: optional ``(Bi, Lv)`` gates of the image tokens, likewise.
        leaky_slope: LAPS's ``leaky_relu(cos, 0.1)`` before the max when set (0.1); None is eq. 7.
            (Computed after the max, the same value since leaky_relu is increasing.)
        block_elements: cosines per block (memory bound).
        check: raise when a row of a mask has no real token (a host read; :func:`grm_similarity` passes False
            for the masks of :class:`GRMHead` outputs, checked when they were made).

    Returns:
        ``(Bi, Bt)`` similarities, in [-2, 2].
    """
    _check_tokens("text", text)
    _check_tokens("image", image)
    if text.shape[-1] != image.shape[-1]:
        raise ValueError(
            f"text and image tokens must share the width d, got {text.shape[-1]} and {image.shape[-1]}"
        )
    if block_elements < 1:
        raise ValueError(f"block_elements must be >= 1, got {block_elements}")
    text_mask = _token_mask("text_mask", text_mask, text, need_one=check)
    image_mask = _token_mask("image_mask", image_mask, image, need_one=check)
    text_weights = _token_weights("text_weights", text_weights, text)
    image_weights = _token_weights("image_weights", image_weights, image)
    n_image, lv = image.shape[:2]
    n_text, lt = text.shape[:2]
    if n_image == 0 or n_text == 0:
        return image.new_zeros(n_image, n_text)
    per_pair = lv * lt
    pairs = max(1, block_elements // per_pair)
    ci = min(n_image, max(1, math.isqrt(pairs)))
    ct = min(n_text, max(1, pairs // ci))
    ci = min(n_image, max(1, pairs // ct))
    inputs = (text, image, text_weights, image_weights)
    needs_graph = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    # Without autograd the blocks are written into the result (no second copy of it).
    out = None if needs_graph else image.new_empty(n_image, n_text)
    columns = []
    for t0 in range(0, n_text, ct):
        t1 = min(t0 + ct, n_text)
        text_block = _unit_tokens(text[t0:t1], None if text_weights is None else text_weights[t0:t1])
        rows = []
        for i0 in range(0, n_image, ci):
            i1 = min(i0 + ci, n_image)
            image_block = _unit_tokens(image[i0:i1], None if image_weights is None else image_weights[i0:i1])
            block = _block_similarity(
                text_block, text_mask[t0:t1], image_block, image_mask[i0:i1], leaky_slope
            )
            if out is None:
                rows.append(block)
            else:
                out[i0:i1, t0:t1] = block
        if out is None:
            columns.append(torch.cat(rows, dim=0))
    return torch.cat(columns, dim=1) if out is None else out


# --- eq. 8: VSE++ hinge --------------------------------------------------------------------


def _hinge(scores: Tensor, positives: Tensor, margin: float, max_violation: bool) -> Tensor:
    """Sum over anchors (q, a) (``positives[q, a]``) of ``[margin + scores[q, c] - scores[q, a]]_+`` over the
    negatives c of row q (or the largest one). ``scores`` ``(Q, C)``: queries x candidates.

    Dense, with no host read (no ``nonzero``): the hardest negative is the row's largest negative score; the sum
    over negatives of ``[s_c - t]_+`` with ``t = s_a - margin`` is ``sum_{s_c > t} s_c - t * #{s_c > t}``, read
    from the row's sorted negatives (prefix sums at ``searchsorted(t)``): O(Q C log C), never (Q, C, C).
    """
    if scores.shape[1] == 0:
        return scores.sum() * 0.0
    negatives = scores.masked_fill(positives, float("-inf"))
    threshold = scores - margin
    if max_violation:
        hardest = negatives.max(dim=1, keepdim=True).values  # -inf where a row has no negative: cost 0
        cost = (hardest - threshold).clamp(min=0)
    else:
        ordered = negatives.sort(dim=1).values  # ascending; positives (-inf) first
        finite = ordered.masked_fill(ordered == float("-inf"), 0.0)
        prefix = F.pad(finite.cumsum(dim=1), (1, 0))  # prefix[:, k] = sum of the k smallest
        above = torch.searchsorted(ordered.detach().contiguous(), threshold.detach().contiguous(), right=True)
        count = ordered.shape[1] - above
        larger = prefix[:, -1:] - prefix.gather(1, above)
        cost = larger - count * threshold
    return cost.masked_fill(~positives, 0.0).sum() + scores.sum() * 0.0


def vse_hinge_loss(
    sim: Tensor,
    *,
    margin: float = PAPER_MARGIN,
    max_violation: bool = True,
    positives: Tensor | None = None,
    gather: bool | None = None,
) -> Tensor:
    """Bidirectional hinge (triplet ranking) loss of GRM eq. 8 / VSE++, summed over the batch.

    For every positive pair (i, j) (an anchor): ``[margin + S_ij' - S_ij]_+`` over the texts j'
    that are not positives of image i, plus ``[margin + S_i'j - S_ij]_+`` over the images i' that
    are not positives of text j. With the default diagonal positives this is eq. 8 exactly.
    ``max_violation=False`` sums over all negatives (eq. 8); ``True`` keeps the hardest negative
    of each row and of each column (VSE++, "hard negative mining"). LAPS sums for the first epoch
    and takes the hardest negative afterwards; the caller switches ``max_violation`` per call.

    Args:
        sim: ``(Bi, Bt)`` image-text similarities (e.g. :func:`token_wise_similarity`).
            Distributed, this rank's images against the texts of every rank, ``(Bi_local,
            world * Bt_local)``, rank 0's texts first; every rank holds as many images and as
            many texts.
        margin: alpha (0.2 in the paper).
        max_violation: hardest negative (True) or sum over negatives (False).
        positives: ``(Bi, Bt)`` bool, True where text j describes image i; such pairs are never
            negatives of each other (e.g. two captions of one image in the batch) and each is an
            anchor. Default: the diagonal (distributed: local image i with global text
            ``rank * Bi + i``), which needs as many images as texts.
        gather: ``None`` gathers when a process group of size > 1 is initialised. The rows of
            ``sim`` (and ``positives``) are then gathered with autograd so that each rank also
            ranks the images of every rank for its own texts; the value is ``world`` times this
            rank's share of the sum (images of its rows, texts of its columns), so that the mean
            over ranks is the single-process loss on the concatenated batch.

    Returns:
        Scalar loss (sum reduction, as eq. 8).
    """
    if not isinstance(sim, Tensor) or sim.dim() != 2 or not sim.is_floating_point():
        got = (sim.dtype, tuple(sim.shape)) if isinstance(sim, Tensor) else type(sim).__name__
        raise ValueError(f"sim must be a floating (Bi, Bt) tensor of image-text similarities, got {got}")
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    rank, world = world_info() if should_gather(gather) else (0, 1)
    n_rows, n_cols = sim.shape
    if world > 1 and n_cols % world:
        raise ValueError(
            f"vse_hinge_loss: distributed, sim's columns are the texts of all {world} ranks; "
            f"{n_cols} texts cannot be split evenly (use drop_last=True)"
        )
    if positives is None:
        if n_rows * world != n_cols:
            raise ValueError(
                f"vse_hinge_loss: {n_rows * world} images and {n_cols} texts; the default diagonal "
                "positives need as many of each: pass positives (Bi, Bt) bool"
            )
        positives = torch.zeros(n_rows, n_cols, dtype=torch.bool, device=sim.device)
        rows = torch.arange(n_rows, device=sim.device)
        positives[rows, rows + rank * n_rows] = True
    elif (
        not isinstance(positives, Tensor)
        or positives.dtype != torch.bool
        or tuple(positives.shape) != (n_rows, n_cols)
    ):
        got = (
            (positives.dtype, tuple(positives.shape))
            if isinstance(positives, Tensor)
            else type(positives).__name__
        )
        raise ValueError(f"positives must be a bool tensor of shape {(n_rows, n_cols)} like sim, got {got}")
    image_queries = _hinge(sim, positives, margin, max_violation)
    if world == 1:
        return image_queries + _hinge(sim.T, positives.T, margin, max_violation)
    sim_all = gather_with_grad(sim)
    positives_all = gather_with_grad(positives)
    per_rank = n_cols // world
    own = slice(rank * per_rank, (rank + 1) * per_rank)
    text_queries = _hinge(sim_all[:, own].T, positives_all[:, own].T, margin, max_violation)
    return (image_queries + text_queries) * world


# --- eqs. 9-13: the GRM objective ----------------------------------------------------------


def _gather_tokens(tokens: Tensor, mask: Tensor, gate: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """All ranks' text tokens, masks and gates, padded to the longest Lt (autograd on floats)."""
    lengths = gather_counts(tokens.shape[1], device=tokens.device)
    pad = max(lengths) - tokens.shape[1]
    if pad:
        tokens = F.pad(tokens, (0, 0, 0, pad))
        mask = F.pad(mask, (0, pad), value=False)
        gate = F.pad(gate, (0, pad))
    return gather_with_grad(tokens), gather_with_grad(mask), gather_with_grad(gate)


def region_entropy(image: GRMImageOutput, *, entropy_of: EntropyOf = "normalised") -> Tensor:
    """Entropy regulariser of GRM eq. 12 per image: ``-1/K sum_k sum_l A^lk log A^lk`` over real
    tokens.

    Args:
        image: the head's image side.
        entropy_of: ``"normalised"`` uses A_hat_r (each region's attention over tokens sums to 1,
            so this is the mean Shannon entropy of the regions); ``"sigmoid"`` uses A_r, the
            sigmoid scores the equation's symbol names.

    Returns:
        ``(B,)`` per image.
    """
    if entropy_of not in ("normalised", "sigmoid"):
        raise ValueError(f"entropy_of must be 'normalised' or 'sigmoid', got {entropy_of!r}")
    a = image.region_weights if entropy_of == "normalised" else image.region_scores
    # Padding set to 1 (1 log 1 = 0): no term and no gradient (0 log 0 has an infinite slope).
    a = a.masked_fill(~image.mask[..., None], 1.0)
    return -torch.xlogy(a, a).sum(dim=1).mean(dim=-1)


def region_kl(image: GRMImageOutput) -> Tensor:
    """KL regulariser of GRM eq. 11 per image: ``sum_k KL(N(mu_k, sigma_k^2) || N(0, I))
    = -1/2 sum_k sum_d (1 + log sigma^2 - mu^2 - sigma^2)``; ``(B,)``."""
    lv = image.log_var
    return -0.5 * (1 + lv - image.mu.square() - lv.exp()).sum(dim=(1, 2))


def reconstruction(image: GRMImageOutput) -> Tensor:
    """Semantic consistency of GRM eq. 10 per image: ``|| mean_k U_k - mean_l V_hat_l ||^2`` (the
    mean over real tokens; dropped tokens count as zero vectors); ``(B,)``."""
    mask = image.mask[..., None].to(image.key_tokens.dtype)
    patch_mean = (image.key_tokens * mask).sum(dim=1) / mask.sum(dim=1)
    return (image.regions.mean(dim=1) - patch_mean).square().sum(dim=-1)


def _batch_mean(per_image: Tensor) -> Tensor:
    """Mean over the images. Distributed, every rank holds as many images (the hinge gathers equal
    blocks of rows), so the mean over ranks of the local means is the global mean."""
    return per_image.mean() if per_image.numel() else per_image.sum()


def grm_similarity(
    image: GRMImageOutput,
    text: GRMTextOutput,
    level: Level = "key",
    *,
    leaky_slope: float | None = None,
    block_elements: int = DEFAULT_BLOCK_ELEMENTS,
) -> Tensor:
    """One of GRM's three similarity levels (eq. 7), ``(Bi, Bt)``.

    ``"ori"``: (T, V), the raw tokens. ``"key"``: (T_hat, V_hat), the gated tokens.
    ``"unc"``: (T_hat, U), gated text tokens against the K regions.
    """
    common = {"leaky_slope": leaky_slope, "block_elements": block_elements, "check": False}
    if level == "ori":
        return token_wise_similarity(text.tokens, text.mask, image.tokens, image.mask, **common)
    if level == "key":
        return token_wise_similarity(
            text.tokens, text.mask, image.tokens, image.mask,
            text_weights=text.gate, image_weights=image.gate, **common,
        )
    if level == "unc":
        return token_wise_similarity(
            text.tokens, text.mask, image.regions, None, text_weights=text.gate, **common
        )
    raise ValueError(f"level must be 'ori', 'key' or 'unc', got {level!r}")


def grm_loss(
    image: GRMImageOutput,
    text: GRMTextOutput,
    *,
    level_weights: tuple[float, float, float] = PAPER_LEVEL_WEIGHTS,
    margin: float = PAPER_MARGIN,
    max_violation: bool = True,
    positives: Tensor | None = None,
    recon_weight: float = 1.0,
    reg_weight: float = 1.0,
    leaky_slope: float | None = None,
    entropy_of: EntropyOf = "normalised",
    block_elements: int = DEFAULT_BLOCK_ELEMENTS,
    gather: bool | None = None,
) -> dict[str, Tensor]:
    """GRM's objective (eqs. 7-13).

    ``L_con = a L_ori + b L_key + c L_unc`` (eq. 9), each :func:`vse_hinge_loss` of a level of
    :func:`grm_similarity`; ``L_recon`` (eq. 10), ``L_KL`` (eq. 11), ``L_ent`` (eq. 12), each a
    mean over the batch's images; ``loss = L_con + recon_weight L_recon + reg_weight (L_KL +
    L_ent)`` (eq. 13 is ``L_reg = L_KL + L_ent``; the paper gives no weights for the sum).

    Args:
        image: :meth:`GRMHead.encode_image` of the batch's images.
        text: :meth:`GRMHead.encode_text` of the batch's texts.
        level_weights: (a, b, c), 0.4 / 0.4 / 0.2 in the paper (a + b + c = 1; ablations may
            zero one).
        margin, max_violation, positives: see :func:`vse_hinge_loss` (``positives`` ``(Bi,
            Bt)``; distributed: local images x all ranks' texts).
        recon_weight, reg_weight: weights of L_recon and L_reg (not in the paper: 1).
        leaky_slope: LAPS's leaky ReLU in eq. 7 (None: eq. 7 as written).
        entropy_of: A of eq. 12, see :func:`region_entropy`.
        block_elements: memory bound of eq. 7, see :func:`token_wise_similarity`.
        gather: ``None`` gathers when a process group of size > 1 is initialised: the texts
            (tokens, masks, gates, padded to the longest Lt) are gathered with autograd, each rank
            scores its images against all texts, and every value is scaled so that its mean over
            ranks equals the single-process value on the concatenated batch (exact gradients
            under DDP's averaging). Every rank must hold as many images and as many texts
            (``drop_last=True``); text lengths may differ.

    Returns:
        ``{"ori", "key", "unc", "con", "recon", "kl", "ent", "reg", "loss"}`` scalars.
    """
    if len(level_weights) != 3 or any(w < 0 for w in level_weights):
        raise ValueError(f"level_weights must be three non-negative numbers (a, b, c), got {level_weights}")
    if recon_weight < 0 or reg_weight < 0:
        raise ValueError(f"recon_weight and reg_weight must be >= 0, got {recon_weight}, {reg_weight}")
    _, world = world_info() if should_gather(gather) else (0, 1)
    if world > 1:
        tokens, mask, gate = _gather_tokens(text.tokens, text.mask, text.gate)
        text = GRMTextOutput(tokens, mask, text.logits, gate, tokens * gate[..., None])
    common = {"leaky_slope": leaky_slope, "block_elements": block_elements}
    hinge = {"margin": margin, "max_violation": max_violation, "positives": positives, "gather": world > 1}
    out = {
        level: vse_hinge_loss(grm_similarity(image, text, level, **common), **hinge)
        for level in ("ori", "key", "unc")
    }
    a, b, c = level_weights
    out["con"] = a * out["ori"] + b * out["key"] + c * out["unc"]
    out["recon"] = _batch_mean(reconstruction(image))
    out["kl"] = _batch_mean(region_kl(image))
    out["ent"] = _batch_mean(region_entropy(image, entropy_of=entropy_of))
    out["reg"] = out["kl"] + out["ent"]
    out["loss"] = out["con"] + recon_weight * out["recon"] + reg_weight * out["reg"]
    return out


class GRMLoss(nn.Module):
    """GRM's objective with its options (eqs. 7-13); see :func:`grm_loss`. Holds no parameters
    (the learnable parts are in :class:`GRMHead`, which belongs to the model).

    ``max_violation`` can be overridden per call: LAPS's schedule (sum over negatives for the
    first epoch, hardest negative afterwards) is ``loss(image, text, max_violation=epoch >= 1)``.
    """

    def __init__(
        self,
        *,
        level_weights: tuple[float, float, float] = PAPER_LEVEL_WEIGHTS,
        margin: float = PAPER_MARGIN,
        max_violation: bool = True,
        recon_weight: float = 1.0,
        reg_weight: float = 1.0,
        leaky_slope: float | None = None,
        entropy_of: EntropyOf = "normalised",
        block_elements: int = DEFAULT_BLOCK_ELEMENTS,
        gather: bool | None = None,
    ) -> None:
        super().__init__()
        if entropy_of not in ("normalised", "sigmoid"):
            raise ValueError(f"entropy_of must be 'normalised' or 'sigmoid', got {entropy_of!r}")
        self.level_weights = tuple(float(w) for w in level_weights)
        self.margin, self.max_violation = float(margin), bool(max_violation)
        self.recon_weight, self.reg_weight = float(recon_weight), float(reg_weight)
        self.leaky_slope, self.entropy_of = leaky_slope, entropy_of
        self.block_elements, self.gather = int(block_elements), gather

    def forward(
        self,
        image: GRMImageOutput,
        text: GRMTextOutput,
        *,
        positives: Tensor | None = None,
        max_violation: bool | None = None,
    ) -> dict[str, Tensor]:
        """:func:`grm_loss` with this module's options; ``max_violation`` overrides the default."""
        return grm_loss(
            image,
            text,
            level_weights=self.level_weights,
            margin=self.margin,
            max_violation=self.max_violation if max_violation is None else max_violation,
            positives=positives,
            recon_weight=self.recon_weight,
            reg_weight=self.reg_weight,
            leaky_slope=self.leaky_slope,
            entropy_of=self.entropy_of,
            block_elements=self.block_elements,
            gather=self.gather,
        )

    def extra_repr(self) -> str:
        return (
            f"level_weights={self.level_weights}, margin={self.margin}, max_violation={self.max_violation}, "
            f"recon_weight={self.recon_weight}, reg_weight={self.reg_weight}, leaky_slope={self.leaky_slope}"
        )
