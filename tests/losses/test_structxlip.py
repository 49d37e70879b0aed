"""losses.structxlip: consistency (eq. 3), local alignment (eqs. 1-2), StructXLIPLoss (eq. 4)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import two_rank_cases
from losses import (
    StructXLIPLoss,
    clip_loss,
    consistency_loss,
    local_structure_loss,
    official_weight_decay,
)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# --- consistency_loss (eq. 3) --------------------------------------------------------------


def test_consistency_loss_hand_computed() -> None:
    # Rows: orthogonal (1 - 0 = 1), identical (0), opposite (2) -> mean 1.
    image = _t([1.0, 0.0], [0.0, 3.0], [2.0, 0.0])
    edge = _t([0.0, 5.0], [0.0, 1.0], [-1.0, 0.0])
    assert consistency_loss(image, edge).item() == pytest.approx(1.0)
    valid = torch.tensor([True, True, False])
    assert consistency_loss(image, edge, valid=valid).item() == pytest.approx(0.5)


def test_consistency_loss_without_valid_rows_is_zero_with_a_graph() -> None:
    image = _randn(3, 4, seed=1).requires_grad_()
    edge = _randn(3, 4, seed=2).requires_grad_()
    loss = consistency_loss(image, edge, valid=torch.zeros(3, dtype=torch.bool))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(edge.grad, torch.zeros_like(edge))


def test_consistency_loss_gradcheck_and_idempotent_normalisation() -> None:
    image = _randn(4, 3, seed=3).requires_grad_()
    edge = _randn(4, 3, seed=4).requires_grad_()
    valid = torch.tensor([True, False, True, True])
    assert torch.autograd.gradcheck(lambda i, e: consistency_loss(i, e, valid=valid), (image, edge))
    torch.testing.assert_close(
        consistency_loss(F.normalize(image, dim=-1), F.normalize(edge, dim=-1)), consistency_loss(image, edge)
    )


def test_consistency_loss_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match="same shape"):
        consistency_loss(torch.randn(3, 4), torch.randn(2, 4))


# --- local_structure_loss (eqs. 1-2) -------------------------------------------------------


def _direct_local(
    chunks: torch.Tensor,
    chunk_owner: list[int],
    regions: torch.Tensor,
    region_owner: list[int],
    temperature: float,
    positives: torch.Tensor | None = None,
    region_valid: list[bool] | None = None,
) -> float:
    """Eqs. 1-2 written per chunk and per sample."""
    cos = F.normalize(chunks, dim=-1) @ F.normalize(regions, dim=-1).T
    valid = region_valid or [True] * len(region_owner)
    per_sample: dict[int, list[float]] = {}
    for c, owner in enumerate(chunk_owner):
        pos = [
            k
            for k in range(len(region_owner))
            if valid[k] and (bool(positives[c, k]) if positives is not None else region_owner[k] == owner)
        ]
        if not pos:
            continue
        numerator = sum(math.exp(cos[c, k].item() / temperature) for k in pos)
        denominator = sum(math.exp(cos[c, j].item() / temperature) for j in range(len(region_owner)) if valid[j])
        per_sample.setdefault(owner, []).append(-math.log(numerator / denominator))
    if not per_sample:
        return 0.0
    return sum(sum(v) / len(v) for v in per_sample.values()) / len(per_sample)


def _local(chunks, chunk_owner, regions, region_owner, **kwargs) -> torch.Tensor:
    return local_structure_loss(
        chunks,
        torch.tensor(chunk_owner, dtype=torch.long),
        regions,
        torch.tensor(region_owner, dtype=torch.long),
        **kwargs,
    )


def test_local_structure_loss_hand_computed() -> None:
    # T = 0.5. Sample 0: chunk [1,0] vs its region [1,0] (logit 2) and the other [0,1] (logit 0)
    # -> a = log(1 + e^-2); chunk [0,1] -> b = log(1 + e^2). Sample 1: chunk [0,1] -> a.
    chunks = _t([1.0, 0.0], [0.0, 1.0], [0.0, 1.0])
    regions = _t([1.0, 0.0], [0.0, 1.0])
    a, b = math.log1p(math.exp(-2)), math.log1p(math.exp(2))
    got = _local(chunks, [0, 0, 1], regions, [0, 1], temperature=0.5)
    assert got.item() == pytest.approx(((a + b) / 2 + a) / 2, rel=1e-12)


def test_local_structure_loss_matches_direct_equations() -> None:
    chunks, regions = _randn(9, 5, seed=5), _randn(11, 5, seed=6)
    chunk_owner = [0, 0, 1, 1, 1, 2, 3, 3, 4]
    region_owner = [0, 0, 0, 1, 2, 2, 3, 3, 3, 5, 5]
    valid = [True, False, True, True, True, True, False, True, True, True, True]
    got = _local(chunks, chunk_owner, regions, region_owner, region_valid=torch.tensor(valid))
    expected = _direct_local(chunks, chunk_owner, regions, region_owner, 0.07, region_valid=valid)
    assert got.item() == pytest.approx(expected, rel=1e-10)


def test_local_structure_loss_explicit_positives_match_direct_equations() -> None:
    chunks, regions = _randn(6, 4, seed=7), _randn(7, 4, seed=8)
    chunk_owner, region_owner = [0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 2, 2]
    positives = torch.zeros(6, 7, dtype=torch.bool)
    positives[0, 0] = positives[1, [1, 2]] = positives[2, 3] = positives[3, 4] = positives[4, 5] = True
    # Chunk 5 has no positive: skipped; chunk 1's positive 2 is invalid: only region 1 counts.
    valid = [True, True, False, True, True, True, True]
    got = _local(
        chunks, chunk_owner, regions, region_owner, positives=positives, region_valid=torch.tensor(valid)
    )
    expected = _direct_local(chunks, chunk_owner, regions, region_owner, 0.07, positives, valid)
    assert got.item() == pytest.approx(expected, rel=1e-10)


def test_local_structure_loss_skips_samples_without_regions_or_chunks() -> None:
    chunks = _t([1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.6, 0.8])
    regions = _t([1.0, 0.0], [0.0, 1.0], [-1.0, 0.2])
    # Sample 2 has a chunk but no region (skipped); sample 3 has a region but no chunk (a negative).
    got = _local(chunks, [0, 0, 1, 2], regions, [0, 1, 3], temperature=0.5)
    expected = _direct_local(chunks, [0, 0, 1, 2], regions, [0, 1, 3], 0.5)
    assert got.item() == pytest.approx(expected, rel=1e-12)
    without_negative = _local(chunks[:3], [0, 0, 1], regions[:2], [0, 1], temperature=0.5)
    assert got.item() != pytest.approx(without_negative.item())


def test_local_structure_loss_with_regions_in_one_sample_only_is_zero() -> None:
    # Sample 1's chunks have no positive and are skipped; sample 0's chunks see only their own
    # regions, so the numerator equals the denominator.
    chunks = _randn(4, 3, seed=9).requires_grad_()
    regions = _randn(3, 3, seed=10).requires_grad_()
    loss = _local(chunks, [0, 0, 1, 1], regions, [0, 0, 0])
    assert loss.item() == pytest.approx(0.0, abs=1e-12)
    loss.backward()
    assert chunks.grad is not None and chunks.grad.abs().max() < 1e-12


def test_local_structure_loss_nothing_valid_is_zero_with_a_graph() -> None:
    chunks = _randn(2, 3, seed=11).requires_grad_()
    regions = _randn(2, 3, seed=12).requires_grad_()
    loss = _local(chunks, [0, 1], regions, [0, 1], region_valid=torch.zeros(2, dtype=torch.bool))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(regions.grad, torch.zeros_like(regions))
    empty = _local(torch.zeros(0, 3, dtype=torch.float64), [], regions, [0, 1])
    assert empty.item() == 0.0


def test_local_structure_loss_gradcheck_with_learnable_temperature() -> None:
    chunks = _randn(4, 3, seed=13).requires_grad_()
    regions = _randn(5, 3, seed=14).requires_grad_()
    log_t = torch.tensor(math.log(0.3), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda c, r, t: _local(c, [0, 0, 1, 2], r, [0, 1, 1, 2, 2], temperature=t.exp()), (chunks, regions, log_t)
    )


def test_local_structure_loss_rejects_bad_inputs() -> None:
    chunks, regions = torch.randn(2, 3), torch.randn(3, 3)
    with pytest.raises(ValueError, match="chunk_owner must be an integer"):
        local_structure_loss(chunks, torch.tensor([0.0, 1.0]), regions, torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match=r"region_owner must be an integer .* shape \(3,\)"):
        local_structure_loss(chunks, torch.tensor([0, 1]), regions, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"positives must be a bool tensor of shape \(2, 3\)"):
        local_structure_loss(
            chunks, torch.tensor([0, 1]), regions, torch.tensor([0, 1, 1]), positives=torch.ones(3, 2, dtype=torch.bool)
        )
    with pytest.raises(ValueError, match="temperature must be > 0"):
        local_structure_loss(chunks, torch.tensor([0, 1]), regions, torch.tensor([0, 1, 1]), temperature=0.0)


# --- official_weight_decay -----------------------------------------------------------------


def test_official_weight_decay_schedule() -> None:
    # warm=1, decay_start=1, decay_end=8: 1 for epochs 0-1, cosine to the floor at epoch 8.
    assert official_weight_decay(0, 0.7) == 1.0
    assert official_weight_decay(1, 0.7) == 1.0
    assert official_weight_decay(4, 0.7) == pytest.approx(0.8833781401, rel=1e-9)  # 0.7+0.15(1+cos(3pi/7))
    assert official_weight_decay(8, 0.4) == pytest.approx(0.4)
    assert official_weight_decay(30, 0.5) == pytest.approx(0.5)
    # Half-way through the decay the cosine is 0: (1 + floor) / 2.
    assert official_weight_decay(5, 0.4, decay_end=9) == pytest.approx(0.7)
    # Linear warm-up when warm > 1.
    assert official_weight_decay(0, 0.4, warm=2, decay_start=2) == 0.5
    with pytest.raises(ValueError, match="epoch"):
        official_weight_decay(-1, 0.4)


# --- StructXLIPLoss (eq. 4) ----------------------------------------------------------------


def _batch(seed: int = 20) -> dict[str, torch.Tensor]:
    return {
        "image_embeds": _randn(4, 5, seed=seed),
        "edge_embeds": _randn(4, 5, seed=seed + 1),
        "filtered_text_embeds": _randn(4, 5, seed=seed + 2),
        "chunk_embeds": _randn(6, 5, seed=seed + 3),
        "chunk_owner": torch.tensor([0, 0, 1, 2, 3, 3]),
        "region_embeds": _randn(7, 5, seed=seed + 4),
        "region_owner": torch.tensor([0, 0, 1, 1, 2, 3, 3]),
        "edge_valid": torch.tensor([True, True, False, True]),
    }


def test_structxlip_loss_paper_defaults() -> None:
    module = StructXLIPLoss()
    assert (module.structure_weight, module.consistency_weight, module.local_weight) == (0.25, 0.1, 0.1)
    assert module.local_temperature == 0.07
    assert module.structure_logit_scale.item() == pytest.approx(math.log(1 / 0.07))
    assert [name for name, _ in module.named_parameters()] == ["structure_logit_scale"]


def test_structxlip_loss_terms_and_weighted_sum() -> None:
    module = StructXLIPLoss().double()
    batch = _batch()
    out = module(**batch)
    assert set(out) == {"structure", "consistency", "local", "loss"}
    valid = batch["edge_valid"]
    scale = 1 / 0.07
    torch.testing.assert_close(
        out["structure"],
        clip_loss(batch["edge_embeds"][valid], batch["filtered_text_embeds"][valid], torch.tensor(scale).double()),
    )
    torch.testing.assert_close(
        out["consistency"], consistency_loss(batch["image_embeds"][valid], batch["edge_embeds"][valid])
    )
    direct_local = _direct_local(
        batch["chunk_embeds"], batch["chunk_owner"].tolist(), batch["region_embeds"], batch["region_owner"].tolist(), 0.07
    )
    assert out["local"].item() == pytest.approx(direct_local, rel=1e-10)
    torch.testing.assert_close(out["loss"], 0.25 * out["structure"] + 0.1 * out["consistency"] + 0.1 * out["local"])


def test_structxlip_loss_trains_its_structure_scale_and_clamps_it() -> None:
    module = StructXLIPLoss(structure_logit_scale_max=2.0).double()
    module(**_batch())["loss"].backward()
    assert module.structure_logit_scale.grad is not None and module.structure_logit_scale.grad != 0
    module.clamp_structure_logit_scale_()
    assert module.structure_logit_scale.item() == 2.0


def test_structxlip_loss_without_local_inputs_has_zero_local_term() -> None:
    batch = {k: v for k, v in _batch().items() if not k.startswith(("chunk", "region"))}
    out = StructXLIPLoss().double()(**batch)
    assert out["local"].item() == 0.0
    torch.testing.assert_close(out["loss"], 0.25 * out["structure"] + 0.1 * out["consistency"])


def test_structxlip_loss_rejects_partial_local_inputs_and_bad_compat() -> None:
    batch = _batch()
    del batch["region_owner"]
    with pytest.raises(ValueError, match="region_owner"):
        StructXLIPLoss().double()(**batch)
    with pytest.raises(ValueError, match="compat"):
        StructXLIPLoss(compat="code")


def test_structxlip_loss_official_compat() -> None:
    module = StructXLIPLoss(compat="official").double()
    assert (module.structure_weight, module.consistency_weight, module.local_weight) == (0.25, 0.001, 0.001)
    assert list(module.parameters()) == []
    batch = _batch()
    with pytest.raises(ValueError, match="logit_scale"):
        module(**batch)
    log_scale = torch.tensor(math.log(33.0), dtype=torch.float64, requires_grad=True)
    out = module(**batch, logit_scale=log_scale.exp())
    valid = batch["edge_valid"]
    torch.testing.assert_close(
        out["structure"],
        clip_loss(batch["edge_embeds"][valid], batch["filtered_text_embeds"][valid], torch.tensor(33.0).double()),
    )
    # min(33 / 0.07, 100) = 100: temperature 0.01.
    direct_local = _direct_local(
        batch["chunk_embeds"], batch["chunk_owner"].tolist(), batch["region_embeds"], batch["region_owner"].tolist(), 0.01
    )
    assert out["local"].item() == pytest.approx(direct_local, rel=1e-9)
    # The structure term uses the detached scale and the local scale is clipped: no gradient.
    (out["structure"] + out["local"]).backward()
    assert log_scale.grad is None or log_scale.grad == 0


# --- two ranks -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    ["consistency", "local", "local_positives", "local_empty_rank", "structxlip", "structxlip_official"],
)
def test_two_ranks_match_one_process_on_the_concatenated_batch(two_ranks: list[dict], case: str) -> None:
    two_rank_cases.assert_matches_single_process(case, two_ranks)
