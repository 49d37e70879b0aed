"""Multi-process (gloo, CPU) runs of ``flair_loss``: the rank-side code and the shared inputs.

A global batch of ``world * B`` images is built from fixed seeds; rank r holds images
``r*B .. r*B + B - 1`` (their K sub-captions, patch tokens and class token) and a private copy of
the shared parameters (the pool, the log scale and the bias, like DDP replicas). Every case is
run and backpropagated on every rank; ``tests/losses/test_flair.py`` compares the results with
hand computations in one process. The code lives here (not in a test module) so that spawned
processes can import it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import gloo_ranks
from losses import FLAIRLoss, TextConditionedAttentionPool, flair_loss, sample_flair_text_indices

B, K, N, D, HEADS = 2, 3, 4, 8, 2
GLOBAL_SEED = 5  # the global draw of text_indices passed explicitly
SAMPLE_SEED = 123  # torch.manual_seed on every rank before flair_loss draws by itself
DRAW_KEY = 987654321  # flair_loss(seed=...): every rank draws its own rows of the draw keyed by it

Tensors = dict[str, torch.Tensor]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def make_pool() -> TextConditionedAttentionPool:
    """The same pool on every rank, with non-trivial norms and biases."""
    torch.manual_seed(0)
    pool = TextConditionedAttentionPool(D, HEADS).double()
    with torch.no_grad():
        for i, ln in enumerate((pool.ln_q, pool.ln_k, pool.ln_v)):
            ln.weight.copy_(1.0 + 0.1 * (i + 1) * _randn(D, seed=10 + i))
            ln.bias.copy_(0.1 * _randn(D, seed=20 + i))
        pool.attn.in_proj_bias.copy_(0.1 * _randn(3 * D, seed=30))
        pool.attn.out_proj.bias.copy_(0.1 * _randn(D, seed=31))
    return pool


def global_inputs(world: int) -> Tensors:
    """The global batch of ``world * B`` images (rank 0's first); image 1 has a padded token."""
    g = world * B
    mask = torch.ones(g, N, dtype=torch.bool)
    mask[1, 2] = False
    # Moderate scale and bias so that positives and negatives both carry gradient.
    return {"text": _randn(g, K, D, seed=1), "local": _randn(g, N, D, seed=2), "global": _randn(g, D, seed=3),
            "mask": mask, "log_scale": torch.tensor(math.log(3.0), dtype=torch.float64),
            "bias": torch.tensor(-1.0, dtype=torch.float64)}


def global_indices(world: int) -> torch.Tensor:
    """The draw of the global batch (``distributed="global"``), the same on every rank."""
    return sample_flair_text_indices(world * B, K, generator=torch.Generator().manual_seed(GLOBAL_SEED))


def ring_indices(world: int) -> list[torch.Tensor]:
    """Each rank's own draw of its batch (``distributed="ring"``)."""
    return [sample_flair_text_indices(B, K, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]


CASES = ("global", "global_public_mps", "global_no_mps", "global_seeded", "global_keyed", "ring", "ring_public_mps",
         "ring_no_mps", "ring_module", "ring_keyed", "local")


def ring_keyed_indices(world: int) -> list[torch.Tensor]:
    """Each rank's own draw under ``distributed="ring"`` with ``seed=DRAW_KEY``: keyed by (key, rank)."""
    from losses import flair_draw_seed

    return [sample_flair_text_indices(B, K, seed=flair_draw_seed(DRAW_KEY, r)) for r in range(world)]


def mps_form(name: str) -> str:
    """The L_mps negatives of case ``name``."""
    return "public_code" if name.endswith("public_mps") else "paper"


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


def run_case(name: str, rank: int, world: int) -> dict:
    """Rank ``rank``'s loss and gradients for case ``name``."""
    full = global_inputs(world)
    rows = slice(rank * B, (rank + 1) * B)
    text, local, glob = (_leaf(full[k][rows]) for k in ("text", "local", "global"))
    log_scale, bias = _leaf(full["log_scale"]), _leaf(full["bias"])
    pool = make_pool()
    kwargs = {"add_mps": not name.endswith("no_mps"), "mps_negatives": mps_form(name), "local_mask": full["mask"][rows],
              "gather": True}
    if name == "local":  # gather=False: each process on its own batch, its own draw
        kwargs.update(gather=False, text_indices=ring_indices(world)[rank])
    elif name == "global_keyed":  # each rank draws only its own rows, keyed by DRAW_KEY
        kwargs.update(distributed="global", seed=DRAW_KEY)
    elif name == "ring_keyed":  # each rank its own matrix, keyed by (DRAW_KEY, rank)
        kwargs.update(distributed="ring", seed=DRAW_KEY)
    elif name.startswith("global"):
        kwargs.update(distributed="global", text_indices=None if name == "global_seeded" else global_indices(world))
    else:
        kwargs.update(distributed="ring", text_indices=ring_indices(world)[rank])
    if name == "global_seeded":
        torch.manual_seed(SAMPLE_SEED)
    parts = {}
    if name == "ring_module":
        module = FLAIRLoss(distributed="ring", gather=True)
        parts = module(text, local, glob, pool, log_scale.exp(), bias, text_indices=kwargs["text_indices"],
                       local_mask=kwargs["local_mask"])
        loss = parts["loss"]
    else:
        loss = flair_loss(text, local, glob, pool, log_scale.exp(), bias, **kwargs)
    loss.backward()
    return {
        "loss": loss.detach(),
        "parts": {k: v.detach() for k, v in parts.items()},
        "grads": {"text": text.grad, "local": local.grad, "global": glob.grad, "log_scale": log_scale.grad,
                  "bias": bias.grad, **{f"pool.{k}": p.grad for k, p in pool.named_parameters()}},
    }


def _rank_results(rank: int, world: int) -> dict:
    results = {name: run_case(name, rank, world) for name in CASES}
    results["world_size"] = dist.get_world_size()
    return results


def run_ranks(folder: str, world: int) -> list[dict]:
    """Spawn ``world`` gloo processes that run every case; returns each rank's results."""
    return gloo_ranks.run_ranks(_rank_results, folder, world)


# --- the ring exchange primitive -------------------------------------------------------------


def _exchange(rank: int, world: int) -> dict:
    from losses import ring_exchange_with_grad

    x = (torch.arange(6, dtype=torch.float64).reshape(2, 3) + 100 * rank).requires_grad_(True)
    received = ring_exchange_with_grad(x)
    weights = torch.arange(1, 7, dtype=torch.float64).reshape(2, 3)
    # Distinct weights per (receiving rank, source rank): the gradient shows who used what.
    loss = sum((10 * rank + source) * (block * weights).sum() for source, block in received)
    loss.backward()
    return {"world_size": dist.get_world_size(), "sources": torch.tensor([s for s, _ in received]),
            "blocks": torch.stack([b.detach() for _, b in received]), "grad": x.grad}


def run_exchange(folder: str, world: int) -> list[dict]:
    """Spawn ``world`` gloo processes that pass a tensor around the ring and backpropagate."""
    return gloo_ranks.run_ranks(_exchange, folder, world, name="exchange")
