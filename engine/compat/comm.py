"""The collectives a DeepSpeed script calls through ``deepspeed.comm`` (``dist``), with
DeepSpeed's signatures, over ``torch.distributed``. A group is a torch process group (from
``mpu`` or a script), an engine :class:`~engine.distributed.groups.AxisGroup` (converted here), or
``None``, which means the world as in DeepSpeed: this module is the DeepSpeed edge, the
one place in ``engine`` where ``group=None`` keeps torch's meaning.

Only what DeepSpeed's module offers and torch implements the same way: no comms logging
(``log_summary`` and the profiling switches are not provided).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from engine.compat.api import init_distributed
from engine.distributed.groups import AxisGroup

__all__ = ["ReduceOp", "init_distributed", "is_initialized", "is_available", "get_rank", "get_world_size",
           "get_local_rank", "get_global_rank", "new_group", "barrier", "broadcast", "all_reduce", "reduce",
           "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "send", "recv",
           "isend", "irecv", "destroy_process_group", "get_backend"]

ProcessGroup = Union[AxisGroup, dist.ProcessGroup, None]  # None: the world (DeepSpeed's meaning)


def _pg(group: ProcessGroup) -> Optional[dist.ProcessGroup]:
    """torch's spelling of ``group`` (None stays the world)."""
    if isinstance(group, AxisGroup):
        if group.size == 1:
            raise ValueError(f"the {group.name} AxisGroup has size 1 and no communicator: a collective over it is "
                             "the identity; skip the call (or use engine.distributed.comm, whose ops do)")
        return group.process_group
    return group


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: ProcessGroup = None) -> int:
    if isinstance(group, AxisGroup):
        return group.rank
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: ProcessGroup = None) -> int:
    if isinstance(group, AxisGroup):
        return group.size
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node, as the launcher gave it."""
    from engine.distributed.env import current_launch

    return current_launch().local_rank


def get_global_rank(group: Union[AxisGroup, dist.ProcessGroup], group_rank: int) -> int:
    if isinstance(group, AxisGroup):
        return group.global_rank_of(group_rank)
    return dist.get_global_rank(group, group_rank)


def get_backend(group: ProcessGroup = None) -> str:
    return str(dist.get_backend(_pg(group)))


def new_group(ranks: list[int], **kwargs: Any) -> Any:
    return dist.new_group(ranks, **kwargs)


def barrier(group: ProcessGroup = None, async_op: bool = False, device_ids: Any = None) -> Any:
    return dist.barrier(group=_pg(group), async_op=async_op, device_ids=device_ids)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup = None, async_op: bool = False) -> Any:
    return dist.broadcast(tensor, src, group=_pg(group), async_op=async_op)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: ProcessGroup = None,
               async_op: bool = False) -> Any:
    return dist.all_reduce(tensor, op=op, group=_pg(group), async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: ProcessGroup = None,
           async_op: bool = False) -> Any:
    return dist.reduce(tensor, dst, op=op, group=_pg(group), async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup = None,
               async_op: bool = False) -> Any:
    return dist.all_gather(tensor_list, tensor, group=_pg(group), async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup = None,
                           async_op: bool = False) -> Any:
    return dist.all_gather_into_tensor(output_tensor, tensor, group=_pg(group), async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: ProcessGroup = None, async_op: bool = False) -> Any:
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=_pg(group), async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: Any = None,
                      input_split_sizes: Any = None, group: ProcessGroup = None, async_op: bool = False) -> Any:
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=_pg(group),
                                  async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup = None, tag: int = 0) -> Any:
    return dist.send(tensor, dst, group=_pg(group), tag=tag)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group: ProcessGroup = None, tag: int = 0) -> Any:
    return dist.recv(tensor, src, group=_pg(group), tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup = None, tag: int = 0) -> Any:
    return dist.isend(tensor, dst, group=_pg(group), tag=tag)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: ProcessGroup = None, tag: int = 0) -> Any:
    return dist.irecv(tensor, src, group=_pg(group), tag=tag)


def destroy_process_group(group: ProcessGroup = None) -> None:
    if group is None:
        from engine.distributed.env import shutdown

        shutdown()
    else:
        dist.destroy_process_group(_pg(group))
