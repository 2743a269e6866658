"""Optimizers (fused kernels when built, the torch reference otherwise), Muon, and LR schedules."""

from engine.optim.chunked_adam import ChunkedAdam, ChunkedAdamW
from engine.optim.fused_adamw import FusedAdamW
from engine.optim.lion import Lion
from engine.optim.lr_schedules import build_lr_scheduler
from engine.optim.muon import Muon

__all__ = ["ChunkedAdam", "ChunkedAdamW", "FusedAdamW", "Lion", "Muon", "build_lr_scheduler"]
