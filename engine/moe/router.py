"""The softmax top-k router, in fp32.

``logits = x W_r^T`` (T, E); ``probs = softmax(logits)``; each token picks the ``top_k``
experts of highest ``probs + bias`` (``bias``: the aux-free balancing bias, zero otherwise;
it steers the choice only, never the weights, as in DeepSeek-V3) and weighs their outputs
with its chosen probabilities renormalised to sum to 1 (Mixtral's top-k softmax). With
``top_k == 1`` the weight is therefore 1 and the router learns from the balancing loss only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

__all__ = ["Routing", "TopKRouter", "route"]


@dataclass(frozen=True)
class Routing:
    """One micro-batch's routing of T tokens to E experts."""

    logits: torch.Tensor   # (T, E) fp32
    probs: torch.Tensor    # (T, E) fp32, softmax of logits
    experts: torch.Tensor  # (T, K) int64 global expert indices, distinct per token
    weights: torch.Tensor  # (T, K) fp32, renormalised chosen probabilities


def route(logits: torch.Tensor, top_k: int, bias: Optional[torch.Tensor] = None) -> Routing:
    """The routing of ``logits`` (T, E) (any float dtype; computed in fp32)."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)                                # (T, E)
    scores = probs.detach() if bias is None else probs.detach() + bias.float()
    experts = torch.topk(scores, top_k, dim=-1, sorted=True).indices     # (T, K)
    chosen = probs.gather(1, experts)                                    # (T, K)
    weights = chosen / chosen.sum(dim=-1, keepdim=True)
    return Routing(logits, probs, experts, weights)


class TopKRouter(nn.Module):
    """The router's weight ``W_r`` (E, H), replicated on every rank (data, tensor and expert
    parallel: each rank routes its own tokens). Computed in fp32 whatever the model dtype."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, weight: torch.Tensor) -> None:
        super().__init__()
        if tuple(weight.shape) != (num_experts, hidden):
            raise ValueError(f"router weight must be (num_experts, hidden) = ({num_experts}, {hidden}), "
                             f"got {tuple(weight.shape)}")
        self.top_k = top_k
        self.weight = nn.Parameter(weight)

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None,
                weight: Optional[torch.Tensor] = None) -> Routing:
        """``x`` (T, H) -> :class:`Routing`. ``weight``: the weight to use (the layer passes its
        weight through a TP mapping under sequence parallelism), default ``self.weight``."""
        w = self.weight if weight is None else weight
        return route(x.float() @ w.float().t(), self.top_k, bias)
