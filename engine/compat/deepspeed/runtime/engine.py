"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is the engine's :class:`~engine.engine.Engine`
(what ``deepspeed.initialize`` returns; one class for every layout, pipelines included), and
DeepSpeed's callable types for ``initialize(optimizer=, lr_scheduler=)``."""

from __future__ import annotations

from typing import Callable, Iterable, Union

import torch
from torch.optim.lr_scheduler import LRScheduler

from engine.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine", "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable"]

DeepSpeedOptimizerCallable = Callable[[Union[Iterable[torch.nn.Parameter], dict]], torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], LRScheduler]
