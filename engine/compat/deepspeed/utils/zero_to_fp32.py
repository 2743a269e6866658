"""``deepspeed.utils.zero_to_fp32``: :mod:`engine.compat.zero_to_fp32` (the full fp32 weights
from this engine's checkpoints, by DeepSpeed's function names)."""

from engine.compat.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "convert_zero_checkpoint_to_fp32_state_dict",
           "load_state_dict_from_zero_checkpoint"]
