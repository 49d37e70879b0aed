"""Two-process (gloo, CPU) runs of F-CAST's losses against one process on the concatenated batch, with the
conventions of ``two_rank_cases`` (loss: mean over ranks; input gradients / world; DDP-averaged parameter
gradients). Kept in a module of its own so that spawned processes can import it."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gloo_ranks import run_ranks
from losses import TextConditionedAttentionPool, fcast_loss, sample_flair_text_indices
from two_rank_cases import WORLD, Case, _even_rows, _grad, _leaf, _randn

B, K, M, D = 6, 3, 5, 8  # global batch 6: 3 images per rank


def _make(rank: int | None):
    rows = _even_rows(rank, B // WORLD)
    torch.manual_seed(0)
    pool = TextConditionedAttentionPool(D, 2).double()
    mask = torch.ones(B, M, dtype=torch.bool)
    mask[1, 3:] = False
    mask[4, 0] = False
    inputs = {
        "sub": _leaf(_randn(B, K, D, seed=40)[rows]),
        "fine": _leaf(_randn(B, M, D, seed=41)[rows]),
        "coarse": _leaf(_randn(B, D, seed=42)[rows]),
        "long": _leaf(_randn(B, D, seed=43)[rows]),
        "mask": mask[rows],
        "indices": sample_flair_text_indices(B, K, generator=torch.Generator().manual_seed(44)),
        "pool": pool,
    }
    params = {f"pool.{n}": p for n, p in pool.named_parameters()}
    params.update({
        "part_log_scale": _leaf(torch.tensor(math.log(1 / 0.07), dtype=torch.float64)),
        "part_bias": _leaf(torch.tensor(-3.0, dtype=torch.float64)),
        "whole_log_scale": _leaf(torch.tensor(math.log(5.0), dtype=torch.float64)),
        "whole_bias": _leaf(torch.tensor(-2.0, dtype=torch.float64)),
    })
    return inputs, params, {"sub": rows, "fine": rows, "coarse": rows, "long": rows}


def _loss(inputs, params, gather):
    out = fcast_loss(inputs["sub"], inputs["fine"], inputs["coarse"], inputs["long"], inputs["pool"],
                     params["part_log_scale"].exp(), params["part_bias"], params["whole_log_scale"].exp(),
                     params["whole_bias"], fine_mask=inputs["mask"], text_indices=inputs["indices"], gather=gather)
    return out["loss"] + 2 * out["part"] + 3 * out["whole"]  # each level checked through distinct weights


def _keyed_loss(inputs, params, gather):
    """The same with the negatives keyed by a seed: each rank draws only its own rows of the draw one
    process makes on the whole batch."""
    out = fcast_loss(inputs["sub"], inputs["fine"], inputs["coarse"], inputs["long"], inputs["pool"],
                     params["part_log_scale"].exp(), params["part_bias"], params["whole_log_scale"].exp(),
                     params["whole_bias"], fine_mask=inputs["mask"], seed=4242, gather=gather)
    return out["loss"] + 2 * out["part"] + 3 * out["whole"]


CASES = {"fcast": Case(_make, _loss), "fcast_keyed": Case(_make, _keyed_loss)}


def _run(case: Case, rank: int | None) -> dict:
    inputs, params, _ = case.make(rank)
    loss = case.loss(inputs, params, rank is not None)
    loss.backward()
    return {"loss": loss.detach(),
            "input_grads": {k: _grad(v) for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.requires_grad},
            "param_grads": {k: _grad(v) for k, v in params.items()}}


def _rank_results(rank: int, world: int) -> dict:
    out = {name: _run(case, rank) for name, case in CASES.items()}
    out["world"] = torch.tensor(dist.get_world_size())
    return out


def run_two_ranks(folder: str) -> list[dict]:
    """Spawn two gloo processes running every case; each rank's results."""
    return run_ranks(_rank_results, folder, WORLD)


def assert_matches_single_process(name: str, results: list[dict]) -> None:
    """Case ``name`` of a two-rank run against one process on the whole batch (see the module docstring)."""
    assert all(int(r["world"]) == WORLD for r in results)
    ref = _run(CASES[name], None)
    torch.testing.assert_close(sum(r[name]["loss"] for r in results) / WORLD, ref["loss"], rtol=1e-10, atol=1e-12)
    for key, full in ref["input_grads"].items():
        assert full.abs().sum() > 0, f"{name}: reference gradient of {key} is zero"
        for rank, result in enumerate(results):
            rows = CASES[name].make(rank)[2][key]
            torch.testing.assert_close(result[name]["input_grads"][key] / WORLD, full[rows], rtol=1e-9, atol=1e-12)
    for key, full in ref["param_grads"].items():
        assert full.abs().sum() > 0, f"{name}: reference gradient of {key} is zero"
        torch.testing.assert_close(sum(r[name]["param_grads"][key] for r in results) / WORLD, full,
                                   rtol=1e-9, atol=1e-12)
