"""``deepspeed.runtime``: :mod:`.zero`, :mod:`.pipe`, :mod:`.utils`, :mod:`.config`,
:mod:`.engine`, :mod:`.lr_schedules`, :mod:`.dataloader`, :mod:`.activation_checkpointing`."""

from engine.compat.deepspeed.runtime import (
    activation_checkpointing,
    config,
    dataloader,
    engine,
    lr_schedules,
    pipe,
    utils,
    zero,
)

__all__ = ["zero", "pipe", "utils", "config", "engine", "lr_schedules", "dataloader", "activation_checkpointing"]
