"""``deepspeed.comm.comm``: :mod:`engine.compat.comm` (DeepSpeed's signatures over
``torch.distributed``, ``group=None`` the world) and the other public functions of
DeepSpeed 0.19.8's module. Those that are plain torch calls pass through; comms logging
(``configure``, ``log_summary``, ...), DeepSpeed's own backends and mesh helpers are refused
with the reason."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from engine.compat import comm as _comm
from engine.compat.comm import *  # noqa: F403 (re-exported: DeepSpeed's names)
from engine.compat.comm import ProcessGroup, _pg
from engine.compat.deepspeed._unsupported import unsupported

_LOGGING = "DeepSpeed's communication logger is not implemented in this engine (its timers: wall_clock_breakdown)"
_INTERNAL = "a DeepSpeed backend internal; the engine initialises torch.distributed itself (init_distributed)"

__all__ = list(_comm.__all__) + [
    "broadcast_object_list", "all_gather_object", "all_to_all", "gather", "scatter", "batch_isend_irecv", "P2POp",
    "monitored_barrier", "reduce_scatter", "get_world_group", "get_all_ranks_from_group", "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor", "has_all_reduce_coalesced", "has_coalescing_manager", "allgather_fn",
    "reduce_scatter_fn", "configure", "log_summary", "reset_log", "timed_op", "has_comm_data",
    "get_comm_operation_count", "get_logged_comm_ops", "set_backend", "init_deepspeed_backend",
    "initialize_mesh_device", "enable_symm_mem_for_group", "inference_all_reduce", "all_reduce_coalesced",
    "all_gather_coalesced", "mpi_discovery"]

P2POp = dist.P2POp


def broadcast_object_list(object_list: list[Any], src: int, group: ProcessGroup = None, device: Any = None) -> None:
    dist.broadcast_object_list(object_list, src, group=_pg(group), device=device)


def all_gather_object(object_list: list[Any], obj: Any, group: ProcessGroup = None) -> None:
    dist.all_gather_object(object_list, obj, group=_pg(group))


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: ProcessGroup = None, async_op: bool = False) -> Any:
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=_pg(group), async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: Optional[list[torch.Tensor]] = None, dst: int = 0,
           group: ProcessGroup = None, async_op: bool = False) -> Any:
    return dist.gather(tensor, gather_list, dst, group=_pg(group), async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: Optional[list[torch.Tensor]] = None, src: int = 0,
            group: ProcessGroup = None, async_op: bool = False) -> Any:
    return dist.scatter(tensor, scatter_list, src, group=_pg(group), async_op=async_op)


def batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
    return dist.batch_isend_irecv(p2p_op_list)


def monitored_barrier(group: ProcessGroup = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
    return dist.monitored_barrier(group=_pg(group), timeout=timeout, wait_all_ranks=wait_all_ranks)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = dist.ReduceOp.SUM,
                   group: ProcessGroup = None, async_op: bool = False) -> Any:
    return dist.reduce_scatter(output, input_list, op=op, group=_pg(group), async_op=async_op)


def allgather_fn(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup = None,
                 async_op: bool = False, debug: Any = None) -> Any:
    return _comm.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                      group: ProcessGroup = None, async_op: bool = False, prof: bool = False,
                      debug: Any = None) -> Any:
    return _comm.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def get_world_group() -> Any:
    return dist.group.WORLD


def get_all_ranks_from_group(group: ProcessGroup = None) -> list[int]:
    """The global ranks of ``group`` (the world for None), in group-rank order."""
    pg = _pg(group)
    return list(range(dist.get_world_size())) if pg is None else dist.get_process_group_ranks(pg)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return False


def has_coalescing_manager() -> bool:
    return False


configure = unsupported("deepspeed.comm.configure", _LOGGING)
log_summary = unsupported("deepspeed.comm.log_summary", _LOGGING)
reset_log = unsupported("deepspeed.comm.reset_log", _LOGGING)
timed_op = unsupported("deepspeed.comm.timed_op", _LOGGING)
has_comm_data = unsupported("deepspeed.comm.has_comm_data", _LOGGING)
get_comm_operation_count = unsupported("deepspeed.comm.get_comm_operation_count", _LOGGING)
get_logged_comm_ops = unsupported("deepspeed.comm.get_logged_comm_ops", _LOGGING)
set_backend = unsupported("deepspeed.comm.set_backend", _INTERNAL)
init_deepspeed_backend = unsupported("deepspeed.comm.init_deepspeed_backend", _INTERNAL)
mpi_discovery = unsupported("deepspeed.comm.mpi_discovery", _INTERNAL + " (mpirun's variables are read there)")
initialize_mesh_device = unsupported("deepspeed.comm.initialize_mesh_device",
                                     "the engine builds its process groups from the config's layout (engine.distributed.groups)")
enable_symm_mem_for_group = unsupported("deepspeed.comm.enable_symm_mem_for_group", "symmetric memory is not used here")
inference_all_reduce = unsupported("deepspeed.comm.inference_all_reduce", "DeepSpeed-Inference is not implemented here")
all_reduce_coalesced = unsupported("deepspeed.comm.all_reduce_coalesced", "torch has no public coalesced all-reduce "
                                   "(has_all_reduce_coalesced() is False): call all_reduce per tensor")
all_gather_coalesced = unsupported("deepspeed.comm.all_gather_coalesced", "has_coalescing_manager() is False: call "
                                   "all_gather_into_tensor per tensor")
