"""The step arithmetic contract: what multiplies the loss and the gradients, written once.

One optimizer step runs ``ga`` micro-batches (``gradient_accumulation_steps``) on each of
``dp`` data-parallel replicas; with pipeline parallelism each stage holds different
parameters, and a tied weight (embedding = head) has one copy on each stage that uses it.
The gradient the optimizer must see is that of the MEAN loss over the ``ga * dp``
micro-batches of the global batch. Three factors get it there, and only this module says
what they are (:func:`step_factors`):

- ``loss``: each micro-batch's loss is divided by ``ga`` and multiplied by the loss scale
  ``S`` (fp16; ``S = 1`` for bf16/fp32) before its backward: ``loss / ga * S``. The
  division comes first, in this order, as DeepSpeed's ``backward`` does, so the two agree
  bit for bit. Whoever runs the backward calls :meth:`GradientStep.scale_loss` for it: the
  ZeRO optimizer's ``backward`` (the DeepSpeed loop: ``Engine.backward`` /
  ``Engine.train_batch``) or the pipeline executor (each last-stage micro-batch loss).
- ``grad``: each gradient is multiplied by ``1 / (dp * S)`` as the optimizer's hooks add it
  into their fp32 accumulators (free on the add), so the SUM over the DP group is already
  the unscaled mean: no pass after the reduction. Exact when ``dp`` and ``S`` are powers
  of two (then equal to DeepSpeed's post-division).
- ``tied``: after the DP reduction, the gradients of a tied weight's copies are SUMMED over
  the stages holding one (the embedding group), never averaged: each copy holds only its
  own stage's part of the weight's gradient (:func:`sum_tied_grads`).

Together: ``loss * grad = 1 / (ga * dp)``, whatever ``S`` and the pipeline depth are; the
pipeline adds no factor (its stages hold disjoint parameters; a micro-batch's loss is
computed once, on the last stage). The loss REPORTED is the unscaled mean of the
micro-batch losses (the executor keeps each loss before it is scaled).

What a micro-batch's loss is (:class:`TokenMean`). Where the engine owns the loss (the
reference GPT's cross-entropy through ``train_batch`` / ``eval_batch``:
``ModelParts.token_loss``), the step's loss is the mean over every target token of the
global batch, TorchTitan's choice: ``sum_k l_k / N``, ``N`` the step's count of
non-ignored targets (``!= -100``) over all micro-batches and replicas. Micro-batch ``i``
with token-loss sum ``L_i`` contributes ``L_i / n_bar``, where ``n_bar = N / (ga * dp)``
is the step's mean count per micro-batch; the contract's ``1/ga`` and ``1/dp`` then make
the gradient exactly ``d(sum_i L_i / N)``, and the reported mean of those losses over the
``ga * dp`` micro-batches is ``sum_i L_i / N``: nothing else changes (evaluation: the same
over its own micro-batches). The per-micro-batch mean ``L_i / n_i`` that it replaces is
not the loss of one process over the global batch when the ``n_i`` differ (padding, packed
documents, SFT masks); when they are equal, ``n_bar = n_i`` and the two are bit-identical.
``N`` is counted where the data enters (every target of the step is known before its first
forward) and all-reduced ONCE per step over the LOSS group: the ranks whose targets are
parts of one global batch and whose gradients the ``1/dp`` averages (today the dp group;
with context parallelism dp x cp, as TorchTitan's ``loss`` mesh). It stays on the device
(no host read); a step with no target at all counts ``N = 1`` (loss 0, gradient 0). Users'
losses (a module that returns its own loss, a ``loss_fn``, the DeepSpeed loop's
``engine.backward(loss)``) keep DeepSpeed's meaning: the loss given, divided by ``ga``.

Unscaling, the non-finite check (fp16) and clipping belong to the optimizer's ``step``;
the global norm is computed on the device and read on the host only by a caller that asks
for it. The skip decision needs one host read per step (whether any rank's gradients are
non-finite: the skip and the fp16 loss scaler's update are host logic); every precision
checks unless ``bf16.check_grad_overflow`` is false.

Two implementations of :class:`GradientStep`: :class:`engine.zero.base.ZeroOptimizer`
(every ZeRO stage) and :class:`LocalGradients` (the pipeline executor driving a plain
``torch.optim`` optimizer, no data parallelism). The executor calls, per step:
``scale_loss`` on each loss, ``set_boundary(True)`` before the last backward of each
model chunk (and ``False`` after it: a chunk's DP reductions launch during its last
backward, while the schedule still runs the other chunks' and micro-batches' work), and
``finish_backward()`` after the last action (every reduction completed, tied weights
summed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from engine.distributed import comm
from engine.distributed.groups import AxisGroup
from engine.validate import check_int

NO_TIES = AxisGroup.single("embedding")  # no tied weights across stages: nothing to sum

__all__ = ["NO_TIES", "StepFactors", "step_factors", "scale_loss", "TokenMean", "token_mean", "sum_tied_grads",
           "GradientStep", "LocalGradients"]


@dataclass(frozen=True)
class StepFactors:
    """The factors of one optimizer step (see the module docstring)."""

    ga: int  # micro-batches per step on each replica
    dp: int  # data-parallel replicas
    loss_scale: float  # S (1.0 unless fp16)

    @property
    def loss(self) -> float:
        """What a micro-batch loss is multiplied by before its backward: S / ga."""
        return self.loss_scale / self.ga

    @property
    def grad(self) -> float:
        """What each gradient is multiplied by as it is accumulated: 1 / (dp * S)."""
        return 1.0 / (self.dp * self.loss_scale)

    @property
    def total(self) -> float:
        """``loss * grad``: the factor on the SUM of the per-micro-batch gradients over the
        global batch, 1 / (ga * dp)."""
        return self.loss * self.grad


def step_factors(ga: int, dp: int, loss_scale: float = 1.0) -> StepFactors:
    """The contract's factors for ``ga`` micro-batches on ``dp`` replicas at loss scale ``S``."""
    check_int("gradient accumulation steps", ga, minimum=1, error=ValueError)
    check_int("the data-parallel size", dp, minimum=1, error=ValueError)
    if not loss_scale > 0:
        raise ValueError(f"the loss scale must be > 0, got {loss_scale!r}")
    return StepFactors(ga=ga, dp=dp, loss_scale=float(loss_scale))


def scale_loss(loss: torch.Tensor, num_microbatches: int, loss_scale: float) -> torch.Tensor:
    """``loss / num_microbatches * loss_scale``, in that order (DeepSpeed's), skipping a
    factor of 1 (so a loss with no accumulation and no scaling is the same tensor)."""
    if num_microbatches > 1:
        loss = loss / num_microbatches
    return loss if loss_scale == 1.0 else loss * loss_scale


class TokenMean:
    """One step's token normaliser (see the module docstring): ``TokenMean(n_bar)(L_i) = L_i / n_bar``.

    ``mean_count``: ``n_bar = N / (m * loss group size)``, a 0-dim fp32 tensor on the device
    (``m``: this rank's micro-batches of the step, ``N``: the step's global target count)."""

    def __init__(self, mean_count: torch.Tensor) -> None:
        self.mean_count = mean_count

    def __call__(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The micro-batch loss to report and differentiate, from its token-loss SUM (0-dim)."""
        return loss_sum / self.mean_count


def token_mean(targets: Sequence[torch.Tensor], loss_group: AxisGroup, *, ignore_index: int,
               device: torch.device) -> TokenMean:
    """The :class:`TokenMean` of a step whose micro-batches on this rank have ``targets``
    (any shapes), counting those ``!= ignore_index``: one all-reduce over ``loss_group``, on
    ``device``, no host read (a CPU target tensor is counted on the host and copied)."""
    if not targets:
        raise ValueError("token_mean needs the targets of at least one micro-batch")
    local = torch.stack([(t != ignore_index).sum().to(device, torch.int64) for t in targets]).sum()  # 0-dim
    comm.all_reduce(local, loss_group)  # N: exact in int64, whatever the order
    n_bar = local.clamp(min=1).double() / (len(targets) * loss_group.size)  # rounded once, to fp32 below
    return TokenMean(n_bar.float())


def sum_tied_grads(grads: Sequence[torch.Tensor], group: AxisGroup) -> None:
    """Sum (in place) the gradients of a tied weight's copies over the stages holding one.

    ``grads``: this rank's gradient tensor of each tied weight, in the tied weights' order
    (the same order and shapes on every member of ``group``). A size-1 ``group`` (both
    copies on this stage, where autograd already summed them) is the identity."""
    for g in grads:
        comm.all_reduce(g, group)


@runtime_checkable
class GradientStep(Protocol):
    """What a loop that runs backward passes needs from the owner of the step arithmetic."""

    def scale_loss(self, loss: torch.Tensor, num_microbatches: int = 1) -> torch.Tensor:
        """The tensor to differentiate for one micro-batch's ``loss`` (``loss / ga * S``)."""
        ...

    def set_boundary(self, is_boundary: bool) -> None:
        """Whether the backward passes until the next call are the last of the step for the
        parameters they reach (their data-parallel reductions may launch)."""
        ...

    def finish_backward(self) -> None:
        """After the step's last backward: every reduction completed, tied weights summed."""
        ...


class LocalGradients:
    """:class:`GradientStep` for a plain ``torch.optim`` optimizer over this rank's
    parameters (no data parallelism, no loss scaling): gradients accumulate in ``.grad``;
    ``finish_backward`` sums the tied weights' gradients over ``embedding_group``."""

    def __init__(self, tied_params: Sequence[torch.nn.Parameter] = (),
                 embedding_group: AxisGroup = NO_TIES) -> None:
        self.tied_params = list(tied_params)
        self.embedding_group = embedding_group

    def scale_loss(self, loss: torch.Tensor, num_microbatches: int = 1) -> torch.Tensor:
        return scale_loss(loss, num_microbatches, 1.0)

    def set_boundary(self, is_boundary: bool) -> None:
        """Nothing to launch: there is no data-parallel reduction."""

    def finish_backward(self) -> None:
        for p in self.tied_params:
            if p.grad is None:  # a copy no micro-batch reached still takes part in the sum
                p.grad = torch.zeros_like(p)
        sum_tied_grads([p.grad for p in self.tied_params if p.grad is not None], self.embedding_group)
