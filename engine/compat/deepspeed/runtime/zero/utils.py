"""``deepspeed.runtime.zero.utils``: ``is_zero_param`` is refused (DeepSpeed tests its
``ds_id`` attribute, which the engine's ZeRO-3 parameters do not carry)."""

from engine.compat.deepspeed._unsupported import unsupported

__all__ = ["is_zero_param"]

is_zero_param = unsupported("deepspeed.runtime.zero.utils.is_zero_param",
                            "the engine's ZeRO-3 parameters carry no ds_id; a parameter partitioned by zero.Init "
                            "has ds_tensor (engine.zero.init.is_partitioned)")
