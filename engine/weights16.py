"""DeepSpeed's ``engine.save_16bit_model(save_dir, save_filename="pytorch_model.bin",
exclude_frozen_parameters=False)``: the model's ``state_dict`` in its training dtype
(bf16 / fp16, or fp32 when neither is enabled), written by rank 0 with ``torch.save``.

Under ZeRO-3 the parameters are gathered over the data-parallel group first, and only when
``zero_optimization.stage3_gather_16bit_weights_on_model_save`` is true (otherwise nothing
is written and False is returned, as DeepSpeed; rank 0 says so at WARNING). Every rank must call it. With pipeline or
tensor parallelism the model is spread over ranks: use ``save_checkpoint`` and
:func:`engine.compat.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict` instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.config import Config

__all__ = ["save_16bit_model"]

logger = logging.getLogger(__name__)


def save_16bit_model(config: Config, module: nn.Module, optimizer: Any, save_dir: str,
                     save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False) -> bool:
    if config.pp > 1 or config.tp > 1:
        raise RuntimeError(f"save_16bit_model needs the whole model on each rank, but it is split over "
                           f"pipeline.stages = {config.pp} / tensor_parallel.autotp_size = {config.tp}: call "
                           "save_checkpoint and convert it with engine.compat.zero_to_fp32."
                           "convert_zero_checkpoint_to_fp32_state_dict")
    path = os.path.join(save_dir, save_filename)
    gather: Any = contextlib.nullcontext()
    if config.zero.stage == 3:
        if not config.zero.stage3_gather_16bit_weights_on_model_save:
            if not dist.is_initialized() or dist.get_rank() == 0:
                logger.warning("save_16bit_model wrote nothing to %s: at ZeRO-3 the weights are gathered only when "
                               "zero_optimization.stage3_gather_16bit_weights_on_model_save is true (set it, or "
                               "save_checkpoint and convert with engine.compat.zero_to_fp32)", path)
            return False
        gather = optimizer.gathered_params()  # collective over the DP group: every rank is here
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    with gather:
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        state = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()
                 if not (exclude_frozen_parameters and k in frozen)} if rank0 else None
    if rank0:
        os.makedirs(save_dir, exist_ok=True)
        torch.save(state, path)
        logger.info("saved the %s model weights to %s", config.precision, path)
    if dist.is_initialized():
        dist.barrier()  # the file exists on return, on every rank
    return True
