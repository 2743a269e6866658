"""Optimizers (fused kernels when built, the torch reference otherwise) and LR schedules."""

from engine.optim.fused_adamw import FusedAdamW
from engine.optim.lion import Lion
from engine.optim.lr_schedules import build_lr_scheduler

__all__ = ["FusedAdamW", "Lion", "build_lr_scheduler"]
