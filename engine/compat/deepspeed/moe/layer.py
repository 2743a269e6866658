"""``deepspeed.moe.layer.MoE`` over this engine: DeepSpeed 0.19.8's signature, parameter names
and return value, so a DeepSpeed MoE script runs with only its import changed.

    MoE(hidden_size, expert, num_experts=1, ep_size=1, k=1, capacity_factor=1.0,
        eval_capacity_factor=1.0, min_capacity=4, use_residual=False, noisy_gate_policy=None,
        drop_tokens=True, use_rts=True, use_tutel=False, enable_expert_tensor_parallelism=False,
        top2_2nd_expert_sampling=True)
    forward(hidden_states, used_token=None) -> (output, l_aux, exp_counts)

What it computes (DeepSpeed's gating, ``deepspeed/moe/sharded_moe.py``): the gate
``deepspeed_moe.gate.wg`` (E, H) in fp32, softmax; top-1: each token's argmax expert (with
``noisy_gate_policy="RSample"`` the argmax of Gumbel-noised logits; ``"Jitter"`` multiplies the
gate's input by U(1-1e-2, 1+1e-2) in training), ``l_aux = E * sum_e mean(gates)_e * frac_e``;
top-2: the argmax, then the argmax of the other logits (Gumbel-noised when
``top2_2nd_expert_sampling``), weights renormalised over the two,
``l_aux = E^2 * mean_e(mean(gates)_e * frac1_e)``. Capacity with ``drop_tokens``:
``max(ceil(tokens / E * capacity_factor * k), min_capacity)`` per expert (the eval factor in
eval mode); top-1 keeps, per expert, the ``capacity`` tokens of highest priority (``torch.topk``
over the expert's column: random priorities with ``use_rts``, from another random stream than
DeepSpeed's; the 0/1 mask itself without, as DeepSpeed); top-2 keeps first choices before second
ones, in token order, and renormalises each token's weights over its kept choices (DeepSpeed's). Without
``drop_tokens`` nothing is dropped. ``exp_counts`` (E,) int64: assignments per expert before
dropping. ``use_residual``: DeepSpeed's Residual MoE (``output * c0 + mlp(x) * c1``, ``c`` a
softmax of ``coefficient`` (H -> 2)).

Expert parameters: ``deepspeed_moe.experts.deepspeed_experts.{j}.*`` are ``num_experts /
ep_size`` deep copies of ``expert`` (as DeepSpeed: identical at start), tagged ``allreduce =
False``, ``group_name = "ep_size_{ep_size}"``; with ``ep_size > 1`` also placed as expert
shards (engine.placement) of global experts ``[ep_rank * E/ep, ...)``. The EP group is ranks
``[r - r % ep_size, ... + ep_size)`` of the world (DeepSpeed's layout), made when the layer is
built (every rank builds the same layers in the same order). Refused (ValueError):
``k > 2`` (DeepSpeed's generic top-k gate), ``use_tutel`` and
``enable_expert_tensor_parallelism`` (no tensor-parallel experts here).
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from engine.distributed.groups import AxisGroup
from engine.distributed.strict import host_sync_allowed
from engine.moe.context import NO_EP
from engine.moe.dispatch import dispatch_compute_combine
from engine.placement import ExpertShard, placement_of, set_placement

__all__ = ["MoE"]

_JITTER_EPS = 1e-2


def _expert_parallel_group(ep_size: int) -> AxisGroup:
    """This rank's EP group: ``ep_size`` consecutive ranks (every rank makes every group)."""
    if ep_size == 1:
        return NO_EP
    if not dist.is_initialized():
        raise RuntimeError(f"MoE(ep_size={ep_size}) needs torch.distributed initialised (deepspeed.init_distributed) "
                           "before the model is built")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % ep_size:
        raise ValueError(f"MoE: ep_size {ep_size} must divide the world size {world}")
    mine = None
    for start in range(0, world, ep_size):
        ranks = list(range(start, start + ep_size))
        handle = dist.new_group(ranks)
        if rank in ranks:
            mine = AxisGroup("ep", tuple(ranks), rank - start, handle)
    assert mine is not None
    return mine


class _Gate(nn.Module):
    """DeepSpeed's ``TopKGate``: ``wg`` (E, H) fp32, and the routing (module docstring)."""

    def __init__(self, hidden: int, num_experts: int, k: int, capacity_factor: float, eval_capacity_factor: float,
                 min_capacity: int, noisy_gate_policy: Optional[str], drop_tokens: bool, use_rts: bool,
                 top2_2nd_expert_sampling: bool) -> None:
        super().__init__()
        self.wg = nn.Linear(hidden, num_experts, bias=False).float()
        self.k, self.num_experts = k, num_experts
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts, self.second_sampling = drop_tokens, use_rts, top2_2nd_expert_sampling

    def forward(self, x: torch.Tensor, used_token: Optional[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` (S, H) -> ``l_aux``, ``experts`` (S, k) int64, ``weights`` (S, k) fp32 (0 where
        dropped), ``exp_counts`` (E,) int64."""
        x = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * torch.empty_like(x).uniform_(1.0 - _JITTER_EPS, 1.0 + _JITTER_EPS)
        logits = self.wg(x)                                              # (S, E)
        gates = F.softmax(logits, dim=1)
        e = self.num_experts
        first_scores = gates
        if self.k == 1 and self.noisy_gate_policy == "RSample":
            first_scores = logits + _gumbel(logits)
        first = first_scores.argmax(dim=1)
        mask1 = F.one_hot(first, e)
        if used_token is not None:
            mask1 = mask1 * used_token.view(-1, 1).to(mask1.dtype)
        me, ce = gates.mean(0), mask1.float().mean(0)
        if self.k == 1:
            l_aux = (me * ce).sum() * e
            experts, masks = first.unsqueeze(1), [mask1]
        else:
            l_aux = (me * ce).mean() * e * e
            second_logits = logits + _gumbel(logits) if self.second_sampling else logits
            second = second_logits.masked_fill(mask1.bool(), float("-inf")).argmax(dim=1)
            mask2 = F.one_hot(second, e)
            experts, masks = torch.stack([first, second], 1), [mask1, mask2]
        exp_counts = torch.stack(masks).sum((0, 1)).detach()               # (E,) before dropping
        keep = self._keep(gates, masks) if self.drop_tokens else torch.ones(experts.shape, device=x.device)
        if self.k == 1:
            weights = (gates * mask1).sum(1, keepdim=True) * keep
        else:  # renormalised over the KEPT choices (a token whose first choice was dropped weighs its second 1)
            g = torch.stack([(gates * mask1).sum(1), (gates * mask2).sum(1)], 1) * keep
            weights = g / g.sum(1, keepdim=True).clamp(min=torch.finfo(g.dtype).eps)
        return l_aux, experts, weights, exp_counts

    def _keep(self, gates: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
        """(S, k) 1.0 where the assignment fits its expert's capacity."""
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        tokens = gates.shape[0]
        cap = max(math.ceil(tokens / self.num_experts * factor * self.k), self.min_capacity)
        if self.k == 1:  # the top-`cap` priorities per expert: random with use_rts, else the 0/1 mask's topk
            prio = masks[0] * torch.rand(masks[0].shape, device=gates.device) if self.use_rts else masks[0]
            top = torch.topk(prio, k=min(cap, tokens), dim=0).indices
            kept = torch.zeros_like(masks[0]).scatter_(0, top, 1) * masks[0]
            return kept.sum(1, keepdim=True).float()
        offset = torch.zeros_like(masks[0][:1])
        cols = []
        for m in masks:  # positions: first choices in token order, then second choices
            loc = torch.cumsum(m, 0) - 1 + offset
            cols.append(((loc < cap) * m).sum(1))
            offset = offset + m.sum(0, keepdim=True)
        return torch.stack(cols, 1).float()


def _gumbel(like: torch.Tensor) -> torch.Tensor:
    u = torch.rand_like(like).clamp(min=1e-20, max=1.0 - 1e-7)
    return -torch.log(-torch.log(u))


class _Experts(nn.Module):
    """DeepSpeed's ``Experts``: ``deepspeed_experts``, ``n`` deep copies of the expert."""

    def __init__(self, expert: nn.Module, n: int) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(n)])


class _MOELayer(nn.Module):
    """DeepSpeed's ``MOELayer``: holds ``gate`` and ``experts`` (the parameter names)."""

    def __init__(self, gate: _Gate, experts: _Experts, ep_group: AxisGroup) -> None:
        super().__init__()
        self.gate, self.experts, self.ep_group = gate, experts, ep_group


class MoE(nn.Module):
    """See the module docstring."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,  # noqa: PLR0913 (DeepSpeed's signature)
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: Optional[str] = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if num_experts % ep_size:
            raise ValueError(f"Number of experts ({num_experts}) should be divisible by expert parallel size "
                             f"({ep_size})")
        if k not in (1, 2):
            raise ValueError(f"MoE(k={k}): only k = 1 or 2 (DeepSpeed's top-1 / top-2 gates) are implemented here")
        if use_tutel or enable_expert_tensor_parallelism:
            raise ValueError("MoE: use_tutel and enable_expert_tensor_parallelism are not implemented here "
                             "(experts are whole on each rank); set them to False")
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(f"Unsupported noisy_gate_policy: {noisy_gate_policy}")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size, self.num_experts = ep_size, num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        ep_group = _expert_parallel_group(ep_size)
        gate = _Gate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity, policy,
                     drop_tokens, use_rts, top2_2nd_expert_sampling)
        experts = _Experts(expert, self.num_local_experts)
        self.deepspeed_moe = _MOELayer(gate, experts, ep_group)
        self.first_expert = ep_group.rank * self.num_local_experts
        for p in experts.parameters():
            p.allreduce = False  # type: ignore[attr-defined]
            p.group_name = self.expert_group_name  # type: ignore[attr-defined]
            if ep_size > 1:
                shard = ExpertShard(self.first_expert, self.num_local_experts, num_experts)
                set_placement(p, replace(placement_of(p), expert=shard))
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def forward(self, hidden_states: torch.Tensor,
                used_token: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])                        # (S, H)
        l_aux, experts, weights, exp_counts = self.deepspeed_moe.gate(x, used_token)
        out = self._experts(x, experts, weights).reshape(shape)
        if self.use_residual:
            mlp_out = self.mlp(hidden_states)
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            out = out * coef[..., 0:1] + mlp_out * coef[..., 1:]
        return out, l_aux, exp_counts

    def _experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Kept assignments dispatched to their experts (all-to-all over EP), combined with weights."""
        s, k = experts.shape
        flat_e, flat_w = experts.reshape(-1), weights.reshape(-1)
        token_of = torch.arange(s, device=x.device).repeat_interleave(k)
        kept = flat_w > 0
        order = torch.argsort(torch.where(kept, flat_e, torch.full_like(flat_e, self.num_experts)), stable=True)
        with host_sync_allowed():  # the kept rows' count sizes the dispatch (as DeepSpeed's capacity read)
            n_kept = int(kept.sum())
        order = order[:n_kept]
        counts = torch.bincount(flat_e[order], minlength=self.num_experts)
        modules = self.deepspeed_moe.experts.deepspeed_experts

        def compute(rows: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
            with host_sync_allowed():  # each expert module runs on its own rows
                sizes = [int(c) for c in local_counts.tolist()]
            pieces = torch.split(rows, sizes)
            return torch.cat([modules[j](p) for j, p in enumerate(pieces)], 0)

        out = dispatch_compute_combine(x[token_of[order]], counts, self.deepspeed_moe.ep_group, compute)
        y = torch.zeros(s, x.shape[1], device=x.device, dtype=torch.float32)
        y = y.index_add(0, token_of[order], out.float() * flat_w[order].unsqueeze(1))
        return y.to(x.dtype)
