"""Per-step MoE statistics: accumulated in each layer's training forwards, reduced once per
optimizer step (:func:`moe_step_end`), which also applies the aux-free bias update.

Reported per step (``metrics.jsonl``):

- ``moe_aux_loss``: the balancing term added to the loss (aux_loss_coef * sequence-wise aux +
  z_loss_coef * z-loss, summed over the MoE layers), as the mean over the step's global
  batch: the value whose gradient the layers inject (engine.moe.balancing);
- ``moe_load_imbalance``: max over mean of the step's global assignments per expert, of the
  worst layer (1.0 = perfectly balanced; E / top_k = every token on the same top_k experts);
- ``moe_dropped_tokens``: (token, expert) assignments dropped by the capacity in the step,
  over every rank (only when ``capacity_factor`` is set).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.distributed import comm
from engine.distributed.groups import AxisGroup
from engine.moe.balancing import aux_free_update
from engine.moe.config import AUX_FREE_BIAS_RATE, MoEConfig

if TYPE_CHECKING:  # the layer imports this module
    from engine.moe.layer import MoELayer

__all__ = ["StepAccumulator", "MoEStepGroups", "moe_layers", "moe_step_end", "load_imbalance"]


class StepAccumulator:
    """Sums over a step's training micro-batches on this rank (reset by :meth:`take`)."""

    def __init__(self, num_experts: int, device: Optional[torch.device | str] = None) -> None:
        self.num_experts = num_experts
        self.counts: Optional[torch.Tensor] = None   # (E,) fp32
        self.aux: Optional[torch.Tensor] = None      # 0-dim fp32
        self.dropped: Optional[torch.Tensor] = None  # 0-dim fp32
        self.micro = 0

    def add(self, counts: torch.Tensor, aux: torch.Tensor, dropped: torch.Tensor) -> None:
        if self.counts is None or self.aux is None or self.dropped is None:
            self.counts = torch.zeros(self.num_experts, device=counts.device, dtype=torch.float32)
            self.aux = torch.zeros((), device=counts.device, dtype=torch.float32)
            self.dropped = torch.zeros((), device=counts.device, dtype=torch.float32)
        self.counts += counts.float()
        self.aux += aux.float()
        self.dropped += dropped.float()
        self.micro += 1

    def take(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(counts (E,), aux, dropped, micro-batches) since the last take; zeros if none."""
        z = torch.zeros((), device=device, dtype=torch.float32)
        out = (self.counts if self.counts is not None else torch.zeros(self.num_experts, device=device),
               self.aux if self.aux is not None else z, self.dropped if self.dropped is not None else z.clone(),
               self.micro)
        self.counts = self.aux = self.dropped = None
        self.micro = 0
        return out


@dataclass(frozen=True)
class MoEStepGroups:
    """The groups of the step-end reduction. ``batch``: the ranks holding different
    sequences (the counts are summed over it: each rank's counts already cover its whole
    sequences); ``tokens``: the groups over which the per-rank parts of the losses and the
    dropped counts are summed (the loss role, and TP under sequence parallelism);
    ``loss_size``: the loss role's size (the mean's divisor, with the micro-batches);
    ``pp``: the pipeline stages (each holds its own layers)."""

    batch: AxisGroup
    tokens: tuple[AxisGroup, ...]
    loss_size: int
    pp: AxisGroup


def moe_layers(module: nn.Module) -> list["MoELayer"]:
    """The MoE layers of ``module``, in module order."""
    from engine.moe.layer import MoELayer

    return [m for m in module.modules() if isinstance(m, MoELayer)]


def load_imbalance(counts: torch.Tensor) -> torch.Tensor:
    """max over mean of ``counts`` (E,) (0-dim; 0 when no assignment)."""
    mean = counts.float().mean()
    return torch.where(mean > 0, counts.float().max() / mean.clamp(min=1e-30), torch.zeros_like(mean))


def _sum_over(t: torch.Tensor, groups: Sequence[AxisGroup]) -> torch.Tensor:
    for g in groups:
        comm.all_reduce(t, g)
    return t


def moe_step_end(module: nn.Module, moe: MoEConfig, groups: MoEStepGroups, device: torch.device,
                 train: bool = True) -> dict[str, torch.Tensor]:
    """Reduce the step's statistics of ``module``'s MoE layers, apply the aux-free bias update
    (``train``), and return the step's ``moe_*`` metrics as 0-dim tensors on the device (read
    them on the host when needed). Every rank of the run calls it once per optimizer step,
    whether or not its pipeline stage holds an MoE layer (the PP reduction is collective);
    ``moe``: the model's section (whether a capacity is set decides ``moe_dropped_tokens``)."""
    aux = torch.zeros((), device=device)
    dropped = torch.zeros((), device=device)
    worst = torch.zeros((), device=device)
    for layer in moe_layers(module):
        counts, l_aux, l_drop, micro = layer.stats.take(device)
        counts = _sum_over(counts.clone(), [groups.batch])
        parts = _sum_over(torch.stack([l_aux, l_drop]), groups.tokens)
        if micro:
            aux = aux + parts[0] / (micro * groups.loss_size)
        dropped = dropped + parts[1]
        worst = torch.maximum(worst, load_imbalance(counts))
        if train and micro and layer.moe.load_balancing == "aux_free":
            with torch.no_grad():
                aux_free_update(layer.expert_bias, counts, AUX_FREE_BIAS_RATE)
    sums = _sum_over(torch.stack([aux, dropped]), [groups.pp])
    if groups.pp.size > 1:
        comm.all_reduce(worst, groups.pp, op=dist.ReduceOp.MAX)
    out = {"moe_aux_loss": sums[0], "moe_load_imbalance": worst}
    if moe.capacity_factor is not None:
        out["moe_dropped_tokens"] = sums[1]
    return out
