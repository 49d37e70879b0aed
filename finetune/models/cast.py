"""The CAST image encoder in plain torch (Ke et al. 2022; F-CAST section 3.1, appendix B).

Superpixel tokens are progressively merged by graph pooling: a convolutional stem maps the 224 px
image to a 28 x 28 feature map; each superpixel's token is the mean of the features and of fixed
2-D sin-cos positions inside it; a class token is prepended; stages of transformer blocks alternate
with graph pooling 196 -> 64 -> 32 -> 16 (farthest-point sampled centres, cosine-softmax soft
assignment, centroid update). F-CAST drops CAST's last pooling (16 -> 8, appendix B). The encoder
returns the 64 stage-2 segment tokens (``v_fine``), the final class token (``v_coarse``) and every
stage's assignment (the part-to-whole hierarchy, F-CAST Fig. 6).

No DGL and no timm: farthest-point sampling is :func:`farthest_point_sampling` (squared L2, first
maximum on ties, which reproduces DGL's indices), the segment means are ``index_add_``.

Where CAST's code ignores padded (empty) segments in attention and soft assignment (public-code notes
2.2), they are masked here: never an attention key, never a centre, and no weight in a centroid.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "CastConfig", "CAST_CONFIGS", "CastEncoder", "CastOutput", "GraphPool", "farthest_point_sampling",
    "segment_mean", "sincos_2d", "resize_labels",
]


@dataclass
class CastConfig:
    """A CAST encoder's architecture.

    Attributes:
        width: token width C (CAST-S 384, CAST-B 768).
        heads: attention heads (12 in CAST).
        depths: transformer blocks per stage; one more stage than ``clusters``.
        clusters: segments after each graph pooling (F-CAST: 64, 32, 16).
        embed_dim: joint embedding width D the segment and class tokens are projected to.
        image_size: input side in pixels; the stem divides it by 8.
        n_segments: superpixels per image (196 at 224 px).
        mlp_ratio: hidden width of the blocks' MLP over C.
        assign_scale: the fixed multiplier of the cosine logits of the soft assignment (CAST: 5).
        pool_dropout: dropout in the pooling's feature MLP (CAST: 0.1).
    """

    width: int = 768
    heads: int = 12
    depths: tuple[int, ...] = (3, 3, 3, 2)
    clusters: tuple[int, ...] = (64, 32, 16)
    embed_dim: int = 512
    image_size: int = 224
    n_segments: int = 196
    mlp_ratio: float = 4.0
    assign_scale: float = 5.0
    pool_dropout: float = 0.1

    def __post_init__(self) -> None:
        self.depths, self.clusters = tuple(self.depths), tuple(self.clusters)
        if len(self.depths) != len(self.clusters) + 1:
            raise ValueError(f"CastConfig: depths {self.depths} needs one more stage than clusters {self.clusters}")
        if self.width % 8 or self.width % self.heads or self.width % 4:
            raise ValueError(f"CastConfig: width {self.width} must be divisible by 8 and by heads {self.heads}")
        if self.image_size % 8:
            raise ValueError(f"CastConfig: image_size {self.image_size} must be a multiple of 8 (stem stride)")

    def to_dict(self) -> dict:
        """JSON-serialisable form."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


#: CAST-S / CAST-B (CAST's cast_small / cast_base: C 384 / 768, 12 heads, depths 3-3-3-2, patch 8 stem),
#: F-CAST's clusters (the last pooling dropped); tiny ones for tests and the CPU recipe.
CAST_CONFIGS: dict[str, CastConfig] = {
    "cast-b": CastConfig(width=768, heads=12),
    "cast-s": CastConfig(width=384, heads=12),
    "cast-tiny": CastConfig(width=128, heads=4, depths=(1, 1, 1, 1), clusters=(16, 8, 4), embed_dim=64,
                            image_size=64, n_segments=36),
}


def farthest_point_sampling(x: Tensor, m: int, start: int = 0, valid: Tensor | None = None) -> Tensor:
    """Farthest-point sampling of ``m`` centres per row (CAST's graph pooling; DGL's sampler in torch).

    The first centre is ``start``; each next one is the point whose squared L2 distance to its nearest
    chosen centre is largest, the first such point on ties (``argmax``). Invalid (padded) points are
    never chosen while a valid one has a positive distance; when fewer than ``m`` valid points exist,
    later picks repeat the first valid point at distance 0.

    Args:
        x: ``(B, N, C)`` points (compared in float64, without gradient).
        m: centres to pick (``1 <= m``).
        start: index of the first centre in every row.
        valid: ``(B, N)`` bool, False for padded points; None: all valid.
    Returns:
        ``(B, m)`` int64 indices.
    """
    b, n, _ = x.shape
    if m < 1 or not 0 <= start < n:
        raise ValueError(f"farthest_point_sampling: need m >= 1 and 0 <= start < N={n}, got m={m}, start={start}")
    pts = x.detach().double()
    rows = torch.arange(b, device=x.device)
    dist = torch.full((b, n), math.inf, dtype=torch.float64, device=x.device)
    if valid is not None:
        dist = dist.masked_fill(~valid.bool(), -1.0)
    out = torch.empty(b, m, dtype=torch.long, device=x.device)
    cur = torch.full((b,), start, dtype=torch.long, device=x.device)
    for i in range(m):
        out[:, i] = cur
        d = (pts - pts[rows, cur][:, None]).pow(2).sum(-1)
        dist = torch.minimum(dist, d)
        if valid is not None:
            dist = dist.masked_fill(~valid.bool(), -1.0)
        cur = dist.argmax(dim=1)
    return out


def segment_mean(x: Tensor, labels: Tensor, n_segments: int, *, check: bool = True) -> tuple[Tensor, Tensor]:
    """Mean of ``x`` over the pixels of each segment (CAST's ``segment_mean_nd``).

    Args:
        x: ``(B, P, C)`` per-pixel values (``(P, C)`` is shared by every row, e.g. positions).
        labels: ``(B, P)`` int64 segment of each pixel, in ``[0, n_segments)``.
        n_segments: S.
        check: raise on labels out of range, which reads them on the host; the encoder passes False where S was
            counted from these labels (:meth:`CastEncoder.segment_count`), so that a training step does not sync.
    Returns:
        ``(means (B, S, C), counts (B, S))``; an empty segment's mean is 0 and its count 0.
    """
    b, p = labels.shape
    if x.dim() == 2:
        x = x.unsqueeze(0).expand(b, -1, -1)
    c = x.shape[-1]
    if check and (labels.min() < 0 or labels.max() >= n_segments):
        raise ValueError(f"segment_mean: labels must be in [0, {n_segments}), got [{int(labels.min())}, "
                         f"{int(labels.max())}]")
    flat = (labels + n_segments * torch.arange(b, device=labels.device)[:, None]).reshape(-1)
    sums = x.new_zeros(b * n_segments, c).index_add_(0, flat, x.reshape(-1, c))
    counts = x.new_zeros(b * n_segments).index_add_(0, flat, x.new_ones(b * p))
    means = sums / counts.clamp(min=1)[:, None]
    return means.reshape(b, n_segments, c), counts.reshape(b, n_segments)


def sincos_2d(h: int, w: int, dim: int, temperature: float = 10000.0) -> Tensor:
    """Fixed 2-D sin-cos positions (MoCo v3, as CAST): ``(h * w, dim)`` row-major, ``[sin(x·ω), cos(x·ω),
    sin(y·ω), cos(y·ω)]`` with ``ω_k = temperature^(-k / (dim/4))``."""
    if dim % 4:
        raise ValueError(f"sincos_2d: dim {dim} must be divisible by 4")
    gy, gx = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32),
                            indexing="ij")
    quarter = dim // 4
    omega = 1.0 / temperature ** (torch.arange(quarter, dtype=torch.float32) / quarter)
    ox, oy = gx.reshape(-1, 1) * omega, gy.reshape(-1, 1) * omega
    return torch.cat([ox.sin(), ox.cos(), oy.sin(), oy.cos()], dim=1)


def resize_labels(labels: Tensor, size: tuple[int, int]) -> Tensor:
    """Superpixel labels ``(B, H, W)`` nearest-resized to ``size`` -> ``(B, h, w)`` int64 (CAST)."""
    if tuple(labels.shape[-2:]) == tuple(size):
        return labels.long()
    return F.interpolate(labels[:, None].float(), size=size, mode="nearest")[:, 0].long()


class ConvStem(nn.Module):
    """CAST's stem: four 3x3 conv + BN + ReLU with strides 2, 2, 2, 1 and channels C/8, C/4, C/2, C,
    then a 1x1 conv C -> C: ``(B, 3, H, W) -> (B, C, H/8, W/8)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        layers, cin = [], 3
        for cout, stride in ((width // 8, 2), (width // 4, 2), (width // 2, 2), (width, 1)):
            layers += [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
            cin = cout
        layers.append(nn.Conv2d(width, width, 1))
        self.proj = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + MHA(LN(x))``, then ``x + MLP(LN(x))`` (GELU); padded keys masked."""

    def __init__(self, width: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        hidden = int(width * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        """``x (B, T, C)``; ``key_padding_mask (B, T)`` True where a token is padding."""
        h = self.norm1(x)
        x = x + self.attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GraphPool(nn.Module):
    """CAST's graph pooling (CAST ``graph_pool.py``): N segment tokens -> M centroids.

    ``idx = FPS([mean(x); x], M + 1, start=0)[1:] - 1`` (the mean of the valid tokens is the start, so the
    first centre is the token farthest from it); ``h = x + Attn(LN(x))`` (no MLP), centred over tokens
    plus a learned bias; ``A = softmax_M(scale · cos(h_n, h_idx[m]))``; centroids
    ``c_m = Σ_n A_nm f(x_n) / Σ_n A_nm`` with ``f = Dropout(GELU(Linear(LN(x))))`` to 4C, then
    ``x'_m = g(c_m) + x_idx[m]`` with ``g = Linear(LN(·))`` back to C; the class token becomes
    ``g(f(cls)) + cls``.

    ``f``'s dropout on the N tokens is drawn at ``max(N, noise_tokens)`` tokens and sliced (ours), so that the
    padded segment slots of a batch (``N`` is the planned capacity or the batch's own count) do not decide which
    random numbers land on the real segments: a batch gives the same values at any padding up to ``noise_tokens``.
    """

    def __init__(self, width: int, heads: int, clusters: int, *, scale: float = 5.0, dropout: float = 0.1) -> None:
        super().__init__()
        self.clusters, self.scale = clusters, scale
        self.norm = nn.LayerNorm(width, eps=1e-6)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.centre_bias = nn.Parameter(torch.zeros(width))
        self.fc1 = nn.Sequential(nn.LayerNorm(width, eps=1e-6), nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Dropout(dropout))
        self.fc2 = nn.Sequential(nn.LayerNorm(4 * width, eps=1e-6), nn.Linear(4 * width, width))

    def centres(self, x: Tensor, valid: Tensor) -> Tensor:
        """FPS centres ``(B, M)`` of ``x (B, N, C)`` started from the mean of the valid tokens."""
        w = valid.to(x.dtype)[..., None]
        mean = (x * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp(min=1)
        pts = torch.cat([mean, x], dim=1)
        ok = torch.cat([valid.new_ones(valid.shape[0], 1), valid], dim=1)
        return farthest_point_sampling(pts, self.clusters + 1, start=0, valid=ok)[:, 1:] - 1

    def forward(self, x: Tensor, cls: Tensor, valid: Tensor, noise_tokens: int | None = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Pool ``x (B, N, C)`` (``valid (B, N)`` bool) and update ``cls (B, C)``; ``noise_tokens``: the tokens the
        dropout of ``f`` is drawn at (the class docstring; None: N).

        Returns:
            ``(centroids (B, M, C), cls (B, C), assignment (B, N, M), centre indices (B, M))``; padded
            tokens' assignment rows are 0.
        """
        idx = self.centres(x, valid)
        h = self.norm(x)
        h = x + self.attn(h, h, h, key_padding_mask=~valid, need_weights=False)[0]
        w = valid.to(h.dtype)[..., None]
        h = h - (h * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp(min=1) + self.centre_bias
        hc = h.gather(1, idx[..., None].expand(-1, -1, h.shape[-1]))
        logits = self.scale * F.normalize(h, dim=-1) @ F.normalize(hc, dim=-1).transpose(1, 2)
        assign = logits.softmax(dim=-1) * w
        feats = self._features(x, noise_tokens)
        cent = assign.transpose(1, 2) @ feats / assign.sum(1)[..., None].clamp(min=1e-6)
        out = self.fc2(cent) + x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))
        return out, self.fc2(self.fc1(cls)) + cls, assign, idx

    def _features(self, x: Tensor, noise_tokens: int | None) -> Tensor:
        """``f(x)`` ``(B, N, 4C)``, its dropout mask drawn at ``(B, max(N, noise_tokens), 4C)`` and sliced."""
        drop = self.fc1[-1]
        h = self.fc1[:-1](x)
        if not (self.training and drop.p > 0):
            return h
        n = h.shape[1]
        keep = h.new_empty(h.shape[0], max(n, int(noise_tokens or 0)), h.shape[2]).bernoulli_(1 - drop.p)
        return h * keep[:, :n] / (1 - drop.p)


@dataclass
class CastOutput:
    """What :class:`CastEncoder` returns.

    Attributes:
        fine: ``(B, M_1, D)`` projected stage-2 segment tokens ``v_fine`` (M_1 = 64).
        coarse: ``(B, D)`` projected final class token ``v_coarse``.
        assignments: per graph pooling, ``(B, N_s, M_s)`` soft assignments (196->64, 64->32, 32->16).
        centres: per graph pooling, ``(B, M_s)`` FPS centre indices.
        labels: ``(B, h, w)`` superpixel labels at the feature map's resolution.
        segment_valid: ``(B, S)`` bool, False for superpixels empty at that resolution.
    """

    fine: Tensor
    coarse: Tensor
    assignments: list[Tensor] = field(default_factory=list)
    centres: list[Tensor] = field(default_factory=list)
    labels: Tensor | None = None
    segment_valid: Tensor | None = None


class CastEncoder(nn.Module):
    """CAST with F-CAST's three poolings (F-CAST 3.1): ``(pixels (B, 3, H, W), superpixels (B, H, W)) ->``
    :class:`CastOutput`. ``v_fine`` and ``v_coarse`` pass through one final LayerNorm and one linear
    projection to D (as FLAIR's ``ln_post`` and projection serve both its patch and class tokens)."""

    def __init__(self, config: CastConfig) -> None:
        super().__init__()
        self.config = c = config
        self.stem = ConvStem(c.width)
        self.grid = (c.image_size // 8, c.image_size // 8)
        self.register_buffer("pos_embed", sincos_2d(*self.grid, c.width), persistent=False)
        self.cls_token = nn.Parameter(torch.randn(1, 1, c.width) * 1e-6)
        self.stages = nn.ModuleList(
            nn.ModuleList(Block(c.width, c.heads, c.mlp_ratio) for _ in range(d)) for d in c.depths)
        self.pools = nn.ModuleList(GraphPool(c.width, c.heads, m, scale=c.assign_scale, dropout=c.pool_dropout)
                                   for m in c.clusters)
        self.norm = nn.LayerNorm(c.width, eps=1e-6)
        self.proj = nn.Linear(c.width, c.embed_dim, bias=False)
        self.apply(_init)

    @staticmethod
    def token_grid(height: int, width: int) -> tuple[int, int]:
        """The stem's output grid for ``height x width`` pixels (three stride-2 3x3 convolutions with padding 1:
        ``ceil(H / 8) x ceil(W / 8)``), on which the superpixels are resized."""
        return -(-height // 8), -(-width // 8)

    def segment_count(self, pixel_values: Tensor, superpixels: Tensor) -> int:
        """S of :meth:`tokens`: one more than the largest superpixel label on the token grid. It reads the labels:
        call it where they are on the CPU (the data loader's collate, :meth:`~finetune.objectives.base.Term.plan`)
        and pass it to :meth:`forward` as ``n_segments``.

        Raises:
            ValueError: a negative label."""
        labels = resize_labels(superpixels, self.token_grid(*pixel_values.shape[-2:]))
        if labels.numel() and int(labels.min()) < 0:
            raise ValueError(f"CAST superpixels must be labels >= 0, got {int(labels.min())}")
        return int(labels.max()) + 1 if labels.numel() else 1

    def tokens(self, pixel_values: Tensor, superpixels: Tensor,
               n_segments: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Segment tokens: ``(tokens (B, S, C), valid (B, S), labels (B, h, w))``, each token the mean of
        the stem features plus the mean of the sin-cos positions inside its superpixel. ``n_segments``: S as
        :meth:`segment_count` counted it on the CPU; None counts it here (a read of the labels)."""
        feats = self.stem(pixel_values)
        b, c, h, w = feats.shape
        labels = resize_labels(superpixels.to(feats.device), (h, w))
        flat = labels.reshape(b, -1)
        check = n_segments is None
        n_seg = int(flat.max()) + 1 if n_segments is None else int(n_segments)
        # sums and counts in float32 (a bf16 count is not exact past 256 pixels)
        tok, counts = segment_mean(feats.flatten(2).transpose(1, 2).float(), flat, n_seg, check=check)
        pos = self.pos_embed if self.pos_embed.shape[0] == h * w else sincos_2d(h, w, c).to(feats.device)
        pos_mean, _ = segment_mean(pos.float(), flat, n_seg, check=check)
        return (tok + pos_mean).to(feats.dtype), counts > 0, labels

    def forward(self, pixel_values: Tensor, superpixels: Tensor, n_segments: int | None = None, *,
                noise_tokens: int | None = None) -> CastOutput:
        """Encode ``pixel_values (B, 3, H, W)`` with their ``superpixels (B, H, W)`` int labels; ``n_segments``:
        the segment tokens (their :meth:`segment_count`, or more: a planned capacity), counted on the CPU (None:
        counted here, which reads the labels); ``noise_tokens``: the segment tokens the first pooling's dropout is
        drawn at (:class:`GraphPool`; the planned capacity)."""
        x, valid, labels = self.tokens(pixel_values, superpixels, n_segments)
        segment_valid = valid
        cls = self.cls_token.expand(x.shape[0], -1, -1)[:, 0]
        assignments, centres, fine = [], [], None
        for s, blocks in enumerate(self.stages):
            seq = torch.cat([cls[:, None], x], dim=1)
            pad = torch.cat([valid.new_zeros(valid.shape[0], 1), ~valid], dim=1)
            for blk in blocks:
                seq = blk(seq, key_padding_mask=pad)
            cls, x = seq[:, 0], seq[:, 1:]
            if s == 1:
                fine = x
            if s < len(self.pools):
                x, cls, assign, idx = self.pools[s](x, cls, valid, noise_tokens if s == 0 else None)
                valid = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
                assignments.append(assign)
                centres.append(idx)
        if fine is None:  # a config with a single stage: the tokens after it
            fine = x
        return CastOutput(fine=self.proj(self.norm(fine)), coarse=self.proj(self.norm(cls)),
                          assignments=assignments, centres=centres, labels=labels, segment_valid=segment_valid)


def _init(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):  # CAST: xavier-uniform linears, zero biases
        nn.init.xavier_uniform_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def hierarchy_labels(out: CastOutput) -> list[Tensor]:
    """Each pixel's segment at every level: ``[(B, h, w)]`` for the superpixels and after each pooling
    (hard assignment by argmax, composed level by level): the part-to-whole hierarchy of F-CAST Fig. 6."""
    levels = [out.labels]
    current = out.labels.reshape(out.labels.shape[0], -1)
    for assign in out.assignments:
        hard = assign.argmax(dim=-1)  # (B, N_s)
        current = hard.gather(1, current.clamp(max=hard.shape[1] - 1))
        levels.append(current.reshape(out.labels.shape))
    return levels
