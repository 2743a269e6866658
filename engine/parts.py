"""What a rank trains, as one typed value: :class:`ModelParts`.

The builders in :mod:`engine.assembly` (reference GPT, a given GPT, a layer list, AutoTP, a
``PipelineModule``) each turn the user's model into a ``ModelParts``; the assembly
(:func:`engine.assembly.assemble.assemble_engine`) hands it, with the optimizer and the
pipeline runner built over it, to :class:`engine.engine.Engine`. Nothing is attached to
the engine afterwards: whatever a later consumer needs (the stage chunks for sampling and
export, the tied parameters) is a field here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from engine.context_parallel.layout import CPLayout
from engine.pipeline.stages import StageChunk

__all__ = ["LossFn", "ModelParts", "TokenLoss"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TokenLoss:
    """A loss the engine normalises itself (``engine.zero.step.TokenMean``): ``sum_fn(output,
    targets)`` is the SUM of the micro-batch's per-token losses, targets equal to
    ``ignore_index`` excluded (0-dim)."""

    sum_fn: LossFn
    ignore_index: int = -100


@dataclass(frozen=True)
class ModelParts:
    """This rank's model.

    - ``module``: what the engine holds and the ZeRO optimizer shards: the whole model
      (``pp == 1``) or ``nn.ModuleList(chunks)`` (``pp > 1``);
    - ``chunks``: this rank's pipeline stage chunks, one per virtual stage, in order (empty
      for a plain module or an AutoTP model, which the DeepSpeed loop drives whole);
    - ``tied``: parameters shared by the first and the last pipeline stage (a tied
      embedding / head), whose gradients the optimizer sums over the embedding group;
    - ``loss_fn``: ``loss(output, targets)`` of the pipeline's last stage (``pp > 1``) or of
      the DeepSpeed loop (``pp == 1``); None: the module computes its loss itself;
    - ``dtype``: the compute dtype of the chunks (what crosses a stage boundary);
    - ``reference``: the chunks are the reference GPT's (sampling and export gather them);
    - ``measure_boundary``: the boundary shape is not in the config (a ``PipelineModule``):
      the pipeline measures it on the first micro-batch;
    - ``token_loss``: the engine's own loss (the reference GPT's cross-entropy, none given):
      ``train_batch`` / ``eval_batch`` compute each micro-batch's loss as its token sum over
      the step's mean target count (``engine.zero.step``, the global token mean) instead of
      ``loss_fn`` / the module's; None: users' losses, as given;
    - ``cp``: the chunks' context-parallel layout (``context_parallel.size`` > 1): the engine
      cuts every micro-batch to this rank's sequence shard where it draws it
      (:func:`engine.context_parallel.data.shard_microbatch`); None without CP.
    """

    module: nn.Module
    chunks: tuple[StageChunk, ...] = ()
    tied: tuple[nn.Parameter, ...] = ()
    loss_fn: Optional[LossFn] = None
    dtype: torch.dtype = torch.float32
    reference: bool = False
    measure_boundary: bool = False
    token_loss: Optional[TokenLoss] = None
    cp: Optional[CPLayout] = None

    def __post_init__(self) -> None:
        if self.measure_boundary and not self.chunks:
            raise ValueError("ModelParts: measure_boundary needs the stage chunks it measures")
