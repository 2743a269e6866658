"""What a checkpoint reads and writes of an engine: the typed boundary.

:func:`~engine.checkpoint.save_checkpoint` and :func:`~engine.checkpoint.load_checkpoint`
take any object with this shape (``engine.Engine`` is one) and use only:

- ``config`` (the layout and the checkpoint options), ``module`` (parameter names, the
  model's own values), ``device`` and ``groups`` (this rank's coordinates);
- ``optimizer.shard_view()``: ZeRO's export of this rank's shards (pieces, ownership,
  master weights, element-wise and scalar optimizer state) and the way to load them back
  (:class:`~engine.zero.shard_view.ShardView`);
- ``training_state()``: the engine's counters, RNG states, LR schedule, loss scaler, data
  position and FP8 scaling state with ``state_dict`` / ``load_state_dict``
  (:class:`~engine.training_state.TrainingState`, PyTorch DCP's ``Stateful`` protocol).

Nothing else of the engine or of ZeRO is touched.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.nn as nn

from engine.config import Config
from engine.distributed.groups import ParallelGroups
from engine.training_state import TrainingState
from engine.zero.shard_view import ShardView

__all__ = ["Checkpointable", "ShardedOptimizer"]


class ShardedOptimizer(Protocol):
    """An optimizer that exports its shards (``engine.zero.ZeroOptimizer``)."""

    def shard_view(self) -> ShardView: ...


class Checkpointable(Protocol):
    """See the module docstring."""

    @property
    def config(self) -> Config: ...

    @property
    def module(self) -> nn.Module: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def groups(self) -> Optional[ParallelGroups]: ...

    @property
    def optimizer(self) -> ShardedOptimizer: ...

    @property
    def global_steps(self) -> int: ...

    def training_state(self) -> TrainingState: ...
