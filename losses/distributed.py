"""Cross-rank helpers for losses that need the global batch.

A loss that sees negatives from every rank gathers them *with* autograd (``accelerator.gather``
and ``torch.distributed.all_gather`` carry no gradient) and uses the local-loss scheme: local rows
against all gathered columns. The backward of the gather sums, into each rank's local slice, the
gradients that every rank's loss sends to it; DDP then averages parameter gradients over ranks, so
the update equals the one of a single process on the concatenated batch (see
``toolkits-and-datasets.md`` section 3 and open_clip's ``--local-loss --gather-with-grad``).

All helpers are the identity (or a no-op) when no process group of size > 1 is initialised.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

if torch.distributed.is_available():
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_nn_functional

    try:
        import torch.distributed._functional_collectives as functional_collectives
    except ImportError:  # very old torch: fall back to torch.distributed.nn below
        functional_collectives = None
else:  # torch built without distributed support: everything is single-process
    dist = None
    dist_nn_functional = None
    functional_collectives = None


class VariableGather(NamedTuple):
    """Rows gathered from every rank when ranks hold different numbers of rows.

    Attributes:
        tensor: ``(sum(counts), ...)`` rank 0's rows, then rank 1's, ...
        counts: rows contributed by each rank, ``len(counts) == world_size``.
        offsets: first row of each rank's block in ``tensor`` (exclusive cumulative sum of counts).
    """

    tensor: Tensor
    counts: list[int]
    offsets: list[int]


def is_distributed() -> bool:
    """True when a ``torch.distributed`` process group of size > 1 is initialised."""
    return world_info()[1] > 1


def world_info() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` when none is initialised.

    Under Accelerate these equal ``accelerator.process_index`` and ``accelerator.num_processes``.
    """
    if dist is not None and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def should_gather(gather: bool | None) -> bool:
    """Resolve a loss's ``gather`` argument.

    Args:
        gather: ``None`` gathers when a process group of size > 1 is initialised; ``True`` asks for
            gathering (an initialised process group is then required); ``False`` keeps the loss
            local to each rank (each rank's negatives are its own batch only).

    Returns:
        Whether the loss should gather across ranks.

    Raises:
        ValueError: ``gather=True`` without an initialised ``torch.distributed`` process group.
    """
    if gather is None:
        return is_distributed()
    if gather and (dist is None or not dist.is_initialized()):
        raise ValueError(
            "gather=True needs an initialised torch.distributed process group "
            "(Accelerate and torchrun create one); pass gather=None to gather only when one exists"
        )
    return bool(gather)


def _all_gather_autograd(x: Tensor) -> Tensor:
    """Concatenate equal-shaped ``x`` from all ranks along dim 0, backward = sum of slices."""
    gather_single = getattr(functional_collectives, "all_gather_single_autograd", None)
    if gather_single is not None:
        # wait_tensor (differentiable) turns the AsyncCollectiveTensor into a plain tensor.
        return functional_collectives.wait_tensor(gather_single(x.contiguous(), 0, dist.group.WORLD))
    # Older torch: the autograd all-gather of torch.distributed.nn (gloo: all-to-all backward).
    return torch.cat(dist_nn_functional.all_gather(x.contiguous()), dim=0)


def _all_gather_no_grad(x: Tensor) -> Tensor:
    """Concatenate equal-shaped ``x`` (any dtype, no autograd) from all ranks along dim 0."""
    send = x.to(torch.uint8) if x.dtype == torch.bool else x.contiguous()
    parts = [torch.empty_like(send) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, send)
    out = torch.cat(parts, dim=0)
    return out.to(torch.bool) if x.dtype == torch.bool else out


def gather_with_grad(x: Tensor) -> Tensor:
    """All-gather ``x`` along dim 0 from every rank, keeping autograd.

    Args:
        x: ``(B, ...)`` this rank's rows; every rank must pass the same shape (training loaders
            use ``drop_last=True``; use :func:`gather_variable_with_grad` when row counts differ).

    Returns:
        ``(world_size * B, ...)`` rank 0's rows first. Floating tensors keep their graph: the
        backward delivers to this rank's ``x`` the sum of the gradients every rank's loss sends to
        these rows. Integer/bool tensors are gathered without autograd. Identity when not
        distributed.
    """
    if not is_distributed():
        return x
    if x.is_floating_point() or x.is_complex():
        return _all_gather_autograd(x)
    return _all_gather_no_grad(x)


def sum_over_ranks(x: Tensor) -> Tensor:
    """Sum of ``x`` over all ranks, without autograd (for counts and normalisers).

    Args:
        x: a tensor of the same shape on every rank (e.g. a scalar count).

    Returns:
        A new tensor holding the element-wise sum over ranks; a detached copy of ``x`` when not
        distributed.
    """
    out = x.detach().clone()
    if is_distributed():
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def gather_counts(n: int, device: torch.device | str | None = None) -> list[int]:
    """Every rank's value of the integer ``n`` (e.g. its number of rows), rank 0 first.

    ``device`` must be one the backend can communicate on (CUDA for NCCL); ``[n]`` when not
    distributed.
    """
    if not is_distributed():
        return [int(n)]
    counts = _all_gather_no_grad(torch.tensor([n], dtype=torch.long, device=device))
    return [int(c) for c in counts.tolist()]


def gather_variable_with_grad(x: Tensor, counts: list[int] | None = None) -> VariableGather:
    """All-gather ``x`` along dim 0 when ranks hold different numbers of rows.

    Each rank pads its rows to the largest count, the padded blocks are gathered (with autograd
    for floating tensors, like :func:`gather_with_grad`) and the padding is cut away again. Used
    for StructXLIP's regions and chunks, whose number varies per sample and so per rank.

    Args:
        x: ``(n_rank, ...)`` this rank's rows; trailing dims must match across ranks.
        counts: every rank's ``n_rank`` when already known (e.g. from an earlier call on tensors
            with the same rows); exchanged with one small collective otherwise.

    Returns:
        :class:`VariableGather` with ``tensor`` ``(sum(counts), ...)``, ``counts`` and ``offsets``.

    Raises:
        ValueError: ``counts`` has the wrong length or disagrees with ``x.shape[0]`` on this rank.
    """
    rank, world = world_info()
    if counts is None:
        counts = gather_counts(x.shape[0], device=x.device)
    counts = [int(c) for c in counts]
    if len(counts) != world or counts[rank] != x.shape[0]:
        raise ValueError(
            f"counts={counts} does not match this rank ({rank} of {world}) holding {x.shape[0]} rows; "
            "pass the counts returned by gather_variable_with_grad for tensors with the same rows"
        )
    offsets = [sum(counts[:r]) for r in range(world)]
    if world == 1:
        return VariableGather(x, counts, offsets)
    # At least one row so that no rank sends an empty buffer to the collective.
    width = max(max(counts), 1)
    padded = x
    if x.shape[0] < width:
        pad = x.new_zeros((width - x.shape[0], *x.shape[1:]))
        padded = torch.cat([x, pad], dim=0)
    gathered = gather_with_grad(padded)
    blocks = [gathered[r * width : r * width + counts[r]] for r in range(world)]
    return VariableGather(torch.cat(blocks, dim=0), counts, offsets)


class _NeighbourExchange(torch.autograd.Function):
    """One hop of a ring: send to the right (and, bidirectional, to the left) neighbour, receive
    from the left (and right) one, by ``torch.distributed.batch_isend_irecv``. The backward sends
    each received tensor's gradient back to the rank it came from, so a rank's sent tensor gets
    the gradient of every loss that used it."""

    @staticmethod
    def forward(ctx, left: int, right: int, to_right: Tensor, to_left: Tensor | None):  # noqa: D102
        ctx.left, ctx.right, ctx.bidir = left, right, to_left is not None
        ctx.shapes = (to_right.shape, None if to_left is None else to_left.shape)
        from_left = torch.empty_like(to_right)
        ops = [dist.P2POp(dist.isend, to_right.contiguous(), right), dist.P2POp(dist.irecv, from_left, left)]
        if to_left is None:
            _run_p2p(ops)
            return from_left
        from_right = torch.empty_like(to_left)
        ops += [dist.P2POp(dist.isend, to_left.contiguous(), left), dist.P2POp(dist.irecv, from_right, right)]
        _run_p2p(ops)
        return from_left, from_right

    @staticmethod
    def backward(ctx, grad_from_left: Tensor, grad_from_right: Tensor | None = None):  # noqa: D102
        # What came from the left was the left neighbour's ``to_right``: its gradient goes back
        # left, and the gradient of our ``to_right`` arrives from the right (mirror for to_left).
        grad_to_right = grad_from_left.new_empty(ctx.shapes[0])
        ops = [dist.P2POp(dist.isend, grad_from_left.contiguous(), ctx.left),
               dist.P2POp(dist.irecv, grad_to_right, ctx.right)]
        grad_to_left = None
        if ctx.bidir:
            grad_to_left = grad_from_right.new_empty(ctx.shapes[1])
            ops += [dist.P2POp(dist.isend, grad_from_right.contiguous(), ctx.right),
                    dist.P2POp(dist.irecv, grad_to_left, ctx.left)]
        _run_p2p(ops)
        return None, None, grad_to_right, grad_to_left


def _run_p2p(ops: list) -> None:
    for request in dist.batch_isend_irecv(ops):
        request.wait()


def ring_exchange_with_grad(x: Tensor) -> list[tuple[int, Tensor]]:
    """Every other rank's ``x``, passed around the ring by neighbour exchange, with autograd.

    Bidirectional hops (each rank sends to both neighbours and forwards what it received) for
    ``(W - 1) // 2`` hops, plus one unidirectional hop when ``W - 1`` is odd, as the FLAIR and
    open_clip SigLIP code schedule their ring; in that last hop a rank forwards what it received
    (the public FLAIR code re-sends its own tensor there, so some ranks see a block twice and one
    never: not reproduced). Memory holds one block per hop at a time per direction; the backward
    returns each block's gradient to its owner along the same path, so ``x``'s gradient on its
    rank is the sum of what every rank's loss sends to it.

    Args:
        x: this rank's tensor (any shape; every rank must pass the same shape and dtype).

    Returns:
        ``[(source_rank, tensor), ...]``: the ``W - 1`` other ranks' tensors, each exactly once
        (order: by hop, left before right); ``[]`` when not distributed.
    """
    rank, world = world_info()
    if world == 1:
        return []
    left, right = (rank - 1) % world, (rank + 1) % world
    received: list[tuple[int, Tensor]] = []
    from_left = from_right = x
    bidir_hops = (world - 1) // 2
    for hop in range(1, bidir_hops + 1):
        from_left, from_right = _NeighbourExchange.apply(left, right, from_left, from_right)
        received += [((rank - hop) % world, from_left), ((rank + hop) % world, from_right)]
    if (world - 1) % 2:
        from_left = _NeighbourExchange.apply(left, right, from_left, None)
        received.append(((rank - bidir_hops - 1) % world, from_left))
    return received
