"""Two-process (gloo, CPU) runs of the losses, compared with one process on the whole batch.

Each case builds a global batch from a fixed seed. Rank r gets its share of the rows (the
"local" inputs) and a private leaf copy of the shared parameters (logit scales, like DDP
replicas), computes the loss with ``gather=True`` and backpropagates it. The test then checks,
against one process computing the same loss on the concatenated batch:

* loss: the mean of the per-rank losses equals the single-process loss;
* inputs: each rank's gradient on its local rows, divided by the world size, equals the
  single-process gradient on those rows. The autograd all-gather's backward already sums, into
  rank r's rows, what every rank's loss sends to them; DDP then *averages* the parameter
  gradients over ranks, which divides by the world size;
* shared parameters: the mean over ranks of their gradients (what DDP computes) equals the
  single-process gradient.

The rank-side code lives here (not in a test module) so that spawned processes can import it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gloo_ranks import run_ranks
from losses import (
    StructXLIPLoss,
    clip_loss,
    consistency_loss,
    gather_variable_with_grad,
    gather_with_grad,
    local_structure_loss,
    longclip_loss,
    should_gather,
    siglip_loss,
    tsl_loss,
    world_info,
)
from losses.distributed import sum_over_ranks

WORLD = 2
Tensors = dict[str, torch.Tensor]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


@dataclass
class Case:
    """``make(rank)`` -> (inputs, params, rows); ``rank=None`` is the single-process batch.

    ``rows[name]`` is the slice of the global tensor ``name`` held by that rank.
    """

    make: Callable[[int | None], tuple[Tensors, Tensors, dict[str, slice]]]
    loss: Callable[[Tensors, Tensors, bool | None], torch.Tensor]


def _even_rows(rank: int | None, per_rank: int) -> slice:
    return slice(None) if rank is None else slice(rank * per_rank, (rank + 1) * per_rank)


# --- contrastive -------------------------------------------------------------------------


def _make_clip(rank: int | None, valid: list[bool] | None = None):
    rows = _even_rows(rank, 4)
    inputs = {"image": _leaf(_randn(8, 5, seed=1)[rows]), "text": _leaf(_randn(8, 5, seed=2)[rows])}
    if valid is not None:
        inputs["valid"] = torch.tensor(valid)[rows]
    params = {"log_scale": _leaf(torch.tensor(math.log(10.0), dtype=torch.float64))}
    return inputs, params, {"image": rows, "text": rows}


def _clip(inputs: Tensors, params: Tensors, gather: bool | None) -> torch.Tensor:
    return clip_loss(
        inputs["image"],
        inputs["text"],
        params["log_scale"].exp(),
        label_smoothing=0.1,
        valid=inputs.get("valid"),
        gather=gather,
    )


def _make_siglip(rank: int | None):
    # Two captions per image (texts 2i and 2i+1 describe image i), plus text 0 also fits image 1.
    image_rows, text_rows = _even_rows(rank, 4), _even_rows(rank, 8)
    positives = torch.zeros(8, 16, dtype=torch.bool)
    for i in range(8):
        positives[i, 2 * i : 2 * i + 2] = True
    positives[1, 0] = True
    positives[5, 8] = True
    if rank is not None:
        positives = positives[image_rows, text_rows]
    inputs = {
        "image": _leaf(_randn(8, 5, seed=3)[image_rows]),
        "text": _leaf(_randn(16, 5, seed=4)[text_rows]),
        "positives": positives,
    }
    params = {
        "log_scale": _leaf(torch.tensor(math.log(10.0), dtype=torch.float64)),
        "bias": _leaf(torch.tensor(-4.0, dtype=torch.float64)),
    }
    return inputs, params, {"image": image_rows, "text": text_rows}


def _siglip(inputs: Tensors, params: Tensors, gather: bool | None, exchange: str = "gather") -> torch.Tensor:
    return siglip_loss(
        inputs["image"],
        inputs["text"],
        params["log_scale"].exp(),
        params["bias"],
        positives=inputs["positives"],
        gather=gather,
        exchange=exchange,
    )


def _make_longclip(rank: int | None):
    rows = _even_rows(rank, 6)
    inputs = {
        "image": _leaf(_randn(12, 6, seed=5)[rows]),
        "long": _leaf(_randn(12, 6, seed=6)[rows]),
        "short": _leaf(_randn(12, 6, seed=7)[rows]),
    }
    params = {"log_scale": _leaf(torch.tensor(math.log(20.0), dtype=torch.float64))}
    return inputs, params, dict.fromkeys(inputs, rows)


def _longclip(inputs: Tensors, params: Tensors, gather: bool | None) -> torch.Tensor:
    return longclip_loss(
        inputs["image"], inputs["long"], inputs["short"], params["log_scale"].exp(), pca_dim=3, gather=gather
    )


# --- StructXLIP --------------------------------------------------------------------------

# Per rank: 3 samples. Chunk and region owners are local sample indices; rank 1 has fewer
# regions, one of them invalid, and its sample 0 has no region at all.
_CHUNK_OWNERS = ([0, 0, 1, 2, 2], [0, 1, 1, 2])
_REGION_OWNERS = ([0, 0, 1, 1, 2, 2], [1, 2, 2])
_REGION_VALID = ([True, True, True, False, True, True], [True, True, False])


def _variable_rows(counts: tuple[int, int], rank: int | None) -> slice:
    if rank is None:
        return slice(None)
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])


def _make_local(rank: int | None, *, explicit_positives: bool = False, empty_rank0: bool = False):
    chunk_owners = ([], _CHUNK_OWNERS[1]) if empty_rank0 else _CHUNK_OWNERS
    chunk_counts = tuple(len(o) for o in chunk_owners)
    region_counts = tuple(len(o) for o in _REGION_OWNERS)
    chunk_rows = _variable_rows(chunk_counts, rank)
    region_rows = _variable_rows(region_counts, rank)
    # Single process: sample indices of rank 1 follow those of rank 0 (3 samples per rank).
    chunk_owner = torch.tensor(chunk_owners[0] + [o + 3 for o in chunk_owners[1]])
    region_owner = torch.tensor(_REGION_OWNERS[0] + [o + 3 for o in _REGION_OWNERS[1]])
    region_valid = torch.tensor(_REGION_VALID[0] + _REGION_VALID[1])
    inputs = {
        "chunks": _leaf(_randn(sum(chunk_counts), 4, seed=8)[chunk_rows]),
        "chunk_owner": chunk_owner[chunk_rows] - (3 * rank if rank else 0),
        "regions": _leaf(_randn(sum(region_counts), 4, seed=9)[region_rows]),
        "region_owner": region_owner[region_rows] - (3 * rank if rank else 0),
        "region_valid": region_valid[region_rows],
    }
    if explicit_positives:
        # Chunks of a sample are positive with a subset of their own sample's regions.
        positives = torch.zeros(sum(chunk_counts), sum(region_counts), dtype=torch.bool)
        for c, owner in enumerate(chunk_owner.tolist()):
            own = (region_owner == owner).nonzero().flatten().tolist()
            positives[c, own[: 1 + c % 2]] = True
        inputs["positives"] = positives[chunk_rows, region_rows]
    params = {"log_inv_temperature": _leaf(torch.tensor(math.log(1 / 0.07), dtype=torch.float64))}
    return inputs, params, {"chunks": chunk_rows, "regions": region_rows}


def _local(inputs: Tensors, params: Tensors, gather: bool | None) -> torch.Tensor:
    return local_structure_loss(
        inputs["chunks"],
        inputs["chunk_owner"],
        inputs["regions"],
        inputs["region_owner"],
        temperature=params["log_inv_temperature"].exp().reciprocal(),
        positives=inputs.get("positives"),
        region_valid=inputs["region_valid"],
        gather=gather,
    )


def _make_consistency(rank: int | None):
    rows = _even_rows(rank, 4)
    inputs = {
        "image": _leaf(_randn(8, 5, seed=10)[rows]),
        "edge": _leaf(_randn(8, 5, seed=11)[rows]),
        "valid": torch.tensor([True, False, False, False, True, True, True, False])[rows],
    }
    return inputs, {}, {"image": rows, "edge": rows}


def _consistency(inputs: Tensors, params: Tensors, gather: bool | None) -> torch.Tensor:
    return consistency_loss(inputs["image"], inputs["edge"], valid=inputs["valid"], gather=gather)


def _make_structxlip(rank: int | None, compat: str = "paper"):
    rows = _even_rows(rank, 3)
    local, _, local_rows = _make_local(rank)
    inputs = {
        "image": _leaf(_randn(6, 4, seed=12)[rows]),
        "edge": _leaf(_randn(6, 4, seed=13)[rows]),
        "filtered": _leaf(_randn(6, 4, seed=14)[rows]),
        "edge_valid": torch.tensor([True, True, False, True, False, True])[rows],
        **local,
    }
    module = StructXLIPLoss(compat=compat, gather=None if rank is None else True).double()
    with torch.no_grad():
        if module.structure_logit_scale is not None:
            module.structure_logit_scale.fill_(math.log(12.0))
    params = dict(module.named_parameters())
    if compat == "official":
        # s = 5: the local scale min(s / 0.07, 100) = 71.4 is not clipped, so s has a gradient.
        params["main_log_scale"] = _leaf(torch.tensor(math.log(5.0), dtype=torch.float64))
    inputs["module"] = module  # type: ignore[assignment]  # carried to _structxlip
    return inputs, params, {"image": rows, "edge": rows, "filtered": rows, **local_rows}


def _structxlip(inputs: Tensors, params: Tensors, gather: bool | None) -> torch.Tensor:
    out = inputs["module"](
        image_embeds=inputs["image"],
        edge_embeds=inputs["edge"],
        filtered_text_embeds=inputs["filtered"],
        chunk_embeds=inputs["chunks"],
        chunk_owner=inputs["chunk_owner"],
        region_embeds=inputs["regions"],
        region_owner=inputs["region_owner"],
        edge_valid=inputs["edge_valid"],
        region_valid=inputs["region_valid"],
        logit_scale=params["main_log_scale"].exp() if "main_log_scale" in params else None,
    )
    # Each term is compared through the total and through the sum with distinct weights.
    return out["loss"] + out["structure"] + 2 * out["consistency"] + 3 * out["local"]


# --- FAST-GOAL TSL ------------------------------------------------------------------------


def _make_tsl(rank: int | None, *, span_valid: list[bool] | None = None, weights: bool = False):
    rows = _even_rows(rank, 3)
    inputs = {
        "box": _leaf(_randn(6, 4, seed=15)[rows]),
        "crop": _leaf(_randn(6, 4, seed=16)[rows]),
        "span": _leaf(_randn(6, 4, seed=17)[rows]),
        "sentence": _leaf(_randn(6, 4, seed=18)[rows]),
    }
    if span_valid is not None:
        inputs["span_valid"] = torch.tensor(span_valid)[rows]
    if weights:
        inputs["weights"] = torch.tensor([1.0, 0.5, 2.0, 1.5, 1.0, 0.25], dtype=torch.float64)[rows]
    return inputs, {}, dict.fromkeys(("box", "crop", "span", "sentence"), rows)


def _tsl(inputs: Tensors, params: Tensors, gather: bool | None, form: str = "matrix") -> torch.Tensor:
    return tsl_loss(inputs["box"], inputs["crop"], inputs["span"], inputs["sentence"], form=form,
                    span_valid=inputs.get("span_valid"), weights=inputs.get("weights"), gather=gather)


CASES: dict[str, Case] = {
    "clip": Case(_make_clip, _clip),
    "clip_valid": Case(lambda r: _make_clip(r, [True, False, True, True, False, True, False, False]), _clip),
    "clip_valid_empty_rank": Case(
        lambda r: _make_clip(r, [True, False, True, True, False, False, False, False]), _clip
    ),
    "siglip": Case(_make_siglip, _siglip),
    "siglip_ring": Case(_make_siglip, lambda i, p, g: _siglip(i, p, g, "ring")),
    "longclip": Case(_make_longclip, _longclip),
    "consistency": Case(_make_consistency, _consistency),
    "local": Case(_make_local, _local),
    "local_positives": Case(lambda r: _make_local(r, explicit_positives=True), _local),
    "local_empty_rank": Case(lambda r: _make_local(r, empty_rank0=True), _local),
    "structxlip": Case(_make_structxlip, _structxlip),
    "structxlip_official": Case(lambda r: _make_structxlip(r, "official"), _structxlip),
    "tsl_matrix": Case(_make_tsl, _tsl),
    "tsl_diagonal": Case(_make_tsl, lambda i, p, g: _tsl(i, p, g, "diagonal")),
    # rank 0 keeps one sentence of three, rank 1 two of three
    "tsl_valid_weighted": Case(lambda r: _make_tsl(r, span_valid=[False, True, False, True, False, True],
                                                   weights=True), _tsl),
}


def _grad(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x) if x.grad is None else x.grad.detach()


def _run_case(case: Case, rank: int | None) -> dict:
    inputs, params, _ = case.make(rank)
    loss = case.loss(inputs, params, rank is not None)
    loss.backward()
    return {
        "loss": loss.detach(),
        "input_grads": {
            k: _grad(v) for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.requires_grad
        },
        "param_grads": {k: _grad(v) for k, v in params.items()},
    }


def single_process(name: str) -> dict:
    """The reference: one process, the concatenated batch, no gather."""
    return _run_case(CASES[name], None)


def rows_of(name: str, rank: int) -> dict[str, slice]:
    """Which rows of each global input rank ``rank`` holds in case ``name``."""
    return CASES[name].make(rank)[2]


# --- primitives of losses.distributed ------------------------------------------------------


def _primitives(rank: int) -> dict:
    out: dict = {"world_info": torch.tensor(world_info()), "should_gather": torch.tensor(should_gather(None))}
    x = _leaf(torch.arange(6, dtype=torch.float64).reshape(3, 2) + 10 * rank)
    weights = torch.arange(12, dtype=torch.float64).reshape(6, 2)
    y = gather_with_grad(x)
    (y * weights).sum().backward()
    out["gathered"], out["gathered_grad"] = y.detach(), x.grad
    out["gathered_long"] = gather_with_grad(torch.tensor([rank, rank + 5]))
    # Rank 0 holds no row at all, rank 1 three rows.
    v = _leaf(torch.arange(3 * rank * 2, dtype=torch.float64).reshape(3 * rank, 2) + 1)
    g = gather_variable_with_grad(v)
    (g.tensor * torch.arange(1, 7, dtype=torch.float64).reshape(3, 2)).sum().backward()
    out["variable"], out["variable_grad"] = g.tensor.detach(), v.grad
    out["variable_counts"], out["variable_offsets"] = torch.tensor(g.counts), torch.tensor(g.offsets)
    flags = torch.tensor([True, False, True][: 1 + 2 * rank])
    out["variable_bool"] = gather_variable_with_grad(flags).tensor
    out["sum_over_ranks"] = sum_over_ranks(torch.tensor([rank + 1.0]))
    return out


def _rank_results(rank: int, world: int) -> dict:
    results = {name: _run_case(case, rank) for name, case in CASES.items()}
    results["primitives"] = _primitives(rank)
    return results


def run_two_ranks(folder: str) -> list[dict]:
    """Spawn two gloo processes that run every case; returns each rank's results."""
    return run_ranks(_rank_results, folder, WORLD)


def assert_matches_single_process(name: str, results: list[dict]) -> None:
    """Check case ``name`` of a two-rank run against one process on the whole batch.

    Loss: mean over ranks. Inputs: rank r's gradient / world == the single-process gradient of
    rank r's rows. Shared parameters: mean over ranks of the gradients (DDP) == single-process.
    Every reference gradient must be non-zero, so that a dropped gradient path cannot pass.
    """
    ref = single_process(name)
    mean_loss = sum(r[name]["loss"] for r in results) / WORLD
    torch.testing.assert_close(mean_loss, ref["loss"], rtol=1e-10, atol=1e-12)
    for key, full in ref["input_grads"].items():
        assert full.abs().sum() > 0, f"{name}: reference gradient of {key} is zero"
        for rank, result in enumerate(results):
            rows = rows_of(name, rank)[key]
            torch.testing.assert_close(
                result[name]["input_grads"][key] / WORLD, full[rows], rtol=1e-9, atol=1e-12,
                msg=lambda m, key=key, rank=rank: f"{name}: gradient of {key} on rank {rank}: {m}",
            )
    for key, full in ref["param_grads"].items():
        assert full.abs().sum() > 0, f"{name}: reference gradient of {key} is zero"
        ddp_grad = sum(r[name]["param_grads"][key] for r in results) / WORLD
        torch.testing.assert_close(ddp_grad, full, rtol=1e-9, atol=1e-12)


def siglip_exchanges(rank: int, world: int) -> dict:
    """One rank of ``world``: SigLIP's loss and input gradients with ``exchange="gather"`` and ``"ring"`` on
    its 3 image-text pairs of a ``3 * world`` batch (identity positives); run by ``gloo_ranks.run_ranks``."""
    out = {"world": dist.get_world_size()}  # the process group as it ran, not the argument
    rows = slice(3 * rank, 3 * rank + 3)
    for exchange in ("gather", "ring"):
        image, text = _leaf(_randn(3 * world, 5, seed=11)[rows]), _leaf(_randn(3 * world, 5, seed=12)[rows])
        loss = siglip_loss(image, text, torch.tensor(10.0, dtype=torch.float64),
                           torch.tensor(-4.0, dtype=torch.float64), exchange=exchange)
        loss.backward()
        out[exchange] = {"loss": loss.detach(), "image": image.grad, "text": text.grad}
    return out
