"""The conjugate communication ops of tensor parallelism, as autograd functions.

Each op takes the TP group (an :class:`~engine.distributed.groups.AxisGroup`) as an argument. A
group of one (``NO_TP``, ``AxisGroup.single("tp")``) means no tensor parallelism: every op
is then the identity and never touches ``torch.distributed``, so a model built with
``tp_group=NO_TP`` runs in a process where torch.distributed was never initialised.

The ops come in conjugate pairs (the backward of one is the forward of the other)::

    copy_to_tp_region          fwd: identity               bwd: all-reduce
    reduce_from_tp_region      fwd: all-reduce             bwd: identity
    scatter_to_tp_region       fwd: keep own slice (last)  bwd: all-gather (last dim)
    gather_from_tp_region      fwd: all-gather (last dim)  bwd: keep own slice
    scatter_to_sequence_parallel_region
                               fwd: keep own slice (seq)   bwd: all-gather (seq dim)
    gather_from_sequence_parallel_region
                               fwd: all-gather (seq dim)   bwd: reduce-scatter (seq dim)
    reduce_scatter_to_sequence_parallel_region
                               fwd: reduce-scatter (seq)   bwd: all-gather (seq dim)

Activation layout used by the engine: batch first, ``(B, S, H)``; with sequence
parallelism each TP rank holds the contiguous slice ``(B, S/tp, H)`` of the sequence,
rank r owning positions ``[r*S/tp, (r+1)*S/tp)``. The sequence dim is therefore 1 by
default (``seq_dim`` argument).
"""

from __future__ import annotations

import torch

from engine.distributed import comm
from engine.distributed.groups import AxisGroup

__all__ = [
    "tp_world_size",
    "tp_rank",
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "gather_from_tp_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "split_along_dim",
    "all_gather_along_dim",
    "reduce_scatter_along_dim",
]

SEQ_DIM = 1  # (B, S, H): the sequence dim of the engine's activation layout


def tp_world_size(group: AxisGroup) -> int:
    """TP degree of ``group`` (1: no TP; never calls torch.distributed)."""
    return group.size


def tp_rank(group: AxisGroup) -> int:
    """This rank's index in the TP group."""
    return group.rank


# ---------------------------------------------------------------- plain (non-autograd) helpers

def split_along_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along ``dim`` (no communication)."""
    world = tp_world_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} evenly over {world} TP ranks: "
                         f"make it a multiple of the TP degree (for the sequence dim: seq_len)")
    return x.chunk(world, dim=dim)[tp_rank(group)].contiguous()


def all_gather_along_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order."""
    world = tp_world_size(group)
    if world == 1:
        return x
    # comm.all_gather concatenates along dim 0: move `dim` to the front and back.
    inp = x.movedim(dim, 0).contiguous()                      # (n, ...)
    out = inp.new_empty((world * inp.shape[0],) + tuple(inp.shape[1:]))  # (world*n, ...)
    comm.all_gather(out, inp, group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter_along_dim(x: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's slice along ``dim``."""
    world = tp_world_size(group)
    if world == 1:
        return x
    if x.shape[dim] % world:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {world} TP ranks: "
                         f"make it a multiple of the TP degree (for the sequence dim: seq_len)")
    inp = x.movedim(dim, 0).contiguous()                      # (world*n, ...)
    out = inp.new_empty((inp.shape[0] // world,) + tuple(inp.shape[1:]))  # (n, ...)
    comm.reduce_scatter(out, inp, group)
    return out.movedim(0, dim).contiguous()


def _all_reduce(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    # Out of place: the input may be saved by autograd or be a view of a parameter.
    out = x.contiguous().clone()
    comm.all_reduce(out, group)
    return out


# ---------------------------------------------------------------- autograd functions

class _CopyToRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) the gradient over the TP group.

    Put before a column-parallel matmul: each rank's input gradient is only the part
    flowing through its own weight shard; the true gradient is their sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: all-reduce (sum) over the TP group. Backward: identity.

    Put after a row-parallel matmul: each rank holds a partial sum of the output."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return split_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_along_dim(grad, -1, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's slice of the last dim."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
        ctx.group = group
        return all_gather_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return split_along_dim(grad, -1, ctx.group), None


class _ScatterToSequenceParallel(torch.autograd.Function):
    """Forward: keep this rank's slice of the sequence dim. Backward: all-gather it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return split_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_along_dim(grad, ctx.dim, ctx.group), None, None


class _GatherFromSequenceParallel(torch.autograd.Function):
    """Forward: all-gather the sequence dim. Backward: reduce-scatter the sequence dim.

    Used where a sequence-parallel activation enters a column-parallel matmul: the
    gathered input is consumed by every rank's weight shard, so its gradient is the sum
    over ranks (reduce), of which each rank keeps its own sequence slice (scatter).
    This replaces copy-to-region's backward all-reduce."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return all_gather_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_along_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Forward: reduce-scatter along the sequence dim. Backward: all-gather it.

    Used after a row-parallel matmul under sequence parallelism (replaces
    reduce-from-region's all-reduce: same bytes in the reduction, half the output)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: AxisGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_gather_along_dim(grad, ctx.dim, ctx.group), None, None


# ---------------------------------------------------------------- public functional API

def copy_to_tp_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Forward identity; backward all-reduce of the gradient over ``group``."""
    return x if tp_world_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Forward all-reduce (sum) over ``group``; backward identity."""
    return x if tp_world_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Forward: this rank's slice of the last dim; backward: all-gather of the last dim."""
    return x if tp_world_size(group) == 1 else _ScatterToRegion.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Forward: all-gather of the last dim (rank order); backward: this rank's slice."""
    return x if tp_world_size(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: AxisGroup,
                                        seq_dim: int = SEQ_DIM) -> torch.Tensor:
    """Forward: this rank's slice of ``seq_dim``; backward: all-gather of ``seq_dim``."""
    return x if tp_world_size(group) == 1 else _ScatterToSequenceParallel.apply(x, group, seq_dim)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: AxisGroup,
                                         seq_dim: int = SEQ_DIM) -> torch.Tensor:
    """Forward: all-gather of ``seq_dim``; backward: reduce-scatter (sum) of ``seq_dim``."""
    return x if tp_world_size(group) == 1 else _GatherFromSequenceParallel.apply(x, group, seq_dim)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: AxisGroup,
                                               seq_dim: int = SEQ_DIM) -> torch.Tensor:
    """Forward: reduce-scatter (sum) along ``seq_dim``; backward: all-gather of ``seq_dim``."""
    return x if tp_world_size(group) == 1 else _ReduceScatterToSequenceParallel.apply(x, group, seq_dim)
