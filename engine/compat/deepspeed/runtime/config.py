"""``deepspeed.runtime.config``: :class:`DeepSpeedConfig` (a DeepSpeed JSON config read by the
engine's strict loader, with DeepSpeed's attribute names for what scripts read) and
``DeepSpeedConfigError`` (the engine's :class:`~engine.errors.ConfigError`)."""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional, Union

import torch.distributed as dist

from engine.config import Config, load_config
from engine.errors import ConfigError

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]

DeepSpeedConfigError = ConfigError


class DeepSpeedConfig:
    """DeepSpeed's ``DeepSpeedConfig(config, mpu=None, mesh_device=None)``: ``config`` a JSON
    path or a dict, resolved for the initialised world (1 process before
    ``init_distributed``), with the engine's checks (an unknown key is an error). ``.config``
    is the engine's :class:`~engine.config.Config`; DeepSpeed's attributes below are read from
    it. ``mpu`` / ``mesh_device`` (another layout than the config's) are refused."""

    def __init__(self, config: Union[str, "os.PathLike[str]", Mapping[str, Any]], mpu: Any = None,
                 mesh_device: Any = None) -> None:
        if mpu is not None or mesh_device is not None:
            raise ConfigError("DeepSpeedConfig(mpu=/mesh_device=) is not supported: the engine derives the "
                              "data-parallel size from the config's tensor_parallel / pipeline / context_parallel "
                              "degrees; pass the config alone")
        if isinstance(config, Mapping):
            self._param_dict = dict(config)
        else:
            with open(config) as f:
                self._param_dict = json.load(f)
        initialised = dist.is_initialized()
        self.global_rank = dist.get_rank() if initialised else 0
        self.config: Config = load_config(self._param_dict, world_size=dist.get_world_size() if initialised else 1)
        c = self.config
        self.world_size = c.dp  # DeepSpeed's DeepSpeedConfig.world_size is the data-parallel size
        self.train_batch_size = c.train_batch_size
        self.train_micro_batch_size_per_gpu = c.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = c.gradient_accumulation_steps
        self.steps_per_print = c.steps_per_print
        self.gradient_clipping = c.gradient_clipping
        self.zero_optimization_stage = c.zero.stage
        self.zero_enabled = c.zero.stage > 0
        self.wall_clock_breakdown = c.wall_clock_breakdown
        self.optimizer_name: Optional[str] = None if c.optimizer is None else c.optimizer.type.lower()
        self.scheduler_name: Optional[str] = None if c.scheduler is None else c.scheduler.type

    @property
    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    @property
    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def print(self, name: str) -> None:
        print(f"{name}: {json.dumps(self._param_dict, indent=2, sort_keys=True)}")  # noqa: T201 (DeepSpeed's print)
