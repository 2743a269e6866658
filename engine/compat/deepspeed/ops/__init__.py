"""``deepspeed.ops``: the op families this engine provides under DeepSpeed's names
(``ops.adam``: :class:`DeepSpeedCPUAdam`, :class:`FusedAdam`)."""

from engine.compat.deepspeed.ops import adam

__all__ = ["adam"]
