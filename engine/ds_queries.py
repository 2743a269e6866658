"""DeepSpeed's engine queries and its manual-accumulation methods, as a mixin of
:class:`engine.engine.Engine` (kept apart so the engine's own file holds its step logic):
``fp16_enabled()``, ``bfloat16_enabled()``, ``bf16_master_weights_and_gradients()``,
``bf16_optimizer_states()``, ``torch_autocast_enabled()`` / ``_dtype()`` /
``_lower_precision_safe_modules()``, ``zero_optimization_stage()``,
``zero_gather_16bit_weights_on_model_save()``, ``world_size`` answer from the config;
``_zero3_consolidated_16bit_state_dict()`` gathers the model's weights on rank 0 (accelerate's
``get_state_dict`` and so HF Trainer's ``save_model`` at ZeRO-3); ``set_gradient_accumulation_boundary`` sets the boundary by hand, as
DeepSpeed's (accelerate calls it before every backward); ``scale``, ``no_sync`` and
``coalesce_grad_reduction`` are refused with the way to do it here."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from engine.config import Config
from engine.moe.context import NO_EP
from engine.precision.autocast import autocast_dtype, lower_precision_safe_classes
from engine.topology import Role
from engine.weights16 import consolidated_state_dict

__all__ = ["DeepSpeedQueries"]


class DeepSpeedQueries:
    config: Config
    module: nn.Module
    optimizer: Any
    groups: Any  # engine.distributed.groups.ParallelGroups, None after destroy()
    _manual_boundary: Optional[bool] = None  # set_gradient_accumulation_boundary's value

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def bf16_master_weights_and_gradients(self) -> bool:
        return self.config.bf16.bf16_master_weights_and_grads

    def bf16_optimizer_states(self) -> bool:
        return self.config.bf16.bf16_optimizer_states

    def fp16_master_weights_and_gradients(self) -> bool:
        return False  # fp16.fp16_master_weights_and_grads is refused by the config

    def torch_autocast_enabled(self) -> bool:
        return self.config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> Optional[torch.dtype]:
        return autocast_dtype(self.config.torch_autocast)

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        """The dotted class names (DeepSpeed's default list when unset)."""
        return [f"{c.__module__}.{c.__name__}" for c in lower_precision_safe_classes(self.config.torch_autocast)]

    def zero_optimization_stage(self) -> int:
        return self.config.zero.stage

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Optional[dict]:
        """DeepSpeed's: the whole model's ``state_dict`` in the training dtype on rank 0's host
        (``None`` on the other ranks), gathered one bucket at a time; ZeRO-3 only, every rank
        must call it (a collective over the data-parallel group)."""
        if self.config.zero.stage != 3:
            raise ValueError("_zero3_consolidated_16bit_state_dict requires ZeRO-3 (zero_optimization.stage = "
                             f"{self.config.zero.stage}): read module.state_dict() instead")
        return consolidated_state_dict(self.config, self.module, self.optimizer, exclude_frozen_parameters,
                                       self._expert_gather_group())

    def _expert_gather_group(self) -> Any:
        """The EP role's group when experts are split over ranks (a whole-model state dict
        gathers their shards over it, by global expert index), else ``NO_EP``."""
        groups = self.groups
        return groups.role(Role.EP) if groups is not None and groups.ep_size > 1 else NO_EP

    @property
    def world_size(self) -> int:
        """All ranks of the job (DeepSpeed's ``engine.world_size``; ``dp_world_size`` is the DP part)."""
        return self.config.world_size

    # DeepSpeed's manual-accumulation methods: the engine owns the step arithmetic
    # (engine/zero/step.py), so each is refused with the way to do it here
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("engine.scale(loss) + loss.backward() is not supported: call engine.backward(loss), "
                                  "which applies the loss scale and 1/gradient_accumulation_steps")

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's manual boundary (accelerate calls it before every backward with its
        sync flag): from now on :meth:`is_gradient_accumulation_boundary` answers
        ``is_boundary`` instead of counting ``step()`` calls, so the backward passes before
        the next ``step()`` that sees ``True`` accumulate locally and that step reduces and
        updates. Each loss is still divided by ``gradient_accumulation_steps`` unless
        ``backward(loss, scale_wrt_gas=False)``, as DeepSpeed."""
        self._manual_boundary = bool(is_boundary)

    def no_sync(self) -> Any:
        raise NotImplementedError("engine.no_sync() is not needed: gradients are reduced only on the accumulation "
                                  "boundary (every gradient_accumulation_steps-th backward)")

    def coalesce_grad_reduction(self) -> Any:
        raise NotImplementedError("engine.coalesce_grad_reduction() is not supported: call backward exactly "
                                  "gradient_accumulation_steps times per step; the reduction runs once, on the last")
