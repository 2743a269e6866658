"""SwiGLU experts computed as one grouped GEMM.

A rank holds ``E_local`` experts as two stacked weights, ``gate_up`` (E_local, H, 2F) and
``down`` (E_local, F, H). Its tokens come sorted by local expert with ``counts`` (E_local,)
rows each; expert e computes ``down_e(silu(x W_g,e) * x W_u,e)`` on its rows.

:func:`grouped_mm`: ``torch._grouped_mm`` on CUDA where torch has it (bf16, offsets on the
device, no host sync); elsewhere one matmul per expert over its rows (CPU, or CUDA without
it). Every expert runs its matmul even with zero rows, so each expert weight gets a (zero)
gradient on every rank, whatever the routing: the backward's reductions see the same
parameters everywhere.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.distributed.strict import host_sync_allowed
from engine.placement import ExpertShard, set_expert_placement

__all__ = ["grouped_mm", "GroupedSwiGLU", "has_grouped_mm"]


def has_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` serves ``x`` (N, A) @ ``w`` (G, A, C): CUDA, bf16 both, present
    in this torch, and rows of 16-byte multiples (its alignment rule). Not yet run on a GPU here:
    the per-expert loop is the path the CPU tests check."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype == x.dtype and hasattr(torch, "_grouped_mm")
            and x.shape[1] % 8 == 0 and w.shape[2] % 8 == 0)


def _host_counts(counts: torch.Tensor) -> list[int]:
    """The per-expert row counts on the host (the loop's split sizes). On CPU this is no device
    sync; on CUDA without ``torch._grouped_mm`` it is the one read the loop needs."""
    with host_sync_allowed():
        return [int(c) for c in counts.tolist()]


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x`` (N, A) rows sorted by group, ``w`` (G, A, C), ``counts`` (G,) int with sum N ->
    (N, C): rows of group g times ``w[g]``."""
    if has_grouped_mm(x, w):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    sizes = _host_counts(counts)
    pieces = torch.split(x, sizes, dim=0)
    return torch.cat([p @ w[g].to(p.dtype) for g, p in enumerate(pieces)], dim=0)


class GroupedSwiGLU(nn.Module):
    """``E_local`` SwiGLU experts (module docstring). ``gate_up`` (E_local, H, 2F): columns
    ``[:F]`` the gate, ``[F:]`` the up projection; ``down`` (E_local, F, H).

    ``shard``: which global experts these are, when split over ``ep_size`` > 1 ranks. Both
    weights carry DeepSpeed's MoE tags (``allreduce = False``, ``group_name =
    "ep_size_{ep}"``) and, at ``ep_size`` > 1, ``Placement.expert = shard``, set HERE in the
    constructor that registers them: ``engine.zero.Init`` partitions a module's parameters
    when its constructor returns, over the expert-gradient group only for parameters already
    placed as expert shards (over the grad group they would mix different experts)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, shard: Optional[ExpertShard] = None,
                 ep_size: int = 1) -> None:
        super().__init__()
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != down.shape[0] \
                or gate_up.shape[2] != 2 * down.shape[1] or gate_up.shape[1] != down.shape[2]:
            raise ValueError(f"experts: gate_up (E, H, 2F) and down (E, F, H) disagree: "
                             f"{tuple(gate_up.shape)} and {tuple(down.shape)}")
        if ep_size > 1 and shard is None:
            raise ValueError(f"experts split over {ep_size} expert-parallel ranks need their ExpertShard")
        self.gate_up = nn.Parameter(gate_up)
        self.down = nn.Parameter(down)
        for p in (self.gate_up, self.down):
            if ep_size > 1:
                assert shard is not None
                set_expert_placement(p, shard, ep_size)
            else:  # every expert here: placed like a dense weight (reduced over the grad role)
                p.allreduce = False  # type: ignore[attr-defined]
                p.group_name = f"ep_size_{ep_size}"  # type: ignore[attr-defined]

    @property
    def num_local(self) -> int:
        return self.gate_up.shape[0]

    def forward(self, x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
        """``x`` (N, H) sorted by local expert, ``counts`` (E_local,) -> (N, H). ``gate_up`` /
        ``down``: the weights to use (the layer may pass them through a TP mapping)."""
        h = grouped_mm(x, gate_up, counts)                                 # (N, 2F)
        g, u = h.chunk(2, dim=-1)
        return grouped_mm(F.silu(g) * u, down, counts)                    # (N, H)
