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

Whose choice is what (the paper; LAPS, the public code GRM most likely builds on; ours):

* Eq. 7 as printed is ``S = T V^T`` on the raw tokens. The L2 normalisation of the tokens before it
  (cosines) is LAPS's (``lib/xttn.py``), as is its optional ``leaky_relu(cos, 0.1)``
  (``leaky_slope``). The toolkit normalises (LAPS); the leaky ReLU is off unless asked for.
* The gates and the normalisation. ``normalize(a * v) == normalize(v)`` for any ``a > 0``: a soft
  gate of eq. 1 cancels under LAPS's normalisation. The head therefore uses a straight-through hard
  Gumbel gate (``hard=True``, exactly 0/1 forward, the soft sample's gradient; ours).
* Kept tokens (ours, reading eq. 1's ``V_hat = M . A`` as the set of kept tokens): a token whose
  gate is 0 takes no part in eqs. 2-3, 7 and 10. Eq. 7's maxima run over the kept tokens and its
  means are gate-weighted means over them (for 0/1 gates, the mean over the kept tokens); the region
  attention of eq. 2 is normalised over them, and eq. 10's patch mean is their mean. Read literally
  (dropped tokens as zero vectors that still count in the means), closing every gate makes every
  score 0 and mu = 0, which the hinge and L_KL both prefer: the gates collapse and retrieval
  scores every pair the same (measured, see the README). A floor keeps at least
  ``max(1, ceil(min_keep * n))`` of a sample's ``n`` real tokens (those the gate's sample prefers),
  so that the means are always defined (ours; the paper has none).
* Eq. 8 as printed sums the hinge over every negative j != i; the text cites VSE++'s hard negative
  mining, which keeps the hardest negative of each row and column. ``max_violation=True`` is that
  reading (the default), ``False`` the sum as printed. LAPS sums in its first epoch and takes the
  hardest negative afterwards (the caller switches ``max_violation``).
* Several captions of one image in a batch (``positives``): as LAPS's ``ContrastiveLoss``, each
  sample's own pair is the anchor and the other same-image pairs are only left out of the negatives
  (``anchors="own"``); ``anchors="positives"`` makes every same-image pair an anchor.

Host reads: nothing in the training path reads a device value (no ``.item()``, ``nonzero`` or
boolean-mask indexing); the "every sample has a token" checks are device-side assertions under
autograd and ``ValueError`` otherwise.

Distributed (``gather``): images stay local, texts are gathered. A rank scores its local images
against the texts of every rank (rank 0's texts first), ``sim`` is ``(Bi_local, Bt_global)``;
:func:`vse_hinge_loss` gathers these rows with autograd to rank the columns of its own texts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .checks import check_number, device_check, zero_with_graph
from .distributed import gather_counts, gather_with_grad, should_gather, world_info

# Eq. 9 weights a, b, c (paper, "Parameter Analysis" and implementation details).
PAPER_LEVEL_WEIGHTS = (0.4, 0.4, 0.2)
# Eq. 8 margin alpha (implementation details).
PAPER_MARGIN = 0.2
# K for ViT backbones (K = 50 for Swin; implementation details).
PAPER_NUM_REGIONS = 5
# LAPS (lib/xttn.py) applies leaky_relu(cos, 0.1) before the max; eq. 7 has none.
LAPS_LEAKY_SLOPE = 0.1
# The gate's floor (ours; the paper has none): at least this fraction of a sample's real tokens is
# kept, and at least one.
DEFAULT_MIN_KEEP = 0.05
# Elements of one (images x texts x Lv x Lt) block of token cosines (16 MiB in float32).
DEFAULT_BLOCK_ELEMENTS = 2**22

EntropyOf = Literal["normalised", "sigmoid"]
Level = Literal["ori", "key", "unc"]
Anchors = Literal["own", "positives"]


# --- checks --------------------------------------------------------------------------------


def _check_tokens(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor) or x.dim() != 3 or not x.is_floating_point():
        got = (x.dtype, tuple(x.shape)) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a floating (B, L, d) tensor of token states, got {got}")


def _require_rows(name: str, present: Tensor, what: str = "real token", *, lazy: bool | None = None) -> None:
    """Every row of the ``(B, L)`` bool ``present`` has a True, without a host read in training.

    ``lazy`` (default: ``torch.is_grad_enabled()``, i.e. the training step): a device-side assertion
    (:func:`losses.checks.device_check`: no synchronisation on accelerators, a ``ValueError`` at once on the CPU);
    otherwise (evaluation, inference) a ``ValueError`` naming the rows (a host read).
    """
    if present.shape[0] == 0:
        return
    if present.shape[1] == 0:
        raise ValueError(f"{name}: no token positions (L = 0); every sample needs at least one {what}")
    ok = present.any(dim=1)
    if torch.is_grad_enabled() if lazy is None else lazy:
        device_check(ok.all(), f"{name}: a sample has no {what}; every sample needs at least one")
        return
    if not bool(ok.all()):
        empty = (~ok).nonzero().flatten().tolist()
        raise ValueError(f"{name}: rows {empty} have no {what}; every sample needs at least one")


def _token_mask(
    name: str, mask: Tensor | None, tokens: Tensor, *, need_one: bool = True, lazy: bool | None = None
) -> Tensor:
    """``mask`` as a (B, L) bool tensor (all True when None); True marks a real token (``lazy``: see
    :func:`_require_rows`)."""
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
    if need_one:
        _require_rows(name, mask, lazy=lazy)
    return mask


def _token_weights(name: str, weights: Tensor | None, tokens: Tensor) -> Tensor | None:
    if weights is None:
        return None
    if not isinstance(weights, Tensor) or tuple(weights.shape) != tuple(tokens.shape[:2]):
        got = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"{name} must be a (B, L) = {tuple(tokens.shape[:2])} tensor of gates, got {got}")
    return weights


# --- eq. 1: adapters and the Gumbel gate ---------------------------------------------------


def _check_min_keep(name: str, min_keep: float | None) -> None:
    if min_keep is None:
        return
    try:
        check_number("min_keep", min_keep, low=0.0, high=1.0, where=name)
    except ValueError:
        raise ValueError(f"{name}: min_keep must be a fraction in [0, 1] (or None: no floor), "
                         f"got {min_keep!r}") from None


def _check_leaky_slope(name: str, leaky_slope: float | None) -> None:
    if leaky_slope is not None:
        check_number("leaky_slope", leaky_slope, low=0.0, where=name)


def keep_floor(preference: Tensor, mask: Tensor | None, min_keep: float) -> Tensor:
    """The tokens the gate's floor keeps: the ``max(1, ceil(min_keep * n))`` real tokens of each row
    with the highest ``preference`` (``n`` = the row's real tokens). Ours; GRM's eq. 1 has no floor.

    Computed on the device (a sort, no host read).

    Args:
        preference: ``(B, L)`` how much the gate wants each token (higher = kept first).
        mask: ``(B, L)`` bool, True for real tokens; None: all real.
        min_keep: fraction in [0, 1].

    Returns:
        ``(B, L)`` bool, True for the tokens kept by the floor (never padding).
    """
    _check_min_keep("keep_floor", min_keep)
    if mask is None:
        mask = torch.ones(preference.shape, dtype=torch.bool, device=preference.device)
    n = mask.sum(dim=-1, keepdim=True)
    # ceil(min_keep * n) in integers (exact): min_keep as q / 10^6.
    scale = 10**6
    q = round(float(min_keep) * scale)
    k = ((n * q + scale - 1) // scale).clamp(min=1)
    order = preference.detach().masked_fill(~mask, float("-inf")).argsort(dim=-1, descending=True)
    positions = torch.arange(preference.shape[-1], device=preference.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)
    return (rank < k) & mask


def gumbel_gate(
    logits: Tensor,
    *,
    tau: float = 1.0,
    hard: bool = True,
    stochastic: bool = True,
    generator: torch.Generator | None = None,
    mask: Tensor | None = None,
    min_keep: float | None = None,
    noise_length: int | None = None,
) -> Tensor:
    """Column 1 of the Gumbel-softmax of 2-way logits: ``A = f_g(D, tau)[:, 1]`` (GRM eq. 1).

    Args:
        logits: ``(..., 2)`` D of eq. 1; column 1 is "keep". With ``mask`` or ``min_keep``,
            ``(B, L, 2)``.
        tau: Gumbel-softmax temperature.
        hard: straight-through: the forward value is the one-hot argmax of the sample (exactly 0
            or 1), the gradient the soft sample's.
        stochastic: add Gumbel noise (training). ``False`` is evaluation: no noise, the gate is the
            argmax of the logits (always hard), with the straight-through gradient of
            ``softmax(D / tau)``.
        generator: RNG of the Gumbel noise.
        mask: optional ``(B, L)`` bool, True for real tokens: the gate is 0 on padding.
        min_keep: the floor (ours, :func:`keep_floor`): with a hard or evaluation gate, at least
            ``max(1, ceil(min_keep * n))`` of each row's ``n`` real tokens are kept (forward value
            1, gradient the soft sample's), those whose sampled keep-minus-drop logit is highest.
            None: no floor (eq. 1 alone; a row may keep nothing). A soft gate is never 0, so the
            floor does not apply to it.
        noise_length: with ``(B, L, 2)`` logits, draw the Gumbel noise for ``max(L, noise_length)``
            positions and keep the first ``L`` (ours): the noise of a token then does not depend on how
            far the batch is padded (a text padded to any length up to ``noise_length``, e.g. the
            model's ``max_text_len``, gets the same gates). None: noise of the logits' shape.

    Returns:
        ``(...)`` the gate A in [0, 1].
    """
    if logits.shape[-1] != 2:
        raise ValueError(
            f"gumbel_gate: logits must end with 2 columns (drop, keep), got {tuple(logits.shape)}"
        )
    check_number("tau", tau, low=0.0, above=True, where="gumbel_gate")
    _check_min_keep("gumbel_gate", min_keep)
    if (mask is not None or min_keep is not None) and logits.dim() != 3:
        raise ValueError(f"gumbel_gate: with mask or min_keep, logits must be (B, L, 2), got {tuple(logits.shape)}")
    if noise_length is not None and logits.dim() != 3:
        raise ValueError(f"gumbel_gate: with noise_length, logits must be (B, L, 2), got {tuple(logits.shape)}")
    if stochastic:
        if noise_length is not None and noise_length > logits.shape[1]:
            b, n, two = logits.shape
            exponential = logits.new_empty(b, int(noise_length), two).exponential_(generator=generator)[:, :n]
        else:
            exponential = torch.empty_like(logits).exponential_(generator=generator)
        gumbel = -exponential.clamp_min(torch.finfo(logits.dtype).tiny).log()
        noisy = logits + gumbel
    else:
        noisy = logits
    soft = (noisy / tau).softmax(dim=-1)
    if hard or not stochastic:
        keep = noisy[..., 1] > noisy[..., 0]
        if min_keep is not None:
            keep = keep | keep_floor(noisy[..., 1] - noisy[..., 0], mask, min_keep)
        # keep + (soft - soft.detach()): exactly 0/1 in the forward, the soft gradient.
        gate = keep.to(soft.dtype) + (soft[..., 1] - soft[..., 1].detach())
    else:
        gate = soft[..., 1]
    return gate if mask is None else gate * mask


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
            expectation at a zero ``W2`` row difference).
    """

    def __init__(self, dim: int, hidden_dim: int | None = None, *, keep_bias: float = 0.0) -> None:
        super().__init__()
        hidden_dim = dim if hidden_dim is None else hidden_dim
        if dim < 1 or hidden_dim < 1:
            raise ValueError(f"TokenAdapter: dim and hidden_dim must be >= 1, got {dim}, {hidden_dim}")
        check_number("keep_bias", keep_bias, where="TokenAdapter")
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
        gate: ``(B, L)`` A (0 on padding); 0/1 with a hard gate and at evaluation, where the
            head's floor keeps at least one real token per sample.
        key_tokens: ``(B, L, d)`` the key tokens A * T (eq. 1).
    """

    tokens: Tensor
    mask: Tensor
    logits: Tensor
    gate: Tensor
    key_tokens: Tensor

    @property
    def kept(self) -> Tensor:
        """``(B, L)`` bool: the tokens the gate keeps (gate > 0; every real token under a soft gate)."""
        return (self.gate != 0) & self.mask

    def keep_ratio(self) -> Tensor:
        """Fraction of real tokens the gate keeps (the mean gate over real tokens), per sample ``(B,)``,
        detached (for logs and reports)."""
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
        region_scores: ``(B, Lv, K)`` A_r = sigmoid(V_hat P_hat^T) (eq. 2) times the gate: 0 on dropped
            tokens and padding.
        region_weights: ``(B, Lv, K)`` A_hat_r, A_r normalised over the kept tokens (eq. 2).
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
    gate is the argmax of the logits (with the floor), U = mu.

    Args:
        dim: token width d (512 in the paper).
        num_regions: K (5 for ViT, 50 for Swin in the paper).
        tau: Gumbel-softmax temperature (the paper does not give it: 1.0).
        hard: straight-through hard gate (default; ours: a soft gate cancels under LAPS's
            normalisation of the tokens, see the module docstring). ``False``: the soft gate weights
            the means of eqs. 2-3, 7 and 10.
        hidden_dim: width of each adapter's ``W1`` (not given: ``dim``).
        keep_bias: initial keep-minus-drop bias of both adapters (not given: 0, PyTorch's
            initialisation), see :class:`TokenAdapter`.
        min_keep: the gates' floor (ours, :func:`keep_floor`): every sample keeps at least
            ``max(1, ceil(min_keep * n))`` of its ``n`` real tokens, in training and at evaluation.
        leaky_slope: LAPS's leaky ReLU of eq. 7 the head is trained with (None: eq. 7 without it);
            not used by the head itself: recorded with it so that retrieval (the ``grm`` scorer)
            scores as training did.
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
        min_keep: float = DEFAULT_MIN_KEEP,
        leaky_slope: float | None = None,
    ) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"GRMHead: dim must be >= 1, got {dim}")
        if num_regions < 1:
            raise ValueError(f"GRMHead: num_regions (K) must be >= 1, got {num_regions}")
        check_number("tau", tau, low=0.0, above=True, where="GRMHead")
        check_number("keep_bias", keep_bias, where="GRMHead")
        _check_min_keep("GRMHead", min_keep)
        if leaky_slope is not None:
            try:
                check_number("leaky_slope", leaky_slope, low=0.0, where="GRMHead")
            except ValueError:
                raise ValueError(f"GRMHead: leaky_slope must be a finite number >= 0 or None, got {leaky_slope!r}") \
                    from None
        self.dim, self.num_regions, self.tau, self.hard = dim, num_regions, float(tau), bool(hard)
        self.hidden_dim, self.keep_bias = hidden_dim, float(keep_bias)
        self.min_keep = float(min_keep)
        self.leaky_slope = None if leaky_slope is None else float(leaky_slope)
        self.vision_adapter = TokenAdapter(dim, hidden_dim, keep_bias=keep_bias)
        self.text_adapter = TokenAdapter(dim, hidden_dim, keep_bias=keep_bias)
        # Directions uniform on the sphere (only the normalised prompts are used).
        self.prompts = nn.Parameter(torch.randn(num_regions, dim))
        self.phi = nn.Linear(dim, dim)

    def inference_config(self) -> dict[str, Any]:
        """The init arguments that rebuild this head (saved with a fine-tuned model), with the current
        ``min_keep`` and ``leaky_slope``."""
        return {"dim": self.dim, "num_regions": self.num_regions, "tau": self.tau, "hard": self.hard,
                "hidden_dim": self.hidden_dim, "keep_bias": self.keep_bias, "min_keep": self.min_keep,
                "leaky_slope": self.leaky_slope}

    def _stochastic(self, stochastic: bool | None) -> bool:
        return self.training if stochastic is None else bool(stochastic)

    def _check_dim(self, name: str, tokens: Tensor) -> None:
        _check_tokens(name, tokens)
        if tokens.shape[-1] != self.dim:
            raise ValueError(f"GRMHead(dim={self.dim}): {name} has width {tokens.shape[-1]}")

    def _gated(self, side: str, adapter: nn.Module, tokens: Tensor, mask: Tensor | None, stochastic: bool,
               generator: torch.Generator | None, noise_length: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Eq. 1 on one side: the checked mask, the adapter's logits D and the gate A (0 on padding)."""
        self._check_dim(f"{side} tokens", tokens)
        mask = _token_mask(f"{side} mask", mask, tokens)
        logits = adapter(tokens)
        gate = gumbel_gate(logits, tau=self.tau, hard=self.hard, stochastic=stochastic, generator=generator,
                           mask=mask, min_keep=self.min_keep, noise_length=noise_length)
        return mask, logits, gate

    def encode_text(
        self,
        tokens: Tensor,
        mask: Tensor | None = None,
        *,
        stochastic: bool | None = None,
        generator: torch.Generator | None = None,
        noise_length: int | None = None,
    ) -> GRMTextOutput:
        """Granularity-aware adapter on text tokens (eq. 1).

        Args:
            tokens: ``(B, Lt, d)`` T (projected token states).
            mask: ``(B, Lt)`` bool or 0/1 attention mask; None: no padding.
            stochastic: Gumbel noise on/off; None follows ``self.training``.
            generator: RNG of the Gumbel noise.
            noise_length: draw the Gumbel noise for this many positions (at least ``Lt``) and keep the
                first ``Lt`` (:func:`gumbel_gate`): the text's padding then does not decide its gates
                (the training step passes the model's ``max_text_len``). None: ``Lt``.

        Returns:
            :class:`GRMTextOutput` (gate 0 on padding).
        """
        mask, logits, gate = self._gated("text", self.text_adapter, tokens, mask, self._stochastic(stochastic),
                                         generator, noise_length)
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
            :class:`GRMImageOutput`; padding and dropped tokens have region weight 0, and each
            region's weights sum to 1 over the kept tokens (also when K exceeds their number).
        """
        stochastic = self._stochastic(stochastic)
        mask, logits, gate = self._gated("image", self.vision_adapter, tokens, mask, stochastic, generator)
        key_tokens = tokens * gate[..., None]
        prompts = F.normalize(self.prompts, dim=-1).to(key_tokens.dtype)
        # Eq. 2 over the kept tokens: A_r times the gate (0 on dropped tokens and padding; a soft
        # gate weights the tokens), normalised over the tokens. The floor keeps one token at least.
        region_scores = torch.sigmoid(key_tokens @ prompts.T) * gate[..., None].to(key_tokens.dtype)
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


def _block_similarity(
    text: Tensor,
    text_keep: Tensor,
    text_weight: Tensor,
    image: Tensor,
    image_keep: Tensor,
    image_weight: Tensor,
    leaky_slope: float | None,
) -> Tensor:
    """Eq. 7 for one block: ``(ci, Lv, d)`` unit images x ``(ct, Lt, d)`` unit texts -> (ci, ct).

    ``*_keep`` ``(c, L)`` bool: the tokens the maxima run over; ``*_weight`` ``(c, L)``: the weights of
    the means (0 where not kept), each row normalised to sum 1.
    """
    ci, lv, d = image.shape
    ct, lt, _ = text.shape
    # (ci, Lv, ct, Lt) token cosines, without a permuted copy.
    s = (image.reshape(ci * lv, d) @ text.reshape(ct * lt, d).T).reshape(ci, lv, ct, lt)
    low = torch.finfo(s.dtype).min
    # Text2Image: each text token takes its best kept image token.
    t2i = s.masked_fill(~image_keep[:, :, None, None], low).max(dim=1).values  # (ci, ct, Lt)
    # Image2Text: each image token takes its best kept text token (without autograd the mask is
    # written in place: one block copy fewer).
    no_text = ~text_keep[None, None]
    masked = s.masked_fill(no_text, low) if s.requires_grad else s.masked_fill_(no_text, low)
    i2t = masked.max(dim=3).values  # (ci, Lv, ct)
    if leaky_slope is not None:
        # leaky_relu is increasing, so max(leaky(s)) = leaky(max(s)): applied after the max, the
        # block of cosines is not kept for the backward.
        t2i, i2t = F.leaky_relu(t2i, leaky_slope), F.leaky_relu(i2t, leaky_slope)
    # A dropped token's max is finite (every row keeps a token) and weighs 0.
    t2i = (t2i * text_weight[None]).sum(dim=-1)
    i2t = (i2t * image_weight[..., None]).sum(dim=1)
    return t2i + i2t


def _keep_and_weights(
    name: str, mask: Tensor, weights: Tensor | None, tokens: Tensor, lazy: bool
) -> tuple[Tensor, Tensor]:
    """The tokens a side keeps (real and weight != 0) and the weights of its means, each row summing
    to 1, in the tokens' dtype (at least float32)."""
    dtype = torch.promote_types(tokens.dtype, torch.float32)
    if weights is None:
        keep, w = mask, mask.to(dtype)
    else:
        keep = mask & (weights != 0)
        _require_rows(name, keep, "kept token (gate > 0)", lazy=lazy)
        w = weights.to(dtype) * mask
    return keep, w / w.sum(dim=1, keepdim=True)


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
) -> Tensor:
    """Bidirectional token-wise similarity (GRM eq. 7) of every image with every text.

    ``S = 1/Lt sum_t max_v s_tv + 1/Lv sum_v max_t s_tv`` (a sum of the two directions, as
    printed and as LAPS), with ``s_tv`` the cosine of L2-normalised tokens (the normalisation is
    LAPS's; eq. 7 as printed uses raw dot products); padding tokens take part neither in the max
    nor in the mean. Blocks of images x texts are scored one at a time so that at most
    ``block_elements`` token cosines exist at once (peak memory about two to three times that, plus
    the inputs and the (Bi, Bt) result); under autograd each block keeps only the arg-max indices,
    so training memory is linear in Bi x Bt x (Lv + Lt), not in Bi x Bt x Lv x Lt.

    Gates (GRM's key level, ``*_weights``): a token with gate 0 is dropped, out of the maxima and
    the means; the means are gate-weighted, ``sum_t A_t max_v s_tv / sum_t A_t``, which for 0/1
    gates is the mean over the kept tokens and passes the gates a gradient (``max_v s_tv`` minus
    the mean: keep the tokens that match better than the others). Every sample must keep a token.

    Args:
        text: ``(Bt, Lt, d)`` text token states (raw; normalised here).
        text_mask: ``(Bt, Lt)`` bool or 0/1, True for real tokens; None: no padding.
        image: ``(Bi, Lv, d)`` image token states (or regions U).
        image_mask: ``(Bi, Lv)``; None: no padding.
        text_weights: optional ``(Bt, Lt)`` gates in [0, 1] of the text tokens (0: dropped).
        image_weights: optional ``(Bi, Lv)`` gates of the image tokens, likewise.
        leaky_slope: LAPS's ``leaky_relu(cos, 0.1)`` before the max when set (0.1); None is eq. 7.
            (Computed after the max, the same value since leaky_relu is increasing.)
        block_elements: cosines per block (memory bound).

    Returns:
        ``(Bi, Bt)`` similarities, in [-2, 2].
    """
    _check_tokens("text", text)
    _check_tokens("image", image)
    if text.shape[-1] != image.shape[-1]:
        raise ValueError(
            f"text and image tokens must share the width d, got {text.shape[-1]} and {image.shape[-1]}"
        )
    if isinstance(block_elements, bool) or not isinstance(block_elements, int) or block_elements < 1:
        raise ValueError(f"block_elements must be an integer >= 1, got {block_elements!r}")
    _check_leaky_slope("token_wise_similarity", leaky_slope)
    inputs = (text, image, text_weights, image_weights)
    # Training (a graph to build): the value checks run on the device, without a host read.
    needs_graph = torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in inputs)
    text_mask = _token_mask("text_mask", text_mask, text, lazy=needs_graph)
    image_mask = _token_mask("image_mask", image_mask, image, lazy=needs_graph)
    text_weights = _token_weights("text_weights", text_weights, text)
    image_weights = _token_weights("image_weights", image_weights, image)
    n_image, lv = image.shape[:2]
    n_text, lt = text.shape[:2]
    if n_image == 0 or n_text == 0:
        return image.new_zeros(n_image, n_text)
    text_keep, text_w = _keep_and_weights("text_weights", text_mask, text_weights, text, needs_graph)
    image_keep, image_w = _keep_and_weights("image_weights", image_mask, image_weights, image, needs_graph)
    per_pair = lv * lt
    pairs = max(1, block_elements // per_pair)
    ci = min(n_image, max(1, math.isqrt(pairs)))
    ct = min(n_text, max(1, pairs // ci))
    ci = min(n_image, max(1, pairs // ct))
    # Without autograd the blocks are written into the result (no second copy of it).
    out = None if needs_graph else image.new_empty(n_image, n_text)
    columns = []
    for t0 in range(0, n_text, ct):
        t1 = min(t0 + ct, n_text)
        text_block = F.normalize(text[t0:t1], dim=-1)
        rows = []
        for i0 in range(0, n_image, ci):
            i1 = min(i0 + ci, n_image)
            block = _block_similarity(
                text_block, text_keep[t0:t1], text_w[t0:t1],
                F.normalize(image[i0:i1], dim=-1), image_keep[i0:i1], image_w[i0:i1], leaky_slope,
            )
            if out is None:
                rows.append(block)
            else:
                out[i0:i1, t0:t1] = block
        if out is None:
            columns.append(torch.cat(rows, dim=0))
    return torch.cat(columns, dim=1) if out is None else out


# --- eq. 8: VSE++ hinge --------------------------------------------------------------------


def _own_anchor_hinge(scores: Tensor, own: Tensor, excluded: Tensor, margin: float, max_violation: bool) -> Tensor:
    """LAPS's ``ContrastiveLoss`` for one direction: each query q's anchor is its own item
    ``own[q]``; ``sum_q`` of ``[margin + scores[q, c] - scores[q, own[q]]]_+`` over the candidates c not
    ``excluded[q, c]`` (its own and the other positives), or the largest of them.
    ``scores`` ``(Q, C)``: queries x candidates."""
    anchor = scores.gather(1, own[:, None])
    cost = (margin + scores - anchor).clamp(min=0).masked_fill(excluded, 0.0)
    per_query = cost.amax(dim=1) if max_violation else cost.sum(dim=1)
    return per_query.sum()


def _every_positive_hinge(scores: Tensor, positives: Tensor, margin: float, max_violation: bool) -> Tensor:
    """Every positive (q, a) is an anchor: ``sum`` over them of ``[margin + scores[q, c] - scores[q, a]]_+``
    over the non-positive c (or the largest). Dense, without a host read: the hardest negative of a
    row serves all its anchors; the sum uses the row's sorted negatives (``searchsorted`` finds
    those above each anchor's threshold, a prefix sum adds them). ``scores`` ``(Q, C)``."""
    negatives = scores.masked_fill(positives, float("-inf"))
    threshold = scores - margin  # a negative c costs scores[q, c] - threshold[q, a] when above it
    if max_violation:
        hardest = negatives.amax(dim=1, keepdim=True)  # -inf for a row without negatives: cost 0
        cost = (hardest - threshold).clamp(min=0)
    else:
        values, _ = negatives.sort(dim=1)  # ascending, -inf (positives) first
        finite = torch.isfinite(values)
        prefix = F.pad(values.where(finite, torch.zeros_like(values)).cumsum(dim=1), (1, 0))  # (Q, C + 1)
        below = torch.searchsorted(values.detach().contiguous(), threshold.detach().contiguous(), right=True)
        above_sum = prefix[:, -1:] - prefix.gather(1, below)
        above_count = (scores.shape[1] - below).to(scores.dtype)
        cost = above_sum - above_count * threshold
    return cost.masked_fill(~positives, 0.0).sum()


def vse_hinge_loss(
    sim: Tensor,
    *,
    margin: float = PAPER_MARGIN,
    max_violation: bool = True,
    positives: Tensor | None = None,
    anchors: Anchors = "own",
    gather: bool | None = None,
) -> Tensor:
    """Bidirectional hinge (triplet ranking) loss of GRM eq. 8 / VSE++ / LAPS, summed over the batch.

    For each image i and its own text i (the anchor): ``[margin + S_ij - S_ii]_+`` over the texts j
    that are negatives of image i, plus ``[margin + S_ji - S_ii]_+`` over the images j that are
    negatives of text i. With the default diagonal positives this is eq. 8.

    Eq. 8 as printed sums over every negative (``max_violation=False``); the text cites VSE++'s
    "hard negative mining", the hardest negative of each row and of each column
    (``max_violation=True``, the default). LAPS sums for its first epoch and takes the hardest
    negative afterwards; the caller switches ``max_violation`` per call.

    Args:
        sim: ``(Bi, Bt)`` image-text similarities (e.g. :func:`token_wise_similarity`); sample i's
            image is row i and its text column i. Distributed, this rank's images against the
            texts of every rank, ``(Bi_local, world * Bt_local)``, rank 0's texts first; every rank
            holds as many images and as many texts.
        margin: alpha (0.2 in the paper).
        max_violation: hardest negative (True) or sum over negatives (False).
        positives: ``(Bi, Bt)`` bool, True where text j describes image i (e.g. two captions of one
            image in the batch); such pairs are never negatives of each other. Default: the
            diagonal (distributed: local image i with global text ``rank * Bi + i``).
        anchors: ``"own"`` (default, LAPS's ``ContrastiveLoss``, GRM's stated base): each sample's
            own pair (i, i) is the only anchor, the other positives are left out of the negatives;
            needs one text per image. ``"positives"``: every positive pair is an anchor (a query
            with two captions in the batch then counts twice).
        gather: ``None`` gathers when a process group of size > 1 is initialised. The rows of
            ``sim`` (and ``positives``) are then gathered with autograd so that each rank also
            ranks the images of every rank for its own texts; the value is ``world`` times this
            rank's share of the sum (images of its rows, texts of its columns), so that the mean
            over ranks is the single-process loss on the concatenated batch.

    Returns:
        Scalar loss (sum reduction, as eq. 8); 0 with the graph intact when there is no image or no text.

    Raises:
        ValueError: naming the argument: ``sim`` not a floating ``(Bi, Bt)`` tensor, a ``margin`` that is not
            finite and >= 0, ``positives`` of the wrong shape or dtype, an unknown ``anchors``, shapes that the
            anchors or the processes cannot split.
    """
    if not isinstance(sim, Tensor) or sim.dim() != 2 or not sim.is_floating_point():
        got = (sim.dtype, tuple(sim.shape)) if isinstance(sim, Tensor) else type(sim).__name__
        raise ValueError(f"sim must be a floating (Bi, Bt) tensor of image-text similarities, got {got}")
    try:
        check_number("margin", margin, low=0.0)
    except ValueError:
        raise ValueError(f"margin must be a finite number >= 0, got {margin!r}") from None
    if anchors not in ("own", "positives"):
        raise ValueError(f"anchors must be 'own' (LAPS) or 'positives', got {anchors!r}")
    rank, world = world_info() if should_gather(gather) else (0, 1)
    n_rows, n_cols = sim.shape
    if n_rows == 0 or n_cols == 0:  # every rank holds as many images and texts: all return here
        if positives is not None and (not isinstance(positives, Tensor) or tuple(positives.shape) != (n_rows, n_cols)):
            raise ValueError(f"positives must be a bool tensor of shape {(n_rows, n_cols)} like sim")
        return zero_with_graph(sim)
    if world > 1 and n_cols % world:
        raise ValueError(
            f"vse_hinge_loss: distributed, sim's columns are the texts of all {world} ranks; "
            f"{n_cols} texts cannot be split evenly (use drop_last=True)"
        )
    square = n_rows * world == n_cols
    if not square and (positives is None or anchors == "own"):
        need = "the default diagonal positives need" if positives is None else "anchors='own' (LAPS) needs"
        raise ValueError(
            f"vse_hinge_loss: {n_rows * world} images and {n_cols} texts; {need} as many of each "
            "(sample i's image is row i, its text column i): pass positives with anchors='positives'"
        )
    rows = torch.arange(n_rows, device=sim.device)
    own = rows + rank * n_rows
    diagonal = torch.zeros(n_rows, n_cols, dtype=torch.bool, device=sim.device)
    if square:
        diagonal[rows, own] = True
    if positives is None:
        positives = diagonal
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
    elif anchors == "own":
        positives = positives | diagonal  # a sample's own pair is never its negative

    def one_way(scores: Tensor, pos: Tensor, own_items: Tensor) -> Tensor:
        if anchors == "own":
            return _own_anchor_hinge(scores, own_items, pos, margin, max_violation)
        return _every_positive_hinge(scores, pos, margin, max_violation)

    image_queries = one_way(sim, positives, own)
    if world == 1:
        return image_queries + one_way(sim.T, positives.T, rows)
    sim_all = gather_with_grad(sim)
    positives_all = gather_with_grad(positives)
    per_rank = n_cols // world
    cols = slice(rank * per_rank, (rank + 1) * per_rank)
    # This rank's texts query every rank's images; text j's own image is global row j.
    text_queries = one_way(sim_all[:, cols].T, positives_all[:, cols].T, own)
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
        entropy_of: ``"normalised"`` uses A_hat_r (each region's attention over the kept tokens
            sums to 1, so this is the mean Shannon entropy of the regions); ``"sigmoid"`` uses A_r,
            the sigmoid scores the equation's symbol names.

    Returns:
        ``(B,)`` per image, over the kept tokens.
    """
    if entropy_of not in ("normalised", "sigmoid"):
        raise ValueError(f"entropy_of must be 'normalised' or 'sigmoid', got {entropy_of!r}")
    a = image.region_weights if entropy_of == "normalised" else image.region_scores
    # Padding and dropped tokens set to 1 (1 log 1 = 0): no term and no gradient (0 log 0 has an
    # infinite slope).
    a = a.masked_fill(~image.kept[..., None], 1.0)
    return -torch.xlogy(a, a).sum(dim=1).mean(dim=-1)


def region_kl(image: GRMImageOutput) -> Tensor:
    """KL regulariser of GRM eq. 11 per image: ``sum_k KL(N(mu_k, sigma_k^2) || N(0, I))
    = -1/2 sum_k sum_d (1 + log sigma^2 - mu^2 - sigma^2)``; ``(B,)``."""
    lv = image.log_var
    return -0.5 * (1 + lv - image.mu.square() - lv.exp()).sum(dim=(1, 2))


def reconstruction(image: GRMImageOutput) -> Tensor:
    """Semantic consistency of GRM eq. 10 per image: ``|| mean_k U_k - mean_l V_hat_l ||^2``, the
    patch mean over the kept tokens (gate-weighted: for 0/1 gates the mean of the kept tokens; ours,
    as in eqs. 2-3 and 7); ``(B,)``."""
    gate = image.gate[..., None].to(image.key_tokens.dtype)
    patch_mean = (image.key_tokens * gate).sum(dim=1) / gate.sum(dim=1)
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

    ``"ori"``: (T, V), the raw tokens. ``"key"``: (T_hat, V_hat), the kept tokens of both sides.
    ``"unc"``: (T_hat, U), the kept text tokens against the K regions.
    """
    common = {"leaky_slope": leaky_slope, "block_elements": block_elements}
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


def _check_grm_options(level_weights: Any, margin: Any, recon_weight: Any, reg_weight: Any, leaky_slope: Any,
                       entropy_of: Any, where: str) -> None:
    """The numeric options of :func:`grm_loss` / :class:`GRMLoss`, checked when given (``ValueError`` naming each)."""
    try:
        weights = tuple(level_weights)
        if len(weights) != 3:
            raise ValueError
        for w in weights:
            check_number("level_weights", w, low=0.0)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: level_weights must be three finite non-negative numbers (a, b, c), got "
                         f"{level_weights!r}") from None
    check_number("margin", margin, low=0.0, where=where)
    check_number("recon_weight", recon_weight, low=0.0, where=where)
    check_number("reg_weight", reg_weight, low=0.0, where=where)
    _check_leaky_slope(where, leaky_slope)
    if entropy_of not in ("normalised", "sigmoid"):
        raise ValueError(f"entropy_of must be 'normalised' or 'sigmoid', got {entropy_of!r}")


def grm_loss(
    image: GRMImageOutput,
    text: GRMTextOutput,
    *,
    level_weights: tuple[float, float, float] = PAPER_LEVEL_WEIGHTS,
    margin: float = PAPER_MARGIN,
    max_violation: bool = True,
    positives: Tensor | None = None,
    anchors: Anchors = "own",
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
        margin, max_violation, positives, anchors: see :func:`vse_hinge_loss` (``positives``
            ``(Bi, Bt)``; distributed: local images x all ranks' texts; ``anchors="own"`` is LAPS's).
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
        ``{"ori", "key", "unc", "con", "recon", "kl", "ent", "reg", "loss"}`` scalars, and
        ``"keep_image"`` / ``"keep_text"``, the mean fraction of real tokens the significance- and
        granularity-aware gates keep (this rank's samples; detached: for logs, not for training). An empty
        batch gives 0 for every term, with the graph intact.

    Raises:
        ValueError: naming the option: ``level_weights`` not three finite numbers >= 0, a ``margin``,
            ``recon_weight``, ``reg_weight`` or ``leaky_slope`` that is not finite and >= 0, an unknown
            ``entropy_of`` (and what :func:`vse_hinge_loss` refuses).
    """
    _check_grm_options(level_weights, margin, recon_weight, reg_weight, leaky_slope, entropy_of, "grm_loss")
    _, world = world_info() if should_gather(gather) else (0, 1)
    keep = {"keep_image": _batch_mean(image.keep_ratio()), "keep_text": _batch_mean(text.keep_ratio())}
    if world > 1:
        tokens, mask, gate = _gather_tokens(text.tokens, text.mask, text.gate)
        text = GRMTextOutput(tokens, mask, text.logits, gate, tokens * gate[..., None])
    common = {"leaky_slope": leaky_slope, "block_elements": block_elements}
    hinge = {"margin": margin, "max_violation": max_violation, "positives": positives, "anchors": anchors,
             "gather": world > 1}
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
    return {**out, **keep}


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
        anchors: Anchors = "own",
        recon_weight: float = 1.0,
        reg_weight: float = 1.0,
        leaky_slope: float | None = None,
        entropy_of: EntropyOf = "normalised",
        block_elements: int = DEFAULT_BLOCK_ELEMENTS,
        gather: bool | None = None,
    ) -> None:
        super().__init__()
        _check_grm_options(level_weights, margin, recon_weight, reg_weight, leaky_slope, entropy_of, "GRMLoss")
        if isinstance(block_elements, bool) or not isinstance(block_elements, int) or block_elements < 1:
            raise ValueError(f"GRMLoss: block_elements must be an integer >= 1, got {block_elements!r}")
        if anchors not in ("own", "positives"):
            raise ValueError(f"anchors must be 'own' (LAPS) or 'positives', got {anchors!r}")
        self.level_weights = tuple(float(w) for w in level_weights)
        self.margin, self.max_violation, self.anchors = float(margin), bool(max_violation), anchors
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
            anchors=self.anchors,
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
            f"anchors={self.anchors!r}, "
            f"recon_weight={self.recon_weight}, reg_weight={self.reg_weight}, leaky_slope={self.leaky_slope}"
        )
