"""ZeRO stages 0-3 over one data-parallel group.

- :mod:`engine.zero.partition`: pure shard maths (layouts, padding, alignment, buckets).
- :mod:`engine.zero.buckets`: flat buckets and groups (the storage the stages share).
- :mod:`engine.zero.base`: hooks, reduction, the mixed-precision step, norm, state, memory.
- :mod:`engine.zero.stage0` ... :mod:`engine.zero.stage3`: one small class per stage.
- :mod:`engine.zero.init`: :class:`Init` (build a model already partitioned) and
  :class:`GatheredParameters` (gather for reading or modification), DeepSpeed's names.
- :mod:`engine.zero.memory` / :mod:`engine.zero.peak`: the formulas and the measured peak.
- :mod:`engine.zero.offload`: ZeRO-Offload (master shards and optimizer state on the host).

:func:`build_zero_optimizer` picks the stage.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from engine.distributed.groups import AxisGroup, ParallelGroups
from engine.precision.loss_scaler import DynamicLossScaler, StaticLossScaler
from engine.precision.mixed import PrecisionPolicy
from engine.topology import Role
from engine.zero.base import OptimizerFactory, ParamsArg, ZeroOptimizer
from engine.zero.external import register_external_parameter, unregister_external_parameter
from engine.zero.init import GatheredParameters, Init
from engine.zero.offload import NO_OFFLOAD, OffloadOptions
from engine.zero.stage0 import DataParallelOptimizer
from engine.zero.stage1 import Zero1Optimizer
from engine.zero.stage2 import Zero2Optimizer
from engine.zero.stage3 import Zero3Optimizer

__all__ = ["build_zero_optimizer", "ZeroOptimizer", "DataParallelOptimizer", "Zero1Optimizer",
           "Zero2Optimizer", "Zero3Optimizer", "STAGES", "Init", "GatheredParameters", "OffloadOptions",
           "register_external_parameter", "unregister_external_parameter"]

STAGES = {0: DataParallelOptimizer, 1: Zero1Optimizer, 2: Zero2Optimizer, 3: Zero3Optimizer}


def build_zero_optimizer(stage: int, params_or_module: ParamsArg, optimizer_factory: OptimizerFactory,  # noqa: PLR0913 (keyword-only options named as DeepSpeed's zero_optimization keys)
                         groups: Union[ParallelGroups, AxisGroup], *,
                         module: Optional[torch.nn.Module] = None,
                         tied_params: Sequence[torch.nn.Parameter] = (),
                         precision: Optional[PrecisionPolicy] = None,
                         loss_scaler: Union[StaticLossScaler, DynamicLossScaler, None] = None,
                         reduce_bucket_size: int = 500_000_000, overlap_comm: bool = True,
                         alignment: int = 8, clip_grad: float = 0.0,
                         stage3_prefetch_bucket_size: int = 50_000_000,
                         stage3_max_live_parameters: int = 1_000_000_000,
                         stage3_max_reuse_distance: int = 0,
                         stage3_param_persistence_threshold: int = 100_000,
                         role_groups: Mapping[Role, AxisGroup] = MappingProxyType({}),
                         offload: OffloadOptions = NO_OFFLOAD) -> ZeroOptimizer:
    """The ZeRO optimizer for ``stage`` (0-3) over the run's ``groups`` (its DP group; or the
    DP :class:`~engine.distributed.groups.AxisGroup` alone for data parallelism without TP/PP).

    ``params_or_module``: the model, its trainable parameters, or torch-style group dicts
    (extra keys such as ``weight_decay`` become the inner optimizer's group options).
    ``optimizer_factory(param_groups) -> torch.optim.Optimizer`` builds the inner optimizer
    over this rank's fp32 master shard(s), e.g. ``lambda g: torch.optim.AdamW(g, lr=1e-3)``.
    Stage 3 needs the module (``module=`` or as ``params_or_module``) to hook its forward.
    The TP and PP groups are used only for the global gradient norm and the overflow vote;
    the embedding group sums ``tied_params``' gradients across stages. ``role_groups``:
    groups of roles the ``groups`` do not build, e.g. ``{Role.EXPERT_GRAD: group}`` for the
    flat groups of expert-sharded parameters (``Placement.expert``), which are reduced and
    partitioned over it instead of the grad role's group. ``offload``: ZeRO-Offload
    (:mod:`engine.zero.offload`; DeepSpeed's ``offload_optimizer`` / ``offload_param``).
    """
    if stage not in STAGES:
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    common: dict[str, Any] = dict(
        tied_params=tied_params,
        precision=precision, loss_scaler=loss_scaler, reduce_bucket_size=reduce_bucket_size,
        overlap_comm=overlap_comm, alignment=alignment, clip_grad=clip_grad, role_groups=role_groups,
        offload=offload)
    if stage == 3:
        mod = module if module is not None else params_or_module
        if not isinstance(mod, torch.nn.Module):
            raise ValueError("ZeRO stage 3 needs the model: pass module=<the nn.Module> (it hooks the "
                             "forward and backward of each submodule to gather its parameters)")
        return Zero3Optimizer(params_or_module, optimizer_factory, groups, module=mod,
                              prefetch_bucket_size=stage3_prefetch_bucket_size,
                              max_live_parameters=stage3_max_live_parameters,
                              max_reuse_distance=stage3_max_reuse_distance,
                              param_persistence_threshold=stage3_param_persistence_threshold, **common)
    return STAGES[stage](params_or_module, optimizer_factory, groups, **common)
