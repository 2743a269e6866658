"""The expert parameters of a model, checked against the run's expert parallelism once, at
assembly (docs/expert_parallel.md).

An expert parameter says what it is in its placement (``Placement.expert``, set with
:func:`engine.placement.set_expert_placement`), which also sets DeepSpeed's attributes
(``allreduce = False``, ``group_name = "ep_size_{EP}"``). This module is the one reader of
those loose attributes: with ``expert_parallel.size`` > 1 a parameter DeepSpeed would treat
as an expert must carry the placement ZeRO, the initial broadcast and the checkpoints read,
and both must agree with ``expert_parallel.size`` (at size 1 an expert parameter without a
placement holds every expert and is reduced like a dense one, which is the same thing). A mismatch would reduce an expert's gradient over the wrong ranks
(silently wrong), so it is refused on every rank before the first collective of the assembly.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from engine.errors import ConfigError
from engine.optim.client import agree_on_error
from engine.placement import expert_group_name, placement_of

__all__ = ["expert_param_problem", "check_expert_params"]


def expert_param_problem(module: nn.Module, ep: int, *, whole_model: bool) -> Optional[str]:
    """What is wrong with ``module``'s expert parameters at expert-parallel size ``ep`` (None:
    nothing). ``whole_model``: ``module`` is the whole model (no pipeline stages), so
    ``ep > 1`` without any expert parameter is an error too."""
    experts = 0
    for name, p in module.named_parameters():
        shard = placement_of(p).expert
        flag = getattr(p, "allreduce", True)  # DeepSpeed's: False on expert parameters
        if shard is None:
            group = getattr(p, "group_name", None)
            if flag is False and group is not None and group != expert_group_name(ep):
                return (f"parameter {name} is an expert parameter of group_name {group!r} but expert_parallel.size is "
                        f"{ep}: set expert_parallel.size to the layer's ep_size (its experts would be reduced over "
                        "the wrong ranks)")
            if flag is False and ep > 1:  # at ep 1 an expert parameter holds every expert: dense
                return (f"parameter {name} has DeepSpeed's allreduce = False (an expert parameter) but no expert "
                        "placement, so the engine cannot tell which experts it holds: build it with "
                        "engine.placement.set_expert_placement(param, ExpertShard(first, count, num_experts), ep)")
            continue
        experts += 1
        if flag is not False:
            return f"parameter {name} has an expert placement but allreduce = {flag!r}: expert parameters set it False"
        if shard.count * ep != shard.num_experts:
            return (f"parameter {name} holds {shard.count} of {shard.num_experts} experts, but expert_parallel.size "
                    f"= {ep} gives each rank {shard.num_experts // ep if shard.num_experts % ep == 0 else '?'}: "
                    "build the model with the run's expert_parallel.size")
        want, have = expert_group_name(ep), getattr(p, "group_name", None)
        if have is not None and have != want:
            return (f"parameter {name} has group_name {have!r} but expert_parallel.size is {ep} "
                    f"(expected {want!r}): build the model with the run's expert_parallel.size")
    if ep > 1 and whole_model and experts == 0:
        return (f"expert_parallel.size = {ep} but the model has no expert parameters (Placement.expert): "
                "remove expert_parallel, or give the model mixture-of-experts layers")
    return None


def check_expert_params(module: nn.Module, ep: int, device: torch.device, *, whole_model: bool) -> None:
    """:func:`expert_param_problem` raised on every rank when any rank has one (collective)."""
    agree_on_error(expert_param_problem(module, ep, whole_model=whole_model), device, ConfigError)
