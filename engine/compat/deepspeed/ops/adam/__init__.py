"""``deepspeed.ops.adam``: :class:`DeepSpeedCPUAdam` and :class:`FusedAdam` with DeepSpeed's
constructor signatures, over the engine's fused AdamW kernel (engine.optim.ds_adam)."""

from engine.optim.ds_adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
