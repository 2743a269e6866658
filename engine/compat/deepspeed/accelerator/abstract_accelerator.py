"""``deepspeed.accelerator.abstract_accelerator.DeepSpeedAccelerator``: the engine's two
accelerators (CPU and CUDA) share this base (see :mod:`engine.compat.deepspeed.accelerator.real_accelerator`)."""

from engine.compat.deepspeed.accelerator.real_accelerator import DeepSpeedAccelerator

__all__ = ["DeepSpeedAccelerator"]
