"""Two-process (gloo, CPU) runs of GRM's losses against one process on the concatenated batch.

Same scheme and checks as ``two_rank_cases`` (whose ``Case``, ``_run_case`` and
``assert_matches_single_process`` are reused): GRM's cases are registered into its ``CASES`` on
import and run by their own spawn (:func:`run_two_ranks`), so that the shared case list stays
untouched. Rank-side code lives here so that spawned processes can import it.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

import two_rank_cases
from gloo_ranks import run_ranks
from losses import GRMHead, gather_with_grad, grm_loss, token_wise_similarity, vse_hinge_loss
from two_rank_cases import WORLD, Case, Tensors, _even_rows, _leaf, _randn, _run_case


def _make_hinge(rank: int | None, positives: bool = False):
    rows = _even_rows(rank, 4)
    inputs = {"sim": _leaf((_randn(8, 8, seed=40) * 0.3)[rows])}
    if positives:
        # Images 1 (rank 0) and 6 (rank 1) are one image: texts 1 and 6 describe both.
        pos = torch.eye(8, dtype=torch.bool)
        for i in (1, 6):
            pos[i, 1] = pos[i, 6] = True
        inputs["positives"] = pos[rows]
    return inputs, {}, {"sim": rows}


def _hinge(max_violation: bool, anchors: str = "own"):
    def loss(inputs: Tensors, params: Tensors, gather: bool | None) -> torch.Tensor:
        return vse_hinge_loss(
            inputs["sim"], max_violation=max_violation, positives=inputs.get("positives"), anchors=anchors,
            gather=gather,
        )

    return loss


def _make_tokens(rank: int | None):
    rows = _even_rows(rank, 4)
    inputs = {"image": _leaf(_randn(8, 3, 4, seed=41)[rows]), "text": _leaf(_randn(8, 2, 4, seed=42)[rows])}
    return inputs, {}, {"image": rows, "text": rows}


def _from_tokens(inputs: Tensors, params: Tensors, gather: bool | None) -> torch.Tensor:
    """The documented pattern: local images x all ranks' texts (gathered with autograd)."""
    text = gather_with_grad(inputs["text"]) if gather else inputs["text"]
    sim = token_wise_similarity(text, None, inputs["image"], None)
    return vse_hinge_loss(sim, gather=gather)


# Texts: rank 0's are 5 tokens long, rank 1's 3 (the single process pads them to 5).
_TEXT_LENGTHS = [5, 2, 4, 3, 3, 1, 2, 3]


def _make_grm(rank: int | None):
    rows = _even_rows(rank, 4)
    text_rows = rows if rank != 1 else (rows, slice(0, 3))
    width = 5 if rank != 1 else 3
    text_mask = torch.arange(5)[None] < torch.tensor(_TEXT_LENGTHS)[:, None]
    image_mask = torch.ones(8, 6, dtype=torch.bool)
    image_mask[2, 4:] = image_mask[5, 1:] = False
    same = torch.eye(8, dtype=torch.bool)
    same[1, 6] = same[6, 1] = True  # images 1 (rank 0) and 6 (rank 1) are one image (LAPS's anchors)
    torch.manual_seed(0)
    head = GRMHead(4, num_regions=7).double().eval()  # deterministic: Gumbel and Gaussian noise off
    inputs = {
        "image": _leaf(_randn(8, 6, 4, seed=43)[rows]),
        "image_mask": image_mask[rows],
        "text": _leaf(_randn(8, 5, 4, seed=44)[rows][:, :width]),
        "text_mask": text_mask[rows][:, :width],
        "head": head,
        "positives": same[rows],
    }
    return inputs, dict(head.named_parameters()), {"image": rows, "text": text_rows}


def _grm(inputs: Tensors, params: Tensors, gather: bool | None) -> torch.Tensor:
    out = inputs["head"](inputs["image"], inputs["text"], inputs["image_mask"], inputs["text_mask"])
    parts = grm_loss(out.image, out.text, max_violation=True, positives=inputs["positives"], gather=gather)
    # Each part is compared through the total and through a sum with distinct weights.
    names = ("ori", "key", "unc", "recon", "kl", "ent")
    return parts["loss"] + sum((i + 1) * parts[n] for i, n in enumerate(names))


GRM_CASES: dict[str, Case] = {
    "vse_hinge_hardest": Case(_make_hinge, _hinge(True)),
    "vse_hinge_sum": Case(_make_hinge, _hinge(False)),
    "vse_hinge_positives": Case(lambda r: _make_hinge(r, positives=True), _hinge(True)),
    "vse_hinge_positives_sum": Case(lambda r: _make_hinge(r, positives=True), _hinge(False)),
    "vse_hinge_every_positive": Case(lambda r: _make_hinge(r, positives=True), _hinge(True, "positives")),
    "vse_hinge_every_positive_sum": Case(lambda r: _make_hinge(r, positives=True), _hinge(False, "positives")),
    "vse_hinge_from_tokens": Case(_make_tokens, _from_tokens),
    "grm_loss": Case(_make_grm, _grm),
}
two_rank_cases.CASES.update(GRM_CASES)


def _rank_results(rank: int, world: int) -> dict:
    results = {name: _run_case(case, rank) for name, case in GRM_CASES.items()}
    results["world_size"] = dist.get_world_size()
    return results


def run_two_ranks(folder: str) -> list[dict]:
    """Spawn two gloo processes that run every GRM case; returns each rank's results."""
    return run_ranks(_rank_results, folder, WORLD)


assert_matches_single_process = two_rank_cases.assert_matches_single_process
