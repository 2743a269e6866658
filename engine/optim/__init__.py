"""Optimizers (fused kernels when built, the torch reference otherwise) and LR schedules."""

from engine.optim.fused_adamw import FusedAdamW

__all__ = ["FusedAdamW"]
