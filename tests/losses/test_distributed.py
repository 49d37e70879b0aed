"""losses.distributed: single-process behaviour and the collectives on two gloo ranks."""

from __future__ import annotations

import pytest
import torch

from losses.distributed import (
    gather_counts,
    gather_variable_with_grad,
    gather_with_grad,
    is_distributed,
    should_gather,
    sum_over_ranks,
    world_info,
)


def test_single_process_world_is_rank_0_of_1() -> None:
    assert world_info() == (0, 1)
    assert not is_distributed()


def test_should_gather_resolves_none_and_false_without_process_group() -> None:
    assert should_gather(None) is False
    assert should_gather(False) is False


def test_should_gather_true_without_process_group_says_how_to_fix() -> None:
    with pytest.raises(ValueError, match="init_process_group|gather=None"):
        should_gather(True)


def test_gathers_are_identity_in_a_single_process() -> None:
    x = torch.randn(3, 2, requires_grad=True)
    assert gather_with_grad(x) is x
    out = gather_variable_with_grad(x)
    assert out.tensor is x
    assert out.counts == [3] and out.offsets == [0]
    assert gather_counts(7) == [7]


def test_gather_variable_rejects_counts_that_do_not_match_this_rank() -> None:
    with pytest.raises(ValueError, match="counts"):
        gather_variable_with_grad(torch.zeros(3, 2), counts=[2])
    with pytest.raises(ValueError, match="counts"):
        gather_variable_with_grad(torch.zeros(3, 2), counts=[3, 1])


def test_sum_over_ranks_is_a_detached_copy_in_a_single_process() -> None:
    x = torch.tensor([2.0, 3.0], requires_grad=True)
    out = sum_over_ranks(x)
    assert torch.equal(out, x.detach())
    assert not out.requires_grad
    out.add_(1)
    assert torch.equal(x.detach(), torch.tensor([2.0, 3.0]))


@pytest.mark.slow
def test_two_ranks_see_the_world_and_gather_by_default(two_ranks: list[dict]) -> None:
    for rank, result in enumerate(two_ranks):
        p = result["primitives"]
        assert p["world_info"].tolist() == [rank, 2]
        assert bool(p["should_gather"]) is True
        assert p["sum_over_ranks"].tolist() == [3.0]


@pytest.mark.slow
def test_gather_with_grad_concatenates_and_sums_gradients_of_all_ranks(two_ranks: list[dict]) -> None:
    # Rank r holds arange(6).reshape(3, 2) + 10 r; each rank's loss is sum(gathered * W) with
    # W = arange(12).reshape(6, 2), so each rank's rows receive W's block once per rank.
    expected = torch.cat([torch.arange(6.0).reshape(3, 2) + 10 * r for r in range(2)]).double()
    weights = torch.arange(12.0, dtype=torch.float64).reshape(6, 2)
    for rank, result in enumerate(two_ranks):
        p = result["primitives"]
        assert torch.equal(p["gathered"], expected)
        assert torch.equal(p["gathered_grad"], 2 * weights[3 * rank : 3 * rank + 3])
        assert p["gathered_long"].tolist() == [0, 5, 1, 6]


@pytest.mark.slow
def test_gather_variable_handles_an_empty_rank_and_unpads(two_ranks: list[dict]) -> None:
    # Rank 0 holds no row, rank 1 three rows [[1, 2], [3, 4], [5, 6]]; the loss weights are 1..6.
    rows = torch.arange(1.0, 7.0, dtype=torch.float64).reshape(3, 2)
    for rank, result in enumerate(two_ranks):
        p = result["primitives"]
        assert torch.equal(p["variable"], rows)
        assert p["variable_counts"].tolist() == [0, 3]
        assert p["variable_offsets"].tolist() == [0, 0]
        assert p["variable_bool"].tolist() == [True, True, False, True]
        assert p["variable_bool"].dtype == torch.bool
    assert two_ranks[0]["primitives"]["variable_grad"].shape == (0, 2)
    assert torch.equal(two_ranks[1]["primitives"]["variable_grad"], 2 * rows)


@pytest.mark.slow
@pytest.mark.parametrize("world", [4])
def test_ring_exchange_delivers_every_other_rank_once_and_returns_gradients(tmp_path, world: int) -> None:
    """4 processes: one bidirectional hop and one unidirectional hop with distinct neighbours,
    where the FLAIR code re-sends its own tensor (so a rank would see one block twice)."""
    import flair_ranks

    results = flair_ranks.run_exchange(str(tmp_path), world)
    weights = torch.arange(1, 7, dtype=torch.float64).reshape(2, 3)
    for rank, result in enumerate(results):
        assert result["world_size"] == world
        assert sorted(result["sources"].tolist()) == [r for r in range(world) if r != rank]
        for source, block in zip(result["sources"].tolist(), result["blocks"]):
            torch.testing.assert_close(block, torch.arange(6, dtype=torch.float64).reshape(2, 3) + 100 * source)
        # x's gradient on its rank: every other rank's use of it, sent back along the ring
        coefficient = sum(10 * r + rank for r in range(world) if r != rank)
        torch.testing.assert_close(result["grad"], coefficient * weights)


def test_ring_exchange_is_empty_in_a_single_process() -> None:
    from losses import ring_exchange_with_grad

    assert ring_exchange_with_grad(torch.ones(2)) == []
