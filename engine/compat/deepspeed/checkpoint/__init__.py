"""``deepspeed.checkpoint``: its ``utils`` (``clone_tensors_for_torch_save``, which accelerate's
``get_state_dict`` and so Hugging Face's ``Trainer.save_model`` import) is here; DeepSpeed's
universal-checkpoint tools (``DeepSpeedCheckpoint``, the reshape and ``ds_to_universal``
modules) are refused with the reason (engine.compat.deepspeed._unsupported), since the engine's
own checkpoints reshape across layouts (engine.checkpoint)."""

from engine.compat.deepspeed.checkpoint import utils
from engine.compat.deepspeed.checkpoint.utils import clone_tensors_for_torch_save

__all__ = ["utils", "clone_tensors_for_torch_save"]
