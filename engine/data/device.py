"""Moving a batch to the engine's device, whatever its structure.

A micro-batch from the engine's DataLoader (or the user's) may be a tensor, a tuple/list,
a dict, a dataclass (``engine.data.Batch``) or a namedtuple, nested. Every tensor in it
goes to the engine's device before the module sees it; nothing here names ``cpu`` or
``cuda``. ``non_blocking=True``: from pinned host memory (the engine's DataLoader pins
when the device is a GPU) the copy overlaps with compute; from pageable memory it is
simply synchronous, so it is always safe.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["move_to_device"]


def move_to_device(x: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """``x`` with every tensor inside it on ``device`` (containers rebuilt, other leaves kept)."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=non_blocking)
    if isinstance(x, dict):
        return type(x)((k, move_to_device(v, device, non_blocking)) for k, v in x.items())
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(move_to_device(v, device, non_blocking) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(move_to_device(v, device, non_blocking) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        changes = {f.name: move_to_device(getattr(x, f.name), device, non_blocking)
                   for f in dataclasses.fields(x) if f.init}
        return dataclasses.replace(x, **changes)
    return x
