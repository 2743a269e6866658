"""The MoE values a run builds from its config and groups (the reference GPT's MoE layers):

- :func:`moe_context`: what each layer is given (engine.moe.context);
- :func:`moe_step_groups`: what the once-per-step reduction runs over (engine.moe.stats).

Both take the expert-parallel group explicitly: the default ``NO_EP`` keeps every expert
local (EP 1, on any DP x TP x PP x CP); the expert-parallel engine passes its EP role's group.
"""

from __future__ import annotations

from typing import Optional

from engine.config import Config
from engine.distributed.groups import AxisGroup, ParallelGroups
from engine.moe.context import NO_EP, MoEContext
from engine.moe.stats import MoEStepGroups
from engine.topology import Axis, Role

__all__ = ["moe_context", "moe_step_groups"]


def moe_context(cfg: Config, groups: ParallelGroups, ep_group: AxisGroup = NO_EP) -> MoEContext:
    """The reference GPT's MoE layers' context: CP ranks split each sequence (their counts are
    combined and the grad role averages over them: ``grad_avg`` = cp); the balancing loss is
    scaled like the training loss (``1 / gradient_accumulation_steps``; fp16's loss scale is
    refused with MoE at config time). The TP group and sequence parallelism are the block's
    (``MoEContext.with_tp``)."""
    cp = groups[Axis.CP]
    return MoEContext(ep_group=ep_group, seq_groups=(cp,) if cp.size > 1 else (), grad_avg=cp.size,
                      loss_factor=1.0 / cfg.gradient_accumulation_steps)


def moe_step_groups(cfg: Config, groups: ParallelGroups) -> Optional[MoEStepGroups]:
    """The step-end reduction's groups, or None when the config's model has no MoE layer.
    Counts: summed over the batch role (each rank's counts cover whole sequences, CP already
    combined); loss parts and drops: over the loss role (cp x dp) and TP under sequence
    parallelism; the worst layer and the sums across pipeline stages."""
    if cfg.model is None or cfg.model.moe is None:
        return None
    loss = groups.role(Role.LOSS)
    tokens = (loss,) + ((groups[Axis.TP],) if cfg.tensor_parallel.sequence_parallel and cfg.tp > 1 else ())
    return MoEStepGroups(batch=groups.role(Role.BATCH), tokens=tokens, loss_size=loss.size, pp=groups.role(Role.PP))
