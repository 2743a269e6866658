"""DeepSpeed's ``engine.save_16bit_model(save_dir, save_filename="pytorch_model.bin",
exclude_frozen_parameters=False)``: the model's ``state_dict`` in its training dtype
(bf16 / fp16, or fp32 when neither is enabled), written by rank 0 with ``torch.save``.

Under ZeRO-3 the parameters are gathered over the data-parallel group one bucket (at most
one unit) at a time, copied to host memory on rank 0 and released before the next, so no
device ever holds more than its shards plus one unit; only when
``zero_optimization.stage3_gather_16bit_weights_on_model_save`` is true (otherwise nothing
is written and False is returned, as DeepSpeed; rank 0 says so at WARNING). A weight shared
by several modules is one tensor under each of its names (``torch.load`` gives it back tied).
Every rank must call it. With pipeline or
tensor parallelism the model is spread over ranks: use ``save_checkpoint`` and
:func:`engine.compat.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict` instead.

With expert parallelism (``ep_group``, the EP role's group, of size > 1; default ``NO_EP``) an expert parameter (``Placement.expert``:
this rank's experts stacked along dim 0) is all-gathered over the EP group, one tensor at a
time: EP rank r holds global experts ``[r * E/ep, (r+1) * E/ep)``, so the concatenation in
EP-rank order is the whole ``(E, ...)`` tensor by global expert index, as one process (and a
Hugging Face checkpoint) holds it.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.config import Config
from engine.distributed import comm
from engine.distributed.groups import AxisGroup
from engine.moe.context import NO_EP
from engine.placement import placement_of
from engine.zero.init import GatheredParameters

__all__ = ["save_16bit_model", "consolidated_state_dict"]

logger = logging.getLogger(__name__)


def save_16bit_model(config: Config, module: nn.Module, optimizer: Any, save_dir: str,
                     save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False, *,
                     ep_group: AxisGroup = NO_EP) -> bool:
    _require_whole_model(config, "save_16bit_model")
    path = os.path.join(save_dir, save_filename)
    rank0 = _is_rank0()
    if config.zero.stage == 3 and not config.zero.stage3_gather_16bit_weights_on_model_save:
        if rank0:
            logger.warning("save_16bit_model wrote nothing to %s: at ZeRO-3 the weights are gathered only when "
                           "zero_optimization.stage3_gather_16bit_weights_on_model_save is true (set it, or "
                           "save_checkpoint and convert with engine.compat.zero_to_fp32)", path)
        return False
    state = consolidated_state_dict(config, module, optimizer, exclude_frozen_parameters, ep_group)
    if rank0:
        os.makedirs(save_dir, exist_ok=True)
        torch.save(state, path)
        logger.info("saved the %s model weights to %s", config.precision, path)
    if dist.is_initialized():
        dist.barrier()  # the file exists on return, on every rank
    return True


def consolidated_state_dict(config: Config, module: nn.Module, optimizer: Any, exclude_frozen_parameters: bool,
                            ep_group: AxisGroup = NO_EP) -> Optional[dict]:
    """The whole model's ``state_dict`` in the training dtype on rank 0's host, None on the
    other ranks (``save_16bit_model``'s content; DeepSpeed's
    ``_zero3_consolidated_16bit_state_dict``). A collective over the DP group at stage 3 (every
    rank walks the same buckets in order) and over ``ep_group`` for expert shards."""
    _require_whole_model(config, "a consolidated 16-bit state dict")
    zero3 = optimizer if config.zero.stage == 3 else None
    return _host_state_dict(module, zero3, _is_rank0(), exclude_frozen_parameters, ep_group)


def _require_whole_model(config: Config, what: str) -> None:
    if config.pp > 1 or config.tp > 1:
        raise RuntimeError(f"{what} needs the whole model on each rank, but it is split over "
                           f"pipeline.stages = {config.pp} / tensor_parallel.autotp_size = {config.tp}: call "
                           "save_checkpoint and convert it with engine.compat.zero_to_fp32."
                           "convert_zero_checkpoint_to_fp32_state_dict")


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@torch.no_grad()
def _host_state_dict(module: nn.Module, zero3: Any, rank0: bool, exclude_frozen: bool,
                     ep_group: AxisGroup = NO_EP) -> Optional[dict]:
    """``module.state_dict()`` copied to host memory on rank 0 (None elsewhere). ``zero3``:
    the stage-3 optimizer, whose parameters are gathered one bucket at a time; ``ep_group``:
    expert shards are gathered over it (module docstring)."""
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    entries = [(k, v) for k, v in module.state_dict(keep_vars=True).items() if not (exclude_frozen and k in frozen)]
    keys_of: dict[int, list[str]] = {}
    for k, v in entries:
        keys_of.setdefault(id(v), []).append(k)
    tensors = list({id(v): v for _, v in entries}.values())
    groups = zero3.gather_groups(tensors) if zero3 is not None else [tensors]
    host: dict[int, torch.Tensor] = {}
    for group in groups:
        with GatheredParameters(group):  # whole inside (stage 3), released on exit
            for t in group:
                whole = _all_experts(t, ep_group)  # collective over EP for an expert shard
                if rank0:
                    host[id(t)] = whole.to("cpu", copy=True)
    return {k: host[id(v)] for k, v in entries} if rank0 else None


def _all_experts(t: torch.Tensor, ep_group: AxisGroup) -> torch.Tensor:
    """``t`` itself, or for an expert shard (E/ep, ...) the whole (E, ...) gathered over ``ep_group``."""
    if ep_group.size == 1 or placement_of(t).expert is None:   # on the Parameter itself
        return t.detach()
    out = t.new_empty((t.shape[0] * ep_group.size,) + tuple(t.shape[1:]))
    comm.all_gather(out, t.detach().contiguous(), ep_group)
    return out
