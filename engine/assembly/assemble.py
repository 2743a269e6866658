"""From :class:`engine.parts.ModelParts` to the engine, explicitly and once.

:func:`assemble_engine` is the one place every builder's output goes through: every DP
replica starts from DP rank 0's weights, the ZeRO optimizer is built over the builder's
:class:`~engine.optim.build.OptimizerInputs` (with the TP group when the model is TP-sharded,
the pipeline and embedding groups when it is cut into stages with tied weights), the
pipeline runner over the stage chunks (``pp > 1``), the LR schedule, and the engine from
those typed collaborators.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.nn as nn

from engine.assembly.experts import check_expert_params
from engine.config import Config
from engine.distributed import comm
from engine.distributed.env import DistEnv
from engine.distributed.groups import ParallelGroups
from engine.engine import Engine, Pipeline
from engine.monitor import Monitor
from engine.optim.build import OptimizerInputs, build_engine_optimizer, build_scheduler
from engine.parts import ModelParts
from engine.pipeline.runner import PipelineRunner
from engine.placement import placement_of
from engine.topology import Role
from engine.zero import ZeroOptimizer
from engine.zero.init import is_partitioned

__all__ = ["assemble_engine", "broadcast_from_first_replica"]


def broadcast_from_first_replica(module: nn.Module, groups: ParallelGroups) -> None:
    """Every replica of the weights (the grad role) starts from its first member's weights and
    buffers (as DeepSpeed does from DP rank 0); an expert shard (``Placement.expert``) from the
    first of ITS replicas (the expert-gradient role): expert-parallel ranks hold different experts."""
    dense = groups.role(Role.GRAD)
    experts = groups.role(Role.EXPERT_GRAD) if groups.ep_size > 1 else dense
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            replicas = experts if placement_of(t).expert_sharded else dense
            if replicas.size > 1 and not is_partitioned(t):  # built under engine.zero.Init: already equal slices
                comm.broadcast(t.data, replicas.global_rank_of(0), replicas)


def _pipeline(cfg: Config, parts: ModelParts, groups: ParallelGroups, device: torch.device,
              opt: ZeroOptimizer) -> Optional[Pipeline]:
    """The schedule runner over this rank's chunks (``pp > 1``); None without a pipeline."""
    if cfg.pp == 1:
        return None
    if parts.loss_fn is None:
        raise ValueError("ModelParts for a pipeline need a loss_fn (the last stage's loss)")
    return PipelineRunner(list(parts.chunks), cfg, groups, parts.loss_fn, device=device, dtype=parts.dtype,
                          grads=opt, measure_boundary=parts.measure_boundary)


def assemble_engine(cfg: Config, parts: ModelParts, opt_inputs: OptimizerInputs, client_sched: Any,
                    groups: ParallelGroups, device: torch.device, *, dist_env: Optional[DistEnv],
                    monitor: Optional[Monitor], training_dataloader: Optional[Iterable[Any]] = None) -> Engine:
    """The engine over ``parts`` (see the module docstring). ``client_sched``: DeepSpeed's
    ``lr_scheduler`` argument (a scheduler, a callable ``optimizer -> scheduler`` or None)."""
    check_expert_params(parts.module, groups.ep_size, device, whole_model=cfg.pp == 1)  # before any other collective
    broadcast_from_first_replica(parts.module, groups)
    opt = build_engine_optimizer(cfg, opt_inputs.params, opt_inputs.factory, groups=groups,
                                 tied_params=list(parts.tied), module=parts.module)
    pipeline = _pipeline(cfg, parts, groups, device, opt)
    sched = build_scheduler(cfg, opt, client_sched, client_optimizer=opt_inputs.client)
    return Engine(cfg, parts, opt, device=device, groups=groups, lr_scheduler=sched, pipeline=pipeline,
                  dist_env=dist_env, training_dataloader=training_dataloader, monitor=monitor)
