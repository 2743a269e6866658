"""``deepspeed.checkpoint.utils.clone_tensors_for_torch_save``: what accelerate's
``get_state_dict`` calls on a ZeRO-0/1/2 model's ``state_dict`` before ``torch.save``."""

from __future__ import annotations

from typing import Any, Union

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: Union[str, torch.device] = "cpu") -> Any:
    """``item`` with every tensor in it (nested in lists, tuples and dicts, the container types
    kept) replaced by a detached copy on ``device``: its own storage, so saving it writes no
    view's whole base and later training does not change it. Other values are returned as they are."""
    if torch.is_tensor(item):
        target = torch.device(device)
        return item.detach().clone() if item.device == target else item.detach().to(target)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
