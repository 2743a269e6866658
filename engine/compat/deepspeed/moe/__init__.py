"""DeepSpeed's ``deepspeed.moe`` over this engine: ``layer.MoE`` and
``utils.split_params_into_different_moe_groups_for_optimizer`` (docs/moe.md)."""

from engine.compat.deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]
