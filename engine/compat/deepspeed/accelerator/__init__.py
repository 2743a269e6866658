"""``deepspeed.accelerator``: :func:`get_accelerator` (the CUDA accelerator when torch sees a
GPU, else the CPU one, as the engine picks its device), :func:`set_accelerator`,
:func:`is_current_accelerator_supported`, :class:`DeepSpeedAccelerator`."""

from engine.compat.deepspeed.accelerator.real_accelerator import (
    DeepSpeedAccelerator,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = ["get_accelerator", "set_accelerator", "is_current_accelerator_supported", "DeepSpeedAccelerator"]
