"""``deepspeed.runtime.dataloader``: :class:`RepeatingLoader` (DeepSpeed's home of it)."""

from engine.compat.deepspeed.utils import RepeatingLoader

__all__ = ["RepeatingLoader"]
