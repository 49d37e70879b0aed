"""The xlipkit losses in a plain PyTorch loop: CLIP's InfoNCE plus StructXLIP's terms.

A toy two-tower model learns to match random "scenes" (a few patterns placed on a grid) with
"captions" (the ids of those patterns and of their colours). StructXLIP's inputs are built as
the toolkit would build them: edge maps of the images, captions with the colour words removed,
one chunk per object of the filtered caption and one region per object crop of the edge map.

    python examples/losses_in_a_plain_loop.py        # CPU, a few seconds
    python examples/losses_in_a_plain_loop.py --steps 300 --batch-size 64 --seed 1

Under torchrun/Accelerate the same code sees the global batch: every loss gathers with
gradients when a process group is initialised.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from losses import StructXLIPLoss, clip_loss

N_SHAPES, N_COLOURS, N_OBJECTS, CELL, DIM = 6, 4, 3, 6, 32
COLOUR_TOKEN = N_SHAPES  # colour c is token COLOUR_TOKEN + c; shape s is token s
VOCAB = N_SHAPES + N_COLOURS


class ImageTower(nn.Module):
    """Conv + global pooling, so crops of any size can be encoded: (B, 3, H, W) -> (B, D)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, DIM),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TextTower(nn.Module):
    """Mean of token embeddings and an MLP: (B, L) ids with -1 padding -> (B, D)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, DIM))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids >= 0).float().unsqueeze(-1)
        pooled = (self.embed(ids.clamp(min=0)) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.mlp(pooled)


def make_batch(n: int, patterns: torch.Tensor, colours: torch.Tensor, gen: torch.Generator) -> dict:
    """Scenes of N_OBJECTS objects in a row of cells, their captions and StructXLIP's views."""
    shapes = torch.randint(N_SHAPES, (n, N_OBJECTS), generator=gen)
    colour = torch.randint(N_COLOURS, (n, N_OBJECTS), generator=gen)
    images = torch.zeros(n, 3, CELL, CELL * N_OBJECTS)
    for i in range(n):
        for k in range(N_OBJECTS):
            cell = patterns[shapes[i, k]] * colours[colour[i, k]][:, None, None]
            images[i, :, :, k * CELL : (k + 1) * CELL] = cell
    images += 0.1 * torch.randn(images.shape, generator=gen)
    # Edge map: gradient magnitude of the grey image, repeated on 3 channels.
    grey = images.mean(1, keepdim=True)
    edges = (F.pad(grey.diff(dim=-1), (0, 1)).abs() + F.pad(grey.diff(dim=-2), (0, 0, 0, 1)).abs()).repeat(1, 3, 1, 1)
    caption = torch.stack([colour + COLOUR_TOKEN, shapes], dim=-1).flatten(1)  # "colour shape, ..."
    filtered = shapes  # the colour words removed
    # One chunk (the object's filtered words) and one region (its edge crop) per object.
    chunks = shapes.reshape(-1, 1)
    regions = torch.cat([edges[..., k * CELL : (k + 1) * CELL] for k in range(N_OBJECTS)], dim=0)
    region_owner = torch.arange(n).repeat(N_OBJECTS)  # regions are stacked object-major
    chunk_owner = torch.arange(n).repeat_interleave(N_OBJECTS)
    # Chunk of object k of sample i is positive with the region of that object only.
    chunk_object = torch.arange(N_OBJECTS).repeat(n)
    region_object = torch.arange(N_OBJECTS).repeat_interleave(n)
    positives = (chunk_owner[:, None] == region_owner[None]) & (chunk_object[:, None] == region_object[None])
    return dict(images=images, edges=edges, caption=caption, filtered=filtered, chunks=chunks,
                regions=regions, chunk_owner=chunk_owner, region_owner=region_owner, positives=positives)


@torch.no_grad()
def recall_at_1(image: ImageTower, text: TextTower, batch: dict) -> float:
    sims = F.normalize(image(batch["images"]), dim=-1) @ F.normalize(text(batch["caption"]), dim=-1).T
    return (sims.argmax(1) == torch.arange(sims.shape[0])).float().mean().item()


def main(steps: int = 150, batch_size: int = 32, seed: int = 0) -> None:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    patterns = (torch.rand(N_SHAPES, 1, CELL, CELL, generator=gen) > 0.5).float()
    colours = torch.rand(N_COLOURS, 3, generator=gen)
    image_tower, text_tower = ImageTower(), TextTower()
    logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # CLIP's log-scale parameter
    structxlip = StructXLIPLoss()  # paper weights 0.25 / 0.1 / 0.1, own structure temperature
    params = [*image_tower.parameters(), *text_tower.parameters(), logit_scale, *structxlip.parameters()]
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    held_out = make_batch(128, patterns, colours, torch.Generator().manual_seed(seed + 1))
    print(f"Recall@1 on 128 held-out scenes before: {recall_at_1(image_tower, text_tower, held_out):.2f}")

    for step in range(steps):
        b = make_batch(batch_size, patterns, colours, gen)
        image_embeds = image_tower(b["images"])
        base = clip_loss(image_embeds, text_tower(b["caption"]), logit_scale.exp())  # L_IT
        terms = structxlip(
            image_embeds=image_embeds,
            edge_embeds=image_tower(b["edges"]),
            filtered_text_embeds=text_tower(b["filtered"]),
            chunk_embeds=text_tower(b["chunks"]),
            chunk_owner=b["chunk_owner"],
            region_embeds=image_tower(b["regions"]),
            region_owner=b["region_owner"],
            chunk_positives=b["positives"],
        )
        loss = base + terms["loss"]  # L_total = L_IT + L* (StructXLIP eq. 4)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            logit_scale.clamp_(max=math.log(100))
        structxlip.clamp_structure_logit_scale_()
        if step % 25 == 0 or step == steps - 1:
            parts = " ".join(f"{k} {v.item():.3f}" for k, v in terms.items() if k != "loss")
            print(f"step {step:3d}  L_IT {base.item():.3f}  {parts}  total {loss.item():.3f}")

    print(f"Recall@1 on 128 held-out scenes after:  {recall_at_1(image_tower, text_tower, held_out):.2f}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="optimiser steps")
    p.add_argument("--batch-size", type=int, default=32, help="scenes per step (the B of the contrastive losses)")
    p.add_argument("--seed", type=int, default=0, help="seed of the scenes and the initial weights")
    return p


if __name__ == "__main__":
    args = _parser().parse_args()
    main(steps=args.steps, batch_size=args.batch_size, seed=args.seed)
