"""Per-parameter tags that say how a parameter is laid out across TP and PP ranks.

Gradient-norm computation and ZeRO partitioning read these so that every element of the
unsharded model is counted exactly once:

- ``tp_sharded`` (bool): the parameter is a slice of a larger tensor split over the TP
  group (``tp_partition_dim`` says along which dim). Replicated parameters (norm weights,
  row-parallel biases) are identical on every TP rank and count once per TP group.
- ``tied_copy`` (bool): this parameter is a duplicate of a tied weight held on another
  pipeline stage (the LM head on the last stage tied to the first stage's embedding);
  it is kept identical via the embedding group and not counted again.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["set_tp_attrs", "is_tp_sharded", "tp_partition_dim", "mark_tied_copy", "is_tied_copy"]


def set_tp_attrs(param: torch.Tensor, sharded: bool, partition_dim: Optional[int] = None) -> None:
    param.tp_sharded = bool(sharded)  # type: ignore[attr-defined]  # attributes on tensors: torch allows them, its stubs do not
    param.tp_partition_dim = partition_dim if sharded else None  # type: ignore[attr-defined]  # attributes on tensors: torch allows them, its stubs do not


def is_tp_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tp_sharded", False))


def tp_partition_dim(param: torch.Tensor) -> Optional[int]:
    return getattr(param, "tp_partition_dim", None)


def mark_tied_copy(param: torch.Tensor) -> None:
    param.tied_copy = True  # type: ignore[attr-defined]  # attributes on tensors: torch allows them, its stubs do not


def is_tied_copy(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tied_copy", False))
