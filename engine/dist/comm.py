"""Typed wrappers for the collectives the engine uses.

One place to adapt to torch's collective API (``*_single`` names replaced the
``*_tensor`` ones), to check shapes before a collective (a shape mismatch otherwise
hangs or corrupts silently on some backends), and to keep the group an explicit
argument. No hidden device syncs: async calls return the ``Work`` handle.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "group_size", "group_rank"]

ProcessGroup = Optional[dist.ProcessGroup]


def group_size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    return dist.get_rank(group)


def all_reduce(t: torch.Tensor, group: ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM,
               async_op: bool = False):
    """In place; a no-op on a group of one."""
    if group_size(group) == 1:
        return None
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup,
                   op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False):
    """``out`` (N,) <- this rank's slice of the reduction of ``inp`` (world*N,) along dim 0."""
    world = group_size(group)
    if inp.shape[0] != out.shape[0] * world or inp.shape[1:] != out.shape[1:]:
        raise ValueError(f"reduce_scatter: input {tuple(inp.shape)} must be {world} x output {tuple(out.shape)} along dim 0")
    if world == 1:
        out.copy_(inp)
        return None
    return dist.reduce_scatter_single(out, inp, op=op, group=group, async_op=async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    """``out`` (world*N, ...) <- concatenation along dim 0 of every rank's ``inp`` (N, ...)."""
    world = group_size(group)
    if out.shape[0] != inp.shape[0] * world or out.shape[1:] != inp.shape[1:]:
        raise ValueError(f"all_gather: output {tuple(out.shape)} must be {world} x input {tuple(inp.shape)} along dim 0")
    if world == 1:
        out.copy_(inp)
        return None
    return dist.all_gather_single(out, inp, group=group, async_op=async_op)


def broadcast(t: torch.Tensor, src: int, group: ProcessGroup, async_op: bool = False):
    """``src`` is a GLOBAL rank, as in torch.distributed."""
    if group_size(group) == 1:
        return None
    return dist.broadcast(t, src=src, group=group, async_op=async_op)
