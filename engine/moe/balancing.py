"""Load balancing: the statistics, the auxiliary and z losses, the aux-free bias update.

The auxiliary loss is DeepSeek-V3's SEQUENCE-WISE loss, averaged over the sequences of the
global batch. For sequence b of T tokens routed to E experts with top-k K,

    f_bi = E / (K T) * #{t in b : token t picked expert i}     (no gradient)
    P_bi = 1 / T * sum_{t in b} p_ti                           (softmax probabilities)
    L_b  = sum_i f_bi P_bi                                     (1 when perfectly balanced)
    aux  = aux_loss_coef * mean_b L_b, summed over the MoE layers.

Why per sequence: every statistic lives inside one sequence, so the loss of a global batch
is the same however its sequences are spread over data-parallel ranks and micro-batches
(gradient accumulation); a batch-wide f (GShard / Switch) would depend on how the batch is
cut. When a sequence is itself split (context parallelism, or TP's sequence parallelism)
each rank holds a slice of its tokens: the counts are all-reduced over the ranks that split
it (``seq_groups``; no gradient flows through counts) and each rank keeps only its tokens'
part of ``P`` (``sum_{t here} p_ti / T``), so the parts sum to ``L_b`` exactly.

How it reaches the gradients (:class:`AuxLossInjector`, Megatron's aux-loss auto-scaler): the
layer returns its output unchanged in value and, in backward, feeds ``loss_factor`` to the
micro-batch's auxiliary loss, where ``loss_factor`` is what the training loss is multiplied by
before its backward (``1 / gradient_accumulation_steps``: engine.zero.step's ``loss`` factor,
fp16's loss scale refused with MoE) times ``grad_avg`` (the context-parallel size: the
gradient role averages over it, while each CP rank holds only its part of ``L_b``). The
optimizer's ``1/dp`` then makes the gradient exactly that of the global mean over sequences,
at any DP, GA, CP or pipeline stage (each stage injects its own layers' term). The z-loss
(``z_loss_coef * mean_t logsumexp(logits_t)^2``, ST-MoE) is per sequence the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from engine.distributed import comm
from engine.distributed.groups import AxisGroup

__all__ = ["BalanceStats", "sequence_stats", "aux_loss_terms", "AuxLossInjector", "aux_free_update"]


@dataclass(frozen=True)
class BalanceStats:
    """Per-sequence statistics of one micro-batch on this rank."""

    counts: torch.Tensor   # (B, E) fp32 assignments per expert of each WHOLE sequence (summed over seq_groups)
    prob_sum: torch.Tensor  # (B, E) fp32 sum over this rank's tokens of p_ti (with gradient)
    tokens: int            # T: tokens of one whole sequence


def sequence_stats(probs: torch.Tensor, experts: torch.Tensor, batch: int, num_experts: int,
                   seq_groups: Sequence[AxisGroup]) -> BalanceStats:
    """``probs`` (B*s, E), ``experts`` (B*s, K) of this rank's ``s`` tokens of each of ``batch``
    sequences (batch-major rows) -> :class:`BalanceStats`; counts all-reduced over ``seq_groups``."""
    k = experts.shape[1]
    s = probs.shape[0] // batch
    one_hot = torch.zeros(batch * s, num_experts, device=probs.device, dtype=torch.float32)
    one_hot.scatter_add_(1, experts, torch.ones_like(experts, dtype=torch.float32))
    counts = one_hot.view(batch, s, num_experts).sum(1)                  # (B, E)
    tokens = s
    for g in seq_groups:
        if g.size > 1:
            comm.all_reduce(counts, g)
            tokens *= g.size
    assert counts.shape == (batch, num_experts) and k >= 1
    return BalanceStats(counts, probs.view(batch, s, num_experts).sum(1), tokens)


def aux_loss_terms(stats: BalanceStats, top_k: int) -> torch.Tensor:
    """This rank's part of ``mean_b L_b`` (0-dim fp32; the parts over ``seq_groups`` sum to it)."""
    e = stats.counts.shape[1]
    f = stats.counts * (e / (top_k * stats.tokens))                       # (B, E), no gradient
    p = stats.prob_sum / stats.tokens                                     # (B, E), this rank's part
    return (f * p).sum(1).mean()


def z_loss_terms(logits: torch.Tensor, batch: int, tokens: int) -> torch.Tensor:
    """This rank's part of ``mean_b (1/T) sum_t logsumexp(logits_t)^2`` (0-dim fp32)."""
    lse = torch.logsumexp(logits.float(), dim=-1)                        # (B*s,)
    return lse.pow(2).sum() / (batch * tokens)


class AuxLossInjector(torch.autograd.Function):
    """``forward(out, aux, factor) = out``; backward gives ``aux`` the gradient ``factor``
    (module docstring): ``aux`` joins the loss being differentiated without changing what
    the model returns."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        ctx.save_for_backward(aux)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.factor), None


def aux_free_update(bias: torch.Tensor, step_counts: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's bias step, in place: ``b_i += rate * sign(mean_j c_j - c_i)`` with ``c``
    (E,) the step's GLOBAL assignment counts (already reduced: identical on every rank, so
    every rank's bias stays identical)."""
    err = step_counts.float().mean() - step_counts.float()
    bias.add_(torch.sign(err), alpha=rate)
