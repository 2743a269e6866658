"""DeepSpeed's Adam optimizers by their own names and constructor signatures, over this
engine's fused AdamW (csrc/adam: the vectorised, multi-threaded CPU kernel, and the CUDA
multi-tensor kernel), for scripts that pass them to ``initialize(optimizer=...)``:

- :class:`DeepSpeedCPUAdam` (``deepspeed.ops.adam.DeepSpeedCPUAdam``): the optimizer
  ZeRO-Offload steps on the host. With ``zero_optimization.offload_optimizer`` and
  ``zero_force_ds_cpu_optimizer`` (default true), a client optimizer must be one of these,
  as in DeepSpeed (:func:`check_offload_client`).
- :class:`FusedAdam` (``deepspeed.ops.adam.FusedAdam``): the same update on any device.

Both keep torch.optim.AdamW's state (``step``, ``exp_avg``, ``exp_avg_sq``), so their state
dicts load into either and into the engine's own optimizer. ``adamw_mode`` / ``adam_w_mode``
false is Adam with L2 weight decay (torch.optim.Adam's update).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from engine.errors import ConfigError
from engine.optim.fused_adamw import FusedAdamW

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "check_offload_client"]


class DeepSpeedCPUAdam(FusedAdamW):
    """``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
    adamw_mode, fp32_optimizer_states)``: DeepSpeed's signature and defaults."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,  # noqa: PLR0913 (DeepSpeed's signature)
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise RuntimeError("DeepSpeedCPUAdam does not support the AMSGrad variant.")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, adam_w_mode=adamw_mode)
        # DeepSpeed's meaning: fp32 moments (True), or moments in the parameters' dtype (False:
        # bf16 moments of bf16 master weights, its bf16_optimizer_states under offload)
        self.state_dtype = torch.float32 if fp32_optimizer_states else None
        self.adamw_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states


class FusedAdam(FusedAdamW):
    """``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
    set_grad_none)``: DeepSpeed's signature and defaults (``set_grad_none`` is torch's
    ``zero_grad(set_to_none=True)`` default and changes nothing here)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,  # noqa: PLR0913 (DeepSpeed's signature)
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, adam_w_mode=adam_w_mode)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none


def check_offload_client(client: torch.optim.Optimizer, offload: bool, force_ds_cpu_optimizer: bool) -> None:
    """DeepSpeed's rule: with ``offload_optimizer`` and ``zero_force_ds_cpu_optimizer`` true
    (its default), a client optimizer must be :class:`DeepSpeedCPUAdam`. Raised on every rank
    (the same config and script everywhere) before any collective."""
    if offload and force_ds_cpu_optimizer and not isinstance(client, DeepSpeedCPUAdam):
        raise ConfigError(
            f"zero_optimization.offload_optimizer is on and the client optimizer is {type(client).__name__}: "
            f"ZeRO-Offload steps a client optimizer on the host, which for most optimizers is slow; pass "
            f"engine.compat.deepspeed.ops.adam.DeepSpeedCPUAdam (the fused CPU kernel), or use the config's optimizer "
            f"section, or set \"zero_force_ds_cpu_optimizer\": false to step {type(client).__name__} on the host anyway")
