"""``deepspeed.moe.utils``: telling expert parameters apart for the optimizer.

An expert parameter carries ``allreduce = False`` and ``group_name = "ep_size_{ep}"``
(:class:`engine.compat.deepspeed.moe.layer.MoE` and :class:`engine.moe.layer.MoELayer` set
them, as DeepSpeed's experts do).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple, Union

import torch

__all__ = ["is_moe_param", "split_params_into_shared_and_expert_params",
           "split_params_into_different_moe_groups_for_optimizer", "is_moe_param_group"]


def is_moe_param(param: torch.Tensor) -> bool:
    """An expert parameter (``allreduce`` present and False)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(
        params: List[torch.nn.Parameter]) -> Tuple[List[torch.nn.Parameter], List[torch.nn.Parameter]]:
    """``(shared, expert)`` parameters of ``params``, in order."""
    shared = [p for p in params if not is_moe_param(p)]
    expert = [p for p in params if is_moe_param(p)]
    return shared, expert


def is_moe_param_group(param_group: Dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def _chunks(params: List[torch.nn.Parameter], max_size: Union[int, float]) -> List[List[torch.nn.Parameter]]:
    """``params`` cut, in order, into runs of at most ``max_size`` elements (a larger parameter
    alone in its run). As DeepSpeed's, a parameter larger than ``max_size`` first closes the
    current run even when it is empty: an empty group precedes it (torch optimizers accept one)."""
    runs: List[List[torch.nn.Parameter]] = []
    current: List[torch.nn.Parameter] = []
    size = 0
    for p in params:
        n = int(getattr(p, "ds_numel", p.numel()))
        if size + n > max_size:
            runs.append(current)
            current, size = [], 0
        current.append(p)
        size += n
    if current:
        runs.append(current)
    return runs


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: Union[Dict[str, Any], Tuple[Dict[str, Any], ...], List[Dict[str, Any]]],
        max_group_size: Union[int, float] = 178956971) -> List[Dict[str, Any]]:
    """DeepSpeed's signature and result: every group keeps its non-expert parameters, and for
    each group and each expert ``group_name`` a new group is appended with the group's options,
    ``"name": group_name``, ``"moe": True`` and that group's expert parameters (cut into runs of
    at most ``max_group_size`` elements; None: one group). Each input group needs a ``"name"``
    (DeepSpeed indexes by it)."""
    if isinstance(param_groups, tuple):
        groups = list(param_groups)
    elif isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, list):
        groups = param_groups
    else:
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for g in groups:
        if "name" not in g:
            raise ValueError("split_params_into_different_moe_groups_for_optimizer: every parameter group needs a "
                             "'name' (e.g. {'params': model.parameters(), 'name': 'parameters'}), as in DeepSpeed")
    names = sorted({p.group_name for g in groups for p in g["params"] if is_moe_param(p)})
    expert_groups: List[Dict[str, Any]] = []
    for g in groups:
        params = list(g["params"])
        for name in names:
            mine = [p for p in params if is_moe_param(p) and p.group_name == name]
            runs = _chunks(mine, max_group_size) if max_group_size is not None else [mine]
            expert_groups += [{**g, "name": name, "moe": True, "params": run} for run in runs]
        g["params"] = [p for p in params if not is_moe_param(p)]
    return groups + expert_groups
