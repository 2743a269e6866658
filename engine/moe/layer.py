"""The mixture-of-experts MLP: router, dispatch, grouped SwiGLU experts, shared experts.

``MoELayer``: hidden (B, s, H) -> (B, s, H), where ``s`` is this rank's slice of the
sequence (S; S/cp under context parallelism; S/tp under sequence parallelism). Per token:
``y = sum_{k} w_k * expert_{e_k}(x) [+ shared(x)]`` (engine.moe.router for ``e``, ``w``).

Parameters (names are the checkpoint's):

- ``router.weight`` (E, H): replicated everywhere (dense: reduced over the grad role);
- ``experts.gate_up`` (E/ep, H, 2F) and ``experts.down`` (E/ep, F, H): this EP rank's
  experts, global experts ``[first_expert, first_expert + E/ep)`` (``first_expert =
  ep_rank * E/ep``; local slot j is global expert ``first_expert + j``). Following
  DeepSpeed, each carries ``allreduce = False`` and ``group_name = "ep_size_{ep}"``; with
  ``ep > 1`` also ``Placement.expert = ExpertShard(first_expert, E/ep, E)`` (engine.placement:
  ZeRO reduces and partitions them over the expert-gradient role). At ``ep == 1`` they hold
  every expert and are placed like dense weights (reduced over the grad role).
- ``shared``: ``shared_experts`` always-active experts as one SwiGLU of inner size
  ``shared_experts * F``, tensor-parallel like the dense MLP.
- buffer ``expert_bias`` (E,): the aux-free balancing bias (zeros otherwise), identical on
  every rank, saved with the model.

Every expert weight is drawn from ``(seed, "blocks.{layer}.mlp.experts.{e}.…")`` for its
GLOBAL index e, so the model is the same at every EP size. See engine.moe.balancing for the
balancing losses and engine.moe.stats for the per-step statistics.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional, Union

import torch
import torch.nn as nn

from engine.models.config import ModelConfig
from engine.models.recompute import in_recompute_first_pass
from engine.moe.balancing import AuxLossInjector, aux_loss_terms, sequence_stats, z_loss_terms
from engine.moe.config import MoEConfig
from engine.moe.context import LOCAL_MOE, MoEContext
from engine.moe.dispatch import dispatch_compute_combine
from engine.moe.experts import GroupedSwiGLU
from engine.moe.router import TopKRouter
from engine.moe.stats import StepAccumulator
from engine.placement import ExpertShard
from engine.tensor_parallel.layers import NormalInit
from engine.tensor_parallel.mappings import copy_to_tp_region

__all__ = ["MoELayer", "expert_init"]

Device = Optional[Union[torch.device, str]]
Dtype = Optional[torch.dtype]


def expert_init(cfg: ModelConfig, moe: MoEConfig, layer: int, seed: int, first: int,
                count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global experts ``[first, first + count)`` of block ``layer``: ``gate_up`` (count, H, 2F)
    and ``down`` (count, F, H), fp32 on CPU, each expert from its own ``(seed, key)``."""
    h, f = cfg.hidden_size, moe.expert_hidden_size
    std_out = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    gate_up = [NormalInit(cfg.init_std, seed, f"blocks.{layer}.mlp.experts.{e}.gate_up")((h, 2 * f))
               for e in range(first, first + count)]
    down = [NormalInit(std_out, seed, f"blocks.{layer}.mlp.experts.{e}.down")((f, h))
            for e in range(first, first + count)]
    return torch.stack(gate_up), torch.stack(down)


class MoELayer(nn.Module):
    """See the module docstring. ``ctx``: the groups and factors of the run (engine.moe.context)."""

    expert_bias: torch.Tensor  # buffer (E,)

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, layer: int, seed: int, ctx: MoEContext = LOCAL_MOE,
                 device: Device = None, dtype: Dtype = None) -> None:
        super().__init__()
        e, ep = moe.num_experts, ctx.ep_size
        if e % ep:
            raise ValueError(f"model.moe.num_experts = {e} is not divisible by the expert-parallel size {ep}: "
                             "pick expert_parallel.size dividing num_experts")
        self.moe, self.ctx, self.layer = moe, ctx, layer
        self.num_experts, self.top_k = e, moe.top_k
        self.num_local_experts = e // ep
        self.first_expert = ctx.ep_rank * self.num_local_experts
        router_w = NormalInit(cfg.init_std, seed, f"blocks.{layer}.mlp.router")((e, cfg.hidden_size))
        self.router = TopKRouter(cfg.hidden_size, e, moe.top_k, router_w.to(device=device, dtype=dtype))
        gate_up, down = expert_init(cfg, moe, layer, seed, self.first_expert, self.num_local_experts)
        shard = ExpertShard(self.first_expert, self.num_local_experts, e) if ep > 1 else None
        self.experts = GroupedSwiGLU(gate_up.to(device=device, dtype=dtype), down.to(device=device, dtype=dtype),
                                     shard, ep)
        self.shared: Optional[nn.Module] = None
        if moe.shared_experts:
            from engine.models.blocks import SwiGLU  # blocks imports this module for the MoE MLP
            shared_cfg = replace(cfg, ffn_hidden_size=moe.shared_experts * moe.expert_hidden_size, moe=None)
            self.shared = SwiGLU(shared_cfg, layer, ctx.tp_group, ctx.sequence_parallel, seed, device, dtype)
        self.register_buffer("expert_bias", torch.zeros(e, device=device, dtype=torch.float32))
        self.stats = StepAccumulator(e, device)

    def capacity(self, tokens: int) -> Optional[int]:
        """Assignments each expert takes per rank and micro-batch (None: dropless)."""
        c = self.moe.capacity_factor
        return None if c is None else max(1, math.ceil(c * tokens * self.top_k / self.num_experts))

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router and expert weights, through copy-to-region when TP ranks hold different tokens."""
        ws = (self.router.weight, self.experts.gate_up, self.experts.down)
        if self.ctx.splits_tokens_over_tp:
            return tuple(copy_to_tp_region(w, self.ctx.tp_group) for w in ws)  # type: ignore[return-value]
        return ws

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"MoELayer expects hidden states (batch, seq, hidden), got {tuple(x.shape)}")
        b, s, h = x.shape
        flat = x.reshape(b * s, h)                                       # (T, H), batch-major
        router_w, gate_up, down = self._weights()
        bias = self.expert_bias if self.moe.load_balancing == "aux_free" else None
        r = self.router(flat, bias, router_w)
        stats = sequence_stats(r.probs, r.experts, b, self.num_experts, self.ctx.seq_groups)
        aux = self._balancing_loss(r.logits, stats, b)                  # this rank's part, 0-dim
        y, dropped = self._experts(flat, r.experts, r.weights, gate_up, down)
        y = y.view(b, s, h)
        if self.shared is not None:
            y = y + self.shared(x)
        if aux.requires_grad and torch.is_grad_enabled():
            y = AuxLossInjector.apply(y, aux, self.ctx.loss_factor * self.ctx.grad_avg)
        first_pass = torch.is_grad_enabled() or in_recompute_first_pass()
        if self.training and first_pass and torch._C._current_graph_task_id() == -1:
            # once per training forward: the first pass of a recomputed unit (run without a
            # graph) counts, its replay inside backward does not
            self.stats.add(stats.counts.sum(0), aux.detach() * self.ctx.grad_avg, dropped)
        return y

    def _balancing_loss(self, logits: torch.Tensor, stats, batch: int) -> torch.Tensor:
        """``aux_loss_coef * aux + z_loss_coef * z`` of this rank's tokens (engine.moe.balancing)."""
        total = logits.new_zeros(())
        if self.moe.aux_coef > 0:
            total = total + self.moe.aux_coef * aux_loss_terms(stats, self.top_k)
        if self.moe.z_loss_coef > 0:
            total = total + self.moe.z_loss_coef * z_loss_terms(logits, batch, stats.tokens)
        return total

    def _experts(self, flat: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' weighted sum (T, H) and the number of assignments dropped."""
        t, k = experts.shape
        expert_of = experts.reshape(-1)                                  # (T*K,)
        token_of = torch.arange(t, device=flat.device).repeat_interleave(k)
        order = torch.argsort(expert_of, stable=True)                    # by expert, token order within
        counts = torch.bincount(expert_of, minlength=self.num_experts)   # (E,)
        dropped = counts.new_zeros(())
        cap = self.capacity(t)
        if cap is not None:
            starts = torch.cumsum(counts, 0) - counts
            pos = torch.arange(order.numel(), device=flat.device) - starts[expert_of[order]]
            order = order[pos < cap]
            dropped = (counts - cap).clamp(min=0).sum()
            counts = counts.clamp(max=cap)
        rows = flat[token_of[order]]                                     # (A, H) sorted by global expert

        def compute(xs: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
            return self.experts(xs, local_counts, gate_up, down)

        out = dispatch_compute_combine(rows, counts, self.ctx.ep_group, compute)   # (A, H)
        w = weights.reshape(-1)[order].unsqueeze(1)                       # (A, 1) fp32
        y = flat.new_zeros((t, flat.shape[1]), dtype=torch.float32)
        y = y.index_add(0, token_of[order], out.float() * w)
        return y.to(flat.dtype), dropped
