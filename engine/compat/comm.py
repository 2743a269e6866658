"""The collectives a DeepSpeed script calls through ``deepspeed.comm`` (``dist``), with
DeepSpeed's signatures, over ``torch.distributed`` (the engine's groups are ordinary torch
process groups, so a group from ``mpu`` or from the engine can be passed to them).

Only what DeepSpeed's module offers and torch implements the same way: no comms logging
(``log_summary`` and the profiling switches are not provided).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from engine.compat.api import init_distributed

__all__ = ["ReduceOp", "init_distributed", "is_initialized", "is_available", "get_rank", "get_world_size",
           "get_local_rank", "get_global_rank", "new_group", "barrier", "broadcast", "all_reduce", "reduce",
           "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "send", "recv",
           "isend", "irecv", "destroy_process_group", "get_backend"]

ProcessGroup = Optional[dist.ProcessGroup]


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group: ProcessGroup = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: ProcessGroup = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node, as the launcher gave it."""
    from engine.dist.env import current_launch

    return current_launch().local_rank


def get_global_rank(group: dist.ProcessGroup, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def get_backend(group: ProcessGroup = None) -> str:
    return str(dist.get_backend(group))


def new_group(ranks: list[int], **kwargs: Any) -> Any:
    return dist.new_group(ranks, **kwargs)


def barrier(group: ProcessGroup = None, async_op: bool = False, device_ids: Any = None) -> Any:
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup = None, async_op: bool = False) -> Any:
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: ProcessGroup = None,
               async_op: bool = False) -> Any:
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, group: ProcessGroup = None,
           async_op: bool = False) -> Any:
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup = None,
               async_op: bool = False) -> Any:
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup = None,
                           async_op: bool = False) -> Any:
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: ProcessGroup = None, async_op: bool = False) -> Any:
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: Any = None,
                      input_split_sizes: Any = None, group: ProcessGroup = None, async_op: bool = False) -> Any:
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup = None, tag: int = 0) -> Any:
    return dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group: ProcessGroup = None, tag: int = 0) -> Any:
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: ProcessGroup = None, tag: int = 0) -> Any:
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: ProcessGroup = None, tag: int = 0) -> Any:
    return dist.irecv(tensor, src, group=group, tag=tag)


def destroy_process_group(group: ProcessGroup = None) -> None:
    if group is None:
        from engine.dist.env import shutdown

        shutdown()
    else:
        dist.destroy_process_group(group)
